"""Factories for scheduler and KV-cache tests: requests, schedulers and hand-made runner outputs."""

from __future__ import annotations

from collections.abc import Callable

from omniserve.config import CacheConfig, SchedulerConfig
from omniserve.core.request import Request
from omniserve.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.sampling_params import SamplingParams

EOS_TOKEN_ID = 0


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    block_size: int = 16,
    num_blocks: int = 10_000,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, num_blocks)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 16,
    eos_token_id: int | None = EOS_TOKEN_ID,
    **sampling: object,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        eos_token_id=eos_token_id,
        max_tokens=max_tokens,
    )


def make_requests(
    num: int, num_tokens: int, *, same_prompt: bool = False, prefix: str = "req", **kwargs: object
) -> list[Request]:
    """``num`` requests of ``num_tokens`` prompt tokens each; distinct prompts unless asked.

    Prompt ids start at 1000 so they never collide with the eos id or test stop tokens.
    """
    requests = []
    for i in range(num):
        start = 1000 if same_prompt else 1000 + i * num_tokens
        prompt = list(range(start, start + num_tokens))
        requests.append(make_request(f"{prefix}-{i}", prompt, **kwargs))  # type: ignore[arg-type]
    return requests


def make_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    next_token: Callable[[Request], int] | None = None,
    prompt_logprobs: bool = False,
) -> ModelRunnerOutput:
    """What a model runner would return: one token for each request whose step reaches the end
    of its known tokens, nothing for partial prefills. ``next_token`` picks the token
    (default: 1 + the request's number of output tokens, never the eos id)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    runner_prompt_logprobs: dict[str, LogprobsLists] = {}
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        # schedule() already advanced num_computed_tokens by this step's tokens.
        if request.num_computed_tokens >= request.num_tokens:
            sampled.append([next_token(request) if next_token else request.num_output_tokens + 1])
        else:
            sampled.append([])
        if prompt_logprobs:
            num = scheduler_output.num_scheduled_tokens[req_id]
            runner_prompt_logprobs[req_id] = LogprobsLists([[7]] * num, [[-0.5]] * num, [1] * num)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=runner_prompt_logprobs
    )


def run_to_completion(
    scheduler: Scheduler,
    max_steps: int = 10_000,
    next_token: Callable[[Request], int] | None = None,
) -> dict[str, list[int]]:
    """Step until nothing is left; return every request's output tokens (req_id -> tokens)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        scheduler_output = scheduler.schedule()
        runner_output = make_runner_output(scheduler, scheduler_output, next_token)
        for output in scheduler.update_from_output(scheduler_output, runner_output).outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
