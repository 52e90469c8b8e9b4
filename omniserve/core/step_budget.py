"""What is left of one step's limits while the scheduler takes requests in order: tokens,
encoder embeddings, and the seats for partial prefills (vLLM's ``--max-num-partial-prefills`` /
``--max-long-partial-prefills``). Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from omniserve.config import SchedulerConfig
from omniserve.core.request import Request


@dataclass(slots=True)
class StepBudget:
    """One step's limits, spent as requests are scheduled."""

    num_tokens: int
    num_encoder_embeds: int
    encoder_cache_open: bool = True
    """Cleared once an item is refused for cache space: later requests take no new entries."""
    prefill_seats: int | None = None
    """Requests that may still prefill this step (None: no cap)."""
    long_prefill_seats: int | None = None
    """Of them, those whose rest exceeds ``long_threshold`` (None: no cap)."""
    long_threshold: int = 0

    @classmethod
    def for_step(cls, config: SchedulerConfig) -> StepBudget:
        return cls(config.max_num_batched_tokens, config.max_num_encoder_input_tokens,
                   prefill_seats=config.max_num_partial_prefills,
                   long_prefill_seats=config.max_long_partial_prefills,
                   long_threshold=config.long_prefill_token_threshold)  # fmt: skip

    def _prefill(self, request: Request, num_computed: int) -> tuple[bool, bool]:
        """(prefilling, long): whether a window from ``num_computed`` computes the request's
        prompt (or its recompute after preemption) rather than its next token, and whether the
        rest exceeds the threshold."""
        rest = request.num_tokens - num_computed
        return num_computed < request.num_prompt_tokens or rest > 1, rest > self.long_threshold

    def seats(self, request: Request, num_computed: int) -> bool:
        """Whether a seat is left for the request's window from ``num_computed``: decodes need
        none."""
        if self.prefill_seats is None and self.long_prefill_seats is None:
            return True  # (no caps: nothing to count)
        prefilling, long = self._prefill(request, num_computed)
        return not prefilling or (
            self.prefill_seats != 0 and not (long and self.long_prefill_seats == 0)
        )

    def take_seat(self, request: Request, num_computed: int) -> None:
        if self.prefill_seats is None and self.long_prefill_seats is None:
            return
        prefilling, long = self._prefill(request, num_computed)
        if prefilling and self.prefill_seats is not None:
            self.prefill_seats -= 1
        if prefilling and long and self.long_prefill_seats is not None:
            self.long_prefill_seats -= 1
