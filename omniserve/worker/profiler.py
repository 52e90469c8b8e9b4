"""torch profiler traces of a worker's steps between ``start_profile`` and ``stop_profile``
(vLLM's API), for finding where a step's time goes on a real device: which kernels take the GPU's
time, and how much of the step the host spends launching them.

Each stop writes the rank's trace (a TensorBoard / Perfetto ``.pt.trace.json.gz``) and a table of
the ops with the most self time (device time on CUDA) as ``profiler_out_<rank>.txt``, both into
``OMNISERVE_TORCH_PROFILER_DIR``. Profiling must be enabled when the engine starts, as in vLLM:
the directory is fixed for the engine's life.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

_ROWS = 40


class WorkerProfiler:
    def __init__(self, directory: str | None, rank: int, device: torch.device) -> None:
        self.directory = directory
        self.rank = rank
        self._cuda = device.type == "cuda"
        self._profiler: profile | None = None

    def start(self) -> None:
        if self.directory is None:
            raise RuntimeError(
                "Profiling is off: start the engine with OMNISERVE_TORCH_PROFILER_DIR set to the "
                "directory the traces should go to."
            )
        if self._profiler is not None:
            raise RuntimeError("The profiler is already running: call stop_profile first.")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        handler = tensorboard_trace_handler(self.directory, f"rank{self.rank}", use_gzip=True)
        self._profiler = profile(activities=activities, on_trace_ready=handler)
        self._profiler.start()

    def stop(self) -> None:
        """Stop, write the trace and the table of the ops with the most self time."""
        if self._profiler is None:
            raise RuntimeError("The profiler is not running: call start_profile first.")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        sort_by = "self_device_time_total" if self._cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=_ROWS)
        assert self.directory is not None
        (Path(self.directory) / f"profiler_out_{self.rank}.txt").write_text(table)
