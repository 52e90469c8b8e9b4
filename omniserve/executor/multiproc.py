"""MultiprocExecutor: tensor parallelism over N worker processes on this machine.

Each rank is a spawned process running ``run_worker``: it joins the ``torch.distributed`` group
(a ``file://`` rendezvous in a private temp dir, so no TCP port is picked or raced for), builds its
``WorkerWrapper`` and then serves calls. The executor sends every call once over a broadcast
queue (``broadcast.py``); replies come back on one PULL socket, tagged with the call's id. A step
is answered by rank 0 alone (every rank samples the same tokens); calls such as sizing the KV
cache are answered by all ranks. Other ranks reply to a step only when it failed. Under async
scheduling the next step is sent before a step's reply is read, so the workers go from one step
to the next without waiting for the engine core to schedule it, and a worker that finds the next
step in launches it before it reads its own last step back (``serve_calls``).

Failure handling: a monitor thread watches the worker processes. When one dies, the waiting call
(or, when the engine is idle, the engine core through ``register_failure_callback``) gets a
RuntimeError naming the rank and exit code. Workers exit when their parent (the engine core) dies,
and ``shutdown`` stops them: a shutdown message, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import zmq

from omniserve.config import OmniConfig
from omniserve.core.sched_output import SchedulerOutput
from omniserve.executor.abstract import Executor
from omniserve.executor.broadcast import BroadcastReceiver, BroadcastSender
from omniserve.executor.worker_wrapper import REPLY_ALL, REPLY_RANK0, WorkerWrapper
from omniserve.messages import ModelRunnerOutput, PendingOutput
from omniserve.process_utils import on_parent_death, spawn_context, spawning

logger = logging.getLogger(__name__)

_POLL_MS = 100
_READERS_TIMEOUT_S = 60.0
_SHUTDOWN_TIMEOUT_S = 5.0
_WAIT_S = 5e-5
"""A worker's pause between looks for its next call while its step runs on the device."""
_STARTUP_CALL_ID = 0
"""Id of the READY (or start-up error) reply each worker sends once."""


