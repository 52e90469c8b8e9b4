"""EngineCore: the schedule -> execute -> update loop; EngineCoreProc runs it in its own process."""

from __future__ import annotations

import enum
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, NoReturn

import msgspec
import zmq

from omniserve.config import OmniConfig
from omniserve.core.request import Request, RequestStatus
from omniserve.core.sched_output import SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.engine.detokenizer import IncrementalDetokenizer
from omniserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from omniserve.executor.abstract import Executor
from omniserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
)
from omniserve.plugins import load_plugins
from omniserve.process_utils import on_parent_death
from omniserve.structured_output import StructuredOutputManager, wait_any
from omniserve.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


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
        self.num_requests_received = 0
        executor_class = executor_class or Executor.get_class(config)
        self.model_executor = executor_class(config)
        num_blocks = self.model_executor.determine_num_kv_blocks()
        self.model_executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        num_talker_blocks = self.model_executor.determine_num_talker_kv_blocks()
        if num_talker_blocks:
            self.model_executor.initialize_talker_kv_cache(num_talker_blocks)
        self.talker_capacity = num_talker_blocks * config.cache_config.block_size
        """Talker positions the speech KV pool holds: one request's talker prompt and frames
        must fit (the front end checks at admission, so no talker outgrows the pool alone)."""
        if num_talker_blocks:
            logger.info(
                "Talker KV pool: %d positions (one request's talker prompt and frames "
                "must fit; --talker-kv-cache-memory sets it).",
                self.talker_capacity,
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            num_talker_blocks=num_talker_blocks,
            make_text_stop=self._make_text_stop,
        )
        # Requests with structured outputs wait here, outside the scheduler, for their grammar.
        self.grammar_waiting: dict[str, tuple[Request, Future[Any]]] = {}
        self.structured_output = StructuredOutputManager(config.model_config)
        self._tokenizer: Any = None  # for speaking requests' stop strings, loaded on first use

    def _make_text_stop(self, request: Request) -> IncrementalDetokenizer:
        """The front end's detokenizer, here for a speaking request with stop strings."""
        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(self.config.model_config.tokenizer)
        return IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.sampling_params
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_requests_received += 1
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
            self.grammar_waiting.pop(req_id, None)
            self.structured_output.remove(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.grammar_waiting)

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
            if future.exception() is not None:
                logger.error(
                    "Compiling the grammar of request %s failed: %s", req_id, future.exception()
                )
                failed.append(
                    EngineCoreOutput(
                        request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ERROR
                    )
                )
                continue
            self.structured_output.start(req_id, future.result())
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
            if output.request_id in manager.matchers:
                manager.accept(output.request_id, output.new_token_ids)
                if output.finished:
                    manager.remove(output.request_id)

    def step(self) -> EngineCoreOutputs:
        """Run one step; return what it produced (empty when there was nothing to run)."""
        failed = self._admit_compiled()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(
                outputs=failed, timestamp=time.time(), engine_index=self.engine_index
            )
        scheduler_output = self.scheduler.schedule()
        self._attach_grammar_bitmask(scheduler_output)
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
        except Exception as exc:
            outputs = self._fail_step([scheduler_output], exc)
        else:
            outputs = self._update_from_output(scheduler_output, model_output)
        outputs.outputs = failed + outputs.outputs
        return outputs

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
        outputs = [o for so in scheduler_outputs for o in self.scheduler.fail_step(so).outputs]
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
        return {
            **self.scheduler.make_stats(),
            "num_requests_received": float(self.num_requests_received),
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, float]:
        """Scheduler gauges and counters, plus the KV cache size (a utility for clients/tests)."""
        return {**self.make_stats(), "num_kv_blocks": float(self.num_kv_blocks)}

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

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.model_executor.shutdown()


# ---- the process boundary -------------------------------------------------------------------


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every client -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of every engine -> client message."""

    OUTPUTS = b"\x00"
    UTILITY = b"\x01"


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any]


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None
    """Set when the call raised: the exception's type and message."""


