"""Start-up of engine-core processes: spawn each with its own environment, wait for READY.

Used by ``MPClient``, which owns the processes once they run. With data parallelism each engine
gets its slice of the GPUs (``CUDA_VISIBLE_DEVICES``) or of the CPU threads, set in the
environment the child starts with, so it holds before anything in the child touches CUDA.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
from multiprocessing.process import BaseProcess

import torch

from omniserve import envs
from omniserve.config import OmniConfig
from omniserve.engine.core_proc import EngineCoreProc
from omniserve.engine.data_parallel import engine_env
from omniserve.engine.exceptions import EngineStartupError
from omniserve.process_utils import spawn_context, spawning


def engine_envs(config: OmniConfig) -> list[dict[str, str]]:
    """Per data-parallel rank: the environment overrides of its engine process."""
    parallel = config.parallel_config
    num_engines = parallel.data_parallel_size
    cuda_devices = None
    device = envs.device_override() or config.model_config.device
    # An explicit "cuda:N" pins every engine to that device; "auto"/"cuda" spread them.
    if num_engines > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        cuda_devices = envs.cuda_visible_devices() or [
            str(i) for i in range(torch.cuda.device_count())
        ]
    num_cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return [
        engine_env(
            rank, num_engines, parallel.world_size, num_cpus, envs.num_threads(), cuda_devices
        )
        for rank in range(num_engines)
    ]


def launch_engine(
    config: OmniConfig,
    engine_index: int,
    input_address: str,
    output_address: str,
    ipc_dir: str,
    env: dict[str, str],
) -> tuple[BaseProcess, multiprocessing.connection.Connection]:
    """Spawn engine core ``engine_index``; returns the process and the pipe it reports on."""
    mp_ctx = spawn_context()
    reader, writer = mp_ctx.Pipe(duplex=False)
    name = (
        "OmniEngineCore"
        if config.parallel_config.data_parallel_size == 1
        else f"OmniEngineCore_DP{engine_index}"
    )
    # Not a daemon: the engine may start worker processes of its own (tensor parallelism).
    proc = mp_ctx.Process(
        target=EngineCoreProc.run_engine_core,
        name=name,
        args=(config, input_address, output_address, writer, ipc_dir, engine_index),
    )
    with spawning(env):
        proc.start()
    writer.close()
    return proc, reader


def wait_until_ready(
    procs: list[BaseProcess], ready_pipes: list[multiprocessing.connection.Connection]
) -> list[tuple[int, int]]:
    """Block until every engine reports READY; by rank, its number of KV blocks and its talker
    pool's capacity in positions."""
    try:
        return [
            _wait_until_ready(proc, pipe) for proc, pipe in zip(procs, ready_pipes, strict=True)
        ]
    finally:
        for pipe in ready_pipes:  # those not reached after a failure
            pipe.close()


def _wait_until_ready(
    proc: BaseProcess,
    ready_pipe: multiprocessing.connection.Connection,
) -> tuple[int, int]:
    try:
        multiprocessing.connection.wait([ready_pipe, proc.sentinel])
        message = ready_pipe.recv() if ready_pipe.poll() else None
    except EOFError:  # the child died without a word
        message = None
    finally:
        ready_pipe.close()
    if message is None:
        proc.join(1.0)
        raise EngineStartupError(
            f"The engine core process exited during start-up (exit code "
            f"{proc.exitcode}) without reporting an error; see its log."
        )
    status, value = message
    if status != "READY":
        trace, kind, text = value
        error = EngineStartupError(f"The engine core failed to start:\n{trace}")
        user_error = _USER_ERRORS.get(kind)
        if user_error is not None:
            raise user_error(text) from error
        raise error
    num_kv_blocks, talker_capacity = value
    return int(num_kv_blocks), int(talker_capacity)


# Start-up failures that are the caller's mistake keep their type in the parent.
_USER_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, FileNotFoundError)
}
