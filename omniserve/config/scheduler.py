"""The scheduler's settings: its budgets, chunked prefill and its caps, the policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int = 4096
    """Copied from ModelConfig so the scheduler needs nothing else."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit one step's budget."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill tokens per step (0: no cap), so decodes keep flowing; with
    the partial-prefill caps (other than one at a time) 0 means vLLM's 4% of max_model_len."""
    max_num_partial_prefills: int | None = None
    """vLLM's: most requests prefilling (their prompts, or their recompute after preemption)
    in one step; the others wait, decodes do not. None: no cap (vLLM's V1 takes the flag and
    enforces nothing)."""
    max_long_partial_prefills: int | None = None
    """vLLM's: most of them whose rest exceeds ``long_prefill_token_threshold``, so shorter
    prompts pass long ones in the queue. None: no cap."""
    scheduler_cls: str = ""
    """vLLM's: ``module.Class``, a subclass of ``omniserve.core.scheduler.Scheduler`` the engine
    core schedules with ("": that class)."""
    stream_interval: int = 1
    """vLLM's: a streamed request's output goes out once this many new tokens are in (its
    first token and its end at once), fewer outputs for the front end to make and send."""
    max_num_encoder_input_tokens: int = 8192
    """Encoder compute budget of one step, in embeddings."""
    encoder_cache_size: int = 8192
    """Capacity of the encoder-output cache, in embeddings."""
    disable_chunked_mm_input: bool = False
    """vLLM's: a chunk that would end inside an item's placeholder ends before it (a chunk that
    starts at or in it is not cut, or an item over a step's budget could never run)."""
    policy: str = "fcfs"
    """"fcfs": first come, first served; "priority": by each request's priority (lower first),
    then arrival; preemption takes the last in that order (vLLM's policies)."""
    async_scheduling: bool = False
    """Schedule and launch each step before the previous one's tokens are back on the host, so
    the device does not wait for the host between steps (vLLM's --async-scheduling). A request
    that stops on a stop token computes one token more, discarded; sampling that reads the
    tokens before (penalties, bad words, a grammar) waits for the last one behind the launched
    forward."""

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_num_encoder_input_tokens",
            "encoder_cache_size",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: no cap), got "
                f"{self.long_prefill_token_threshold}."
            )
        self._check_partial_prefill_caps()
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                f"({self.max_model_len}) needs chunked prefill; enable it or raise the budget."
            )

    def _check_partial_prefill_caps(self) -> None:
        num, long = self.max_num_partial_prefills, self.max_long_partial_prefills
        for name in ("max_num_partial_prefills", "max_long_partial_prefills"):
            if (cap := getattr(self, name)) is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1, got {cap}.")
        if num is not None and long is not None and long > num:
            raise ValueError(f"max_long_partial_prefills ({long}) must be <= "
                             f"max_num_partial_prefills ({num}).")  # fmt: skip
        if num is not None and num > 1 and not self.enable_chunked_prefill:
            raise ValueError("max_num_partial_prefills > 1 needs chunked prefill.")
        if self.long_prefill_token_threshold == 0 and (num or long) and num != 1:
            # vLLM's default: what counts as long (and each prefill's chunk)
            object.__setattr__(
                self, "long_prefill_token_threshold", max(1, int(self.max_model_len * 0.04))
            )
