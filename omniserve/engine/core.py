"""EngineCore: the schedule -> execute -> update loop (``core_proc`` runs it in its own process)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any

from omniserve.config import OmniConfig
from omniserve.core.request import Request, RequestStatus
from omniserve.core.sched_output import SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.core.step_failure import fail_step
from omniserve.engine.detokenizer import IncrementalDetokenizer
from omniserve.engine.kv_event_publisher import KVEventPublisher
from omniserve.executor.abstract import Executor
from omniserve.lora.request import LoRARequest, lora_stats
from omniserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    PendingOutput,
)
from omniserve.registry import load_subclass
from omniserve.structured_output import StructuredOutputManager, wait_any
from omniserve.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
"""vLLM's default ``--scheduler-cls``, taken as this engine's own (configs copied from vLLM)."""


def scheduler_class(spec: str) -> type[Scheduler]:
    """``Scheduler``, or the subclass ``--scheduler-cls`` names (``module.Class``, vLLM's
    setting): ValueError when it does not import or is not a ``Scheduler``."""
    if spec in ("", VLLM_SCHEDULER):
        return Scheduler
    return load_subclass(spec, Scheduler, "--scheduler-cls")


@dataclasses.dataclass
class _Raised:
    """A step whose launch raised: it fails when its turn to be read back comes."""

    error: Exception

    def result(self) -> ModelRunnerOutput:
        raise self.error

    def done(self) -> bool:
        return True


class EngineCore:
    """Owns the scheduler and the executor. Only the scheduler owns request state."""

    def __init__(
        self,
        config: OmniConfig,
        executor_class: type[Executor] | None = None,
        engine_index: int = 0,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        """Data-parallel rank: which of the front end's engine cores this is."""
        self.sleeping: list[str] = []
        """What the workers released in ``sleep`` (empty: awake)."""
        self._times: dict[str, tuple[float, float]] = {}
        """Request id -> when it was received and first scheduled (0: not yet), reported on
        its last output."""
        self.num_requests_received = 0
        executor_class = executor_class or Executor.get_class(config)
        async_scheduling = config.scheduler_config.async_scheduling
        self._max_steps_in_flight = 2 if async_scheduling else 1
        if async_scheduling and not executor_class.supports_async_scheduling:
            raise ValueError(
                "--async-scheduling needs the 'uni' or 'mp' executor, not "
                f"{executor_class.__name__}; drop it, or pick one with "
                "--distributed-executor-backend."
            )
        self.model_executor = executor_class(config)
        num_blocks = self.model_executor.determine_num_kv_blocks()
        self.model_executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        num_talker_blocks = self.model_executor.determine_num_talker_kv_blocks()
        if num_talker_blocks:
            self.model_executor.initialize_talker_kv_cache(num_talker_blocks)
        if async_scheduling and num_talker_blocks:
            self.model_executor.shutdown()
            raise ValueError(
                "--async-scheduling does not support speech output yet (the talker follows "
                "each token as it is sampled); add --disable-audio-output or drop it."
            )
        self.talker_capacity = num_talker_blocks * config.cache_config.block_size
        """Talker positions the speech KV pool holds: one request's talker prompt and frames
        must fit (the front end checks at admission, so no talker outgrows the pool alone)."""
        if num_talker_blocks:
            logger.info(
                "Talker KV pool: %d positions (one request's talker prompt and frames "
                "must fit; --talker-kv-cache-memory sets it).",
                self.talker_capacity,
            )
        kv_events = config.kv_events_config
        if kv_events is not None and kv_events.publisher == "null":
            kv_events = None  # recorded only to be dropped: not recorded at all
        self.scheduler = scheduler_class(config.scheduler_config.scheduler_cls)(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            num_talker_blocks=num_talker_blocks,
            make_text_stop=self._make_text_stop,
            max_loras=config.lora_config.max_loras if config.lora_config else 0,
            speculative_config=config.speculative_config,
            record_kv_events=kv_events is not None,
        )
        self.kv_events = (
            KVEventPublisher(kv_events, engine_index, config.parallel_config.data_parallel_size > 1)
            if kv_events is not None
            else None
        )
        if spec := config.speculative_config:
            logger.info(
                "Speculative decoding: n-gram prompt lookup, up to %d drafts per request and "
                "step from matches of %d..%d tokens%s.",
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                f", none while {spec.disable_by_batch_size}+ requests are in"
                if spec.disable_by_batch_size else "",
            )  # fmt: skip
        # Requests with structured outputs wait here, outside the scheduler, for their grammar.
        self.grammar_waiting: dict[str, tuple[Request, Future[Any]]] = {}
        self.structured_output = StructuredOutputManager(config.model_config)
        self._tokenizer: Any = None  # for speaking requests' stop strings, loaded on first use
        # Launched steps whose output is not read yet, oldest first (at most one outside async
        # scheduling, and only within step()).
        self._in_flight: collections.deque[tuple[SchedulerOutput, PendingOutput]] = (
            collections.deque()
        )
        self._unsampled: SchedulerOutput | None = None
        """A step launched up to its logits, to be sampled once the step before it is read
        back (its grammar bitmask follows that step's tokens)."""

    def _make_text_stop(self, request: Request) -> IncrementalDetokenizer:
        """The front end's detokenizer, here for a speaking request with stop strings."""
        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(self.config.model_config.tokenizer)
        return IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.sampling_params
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_requests_received += 1
        self._times[request.request_id] = (time.time(), 0.0)
        engine_request = Request(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            max_tokens=request.max_tokens,
            mm_features=list(request.mm_features),
            cache_salt=request.cache_salt,
            priority=request.priority,
            speech=request.speech,
            lora_request=request.lora_request,
            prompt_embeds=list(request.prompt_embeds),
        )
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(engine_request)
            return
        self.grammar_waiting[request.request_id] = (
            engine_request,
            self.structured_output.compile_async(constraint),
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in request_ids:
            self._times.pop(req_id, None)
            self.grammar_waiting.pop(req_id, None)
            self.structured_output.remove(req_id)

    def has_unfinished_requests(self) -> bool:
        """(False while asleep: requests added then wait for ``wake_up``.)"""
        return not self.sleeping and (
            self.scheduler.has_unfinished_requests()
            or bool(self.grammar_waiting)
            or bool(self._in_flight)
        )

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar is compiled to the scheduler; a compile that failed ends
        its request with an error. With nothing else to run, wait a little for one."""
        if not self.grammar_waiting:
            return []
        if not self.scheduler.has_unfinished_requests():
            wait_any([future for _, future in self.grammar_waiting.values()], timeout=0.05)
        failed = []
        for req_id, (request, future) in list(self.grammar_waiting.items()):
            if not future.done():
                continue
            del self.grammar_waiting[req_id]
            if (error := future.exception()) is not None:
                # xgrammar's errors are the constraint's (its client's 400); others are ours
                own = isinstance(error, ValueError | RuntimeError)
                logger.log(
                    logging.INFO if own else logging.ERROR,
                    "Compiling the grammar of request %s failed: %s",
                    req_id,
                    error,
                )
                failed.append(
                    EngineCoreOutput(request_id=req_id, new_token_ids=[],
                                     finish_reason=FinishReason.ERROR,
                                     error=str(error) if own else None)
                )  # fmt: skip
                continue
            constraint = request.sampling_params.structured_outputs
            assert constraint is not None
            self.structured_output.start(req_id, future.result(), constraint.after_thinking,
                                         request.prompt_token_ids)  # fmt: skip
            self.scheduler.add_request(request)
        return failed

    def _attach_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """A bitmask row for each constrained request that samples in this step."""
        if not self.structured_output.matchers:
            return
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            if (
                req_id in self.structured_output.matchers
                and request is not None
                and request.num_computed_tokens >= request.num_tokens
            ):
                row = self.structured_output.bitmask_row(req_id)
                if row is not None:
                    scheduler_output.grammar_bitmask[req_id] = row

    def _advance_grammars(self, outputs: EngineCoreOutputs) -> None:
        manager = self.structured_output
        if not manager.matchers:
            return
        for output in outputs.outputs:
            if output.request_id not in manager.matchers:
                continue
            try:
                manager.accept(output.request_id, output.new_token_ids)
            except RuntimeError:
                # The sampler applies the grammar, so this is a bug; it ends this request only.
                logger.exception("Request %s left its grammar", output.request_id)
                self.scheduler.finish_requests(output.request_id, RequestStatus.FINISHED_ERROR)
                output.finish_reason = FinishReason.ERROR
            if output.finished:
                manager.remove(output.request_id)

    def step(self) -> EngineCoreOutputs:
        """Run one step; return what it produced (empty when there was nothing to run).

        Under async scheduling the next step is scheduled and launched before this one's output
        is read back, so the device has it queued while the host works on this one's output."""
        if self.sleeping:
            return EngineCoreOutputs(timestamp=time.time(), engine_index=self.engine_index)
        failed = self._admit_compiled()
        self._launch_steps()
        if not self._in_flight:
            return EngineCoreOutputs(
                outputs=self._timed(failed), timestamp=time.time(), engine_index=self.engine_index
            )
        outputs = self._finish_oldest_step()
        if self._unsampled is not None:
            self._sample_launched()
        outputs.outputs = self._timed(failed + outputs.outputs)
        self._publish_kv_events()
        return outputs

    def _timed(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """``outputs``, each request's last one with when it was received and scheduled."""
        for output in outputs:
            if output.finished and (times := self._times.pop(output.request_id, None)):
                output.queued_time, output.scheduled_time = times
        return outputs

    def _publish_kv_events(self) -> None:
        """The prefix cache's changes since the last call, as one batch (``--kv-events-config``)."""
        if self.kv_events is not None and (events := self.scheduler.kv_cache_manager.take_events()):
            self.kv_events.publish(events)

    def _launch_steps(self) -> None:
        """Schedule and launch steps until one is in flight (two under async scheduling), or
        until the scheduler needs the steps in flight back before it can go on (or has nothing
        to run before then: no empty step is launched)."""
        while (
            len(self._in_flight) < self._max_steps_in_flight
            and self.scheduler.has_unfinished_requests()
        ):
            if self._in_flight and (
                self.scheduler.blocked_by_steps_in_flight or not self.scheduler.has_work_ahead()
            ):
                return
            scheduler_output = self.scheduler.schedule()
            now = time.time()
            for new in scheduler_output.scheduled_new_reqs:  # (a resumed one keeps its first)
                received, scheduled = self._times.get(new.req_id, (now, 0.0))
                self._times[new.req_id] = (received, scheduled or now)
            try:
                if self._in_flight and self._samples_under_grammar(scheduler_output):
                    # Its bitmask follows the tokens in flight: sampled once they are back.
                    self.model_executor.launch_model(scheduler_output)
                    self._unsampled = scheduler_output
                    return
                self._attach_grammar_bitmask(scheduler_output)
                pending: PendingOutput = self.model_executor.dispatch_model(scheduler_output)
            except Exception as exc:
                # Read back in order: the steps before it end normally.
                self._in_flight.append((scheduler_output, _Raised(exc)))
                return
            self._in_flight.append((scheduler_output, pending))

    def _samples_under_grammar(self, scheduler_output: SchedulerOutput) -> bool:
        matchers = self.structured_output.matchers
        return bool(matchers) and any(r in matchers for r in scheduler_output.num_scheduled_tokens)

    def _sample_launched(self) -> None:
        """Sample the step launched before the last one was read back, now that the grammars
        have seen its tokens."""
        scheduler_output, self._unsampled = self._unsampled, None
        assert scheduler_output is not None
        try:
            self._attach_grammar_bitmask(scheduler_output)
            pending: PendingOutput = self.model_executor.dispatch_sampling(
                scheduler_output.grammar_bitmask
            )
        except Exception as exc:
            pending = _Raised(exc)
        self._in_flight.append((scheduler_output, pending))

    def _finish_oldest_step(self) -> EngineCoreOutputs:
        scheduler_output, pending = self._in_flight.popleft()
        try:
            model_output = pending.result()
        except Exception as exc:
            # The steps launched after it build on it: they fail with it, unread.
            failed = [scheduler_output, *(so for so, _ in self._in_flight)]
            if self._unsampled is not None:
                failed.append(self._unsampled)
            self._in_flight.clear()
            self._unsampled = None
            return self._fail_step(failed, exc)
        return self._update_from_output(scheduler_output, model_output)

    def _fail_step(
        self, scheduler_outputs: list[SchedulerOutput], exc: Exception
    ) -> EngineCoreOutputs:
        """A step raised: fail only the request that caused it, keep serving the rest.

        Raises (the engine dies) when the workers cannot go on, e.g. one of them died.
        """
        self.model_executor.check_health()
        req_ids = sorted({r for so in scheduler_outputs for r in so.num_scheduled_tokens})
        logger.error(
            "A step failed for request(s) %s (%d scheduled); %s",
            ", ".join(req_ids),
            len(req_ids),
            "failing it" if len(req_ids) == 1 else "rerunning each alone to find the cause",
            exc_info=exc,
        )
        outputs = fail_step(self.scheduler, scheduler_outputs).outputs
        for output in outputs:
            if output.finished:
                self.structured_output.remove(output.request_id)
        return EngineCoreOutputs(
            outputs=outputs,
            timestamp=time.time(),
            engine_index=self.engine_index,
            scheduler_stats=self.make_stats(),
        )

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self._advance_grammars(outputs)
        outputs.timestamp = time.time()
        outputs.engine_index = self.engine_index
        outputs.scheduler_stats = self.make_stats()
        return outputs

    def make_stats(self) -> dict[str, float]:
        """The scheduler's gauges and counters, plus the requests this engine core received."""
        stats = {
            **self.scheduler.make_stats(),
            "num_requests_received": float(self.num_requests_received),
        }
        if self.config.lora_config is not None:
            stats.update(lora_stats(self.scheduler.running, self.scheduler.waiting))
        return stats

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def reset_encoder_cache(self) -> None:
        """Forget the encoder outputs no running request holds (``reset_mm_cache``)."""
        self.scheduler.reset_encoder_cache()

    def get_stats(self) -> dict[str, float]:
        """Scheduler gauges and counters, plus the KV cache size (a utility for clients/tests)."""
        return {**self.make_stats(), "num_kv_blocks": float(self.num_kv_blocks)}

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Read a LoRA adapter into the workers (ValueError: it does not fit the model)."""
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters need the engine started with --enable-lora.")
        self.model_executor.collective_rpc(
            "add_lora", (LoRARequest(lora_name, lora_int_id, lora_path),)
        )
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it)."""
        self.model_executor.collective_rpc("remove_lora", (lora_int_id,))
        return True

    def get_model_info(self) -> dict[str, Any]:
        """The loaded model's dtype, weight and KV-cache bytes, load time and CPU kernels."""
        return self.model_executor.model_info()

    def start_step_timing(self) -> None:
        """Time the model runner's steps per part from now on (for benchmarks)."""
        self.model_executor.start_step_timing()

    def get_step_timings(self) -> dict[str, dict[str, float]]:
        """``{"seconds": part -> s, "steps": phase -> count}`` since ``start_step_timing``."""
        return self.model_executor.step_timings()

    def profile(self, is_start: bool) -> None:
        """Start or stop the workers' torch profilers (``OMNISERVE_TORCH_PROFILER_DIR``)."""
        self.model_executor.profile(is_start)

    # ---- sleep mode and collective_rpc (vLLM's) ------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the workers' KV cache and, at level 2 (on a GPU at level 1 too), their
        weights (``Worker.sleep``), once no request is unfinished; the prefix cache and the
        encoder outputs go with them."""
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep() needs the engine started with enable_sleep_mode=True "
                             "(--enable-sleep-mode).")  # fmt: skip
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}.")
        if self.has_unfinished_requests():
            raise ValueError("sleep(): requests are unfinished; sleep once they have finished "
                             "(or abort them).")  # fmt: skip
        self.reset_prefix_cache()
        self.scheduler.reset_encoder_cache()
        self.sleeping = self.model_executor.collective_rpc("sleep", (level,))[0]

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released of ``tags`` ("weights", "kv_cache"; None: both)."""
        if tags is not None and (unknown := sorted(set(tags) - {"weights", "kv_cache"})):
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', not {unknown}.")
        self.sleeping = self.model_executor.collective_rpc("wake_up", (tags,))[0]

    def is_sleeping(self) -> bool:
        return bool(self.sleeping)

    def collective_rpc(
        self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a worker method (or its ``--worker-extension-cls`` extension's) on every
        worker; the results by rank. A call that read the weights again (``reload_weights``)
        drops the prefix cache: the old weights computed its blocks."""
        call = (method, tuple(args or ()), dict(kwargs or {}))
        replies = self.model_executor.collective_rpc("rpc", call)
        _, reloaded, self.sleeping = replies[0]
        if reloaded:
            self.reset_prefix_cache()
        return [result for result, _, _ in replies]

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.model_executor.shutdown()


# Methods a client may call by name; everything else on the class (step, shutdown, internals) is
# driven by the busy loop itself.
UTILITY_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "reset_encoder_cache",
        "add_lora",
        "remove_lora",
        "get_stats",
        "has_unfinished_requests",
        "get_model_info",
        "start_step_timing",
        "get_step_timings",
        "profile",
        "sleep",
        "wake_up",
        "is_sleeping",
        "collective_rpc",
    }
)
