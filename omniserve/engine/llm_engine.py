"""LLMEngine: the synchronous front end (processor -> engine core -> output processor)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from omniserve import envs
from omniserve.config import OmniConfig
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.core_client import EngineCoreClient, InprocClient
from omniserve.engine.exceptions import SLEEPING, EngineSleepingError
from omniserve.engine.mp_client import SyncMPClient
from omniserve.engine.output_processor import OutputProcessor
from omniserve.engine.processor import start_with_engine
from omniserve.inputs.data import PromptType, prompt_modalities
from omniserve.lora.request import (
    AddedAdapters,
    LoRARequest,
    default_mm_lora_requests,
    with_default_mm_lora,
)
from omniserve.messages import EngineCoreRequest
from omniserve.outputs import RequestOutput
from omniserve.sampling_params import SamplingParams
from omniserve.tokenizer import tokenizer_refusal
from omniserve.tracing import close_stat_loggers, request_tracers

ADD_BATCH_WINDOW_S = 0.05
"""Longest a batch of added requests is held before it is sent (``LLMEngine.batched_adds``)."""


class LLMEngine:
    def __init__(self, config: OmniConfig) -> None:
        self.config = config
        in_other_process = envs.engine_multiprocessing()
        client: Callable[[OmniConfig], EngineCoreClient] = (
            SyncMPClient if in_other_process else InprocClient
        )
        self.processor, self.engine_core = start_with_engine(
            config, lambda: client(config), engine_in_other_process=in_other_process
        )
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(
            self.tokenizer, config.scheduler_config.stream_interval
        )
        self.adapters = AddedAdapters()
        self.default_mm_loras = default_mm_lora_requests(config.lora_config)
        self.asleep = False  # (``sleep``)
        self.stat_loggers = request_tracers(config)
        self._batch: list[list[EngineCoreRequest]] | None = None
        """Request groups processed inside ``batched_adds`` and not yet sent."""
        self._batch_since = 0.0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_config())

    def get_tokenizer(self) -> Any:
        """The tokenizer (ValueError for an engine started without one, as vLLM's)."""
        if self.tokenizer is None:
            raise ValueError(tokenizer_refusal("get_tokenizer()"))
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError/TypeError for bad input (also an
        adapter that does not load)."""
        if self.asleep:
            raise EngineSleepingError(SLEEPING)
        lora_request = with_default_mm_lora(lora_request, prompt_modalities(prompt),
                                            self.default_mm_loras)  # fmt: skip
        if lora_request is not None and self.adapters.is_new(lora_request):
            self.add_lora(lora_request)
        processed = self.processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        self.output_processor.add_processed_request(request_id, processed, params)
        for stat_logger in self.stat_loggers:
            stat_logger.record_new_requests(processed.engine_requests)
        if self._batch is None:
            self.engine_core.add_requests([processed.engine_requests])
            return
        self._batch.append(processed.engine_requests)
        if time.monotonic() - self._batch_since >= ADD_BATCH_WINDOW_S:
            self._send_batch()

    @contextlib.contextmanager
    def batched_adds(self) -> Iterator[None]:
        """Requests added inside reach the engine core together, so its next step takes them
        all (sent one by one, a core in another process starts a step with the first alone
        while the rest are being processed); a long batch is sent every
        ``ADD_BATCH_WINDOW_S`` of processing, so the engine starts on it meanwhile."""
        self._batch, self._batch_since = [], time.monotonic()
        try:
            yield
        finally:
            self._send_batch()
            self._batch = None

    def _send_batch(self) -> None:
        if self._batch:
            self.engine_core.add_requests(self._batch)
        self._batch, self._batch_since = [], time.monotonic()

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = self.output_processor.abort_requests(ids)
        for stat_logger in self.stat_loggers:
            stat_logger.record_aborted(child_ids)
        self.engine_core.abort_requests(child_ids)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs, processed)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into the engine's workers (ValueError: it does not load)."""
        self.adapters.is_new(lora_request)  # refuses an id taken by another adapter
        self.engine_core.call_utility("add_lora", *self.adapters.utility_args(lora_request))
        self.adapters.added(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self.engine_core.call_utility("remove_lora", lora_int_id)
        return self.adapters.removed(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.adapters.ids()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """vLLM's: forget processed media (the processor cache) and the encoder outputs no
        running request holds, so the next request with the same media runs it again."""
        self.processor.reset_mm_cache()
        self.engine_core.call_utility("reset_encoder_cache")

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``EngineCore.sleep``): requests are refused until ``wake_up``."""
        self.engine_core.call_utility("sleep", level)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (``tags``: "weights", "kv_cache"; None: both)."""
        self.engine_core.call_utility("wake_up", tags)
        self.asleep = self.is_sleeping()

    def is_sleeping(self) -> bool:
        return self.engine_core.call_utility("is_sleeping")

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's: call a worker method by name on every worker (``EngineCore.collective_rpc``);
        arguments and results cross processes as msgpack (tensors too)."""
        results = self.engine_core.call_utility("collective_rpc", method, list(args),
                                                kwargs or {}, timeout=timeout)  # fmt: skip
        if self.asleep:  # (reload_weights wakes the workers)
            self.asleep = self.is_sleeping()
        return results

    def start_step_timing(self) -> None:
        """Time the model runner's steps per part from now on (``get_step_timings`` reads)."""
        self.engine_core.call_utility("start_step_timing")

    def get_step_timings(self) -> dict[str, dict[str, float]]:
        """``{"seconds": part -> s, "steps": phase -> count}`` since ``start_step_timing``."""
        return self.engine_core.call_utility("get_step_timings")

    def start_profile(self) -> None:
        """Start the workers' torch profilers (``OMNISERVE_TORCH_PROFILER_DIR``: vLLM's API)."""
        self.engine_core.call_utility("profile", True)

    def stop_profile(self) -> None:
        """Stop them; each writes its trace and op table into the profiler directory."""
        self.engine_core.call_utility("profile", False)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        close_stat_loggers(self.stat_loggers)
