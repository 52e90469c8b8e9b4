"""AsyncLLM: the asyncio front end used by the API server.

Requests are processed (tokenized, validated) here, sent to the engine-core process, and their
outputs are pulled by one background task (``_run_output_handler``) that detokenizes and puts each
``RequestOutput`` on its request's queue. A consumer that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from omniserve.config import OmniConfig
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.exceptions import (
    SLEEPING,
    EngineDeadError,
    EngineSleepingError,
    EngineStoppingError,
)
from omniserve.engine.mp_client import AsyncMPClient
from omniserve.engine.output_processor import OutputProcessor
from omniserve.engine.processor import start_with_engine
from omniserve.inputs.data import PromptType, prompt_modalities
from omniserve.lora.request import (
    AddedAdapters,
    LoRARequest,
    default_mm_lora_requests,
    with_default_mm_lora,
)
from omniserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from omniserve.sampling_params import PoolingParams, SamplingParams, embedding_params
from omniserve.tokenizer import tokenizer_refusal
from omniserve.tracing import close_stat_loggers, request_tracers

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RequestOutputCollector:
    """One request's outputs, handed from the output handler to the consumer.

    ``put`` never blocks; the consumer gets outputs in order, or the exception that ended them.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    def __init__(
        self, config: OmniConfig, stat_loggers: list[Any] | None = None, input_threads: int = 1
    ) -> None:
        """Input work runs off the event loop, in two pools so that no text-only request waits
        behind another's media: ``input_pool`` (one thread) tokenizes and renders templates,
        ``mm_pool`` (``input_threads``) runs the HF processing of prompts with media."""
        if input_threads < 1:
            raise ValueError(f"input_threads must be >= 1, got {input_threads}.")
        self.input_pool = ThreadPoolExecutor(1, thread_name_prefix="omniserve-input")
        self.mm_pool = ThreadPoolExecutor(input_threads, thread_name_prefix="omniserve-mm")
        self.config = config
        self.model_config = config.model_config
        self.processor, self.engine_core = start_with_engine(
            config,
            lambda: AsyncMPClient(config),
            engine_in_other_process=True,
            serving=True,  # vLLM's server rules for max_tokens
        )
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(
            self.tokenizer, config.scheduler_config.stream_interval
        )
        self.adapters = AddedAdapters()
        self.default_mm_loras = default_mm_lora_requests(config.lora_config)
        self.asleep = False  # (``sleep``)
        self.stat_loggers = list(stat_loggers or []) + request_tracers(config)
        self._output_handler: asyncio.Task | None = None
        self.dead_error: BaseException | None = None
        self.stopping_error: EngineStoppingError | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(engine_args.create_config(default_batched_tokens=2048), **kwargs)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def get_tokenizer(self) -> Any:
        """The tokenizer (ValueError for an engine started without one, as vLLM's)."""
        if self.tokenizer is None:
            raise ValueError(tokenizer_refusal("get_tokenizer()"))
        return self.tokenizer

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate and submit; raises ValueError/TypeError for bad input (also an adapter that
        does not load), EngineDeadError."""
        collectors = await self.add_requests(
            [request_id], [prompt], params, arrival_time, priority, lora_request
        )
        return collectors[0]

    async def add_requests(
        self,
        request_ids: list[str],
        prompts: list[PromptType],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutputCollector]:
        """``add_request`` for several prompts, processed side by side and sent together, so
        the engine core's next step takes them all; if one fails, none is added."""
        if self.dead_error is not None:
            raise EngineDeadError("The engine core is dead.") from self.dead_error
        self._check_not_stopping()
        if self.asleep:
            raise EngineSleepingError(SLEEPING)
        self._ensure_output_handler()
        loras = [with_default_mm_lora(lora_request, prompt_modalities(prompt),
                                      self.default_mm_loras) for prompt in prompts]  # fmt: skip
        for lora in dict.fromkeys(loras):
            if lora is not None and self.adapters.is_new(lora):
                await self.add_lora(lora)
        results = await asyncio.gather(
            *(
                self.run_input_work(
                    self.processor.process_inputs,
                    request_id,
                    prompt,
                    params,
                    arrival_time,
                    priority,
                    lora,
                    media=bool(prompt_modalities(prompt)),
                )
                for request_id, prompt, lora in zip(request_ids, prompts, loras, strict=True)
            ),
            return_exceptions=True,
        )
        processed_requests = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            processed_requests.append(result)
        self._check_not_stopping()  # it may have begun while the input was processed
        collectors = []
        for request_id, processed in zip(request_ids, processed_requests, strict=True):
            collector = RequestOutputCollector()
            self.output_processor.add_processed_request(request_id, processed, params, collector)
            for stat_logger in self.stat_loggers:
                stat_logger.record_new_requests(processed.engine_requests)
            collectors.append(collector)
        await self.engine_core.add_requests_async([p.engine_requests for p in processed_requests])
        return collectors

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until it finishes (it is added on the first ``anext``); aborts
        it if the consumer leaves. ``priority``: lower runs first under
        ``--scheduling-policy priority``."""
        return self._outputs(
            request_id,
            lambda: self.add_request(
                request_id, prompt, sampling_params, priority=priority, lora_request=lora_request
            ),
        )

    def generate_many(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams,
        request_ids: list[str],
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """``generate`` for several prompts whose requests are added together (``add_requests``)
        on the first ``anext`` of any; if one fails, each generator raises its error."""
        adding: list[asyncio.Task[list[RequestOutputCollector]]] = []

        async def added(index: int) -> RequestOutputCollector:
            if not adding:
                add = self.add_requests(request_ids, prompts, sampling_params, None, priority,
                                        lora_request)  # fmt: skip
                adding.append(asyncio.ensure_future(add))
            try:
                return (await asyncio.shield(adding[0]))[index]
            except BaseException:
                # Left (or failed) while they were being added: abort it once they are.
                abort = functools.partial(self._abort_added, request_ids[index])
                adding[0].add_done_callback(abort)
                raise

        return [self._outputs(r, functools.partial(added, i)) for i, r in enumerate(request_ids)]

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[EmbeddingRequestOutput | ClassificationRequestOutput, None]:
        """vLLM's ``AsyncLLM.encode``: the prompt's embedding (``LLM.embed``'s), or a sequence
        classifier's label probabilities (``LLM.classify``'s; ``task`` "classify", a
        classifier's default), one output when it is done; ``pooling_params`` None: the
        model's defaults."""
        task = (pooling_params and pooling_params.task) or self.model_config.pooling_task
        result = ClassificationRequestOutput if task == "classify" else EmbeddingRequestOutput
        params = embedding_params(pooling_params)
        async for output in self.generate(prompt, params, request_id, priority, lora_request):
            if output.finished:
                yield result.from_output(output)

    def _abort_added(self, request_id: str, adding: asyncio.Task) -> None:
        if not adding.cancelled() and adding.exception() is None:
            asyncio.ensure_future(self.abort(request_id))

    async def _outputs(
        self, request_id: str, add: Callable[[], Awaitable[RequestOutputCollector]]
    ) -> AsyncGenerator[RequestOutput, None]:
        collector = await add()
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                await self.abort(request_id)

    async def run_input_work(self, fn: Callable[..., T], *args: Any, media: bool = False) -> T:
        """``fn(*args)`` off the event loop: on ``mm_pool`` for work on media, else on
        ``input_pool`` (tokenizing, templating)."""
        pool = self.mm_pool if media else self.input_pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def engine_token_ids(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids as the engine core would get them (media placeholders
        expanded by the model's processor), without submitting it."""
        processed = await self.run_input_work(
            self.processor.input_preprocessor.preprocess, prompt, media=True
        )
        return processed.prompt_token_ids

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = self.output_processor.abort_requests(ids)
        for stat_logger in self.stat_loggers:
            stat_logger.record_aborted(child_ids)
        if child_ids and self.dead_error is None:
            await self.engine_core.abort_requests_async(child_ids)

    async def stop_requests(self, error: EngineStoppingError) -> None:
        """End every in-flight request with ``error`` and refuse new ones with it, the engine
        left running (a server's drain ran out of time and it is about to stop)."""
        self.stopping_error = error
        child_ids = self.output_processor.propagate_error(error)
        for stat_logger in self.stat_loggers:
            stat_logger.record_aborted(child_ids)
        if child_ids and self.dead_error is None:
            await self.engine_core.abort_requests_async(child_ids)

    def _check_not_stopping(self) -> None:
        if self.stopping_error is not None:
            raise EngineStoppingError(str(self.stopping_error))

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler()
            )

    async def _run_output_handler(self) -> None:
        """Pull engine outputs, detokenize, fan out to request queues; record stats."""
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process_outputs(outputs.outputs)
                if processed.reqs_to_abort:
                    await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                for stat_logger in self.stat_loggers:
                    stat_logger.record(outputs, processed)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # engine death: fail every in-flight request, loudly
            logger.error("Engine output handler stopped: %r", exc)
            self.dead_error = exc
            error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
            self.output_processor.propagate_error(error)

    async def check_health(self) -> None:
        if self.dead_error is not None or not self.engine_core.is_alive():
            raise EngineDeadError("The engine core is dead.")

    async def get_stats(self) -> dict[str, float]:
        """The scheduler's gauges and counters now (an idle engine sends no step stats), summed
        over the data-parallel engines (usage fractions averaged)."""
        return await self.engine_core.call_utility_async("get_stats")

    async def get_engine_stats(self) -> list[dict[str, float]]:
        """``get_stats`` of each data-parallel engine core, by rank."""
        return await self.engine_core.call_utility_per_engine_async("get_stats")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into every engine core's workers (ValueError: it does not load)."""
        self.adapters.is_new(lora_request)  # refuses an id taken by another adapter
        await self.engine_core.call_utility_async(
            "add_lora", *self.adapters.utility_args(lora_request)
        )
        self.adapters.added(lora_request)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        await self.engine_core.call_utility_async("remove_lora", lora_int_id)
        return self.adapters.removed(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.adapters.ids()

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    async def reset_mm_cache(self) -> None:
        """As ``LLMEngine.reset_mm_cache``."""
        self.processor.reset_mm_cache()
        await self.engine_core.call_utility_async("reset_encoder_cache")

    async def sleep(self, level: int = 1) -> None:
        """As ``LLMEngine.sleep``: requests are refused (503 on the server) until ``wake_up``."""
        await self.engine_core.call_utility_async("sleep", level)
        self.asleep = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine_core.call_utility_async("wake_up", tags)
        self.asleep = await self.is_sleeping()

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """As ``LLMEngine.collective_rpc``."""
        call = self.engine_core.call_utility_async("collective_rpc", method, list(args),
                                                   kwargs or {})  # fmt: skip
        try:
            results = await asyncio.wait_for(call, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"collective_rpc({method!r}) did not finish within {timeout} s "
                "(the engine core finishes it all the same)."
            ) from None
        if self.asleep:  # (reload_weights wakes the workers)
            self.asleep = await self.is_sleeping()
        return results

    async def start_profile(self) -> None:
        """Start the workers' torch profilers (``OMNISERVE_TORCH_PROFILER_DIR``)."""
        await self.engine_core.call_utility_async("profile", True)

    async def stop_profile(self) -> None:
        """Stop them; each writes its trace and op table into the profiler directory."""
        await self.engine_core.call_utility_async("profile", False)

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        for pool in (self.input_pool, self.mm_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()
        close_stat_loggers(self.stat_loggers)
