"""EngineCoreProc: the engine core in its own process, fed and drained over ZMQ by I/O threads."""

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
from typing import Any, NoReturn

import msgspec
import zmq

from omniserve.config import OmniConfig
from omniserve.engine.core import UTILITY_METHODS, EngineCore
from omniserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from omniserve.executor.abstract import Executor
from omniserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from omniserve.plugins import load_plugins
from omniserve.process_utils import on_parent_death

logger = logging.getLogger(__name__)


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every client -> engine message."""

    ADD = b"\x00"
    """A list of requests, added before the next step."""
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
            for request in payload:  # taken together: the next step sees them all
                self._add_or_reject(request)
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

    def _add_or_reject(self, request: EngineCoreRequest) -> None:
        try:
            self.add_request(request)
        except Exception as exc:
            # The front end validates requests; one that still fails here ends at once
            # instead of leaving its caller waiting.
            logger.error("Rejected request %s: %s", request.request_id, exc)
            rejected = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            outputs = EngineCoreOutputs(
                [rejected], timestamp=time.time(), engine_index=self.engine_index
            )
            self.output_queue.put((EngineCoreOutputType.OUTPUTS, outputs))

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
            EngineCoreRequestType.ADD: MsgpackDecoder(list[EngineCoreRequest]),
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
