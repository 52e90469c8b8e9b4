"""EngineCoreClient: how a front end talks to an EngineCore.

``InprocClient`` runs the core in the caller's process and steps it on demand (tests, debugging,
``OMNISERVE_ENABLE_MULTIPROCESSING=0``). ``SyncMPClient`` (offline ``LLM``) and ``AsyncMPClient``
(``AsyncLLM``) run it in a spawned ``EngineCoreProc`` and talk over ZMQ ipc:// sockets in a private
temp dir, so no TCP port is bound: the client PUSHes requests to the engine's PULL, the engine
PUSHes outputs to the client's PULL. The client's PUSH connects (rather than binds) so a send
queues instead of blocking if the engine is gone; a monitor thread watching the process turns its
death into ``EngineDeadError`` for every pending and later call.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import shutil
import sys
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from omniserve import envs
from omniserve.config import OmniConfig
from omniserve.engine.core import (
    UTILITY_METHODS,
    EngineCore,
    EngineCoreOutputType,
    EngineCoreProc,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from omniserve.engine.exceptions import EngineDeadError, EngineStartupError
from omniserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from omniserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_POLL_MS = 100
_SHUTDOWN_TIMEOUT_S = 5.0
"""How long a SHUTDOWN request may take before SIGTERM (and then SIGKILL) follow."""


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: OmniConfig) -> EngineCoreClient:
        """The synchronous client: a background engine process unless multiprocessing is off."""
        if envs.engine_multiprocessing():
            return SyncMPClient(config)
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call one of the engine core's ``UTILITY_METHODS`` and return its result."""

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engine core."""


class InprocClient(EngineCoreClient):
    """The engine core in this process; ``get_output`` runs one step."""

    def __init__(self, config: OmniConfig) -> None:
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        if method not in UTILITY_METHODS:
            raise AttributeError(f"{method!r} is not an engine core utility.")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# ---- the engine in a background process -----------------------------------------------------


class _ClientState:
    """What the client shares with its background threads. It holds no reference to the client,
    so an unreferenced client is collected and its finalizer stops the engine."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dead_error: EngineDeadError | None = None
        self.closing = False
        self.notify_dead: Callable[[EngineDeadError], None] | None = None
        # call_id -> the caller's future (concurrent, so any thread or event loop may wait on it)
        self.pending_calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def register_call(self) -> tuple[int, Future[Any]]:
        future: Future[Any] = Future()
        with self.lock:
            self.check_alive()
            call_id = next(self._call_ids)
            self.pending_calls[call_id] = future
        return call_id, future

    def resolve_call(self, output: UtilityOutput) -> None:
        with self.lock:
            future = self.pending_calls.pop(output.call_id, None)
        if future is None:
            return
        if output.error is not None:
            future.set_exception(RuntimeError(f"Engine utility call failed: {output.error}"))
        else:
            future.set_result(output.result)

    def mark_dead(self, error: EngineDeadError) -> None:
        """Fail pending and later calls with ``error`` (death, or shutdown by the client)."""
        with self.lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            pending, self.pending_calls = self.pending_calls, {}
        if not self.closing:
            logger.error("%s", error)
        for future in pending.values():
            future.set_exception(EngineDeadError(str(error)))
        if self.notify_dead is not None:
            self.notify_dead(error)


