"""vLLM's ``--structured-outputs-config`` (and ``--reasoning-parser``): how requests' grammars
apply. xgrammar compiles them all (``omniserve/structured_output.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

THINK_TAGS = ("<think>", "</think>")
"""The tags Qwen3-family models think between (the reasoning parsers', a thinking budget's)."""
REASONING_TAGS: dict[str, tuple[str, str]] = {"qwen3": THINK_TAGS, "deepseek_r1": THINK_TAGS}
"""``--reasoning-parser`` names (vLLM's) -> the tags the model thinks between."""
GRAMMAR_BACKENDS = ("auto", "xgrammar")
_OTHER_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")
_NO_EFFECT = {
    "disable_fallback": "xgrammar is the one backend, so nothing falls back",
    "disable_additional_properties": "xgrammar's JSON grammars allow no property or item a "
    "schema leaves out (its strict mode), as in vLLM with xgrammar",
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    """"auto" or "xgrammar": xgrammar compiles every grammar."""
    disable_any_whitespace: bool = False
    """JSON grammars of every request allow no optional whitespace (else each request's own
    ``disable_any_whitespace``)."""
    reasoning_parser: str = ""
    """The model thinks between this parser's tags (``REASONING_TAGS``) before it answers:
    grammars apply to the answer, once the thinking is over ("": no thinking)."""
    enable_in_reasoning: bool = False
    """Grammars apply from the first token, thinking included."""

    def __post_init__(self) -> None:
        if self.backend in _OTHER_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend {self.backend!r} is not available: "
                "xgrammar compiles every grammar here ('auto' or 'xgrammar')."
            )
        if self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of "
                             f"{GRAMMAR_BACKENDS}, not {self.backend!r}.")  # fmt: skip
        if self.reasoning_parser and self.reasoning_parser not in REASONING_TAGS:
            raise ValueError(
                f"reasoning_parser must be one of {sorted(REASONING_TAGS)} (a "
                f"--reasoning-parser-plugin file registers more), not {self.reasoning_parser!r}."
            )
        for name in ("disable_any_whitespace", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be true or false.")

    @classmethod
    def from_dict(cls, value: dict[str, Any], reasoning_parser: str | None = None
                  ) -> StructuredOutputsConfig:  # fmt: skip
        """vLLM's dict; ``reasoning_parser``: ``--reasoning-parser``, which sets the dict's key
        of that name (both given must agree)."""
        options = dict(value)
        for key, why in _NO_EFFECT.items():
            if key not in options:
                continue
            if not isinstance(options.pop(key), bool):
                raise ValueError(f"structured_outputs_config.{key} must be true or false.")
            logger.info("structured_outputs_config.%s has no effect here: %s.", key, why)
        known = {"backend", "disable_any_whitespace", "reasoning_parser", "enable_in_reasoning"}
        if unknown := sorted(options.keys() - known):
            raise ValueError(f"structured_outputs_config: unknown key(s) {unknown}; it takes "
                             f"{sorted(known | _NO_EFFECT.keys())}.")  # fmt: skip
        given = options.get("reasoning_parser") or ""
        if reasoning_parser and given and given != reasoning_parser:
            raise ValueError(
                f"--reasoning-parser {reasoning_parser} contradicts "
                f"structured_outputs_config.reasoning_parser {given!r}."
            )
        options["reasoning_parser"] = reasoning_parser or given
        return cls(**options)

    @property
    def thinking_tags(self) -> tuple[str, str] | None:
        """The tags of the thinking grammars wait for (None: they apply from the first token)."""
        if not self.reasoning_parser or self.enable_in_reasoning:
            return None
        return REASONING_TAGS[self.reasoning_parser]
