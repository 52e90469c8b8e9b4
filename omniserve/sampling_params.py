"""Sampling parameters, with vLLM's names and defaults. Pure Python: the scheduler reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's old spelling) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "> 0")
        if self.temperature < 0.0:
            fail("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                fail(name, "None or an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "None or an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (used to fan out n > 1 into child requests)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