class MultiprocExecutor(Executor):
    supports_async_scheduling = True

    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.world_size
        self._ipc_dir = tempfile.mkdtemp(prefix="omniserve-tp-")
        self._zmq_ctx = zmq.Context()
        self._broadcast = BroadcastSender(self._zmq_ctx, f"ipc://{self._ipc_dir}/calls")
        self._results = self._zmq_ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._ipc_dir}/results")
        self._lock = threading.Lock()  # one thread at a time sends calls and collects replies
        self._call_id = _STARTUP_CALL_ID
        # Steps sent and not yet collected (async scheduling sends the next before collecting
        # one), and their replies that came while another call was collecting.
        self._steps_in_flight: set[int] = set()
        self._early_replies: dict[int, Any] = {}
        self._abandoned_calls: set[int] = set()
        self._failure: str | None = None
        self._closing = False
        self.workers: list[multiprocessing.process.BaseProcess] = []
        # At interpreter exit, before multiprocessing's own hook (registered earlier, so run
        # later) terminates the workers, which the monitor would report as deaths.
        atexit.register(self.shutdown)
        try:
            self._start_workers()
            self._collect(_STARTUP_CALL_ID, set(range(self.world_size)), "start-up")
            self._broadcast.wait_for_readers(self.world_size, _READERS_TIMEOUT_S, self._check_alive)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        mp_ctx = spawn_context()
        args = (
            f"file://{self._ipc_dir}/rendezvous",
            f"ipc://{self._ipc_dir}/calls",
            f"ipc://{self._ipc_dir}/results",
        )
        with spawning():
            for rank in range(self.world_size):
                proc = mp_ctx.Process(
                    target=run_worker,
                    name=f"OmniWorker-TP{rank}",
                    args=(self.config, rank, self.world_size, *args),
                    daemon=True,
                )
                proc.start()
                self.workers.append(proc)
        threading.Thread(
            target=self._monitor_workers, name="omniserve-worker-monitor", daemon=True
        ).start()

    def _monitor_workers(self) -> None:
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self.workers)}
        (sentinel, *_) = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        rank = by_sentinel[cast(int, sentinel)]  # wait returns the sentinels it was given
        proc = self.workers[rank]
        proc.join(1.0)
        self._failure = (
            f"Tensor-parallel worker rank {rank} (pid {proc.pid}) died "
            f"unexpectedly ({_describe_exit(proc.exitcode)}); its log has the cause."
        )
        logger.error(self._failure)
        self._notify_failure(RuntimeError(self._failure))

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def check_health(self) -> None:
        self._check_alive()
        super().check_health()

    # ---- calls ----------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self._call(method, args, REPLY_ALL)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.dispatch_model(scheduler_output).result()

    def dispatch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Send the step; the workers run it while the engine core schedules the next one, and
        take that one as soon as they are done with this (rank 0's reply is read later)."""
        return self._dispatch("execute_model", scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        """Send the step's first half; its reply is not read (an error reply fails the next
        collection)."""
        with self._lock:
            self._send("launch_model", (scheduler_output,), REPLY_RANK0)

    def dispatch_sampling(self, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        return self._dispatch("sample_model", grammar_bitmask)

    def _dispatch(self, method: str, arg: Any) -> PendingOutput:
        with self._lock:
            call_id = self._send(method, (arg,), REPLY_RANK0)
            self._steps_in_flight.add(call_id)
        return _StepReply(self, call_id, method)

    def step_result(self, call_id: int, method: str) -> ModelRunnerOutput:
        with self._lock:
            try:
                return self._collect(call_id, {0}, method)[0]
            finally:
                self._steps_in_flight.discard(call_id)

    def _call(self, method: str, args: tuple, reply: str) -> list[Any]:
        with self._lock:
            call_id = self._send(method, args, reply)
            ranks = set(range(self.world_size)) if reply == REPLY_ALL else {0}
            return self._collect(call_id, ranks, method)

    def _send(self, method: str, args: tuple, reply: str) -> int:
        self._check_alive()
        self._call_id += 1
        self._broadcast.send((self._call_id, method, args, reply))
        return self._call_id

    def _collect(self, call_id: int, ranks: set[int], method: str) -> list[Any]:
        """Replies of ``ranks`` to call ``call_id``, in rank order; raises a worker's error.
        Replies to other steps in flight are kept for their own collection."""
        results: dict[int, Any] = {}
        if call_id in self._early_replies:
            results[0] = self._early_replies.pop(call_id)
        try:
            while len(results) < len(ranks):
                if not self._results.poll(_POLL_MS):
                    self._check_alive()
                    continue
                reply_id, rank, ok, payload = pickle.loads(self._results.recv())
                if not ok and reply_id not in self._abandoned_calls:
                    # A late error of an earlier step (answered by rank 0) counts too: that rank
                    # is out of step with the others.
                    raise _remote_error(rank, method, payload)
                if reply_id == call_id and rank in ranks:
                    results[rank] = payload
                elif reply_id in self._steps_in_flight and rank == 0:
                    self._early_replies[reply_id] = payload
        except BaseException:
            self._abandoned_calls.add(call_id)
            raise
        return [results[rank] for rank in sorted(ranks)]

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        with contextlib.suppress(zmq.ZMQError):
            self._broadcast.send((None, None, (), REPLY_ALL))  # method None: leave the loop
        for proc in self.workers:
            proc.join(_SHUTDOWN_TIMEOUT_S / len(self.workers))
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._broadcast.close()
        self._results.close(linger=0)
        self._zmq_ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


@dataclass
class _StepReply:
    """A step sent to the workers (a ``PendingOutput``): ``result()`` collects rank 0's reply."""

    executor: MultiprocExecutor
    call_id: int
    method: str

    def result(self) -> ModelRunnerOutput:
        return self.executor.step_result(self.call_id, self.method)

    def done(self) -> bool:
        """Whether rank 0's reply is in (kept while another call was collecting)."""
        return self.call_id in self.executor._early_replies


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"exit code {exitcode}, killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _remote_error(
    rank: int, method: str, payload: tuple[BaseException | None, str]
) -> BaseException:
    """The worker's own exception (so a ValueError stays one), noting where it was raised."""
    exc, trace = payload
    where = f"tensor-parallel rank {rank}, in {method}"
    if exc is None:
        return RuntimeError(f"Worker failed ({where}):\n{trace}")
    exc.add_note(f"Raised on {where}. Worker traceback:\n{trace}")
    return exc


# ---- the worker process -------------------------------------------------------------------------


def run_worker(
    config: OmniConfig,
    rank: int,
    world_size: int,
    init_method: str,
    calls_address: str,
    results_address: str,
) -> NoReturn:
    """Entry point of a worker process: start, report READY (or the error), serve calls."""
    _exit_when_parent_dies()
    context = zmq.Context()
    results = context.socket(zmq.PUSH)
    results.connect(results_address)
    calls = BroadcastReceiver(context, calls_address)
    wrapper = WorkerWrapper(rank, world_size)
    try:
        wrapper.init_worker(config, init_method, local_rank=rank)
    except BaseException as exc:
        _reply_error(results, _STARTUP_CALL_ID, rank, exc)
        results.close(linger=2000)  # let the error reach the executor
        sys.exit(1)
    results.send(pickle.dumps((_STARTUP_CALL_ID, rank, True, None)))
    serve_calls(calls, results, wrapper, config.scheduler_config.async_scheduling)
    wrapper.shutdown()
    context.destroy(linger=1000)
    sys.exit(0)


_STEP_DISPATCH = {"execute_model": "dispatch_model", "sample_model": "dispatch_sampling"}
"""Step calls -> the worker method that launches the step and returns before its read-back."""


def serve_calls(
    calls: BroadcastReceiver, results: zmq.Socket, wrapper: WorkerWrapper, ahead: bool
) -> None:
    """Answer calls in order until told to stop. With ``ahead`` (async scheduling, where the
    engine core sends the next step before it reads this one's reply), a step is launched and
    read back only once the next call is in or the step is done, whichever is first: a step
    that is in is launched behind it first (and a ``launch_model``, the next step's first half),
    so the device goes from one step to the next without waiting for this worker's host."""
    pending: tuple[int, str, PendingOutput] | None = None

    def reply(call_id: int, mode: str, result: Any) -> None:
        if mode == REPLY_ALL or wrapper.rank == 0:
            results.send(
                pickle.dumps(
                    (call_id, wrapper.rank, True, result), protocol=pickle.HIGHEST_PROTOCOL
                )
            )

    def finish() -> None:
        nonlocal pending
        if pending is not None:
            (call_id, mode, step), pending = pending, None
            try:
                output = step.result()
            except Exception as exc:
                _reply_error(results, call_id, wrapper.rank, exc)
            else:
                reply(call_id, mode, output)

    while True:
        while pending is not None and not calls.poll(0):
            if pending[2].done():
                finish()
            else:
                time.sleep(_WAIT_S)
        call_id, method, args, mode = calls.recv()
        if method is None:
            finish()
            return
        if method not in _STEP_DISPATCH and method != "launch_model":
            finish()  # every other call sees each step read back
        try:
            if method in _STEP_DISPATCH:
                step = getattr(wrapper.worker, _STEP_DISPATCH[method])(*args)
            else:
                result = wrapper.execute_method(method, args, mode)
        except Exception as exc:
            finish()
            _reply_error(results, call_id, wrapper.rank, exc)
            continue
        if method not in _STEP_DISPATCH:
            reply(call_id, mode, result)
            continue
        finish()
        pending = (call_id, mode, step)
        if not ahead:
            finish()


def _reply_error(socket: zmq.Socket, call_id: int, rank: int, exc: BaseException) -> None:
    trace = traceback.format_exc()
    try:
        message = pickle.dumps((call_id, rank, False, (exc, trace)))
    except Exception:  # an exception that cannot travel still sends its traceback
        message = pickle.dumps((call_id, rank, False, (None, trace)))
    socket.send(message)


def _exit_when_parent_dies() -> None:
    """An engine core killed without cleanup must not leave its workers behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front end, which stops us
    on_parent_death(lambda: os._exit(1))