class _EngineResources:
    """Everything a client must release; ``close`` runs once (shutdown, GC or interpreter exit)."""

    def __init__(self, state: _ClientState, ctx: zmq.Context, tmpdir: str) -> None:
        self.state = state
        self.ctx = ctx
        self.tmpdir = tmpdir
        self.proc: BaseProcess | None = None
        self.input_socket: zmq.Socket | None = None
        self.output_socket: zmq.Socket | None = None
        self.send_lock = threading.Lock()
        self.stop_event = threading.Event()
        self.output_thread: threading.Thread | None = None
        self.output_task: asyncio.Task | None = None

    def close(self) -> None:
        if self.state.closing:
            return
        self.state.closing = True
        _live_resources.discard(self)
        if self.proc is not None:
            self._stop_process(self.proc)
        self.stop_event.set()
        if self.output_thread is not None:
            self.output_thread.join(timeout=2.0)
        if self.output_task is not None and not self.output_task.done():
            with contextlib.suppress(RuntimeError):  # its loop is already closed
                self.output_task.get_loop().call_soon_threadsafe(self.output_task.cancel)
        for socket in (self.input_socket, self.output_socket):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.state.mark_dead(EngineDeadError("The engine core has been shut down."))

    def _stop_process(self, proc: BaseProcess) -> None:
        """SHUTDOWN, then SIGTERM, then SIGKILL: each only if the previous did not end it."""
        if proc.is_alive() and self.input_socket is not None:
            with self.send_lock, contextlib.suppress(zmq.ZMQError):
                # A plain (non-asyncio) view of the socket, so this works outside any event loop.
                zmq.Socket.shadow(self.input_socket.underlying).send(
                    EngineCoreRequestType.SHUTDOWN.value, zmq.NOBLOCK)
        proc.join(_SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            logger.warning("Engine core did not stop within %.0f s; terminating it.",
                           _SHUTDOWN_TIMEOUT_S)
            proc.terminate()
            proc.join(_SHUTDOWN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


class MPClient:
    """Starts ``EngineCoreProc`` and owns its process, sockets, monitor thread and shutdown."""

    def __init__(self, config: OmniConfig, asyncio_mode: bool) -> None:
        self.config = config
        self.state = _ClientState()
        tmpdir = tempfile.mkdtemp(prefix="omniserve-")  # mode 0700: only this user may connect
        ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.resources = resources = _EngineResources(self.state, ctx, tmpdir)
        self._finalizer = weakref.finalize(self, resources.close)
        input_address, output_address = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
        try:
            resources.output_socket = ctx.socket(zmq.PULL)
            resources.output_socket.bind(output_address)
            resources.input_socket = ctx.socket(zmq.PUSH)
            resources.input_socket.connect(input_address)
            self.proc, ready_pipe = _launch_engine(config, input_address, output_address,
                                                   tmpdir)
            resources.proc = self.proc
            _close_at_exit(resources)
            self.num_kv_blocks = _wait_until_ready(self.proc, ready_pipe)
        except BaseException:
            self.shutdown()
            raise
        self.encoder = MsgpackEncoder()

    def _start_monitor(self) -> None:
        """Call once output handling is wired (``state.notify_dead`` set)."""
        threading.Thread(target=_monitor_engine, args=(self.proc, self.state),
                         name="omniserve-engine-monitor", daemon=True).start()

    def _encode_request(self, request_type: EngineCoreRequestType,
                        payload: Any) -> list[Any]:
        return [request_type.value, *self.encoder.encode(payload)]

    def is_alive(self) -> bool:
        return self.state.dead_error is None and self.proc.is_alive()

    def shutdown(self) -> None:
        """Stop the engine process and release sockets; idempotent, also run at exit."""
        self._finalizer()


class SyncMPClient(MPClient, EngineCoreClient):
    """For ``LLMEngine``: a daemon thread drains the output socket into a ``queue.Queue``."""

    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config, asyncio_mode=False)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self.state.notify_dead = self.outputs_queue.put
        self.resources.output_thread = threading.Thread(
            target=_process_outputs_socket,
            args=(self.resources.output_socket, self.state, self.outputs_queue,
                  self.resources.stop_event),
            name="omniserve-client-output", daemon=True)
        self.resources.output_thread.start()
        self._start_monitor()

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self.state.check_alive()
        with self.resources.send_lock:
            frames = self._encode_request(request_type, payload)
            self.resources.input_socket.send_multipart(frames, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        # A dead engine holds no requests: aborting is a no-op, so cleanup paths never raise.
        if request_ids and self.state.dead_error is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        if self.state.dead_error is not None and self.outputs_queue.empty():
            self.state.check_alive()
        item = self.outputs_queue.get()
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put(item)  # every later call fails too
            raise EngineDeadError(str(item))
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id, future = self.state.register_call()
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        return future.result()


class AsyncMPClient(MPClient):
    """For ``AsyncLLM``: an asyncio task reads the output socket into an ``asyncio.Queue``.

    The task starts on first use and binds the client to that event loop.
    """

    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config, asyncio_mode=True)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._start_monitor()

    def _ensure_output_task(self) -> asyncio.Queue[EngineCoreOutputs | EngineDeadError]:
        if self.outputs_queue is None:
            loop = asyncio.get_running_loop()
            outputs_queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()

            def notify_dead(error: EngineDeadError) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(outputs_queue.put_nowait, error)

            self.state.notify_dead = notify_dead
            self.outputs_queue = outputs_queue
            self.resources.output_task = loop.create_task(_process_outputs_socket_async(
                self.resources.output_socket, self.state, outputs_queue))
        return self.outputs_queue

    async def _send_async(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self._ensure_output_task()
        self.state.check_alive()
        frames = self._encode_request(request_type, payload)
        await self.resources.input_socket.send_multipart(frames, copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send_async(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        # A dead engine holds no requests: aborting is a no-op, so cleanup paths never raise.
        if request_ids and self.state.dead_error is None:
            await self._send_async(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs_queue = self._ensure_output_task()
        if self.state.dead_error is not None and outputs_queue.empty():
            self.state.check_alive()
        item = await outputs_queue.get()
        if isinstance(item, EngineDeadError):
            outputs_queue.put_nowait(item)  # every later call fails too
            raise EngineDeadError(str(item))
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        call_id, future = self.state.register_call()
        await self._send_async(EngineCoreRequestType.UTILITY,
                               UtilityRequest(call_id, method, list(args)))
        return await asyncio.wrap_future(future)


# ---- process start-up and background work ---------------------------------------------------

_live_resources: set[_EngineResources] = set()
"""Clients not yet shut down, closed by one exit hook."""


def _close_at_exit(resources: _EngineResources) -> None:
    if not _live_resources:
        # (Re-)registered after multiprocessing's exit hook, so ours runs first (LIFO): engines
        # are stopped before multiprocessing joins its non-daemon children, which would hang.
        atexit.unregister(_close_all)
        atexit.register(_close_all)
    _live_resources.add(resources)


def _close_all() -> None:
    for resources in list(_live_resources):
        resources.close()



def _launch_engine(config: OmniConfig, input_address: str, output_address: str, ipc_dir: str,
                   ) -> tuple[BaseProcess, multiprocessing.connection.Connection]:
    mp_ctx = multiprocessing.get_context("spawn")  # fork is unsafe with CUDA and threads
    reader, writer = mp_ctx.Pipe(duplex=False)
    # Not a daemon: the engine may start worker processes of its own (tensor parallelism).
    proc = mp_ctx.Process(target=EngineCoreProc.run_engine_core, name="OmniEngineCore",
                          args=(config, input_address, output_address, writer, ipc_dir))
    with _skip_main_reimport():
        proc.start()
    writer.close()
    return proc, reader


@contextlib.contextmanager
def _skip_main_reimport() -> Iterator[None]:
    """Keep spawn from re-running the user's script in the engine process.

    spawn re-imports a script's ``__main__`` in the child, which re-runs unguarded top-level code
    (``LLM(...)`` without ``if __name__ == "__main__":``) and fails there. The engine needs nothing
    from ``__main__``; hiding its ``__file__`` while the child is prepared makes spawn treat it
    like an interactive session's ``__main__``.
    """
    main = sys.modules["__main__"]
    main_file = getattr(main, "__file__", None)
    if main_file is None or getattr(main, "__spec__", None) is not None:
        yield  # interactive, or run with -m (spawn already skips a package's __main__)
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = main_file


def _wait_until_ready(proc: BaseProcess, ready_pipe: multiprocessing.connection.Connection,
                      ) -> int:
    """Block until the engine reports READY; return its number of KV blocks."""
    try:
        multiprocessing.connection.wait([ready_pipe, proc.sentinel])
        message = ready_pipe.recv() if ready_pipe.poll() else None
    except EOFError:  # the child died without a word
        message = None
    finally:
        ready_pipe.close()
    if message is None:
        proc.join(1.0)
        raise EngineStartupError(f"The engine core process exited during start-up (exit code "
                                 f"{proc.exitcode}) without reporting an error; see its log.")
    status, value = message
    if status != "READY":
        trace, kind, text = value
        error = EngineStartupError(f"The engine core failed to start:\n{trace}")
        user_error = _USER_ERRORS.get(kind)
        if user_error is not None:
            raise user_error(text) from error
        raise error
    return int(value)


# Start-up failures that are the caller's mistake keep their type in the parent.
_USER_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, FileNotFoundError)}


def _monitor_engine(proc: BaseProcess, state: _ClientState) -> None:
    multiprocessing.connection.wait([proc.sentinel])
    if not state.closing:
        state.mark_dead(EngineDeadError(
            f"The engine core process (pid {proc.pid}) died unexpectedly (exit code "
            f"{proc.exitcode}); its log has the cause."))


class _OutputDecoder:
    def __init__(self) -> None:
        self._decoders = {EngineCoreOutputType.OUTPUTS: MsgpackDecoder(EngineCoreOutputs),
                          EngineCoreOutputType.UTILITY: MsgpackDecoder(UtilityOutput)}

    def decode(self, frames: Sequence[zmq.Frame]) -> tuple[EngineCoreOutputType, Any]:
        output_type = EngineCoreOutputType(frames[0].bytes)
        return output_type, self._decoders[output_type].decode([f.buffer for f in frames[1:]])


def _process_outputs_socket(socket: zmq.Socket, state: _ClientState,
                            outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError],
                            stop_event: threading.Event) -> None:
    decoder = _OutputDecoder()
    try:
        while not stop_event.is_set():
            if not socket.poll(_POLL_MS):
                continue
            output_type, payload = decoder.decode(socket.recv_multipart(copy=False))
            if output_type is EngineCoreOutputType.OUTPUTS:
                outputs_queue.put(payload)
            else:
                state.resolve_call(payload)
    except Exception as exc:
        if not state.closing:
            logger.exception("Reading engine core outputs failed.")
            state.mark_dead(EngineDeadError(f"Reading engine core outputs failed: {exc!r}"))


async def _process_outputs_socket_async(
        socket: zmq.asyncio.Socket, state: _ClientState,
        outputs_queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError]) -> None:
    decoder = _OutputDecoder()
    try:
        while True:
            output_type, payload = decoder.decode(await socket.recv_multipart(copy=False))
            if output_type is EngineCoreOutputType.OUTPUTS:
                outputs_queue.put_nowait(payload)
            else:
                state.resolve_call(payload)
    except Exception as exc:
        if not state.closing:
            logger.exception("Reading engine core outputs failed.")
            state.mark_dead(EngineDeadError(f"Reading engine core outputs failed: {exc!r}"))