# Methods a client may call by name; everything else on the class (step, shutdown, internals) is
# driven by the busy loop itself.
UTILITY_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "get_stats",
        "has_unfinished_requests",
        "get_model_info",
        "start_step_timing",
        "get_step_timings",
        "profile",
    }
)
_POLL_MS = 100
_PARENT_DEATH_GRACE_S = 10.0
_IO_FAILED = None
"""Request type the I/O threads put on the input queue when they fail (payload: the exception)."""
_EXECUTOR_FAILED = "executor-failed"
"""Request type the executor's monitor puts on the input queue when a worker dies."""


class EngineCoreProc(EngineCore):
    """EngineCore in a background process: input thread -> busy loop -> output thread.

    The I/O threads do the socket work and the msgpack (de)serialization, which release the GIL,
    so they overlap the model's forward. Only the busy loop touches the scheduler.
    """

    def __init__(
        self,
        config: OmniConfig,
        input_address: str,
        output_address: str,
        executor_class: type[Executor] | None = None,
        engine_index: int = 0,
    ) -> None:
        super().__init__(config, executor_class, engine_index)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType | str | None, Any]] = (
            queue.Queue()
        )
        self.output_queue: queue.Queue[tuple[EngineCoreOutputType, Any] | None] = queue.Queue()
        self._shutdown_requested = False
        self.model_executor.register_failure_callback(
            lambda exc: self.input_queue.put((_EXECUTOR_FAILED, exc))
        )
        self._stop_io = threading.Event()
        # Sockets are made here, so an address problem fails start-up; each is then used only by
        # its own thread. The engine binds its input (clients connect and queue while it starts).
        self._zmq_ctx = zmq.Context()
        input_socket = self._zmq_ctx.socket(zmq.PULL)
        input_socket.bind(input_address)
        output_socket = self._zmq_ctx.socket(zmq.PUSH)
        output_socket.connect(output_address)
        self._io_threads = [
            threading.Thread(
                target=self._process_input_socket,
                args=(input_socket,),
                name="omniserve-core-input",
                daemon=True,
            ),
            threading.Thread(
                target=self._process_output_socket,
                args=(output_socket,),
                name="omniserve-core-output",
                daemon=True,
            ),
        ]
        for thread in self._io_threads:
            thread.start()

    @staticmethod
    def run_engine_core(
        config: OmniConfig,
        input_address: str,
        output_address: str,
        ready_pipe: multiprocessing.connection.Connection,
        ipc_dir: str | None = None,
        engine_index: int = 0,
    ) -> NoReturn:
        """Entry point of the engine process: start, report READY (or the error), serve.

        ``ipc_dir`` holds the sockets; the engine removes it if its parent dies without cleanup.
        ``engine_index`` is the data-parallel rank (0 without data parallelism).
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            load_plugins()
            engine = EngineCoreProc(
                config, input_address, output_address, engine_index=engine_index
            )
        except BaseException as exc:
            # The exception's kind and message travel too, so that a user mistake (a bad path,
            # an unknown architecture) surfaces in the parent as the same precise exception.
            ready_pipe.send(("FAILED", (traceback.format_exc(), type(exc).__name__, str(exc))))
            ready_pipe.close()
            sys.exit(1)
        ready_pipe.send(("READY", (engine.num_kv_blocks, engine.talker_capacity)))
        ready_pipe.close()
        _shutdown_when_parent_dies(engine, ipc_dir)
        exit_code = 0
        try:
            engine.run_busy_loop()
        except SystemExit:
            logger.info("Engine core %d received SIGTERM; shutting down.", engine_index)
        except BaseException:
            logger.exception(
                "Engine core %d failed; the client will report EngineDeadError.", engine_index
            )
            exit_code = 1
        finally:
            engine.shutdown()
        sys.exit(exit_code)

    def run_busy_loop(self) -> None:
        """Until SHUTDOWN: take new input (blocking while idle), step, hand off the outputs."""
        while not self._shutdown_requested:
            self._process_input_queue()
            if self._shutdown_requested or not self._has_work():
                continue
            outputs = self.step()
            if outputs.outputs:
                self.output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))

    def _has_work(self) -> bool:
        return self.has_unfinished_requests()

    def _process_input_queue(self) -> None:
        block = not self._has_work()
        while not self._shutdown_requested:
            try:
                request_type, payload = self.input_queue.get(block=block)
            except queue.Empty:
                return
            self._handle_input(request_type, payload)
            block = False

    def _handle_input(self, request_type: EngineCoreRequestType | str | None, payload: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            try:
                self.add_request(payload)
            except Exception as exc:
                # The front end validates requests; one that still fails here ends at once
                # instead of leaving its caller waiting.
                logger.error("Rejected request %s: %s", payload.request_id, exc)
                self.output_queue.put(
                    (
                        EngineCoreOutputType.OUTPUTS,
                        EngineCoreOutputs(
                            outputs=[
                                EngineCoreOutput(
                                    request_id=payload.request_id,
                                    new_token_ids=[],
                                    finish_reason=FinishReason.ERROR,
                                )
                            ],
                            timestamp=time.time(),
                            engine_index=self.engine_index,
                        ),
                    )
                )
        elif request_type is EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._run_utility(payload)
        elif request_type is EngineCoreRequestType.SHUTDOWN:
            self._shutdown_requested = True
        elif request_type == _EXECUTOR_FAILED:
            raise payload
        else:
            raise RuntimeError("An engine core I/O thread failed.") from payload

    def _run_utility(self, request: UtilityRequest) -> None:
        try:
            if request.method not in UTILITY_METHODS:
                raise AttributeError(
                    f"{request.method!r} is not an engine core utility; "
                    f"available: {sorted(UTILITY_METHODS)}."
                )
            output = UtilityOutput(
                request.call_id, result=getattr(self, request.method)(*request.args)
            )
        except Exception as exc:
            output = UtilityOutput(request.call_id, error=f"{type(exc).__name__}: {exc}")
        self.output_queue.put((EngineCoreOutputType.UTILITY, output))

    def _process_input_socket(self, socket: zmq.Socket) -> None:
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
        }
        try:
            while not self._stop_io.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                type_frame, *frames = socket.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(type_frame.bytes)
                decoder = decoders.get(request_type)
                payload = decoder.decode([f.buffer for f in frames]) if decoder else None
                self.input_queue.put((request_type, payload))
        except Exception as exc:
            logger.exception("Engine core input thread failed.")
            self.input_queue.put((_IO_FAILED, exc))
        finally:
            socket.close(linger=0)

    def _process_output_socket(self, socket: zmq.Socket) -> None:
        encoder = MsgpackEncoder()
        try:
            while (item := self.output_queue.get()) is not None:
                output_type, payload = item
                try:
                    frames = encoder.encode(payload)
                except TypeError as exc:  # a utility returned something that cannot travel
                    if output_type is not EngineCoreOutputType.UTILITY:
                        raise
                    frames = encoder.encode(UtilityOutput(payload.call_id, error=str(exc)))
                socket.send_multipart([output_type.value, *frames], copy=False)
        except Exception as exc:
            logger.exception("Engine core output thread failed.")
            self.input_queue.put((_IO_FAILED, exc))
        finally:
            socket.close(linger=0)

    def shutdown(self) -> None:
        """Stop the executor, then the I/O threads; outputs not yet sent are dropped."""
        super().shutdown()
        self._stop_io.set()
        self.output_queue.put(None)
        for thread in self._io_threads:
            thread.join(timeout=2.0)
        self._zmq_ctx.destroy(linger=0)


def _exit_on_signal(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


def _shutdown_when_parent_dies(engine: EngineCoreProc, ipc_dir: str | None) -> None:
    """A parent killed without cleanup (SIGKILL, OOM) must not leave this process (or its socket
    directory) behind."""

    def shut_down() -> None:
        logger.warning("The front-end process died; the engine core is shutting down.")
        engine.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        time.sleep(_PARENT_DEATH_GRACE_S)
        os._exit(1)  # the graceful path did not finish in time

    on_parent_death(shut_down)
