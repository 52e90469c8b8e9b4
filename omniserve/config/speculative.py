"""vLLM's ``--speculative-config`` dict, checked for what omniserve runs (n-gram drafts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by n-gram prompt lookup (vLLM's ``--speculative-config`` with
    ``"method": "ngram"``): drafts are copied from the request's own earlier tokens where its
    last n tokens occurred before, and one forward verifies them (``omniserve/spec_decode``)."""

    num_speculative_tokens: int
    """Most draft tokens per request per step."""
    prompt_lookup_max: int = 5
    """Longest n-gram matched (the longest match wins)."""
    prompt_lookup_min: int = 5
    """Shortest n-gram matched."""
    disable_by_batch_size: int | None = None
    """No drafts while this many requests or more are running and waiting (a large batch
    already reads each weight once for many tokens, so drafts would cost more than they save)."""

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """vLLM's dict (or its JSON text): ``method`` "ngram" (or ``model`` "[ngram]"),
        ``num_speculative_tokens``, ``prompt_lookup_max`` / ``prompt_lookup_min`` (one given:
        both take it; neither: 5, vLLM's default) and ``disable_by_batch_size``."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object.")
        options = dict(value)
        method = options.pop("method", None)
        model = options.pop("model", None)
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"
        elif model is not None and model not in ("ngram", "[ngram]"):
            raise ValueError(
                f"speculative_config.model {model!r}: omniserve has no draft models; it "
                'speculates by n-gram prompt lookup ({"method": "ngram", ...}).'
            )
        if method not in ("ngram", "[ngram]"):  # EAGLE, MTP, draft models...: no draft model here
            raise ValueError(
                f"speculative_config.method {method!r} is not supported: omniserve "
                "speculates by n-gram prompt lookup only (method 'ngram')."
            )
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}  # fmt: skip
        if unknown := sorted(options.keys() - known):
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; the n-gram method takes "
                f"{sorted(known | {'method'})}."
            )
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens.")
        lookup_max = options.pop("prompt_lookup_max", None)
        lookup_min = options.pop("prompt_lookup_min", None)
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        return cls(
            prompt_lookup_max=5 if lookup_max is None else lookup_max,
            prompt_lookup_min=5 if lookup_min is None else lookup_min,
            **options,
        )

    @staticmethod
    def check_scheduling(async_scheduling: bool) -> None:
        """Drafts need the tokens of the step before theirs on the host when they are made."""
        if async_scheduling:
            raise ValueError(
                "--speculative-config does not work with --async-scheduling (the drafts of a "
                "step come from the tokens of the step before it); drop one of them."
            )

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got "
                                 f"{value!r}.")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or size < 2):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 2, got {size!r}."
            )
