"""Engine-core clients for cores in processes of their own.

``SyncMPClient`` (offline ``LLM``) and ``AsyncMPClient`` (``AsyncLLM``) run ``data_parallel_size``
spawned ``EngineCoreProc``s (one without data parallelism) and talk over ZMQ ipc:// sockets in a
private temp dir, so no TCP port is bound: the client PUSHes requests to each engine's PULL, and
every engine PUSHes outputs to the client's one PULL. The client's PUSHes connect (rather than bind)
so a send queues instead of blocking if an engine is gone; a monitor thread watching the processes
turns any engine's death into ``EngineDeadError`` for every pending and later call, and stops the
other engines.

Each new request goes to one engine, picked by a ``LoadBalancer`` (fewest outstanding requests);
aborts go to the engine that holds the request; utility calls go to every engine, and their answers
combine (``data_parallel.combine_results``).
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
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from omniserve.config import OmniConfig
from omniserve.engine.core_client import EngineCoreClient
from omniserve.engine.core_launcher import engine_envs, launch_engine, wait_until_ready
from omniserve.engine.core_proc import (
    EngineCoreOutputType,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from omniserve.engine.data_parallel import LoadBalancer, combine_results
from omniserve.engine.exceptions import EngineDeadError
from omniserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from omniserve.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_POLL_MS = 100
_SHUTDOWN_TIMEOUT_S = 5.0
"""How long a SHUTDOWN request (then SIGTERM) may take before the next, harder step."""


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
        if output.error is not None and output.error.startswith("ValueError: "):
            # Bad input (e.g. an adapter that does not load): the caller's 400, as in process.
            future.set_exception(ValueError(output.error.removeprefix("ValueError: ")))
        elif output.error is not None:
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
        self.procs: list[BaseProcess] = []  # by data-parallel rank
        self.input_sockets: list[zmq.Socket] = []  # by data-parallel rank
        self.output_socket: zmq.Socket | None = None
        self.send_lock = threading.Lock()
        self.procs_lock = threading.Lock()  # shutdown and the death monitor may both stop them
        self.stop_event = threading.Event()
        self.output_thread: threading.Thread | None = None
        self.output_task: asyncio.Task | None = None

    def close(self) -> None:
        if self.state.closing:
            return
        self.state.closing = True
        _live_resources.discard(self)
        self.stop_processes(graceful=True)
        self.stop_event.set()
        if self.output_thread is not None:
            self.output_thread.join(timeout=2.0)
        if self.output_task is not None and not self.output_task.done():
            with contextlib.suppress(RuntimeError):  # its loop is already closed
                self.output_task.get_loop().call_soon_threadsafe(self.output_task.cancel)
        for socket in (*self.input_sockets, self.output_socket):
            if socket is not None:
                socket.close(linger=0)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.state.mark_dead(EngineDeadError("The engine core has been shut down."))

    def stop_processes(self, graceful: bool) -> None:
        """SHUTDOWN (if ``graceful``), then SIGTERM, then SIGKILL: each only for the engines the
        previous step did not end. All engines stop side by side."""
        with self.procs_lock:
            if graceful:
                self._request_shutdown()
                _join_all(self.procs, _SHUTDOWN_TIMEOUT_S)
            alive = [proc for proc in self.procs if proc.is_alive()]
            if alive and graceful:
                logger.warning(
                    "%d engine core(s) did not stop within %.0f s; terminating.",
                    len(alive),
                    _SHUTDOWN_TIMEOUT_S,
                )
            for proc in alive:
                proc.terminate()
            _join_all(alive, _SHUTDOWN_TIMEOUT_S)
            for proc in alive:
                if proc.is_alive():
                    proc.kill()
                    proc.join()

    def _request_shutdown(self) -> None:
        for proc, socket in zip(self.procs, self.input_sockets, strict=False):
            if proc.is_alive():
                with self.send_lock, contextlib.suppress(zmq.ZMQError):
                    # A plain (non-asyncio) view of the socket, so this works outside any loop.
                    zmq.Socket.shadow(socket.underlying).send(
                        EngineCoreRequestType.SHUTDOWN.value, zmq.NOBLOCK
                    )


def _join_all(procs: list[BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


class MPClient:
    """Starts ``data_parallel_size`` ``EngineCoreProc``s and owns their processes, sockets,
    monitor thread and shutdown; routes requests to them (see the module docstring)."""

    def __init__(self, config: OmniConfig, asyncio_mode: bool) -> None:
        self.config = config
        self.state = _ClientState()
        self.num_engines = config.parallel_config.data_parallel_size
        tmpdir = tempfile.mkdtemp(prefix="omniserve-")  # mode 0700: only this user may connect
        ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.resources = resources = _EngineResources(self.state, ctx, tmpdir)
        self._finalizer = weakref.finalize(self, resources.close)
        output_address = f"ipc://{tmpdir}/output"
        try:
            resources.output_socket = ctx.socket(zmq.PULL)
            resources.output_socket.bind(output_address)
            ready_pipes = []
            for rank, env in enumerate(engine_envs(config)):
                input_address = f"ipc://{tmpdir}/input{rank}"
                resources.input_sockets.append(ctx.socket(zmq.PUSH))
                resources.input_sockets[rank].connect(input_address)
                proc, ready_pipe = launch_engine(
                    config, rank, input_address, output_address, tmpdir, env
                )
                resources.procs.append(proc)
                ready_pipes.append(ready_pipe)
            _close_at_exit(resources)
            ready = wait_until_ready(resources.procs, ready_pipes)
        except BaseException:
            self.shutdown()
            raise
        self.engine_num_kv_blocks = [num_blocks for num_blocks, _ in ready]
        self.num_kv_blocks = sum(self.engine_num_kv_blocks)
        self.talker_capacity = min(capacity for _, capacity in ready)
        self.balancer = LoadBalancer(self.num_engines)
        self.encoder = MsgpackEncoder()

    @property
    def proc(self) -> BaseProcess:
        """The (first) engine core's process: the only one without data parallelism."""
        return self.resources.procs[0]

    def _start_monitor(self) -> None:
        """Call once output handling is wired (``state.notify_dead`` set)."""
        threading.Thread(
            target=_monitor_engines,
            args=(self.resources,),
            name="omniserve-engine-monitor",
            daemon=True,
        ).start()

    def _encode_request(self, request_type: EngineCoreRequestType, payload: Any) -> list[Any]:
        return [request_type.value, *self.encoder.encode(payload)]

    def _by_engine(
        self, groups: list[list[EngineCoreRequest]]
    ) -> dict[int, list[EngineCoreRequest]]:
        """Engine rank -> the requests of the groups routed to it (one ADD message each)."""
        self.state.check_alive()  # a dead client routes nothing, so its counts stay right
        by_engine: dict[int, list[EngineCoreRequest]] = {}
        for group in groups:
            engine = self.balancer.route([request.request_id for request in group])
            by_engine.setdefault(engine, []).extend(group)
        return by_engine

    def _release_finished(self, outputs: EngineCoreOutputs) -> None:
        self.balancer.release(o.request_id for o in outputs.outputs if o.finished)

    def _owners(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Engine rank -> the given requests it holds; forgets them (they are being aborted)."""
        if self.state.dead_error is not None:
            return {}  # a dead engine holds no requests: aborting is a no-op, never an error
        return self.balancer.release(request_ids)

    def _utility_calls(
        self,
        method: str,
        args: tuple[Any, ...],
    ) -> list[tuple[UtilityRequest, Future[Any]]]:
        """One registered call per engine, by rank."""
        calls = []
        for _ in range(self.num_engines):
            call_id, future = self.state.register_call()
            calls.append((UtilityRequest(call_id, method, list(args)), future))
        return calls

    def is_alive(self) -> bool:
        return self.state.dead_error is None and all(
            proc.is_alive() for proc in self.resources.procs
        )

    def shutdown(self) -> None:
        """Stop the engine processes and release sockets; idempotent, also run at exit."""
        self._finalizer()


class SyncMPClient(MPClient, EngineCoreClient):
    """For ``LLMEngine``: a daemon thread drains the output socket into a ``queue.Queue``."""

    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config, asyncio_mode=False)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self.state.notify_dead = self.outputs_queue.put
        self.resources.output_thread = threading.Thread(
            target=_process_outputs_socket,
            args=(
                self.resources.output_socket,
                self.state,
                self.outputs_queue,
                self.resources.stop_event,
            ),
            name="omniserve-client-output",
            daemon=True,
        )
        self.resources.output_thread.start()
        self._start_monitor()

    def _send(self, engine: int, request_type: EngineCoreRequestType, payload: Any) -> None:
        self.state.check_alive()
        with self.resources.send_lock:
            frames = self._encode_request(request_type, payload)
            self.resources.input_sockets[engine].send_multipart(frames, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([[request]])

    def add_requests(self, groups: list[list[EngineCoreRequest]]) -> None:
        for engine, requests in self._by_engine(groups).items():
            self._send(engine, EngineCoreRequestType.ADD, requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, owned in self._owners(request_ids).items():
            self._send(engine, EngineCoreRequestType.ABORT, owned)

    def get_output(self) -> EngineCoreOutputs:
        if self.state.dead_error is not None and self.outputs_queue.empty():
            self.state.check_alive()
        item = self.outputs_queue.get()
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put(item)  # every later call fails too
            raise EngineDeadError(str(item))
        self._release_finished(item)
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return combine_results(method, self.call_utility_per_engine(method, *args,
                                                                    timeout=timeout))  # fmt: skip

    def call_utility_per_engine(
        self, method: str, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """Call ``method`` on every engine core; their results by data-parallel rank."""
        calls = self._utility_calls(method, args)
        for engine, (request, _) in enumerate(calls):
            self._send(engine, EngineCoreRequestType.UTILITY, request)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return [future.result(None if deadline is None else max(deadline - time.monotonic(), 0))
                    for _, future in calls]  # fmt: skip
        except TimeoutError:
            raise TimeoutError(
                f"{method} did not finish within {timeout} s (the engine core "
                "finishes it all the same)."
            ) from None


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
            self.resources.output_task = loop.create_task(
                _process_outputs_socket_async(
                    _async_socket(self.resources.output_socket), self.state, outputs_queue
                )
            )
        return self.outputs_queue

    async def _send_async(
        self, engine: int, request_type: EngineCoreRequestType, payload: Any
    ) -> None:
        self._ensure_output_task()
        self.state.check_alive()
        frames = self._encode_request(request_type, payload)
        await _async_socket(self.resources.input_sockets[engine]).send_multipart(frames, copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([[request]])

    async def add_requests_async(self, groups: list[list[EngineCoreRequest]]) -> None:
        """``add_requests``, from the event loop."""
        for engine, requests in self._by_engine(groups).items():
            await self._send_async(engine, EngineCoreRequestType.ADD, requests)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for engine, owned in self._owners(request_ids).items():
            await self._send_async(engine, EngineCoreRequestType.ABORT, owned)

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs_queue = self._ensure_output_task()
        if self.state.dead_error is not None and outputs_queue.empty():
            self.state.check_alive()
        item = await outputs_queue.get()
        if isinstance(item, EngineDeadError):
            outputs_queue.put_nowait(item)  # every later call fails too
            raise EngineDeadError(str(item))
        self._release_finished(item)
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return combine_results(method, await self.call_utility_per_engine_async(method, *args))

    async def call_utility_per_engine_async(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every engine core; their results by data-parallel rank."""
        calls = self._utility_calls(method, args)
        for engine, (request, _) in enumerate(calls):
            await self._send_async(engine, EngineCoreRequestType.UTILITY, request)
        # Every result is awaited (also after a failure), so none is left unretrieved.
        results = await asyncio.gather(
            *(asyncio.wrap_future(f) for _, f in calls), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)


# ---- background work ------------------------------------------------------------------------

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


def _monitor_engines(resources: _EngineResources) -> None:
    """The first engine to die kills the client: fail its calls, then stop the other engines."""
    procs = resources.procs
    multiprocessing.connection.wait([proc.sentinel for proc in procs])
    state = resources.state
    if state.closing:
        return
    dead = next((rank for rank, proc in enumerate(procs) if not proc.is_alive()), 0)
    proc = procs[dead]
    proc.join(timeout=1.0)  # its sentinel fired: reap it so the exit code is known
    rank = f", data-parallel rank {dead}" if len(procs) > 1 else ""
    state.mark_dead(
        EngineDeadError(
            f"The engine core process (pid {proc.pid}{rank}) died unexpectedly (exit code "
            f"{proc.exitcode}); its log has the cause."
        )
    )
    resources.stop_processes(graceful=False)


class _OutputDecoder:
    def __init__(self) -> None:
        self._decoders = {
            EngineCoreOutputType.OUTPUTS: MsgpackDecoder(EngineCoreOutputs),
            EngineCoreOutputType.UTILITY: MsgpackDecoder(UtilityOutput),
        }

    def decode(self, frames: Sequence[zmq.Frame]) -> tuple[EngineCoreOutputType, Any]:
        output_type = EngineCoreOutputType(frames[0].bytes)
        return output_type, self._decoders[output_type].decode([f.buffer for f in frames[1:]])


def _route_output(
    decoder: _OutputDecoder,
    frames: Sequence[zmq.Frame],
    state: _ClientState,
    put: Callable[[EngineCoreOutputs], None],
) -> None:
    """Step outputs go to the outputs queue; utility results resolve their pending call."""
    output_type, payload = decoder.decode(frames)
    if output_type is EngineCoreOutputType.OUTPUTS:
        put(payload)
    else:
        state.resolve_call(payload)


def _reading_failed(state: _ClientState, exc: Exception) -> None:
    if not state.closing:
        logger.exception("Reading engine core outputs failed.")
        state.mark_dead(EngineDeadError(f"Reading engine core outputs failed: {exc!r}"))


def _process_outputs_socket(
    socket: zmq.Socket,
    state: _ClientState,
    outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError],
    stop_event: threading.Event,
) -> None:
    decoder = _OutputDecoder()
    try:
        while not stop_event.is_set():
            if socket.poll(_POLL_MS):
                _route_output(decoder, socket.recv_multipart(copy=False), state, outputs_queue.put)
    except Exception as exc:
        _reading_failed(state, exc)


def _async_socket(socket: zmq.Socket | None) -> zmq.asyncio.Socket:
    """A socket of the asyncio-mode context (the resources type it as the sync base)."""
    if not isinstance(socket, zmq.asyncio.Socket):
        raise TypeError(f"Expected an asyncio ZMQ socket, got {type(socket).__name__}.")
    return socket


async def _process_outputs_socket_async(
    socket: zmq.asyncio.Socket,
    state: _ClientState,
    outputs_queue: asyncio.Queue[EngineCoreOutputs | EngineDeadError],
) -> None:
    decoder = _OutputDecoder()
    try:
        while True:
            _route_output(
                decoder, await socket.recv_multipart(copy=False), state, outputs_queue.put_nowait
            )
    except Exception as exc:
        _reading_failed(state, exc)
