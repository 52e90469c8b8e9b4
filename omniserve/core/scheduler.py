"""Scheduler: continuous batching over ``waiting`` and ``running`` with a per-step token budget.

There are no prefill and decode phases. Each step hands every request up to
``num_tokens - num_computed_tokens`` tokens, so one rule covers chunked prefill, prefix-cache hits,
decoding and resumption after preemption. Multimodal items add a second budget and the
encoder cache; their rules live in ``encoder_planner``. Pure Python (no torch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from omniserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from omniserve.core.encoder_cache_manager import EncoderCacheManager
from omniserve.core.encoder_planner import (
    EncoderPlan,
    check_encoder_limits,
    check_request_items,
    commit_encoder_plan,
    free_consumed_encoder_inputs,
    hit_limit_for_blocked_plan,
    plan_encoder_inputs,
)
from omniserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from omniserve.core.request import Request, RequestStatus
from omniserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from omniserve.core.step_budget import StepBudget
from omniserve.core.stop_conditions import (
    FINISH_REASONS,
    TextStop,
    append_and_check_stop,
    check_text_stop,
    waits_for_tokens_in_flight,
)
from omniserve.core.talker_scheduler import TalkerScheduler
from omniserve.lora.request import adapter_fits
from omniserve.messages import (
    ACCEPTED_AT_KEY,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
)


@dataclass(slots=True)
class _ScheduledRequest:
    """What ``schedule()`` decided for one request; the output's dicts are built from these."""

    request: Request
    num_new_tokens: int
    new_block_ids: list[int]
    is_new: bool
    """Workers have not seen it: admitted from waiting (fresh or resumed after preemption)."""
    encoder_inputs: list[int]
    """Indices of the request's multimodal items encoded this step."""
    spec_token_ids: list[int]
    """Draft tokens fed after its last token (their positions count in ``num_new_tokens``)."""


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Order within a step: RUNNING requests in list order (preempting the last running request by
    recompute when KV blocks run out: the newest, or under the priority policy the least urgent),
    then WAITING requests in queue order (FCFS, or by priority) while budget and seats remain
    and nothing was preempted this step. Each request's window is first cut by the encoder rules
    (``encoder_planner``); only running requests hold encoder-cache references.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_mm_item_embeds: int = 0,
        num_talker_blocks: int = 0,
        make_text_stop: Callable[[Request], TextStop] | None = None,
        max_loras: int = 0,
        speculative_config: SpeculativeConfig | None = None,
        record_kv_events: bool = False,
    ) -> None:
        """``max_mm_item_embeds``: the model's largest multimodal item in embeddings (0: text
        only or unknown); start-up fails if that item could never be encoded.
        ``num_talker_blocks``: the speech stage's own KV pool (0: the model does not speak).
        ``make_text_stop``: a stop-string matcher for a speaking request (the front end matches
        stop strings of the others, a step later).
        ``max_loras``: distinct LoRA adapters the running requests may use (0: LoRA is off).
        ``speculative_config``: drafts (from the workers) are scheduled after a request's last
        token, unless the batch reaches its ``disable_by_batch_size``. ``record_kv_events``: keep
        the prefix cache's changes (``kv_cache_manager.take_events``)."""
        if max_mm_item_embeds:
            check_encoder_limits(scheduler_config, max_mm_item_embeds)
        self.scheduler_config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        cache_config.check_holds_one_sequence(num_blocks, self.max_model_len)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, record_kv_events,
            cache_config.prefix_caching_hash_algo,
        )  # fmt: skip
        self.encoder_cache_manager = EncoderCacheManager(scheduler_config.encoder_cache_size)
        self.make_text_stop = make_text_stop
        self.max_loras = max_loras
        self.drafts_off_at = speculative_config and speculative_config.disable_by_batch_size
        self.use_drafts = speculative_config is not None
        self.talker = (
            TalkerScheduler(
                num_talker_blocks,
                self.block_size,
                scheduler_config.max_num_seqs,
                scheduler_config.max_num_batched_tokens,
            )
            if num_talker_blocks
            else None
        )
        # req_id -> every unfinished request (waiting, running or preempted)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(); workers drop their state for these.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.blocked_by_steps_in_flight = False
        """The last ``schedule()`` left a request out because making room for it would preempt
        a request whose step is still running: schedule again once the steps in flight are back
        (async scheduling)."""
        # Multimodal items that needed an encoder output (first time per admission), and those
        # served from the encoder cache or shared with another item encoded in the same step.
        self.encoder_cache_queries = 0
        self.encoder_cache_hits = 0
        # Speculative decoding: requests' steps with drafts, drafts fed, drafts kept.
        self.spec_counts = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                            "spec_decode_num_accepted_tokens": 0}  # fmt: skip
        self.spec_accepted_at: list[int] = []  # drafts kept at each draft position

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already scheduled.")
        if not 0 < request.num_tokens <= self.max_model_len:
            raise ValueError(
                f"Request {request.request_id!r} has {request.num_tokens} prompt "
                f"tokens; needs 1..max_model_len ({self.max_model_len})."
            )
        check_request_items(request, self.scheduler_config)
        if request.lora_request is not None and not self.max_loras:
            raise ValueError(f"Request {request.request_id!r} names a LoRA adapter; LoRA is off.")
        if request.speech is not None:
            if self.talker is None:
                raise ValueError(
                    f"Request {request.request_id!r} asks for audio output, but "
                    "this engine has no speech stage."
                )
            self.talker.add(request, request.speech)
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, *, front: bool) -> None:
        """Into ``waiting``: at the back (new) or the front (preempted) under fcfs; in
        (priority, arrival) order under the priority policy."""
        if self.scheduler_config.policy == "priority":
            key = _priority_key(request)
            index = next(
                (i for i, r in enumerate(self.waiting) if _priority_key(r) > key), len(self.waiting)
            )
            self.waiting.insert(index, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort); unknown or finished ids are ignored.

        Produces no output: whoever asked already knows.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            if self.talker is not None:
                self.talker.finish(req_id)
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self.free_request(request)

    def free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_work_ahead(self) -> bool:
        """Whether a step scheduled before the steps in flight are back could run anything: a
        request waiting for admission, or a running one that need not wait for its tokens."""
        return bool(self.waiting) or not all(
            waits_for_tokens_in_flight(r, self.max_model_len) for r in self.running
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.talker and self.talker.requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests still generating text or (past their text) still speaking."""
        speaking = self.talker.requests.keys() - self.requests.keys() if self.talker else ()
        return len(self.requests) + len(speaking)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        self.encoder_cache_manager.reset()

    def make_stats(self) -> dict[str, float]:
        """Gauges (running, waiting, KV and encoder-cache usage) and cumulative counters."""
        kv = self.kv_cache_manager
        stats = {
            "num_running": float(len(self.running)),
            "num_waiting": float(len(self.waiting)),
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": float(kv.prefix_cache_queries),
            "prefix_cache_hits": float(kv.prefix_cache_hits),
            "num_preemptions": float(self.num_preemptions),
            "encoder_cache_usage": self.encoder_cache_manager.usage,
            "encoder_cache_queries": float(self.encoder_cache_queries),
            "encoder_cache_hits": float(self.encoder_cache_hits),
            **{key: float(count) for key, count in self.spec_counts.items()},
            **{f"{ACCEPTED_AT_KEY}{i}": float(n) for i, n in enumerate(self.spec_accepted_at)},
        }
        if self.talker:
            stats["talker_kv_cache_usage"] = self.talker.usage
            stats["num_speaking"] = float(len(self.talker.requests))
            stats["num_talker_preemptions"] = float(self.talker.num_preemptions)
        return stats

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, then advance them optimistically."""
        # req_id -> record, in scheduling order (running first, then admitted)
        scheduled: dict[str, _ScheduledRequest] = {}
        preempted: list[Request] = []
        self.blocked_by_steps_in_flight = False
        config = self.scheduler_config
        budget = StepBudget.for_step(config)
        if config.policy == "priority":  # the back of `running` is what preemption takes
            self.running.sort(key=_priority_key)
        if self.drafts_off_at:
            self.use_drafts = len(self.running) + len(self.waiting) < self.drafts_off_at
        if self.isolate_suspect(preempted):
            if self.blocked_by_steps_in_flight:
                return self._make_output(scheduled, preempted)
            self._schedule_running(scheduled, preempted, budget)
            if not self.running:
                self._schedule_waiting(scheduled, budget, max_num_seqs=1)
        else:
            self._schedule_running(scheduled, preempted, budget)
            if not preempted and not self.blocked_by_steps_in_flight:
                self._schedule_waiting(scheduled, budget)
        output = self._make_output(scheduled, preempted)
        # Optimistic: the step will compute these tokens (vLLM's _update_after_schedule), and
        # one that reaches the end of the known tokens (and its drafts) samples one more per
        # position after its last token. The talker runs after the thinker in the same step, so
        # it may read what they produce.
        for record in scheduled.values():
            request = record.request
            request.num_computed_tokens += record.num_new_tokens
            num_sampled = 1 + len(record.spec_token_ids)
            if (request.num_computed_tokens + 1 - num_sampled
                    == request.num_tokens + request.num_output_placeholders):  # fmt: skip
                request.num_output_placeholders += num_sampled
        if self.talker is not None:
            output.talker = self.talker.schedule()
        return output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new_tokens = request.num_tokens + request.num_output_placeholders - num_computed_tokens
        if self.use_drafts and request.spec_token_ids:
            # No draft past the last token max_tokens allows (the step samples one more).
            num_new_tokens += min(len(request.spec_token_ids),
                                  request.max_tokens - request.num_output_tokens - 1)  # fmt: skip
        threshold = self.scheduler_config.long_prefill_token_threshold
        if self.scheduler_config.enable_chunked_prefill and 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        # Positions stay below max_model_len (the front end keeps prompts within it).
        num_new_tokens = min(num_new_tokens, self.max_model_len - num_computed_tokens)
        return min(num_new_tokens, token_budget)

    def _plan_encoder(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, budget: StepBudget
    ) -> EncoderPlan:
        if not request.mm_features or num_new_tokens <= 0:
            return EncoderPlan(num_new_tokens)
        plan = plan_encoder_inputs(
            request,
            num_computed_tokens,
            num_new_tokens,
            budget.num_encoder_embeds,
            self.encoder_cache_manager,
            budget.encoder_cache_open,
            self.scheduler_config.disable_chunked_mm_input,
        )
        if plan.blocked_by_cache:
            budget.encoder_cache_open = False
        return plan

    def _schedule_running(
        self, scheduled: dict[str, _ScheduledRequest], preempted: list[Request], budget: StepBudget
    ) -> None:
        """Schedule RUNNING requests in order, preempting from the back."""
        index = 0
        while index < len(self.running) and budget.num_tokens > 0:
            request = self.running[index]
            if waits_for_tokens_in_flight(request, self.max_model_len) or not budget.seats(
                request, request.num_computed_tokens
            ):  # (its prefill waits for a partial-prefill seat)
                index += 1
                continue
            num_new_tokens = self._num_new_tokens(
                request, request.num_computed_tokens, budget.num_tokens
            )
            plan = self._plan_encoder(request, request.num_computed_tokens, num_new_tokens, budget)
            num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0:
                index += 1
                continue
            while (
                new_blocks := self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            ) is None:
                # NOTE: victims come from the back, past this cursor, so none was scheduled yet
                # this step: there are no tokens or blocks of this step to give back.
                if self.running[-1].num_output_placeholders:
                    # Its step is still running: it is preempted, if still needed, once back.
                    self.blocked_by_steps_in_flight = True
                    return
                victim = self.running.pop()
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; it was the last one running
            self._commit(scheduled, request, plan, new_blocks.get_block_ids(), budget, is_new=False)
            index += 1

    def _commit(
        self,
        scheduled: dict[str, _ScheduledRequest],
        request: Request,
        plan: EncoderPlan,
        block_ids: list[int],
        budget: StepBudget,
        is_new: bool,
    ) -> None:
        """Record a request that got its KV slots: reserve its encoder entries, spend budget."""
        commit_encoder_plan(request, plan, self.encoder_cache_manager)
        budget.take_seat(request, request.num_computed_tokens)
        num_hits = plan.num_hits + len(plan.share)
        self.encoder_cache_queries += len(plan.encode) + num_hits
        self.encoder_cache_hits += num_hits
        budget.num_tokens -= plan.num_new_tokens
        budget.num_encoder_embeds -= plan.num_embeds
        known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
        drafts = request.spec_token_ids[: max(plan.num_new_tokens - known, 0)]
        scheduled[request.request_id] = _ScheduledRequest(
            request, plan.num_new_tokens, block_ids, is_new, plan.encode, drafts
        )

    def preempt(self, request: Request) -> None:
        # NOTE: free() before resetting num_computed_tokens: it tells which blocks were written.
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def isolate_suspect(self, preempted: list[Request]) -> bool:
        """While requests of a step that raised are suspects, run one of them per step, alone.

        The first suspect (running, else the first waiting) is put where this step takes it: every
        other running request is preempted (recompute) and a waiting suspect moves to the head
        of the queue. Returns False when there is no suspect.
        """
        suspect = next((r for r in self.running if r.suspect), None) or next(
            (r for r in self.waiting if r.suspect), None
        )
        if suspect is None:
            return False
        if any(r.num_output_placeholders for r in self.running if r is not suspect):
            self.blocked_by_steps_in_flight = True
            return True
        for request in [r for r in self.running if r is not suspect]:
            self.running.remove(request)
            self.preempt(request)
            preempted.append(request)
        if suspect.status != RequestStatus.RUNNING:
            self.waiting.remove(suspect)
            self.waiting.appendleft(suspect)
        return True

    def _schedule_waiting(
        self,
        scheduled: dict[str, _ScheduledRequest],
        budget: StepBudget,
        max_num_seqs: int | None = None,
    ) -> None:
        """Admit WAITING requests in queue order; the first that cannot run stops admission,
        except one whose LoRA adapter has no slot or a long prompt without a seat: passed over."""
        config = self.scheduler_config
        kv = self.kv_cache_manager
        max_num_seqs = config.max_num_seqs if max_num_seqs is None else max_num_seqs
        passed_over: list[Request] = []
        while self.waiting and budget.num_tokens > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            if not adapter_fits(request, self.running, self.max_loras):
                passed_over.append(self.waiting.popleft())  # the slots hold other adapters
                continue
            if budget.prefill_seats == 0:
                break  # (every request admitted prefills)
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            if request.speech is not None and request.speech.reads_prompt_hidden:
                # The talker needs the thinker's hidden states at prompt positions, which a
                # cache hit would skip: compute the whole prompt (still cached for others).
                hit_blocks, num_hit_tokens = KVCacheBlocks(), 0
            if not budget.seats(request, num_hit_tokens):
                passed_over.append(self.waiting.popleft())  # a long prompt: short ones pass
                continue
            plan = self._plan_admission(request, num_hit_tokens, budget)
            capped = hit_limit_for_blocked_plan(request, plan, self.block_size)
            if capped < num_hit_tokens:
                # The hit ends inside an item that cannot be encoded now: start before it instead,
                # so the text ahead of the item can run meanwhile.
                self.encoder_cache_manager.free(request)
                num_hit_tokens = capped
                hit_blocks = KVCacheBlocks(hit_blocks.blocks[: capped // self.block_size])
                plan = self._plan_admission(request, num_hit_tokens, budget)
            num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0 or (
                not config.enable_chunked_prefill
                and num_new_tokens < request.num_tokens - num_hit_tokens
            ):
                # Cut to nothing before an item, or (without chunked prefill) not the whole
                # prompt: it waits, holding no encoder references meanwhile.
                self.encoder_cache_manager.free(request)
                break
            new_blocks = kv.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)
            if new_blocks is None:
                self.encoder_cache_manager.free(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            block_ids = kv.get_block_ids(request.request_id)
            self._commit(scheduled, request, plan, block_ids, budget, is_new=True)
        self.waiting.extendleft(reversed(passed_over))

    def _plan_admission(
        self, request: Request, num_hit_tokens: int, budget: StepBudget
    ) -> EncoderPlan:
        num_new_tokens = self._num_new_tokens(request, num_hit_tokens, budget.num_tokens)
        return self._plan_encoder(request, num_hit_tokens, num_new_tokens, budget)

    def _make_output(
        self, scheduled: dict[str, _ScheduledRequest], preempted: list[Request]
    ) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        for req_id, record in scheduled.items():
            request = record.request
            if record.is_new:
                new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=record.new_block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                        eos_token_id=request.eos_token_id,
                        mm_features=request.mm_features,
                        lora_request=request.lora_request,
                        prompt_embeds=request.prompt_embeds,
                    )
                )
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(record.new_block_ids)
                cached.num_computed_tokens.append(request.num_computed_tokens)
        num_scheduled_tokens = {req_id: r.num_new_tokens for req_id, r in scheduled.items()}
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={request.request_id for request in preempted},
            scheduled_encoder_inputs={
                req_id: r.encoder_inputs for req_id, r in scheduled.items() if r.encoder_inputs
            },
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            kv_block_copies=self.kv_cache_manager.take_block_copies(),
            newly_cached_block_ids=self.kv_cache_manager.take_newly_cached(),
            scheduled_spec_decode_tokens={
                req_id: r.spec_token_ids for req_id, r in scheduled.items() if r.spec_token_ids
            },
        )

    # ---- after the step ----

    def _settle_drafts(self, request: Request, so: SchedulerOutput, sampled: list[int]) -> None:
        """The step's tokens are back: the drafts the model rejected were computed (in the KV
        cache) but are not the request's tokens; the next step overwrites them."""
        num_drafts = len(so.scheduled_spec_decode_tokens.get(request.request_id, ()))
        request.num_output_placeholders -= 1 + num_drafts
        request.num_computed_tokens -= 1 + num_drafts - len(sampled)
        if num_drafts:
            counts = self.spec_counts
            counts["spec_decode_num_drafts"] += 1
            counts["spec_decode_num_draft_tokens"] += num_drafts
            counts["spec_decode_num_accepted_tokens"] += len(sampled) - 1
            kept_at = self.spec_accepted_at
            kept_at += [0] * (len(sampled) - 1 - len(kept_at))
            for position in range(len(sampled) - 1):
                kept_at[position] += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Release consumed encoder inputs, append sampled tokens, check stops, free finished
        requests, report what is new."""
        runner = model_runner_output
        req_id_to_index = {req_id: i for i, req_id in enumerate(runner.req_ids)}
        outputs: list[EngineCoreOutput] = []
        num_finished = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:  # finished (aborted) while the step ran
                continue
            free_consumed_encoder_inputs(request, self.encoder_cache_manager)
            index = req_id_to_index.get(req_id)
            sampled = runner.sampled_token_ids[index] if index is not None else []
            if sampled:
                self._settle_drafts(request, scheduler_output, sampled)
            new_token_ids = append_and_check_stop(request, sampled, self.max_model_len)
            if self.make_text_stop is not None:
                check_text_stop(request, new_token_ids, self.make_text_stop)
            if new_token_ids:
                request.suspect = False  # it ran past the step that failed
            prompt_logprobs = runner.prompt_logprobs.get(req_id)
            if new_token_ids or request.is_finished or prompt_logprobs is not None:
                logprobs = runner.logprobs.get(req_id)
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        # only the tokens kept (a stop or a missing token cuts the step's)
                        new_logprobs=logprobs and logprobs.head(len(new_token_ids)),
                        new_prompt_logprobs=prompt_logprobs,
                        pooled=runner.pooled.get(req_id),
                        finish_reason=FINISH_REASONS.get(request.status),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        error=request.error,
                    )
                )
            if request.is_finished:
                self.free_request(request)
                num_finished += 1
            else:
                self.kv_cache_manager.update_block_hashes(request)
                request.spec_token_ids = runner.spec_token_ids.get(req_id, [])
        if num_finished:
            self.running = [request for request in self.running if not request.is_finished]
        if self.talker is not None:
            outputs = self.talker.hold(outputs) + self.talker.outputs(runner.speech)
        return EngineCoreOutputs(outputs=outputs)


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
