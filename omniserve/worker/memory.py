"""Host memory for CPU workers: what is available, whether a model fits, how much KV cache.

On a CPU the weights, the KV cache and the activations share the machine's memory with
everything else on it, so the worker checks the fit before it reads a byte of the checkpoint
(failing with what it needs and what to change, rather than being OOM-killed half-way through
loading), and sizes the KV cache from the memory still available once the weights are in.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_KV_FRACTION = 0.5
"""Share of the memory available after loading that the KV cache takes by default: the rest stays
for activations, the API server's media processing, and the rest of the machine."""
RESERVE_BYTES = 1 << 30
"""Kept free in any case: a step's activations and the runtime's own allocations."""


def gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def _cgroup_headroom() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate, when it has a limit."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / cgroup.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def available_memory_bytes() -> int:
    """Memory the process can still take: the kernel's MemAvailable (free plus reclaimable page
    cache), or less under a cgroup limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def check_model_fits(
    weight_bytes: int, min_kv_bytes: int, dtype_name: str, max_model_len: int
) -> None:
    """Raise MemoryError, naming the sizes and the options that shrink them, when the weights,
    one max_model_len sequence of KV cache and the reserve exceed the available memory."""
    available = available_memory_bytes()
    needed = weight_bytes + min_kv_bytes + RESERVE_BYTES
    if needed <= available:
        return
    raise MemoryError(
        f"The model does not fit in this machine's memory: its weights take {gib(weight_bytes)} "
        f"in {dtype_name}, one {max_model_len}-token sequence needs {gib(min_kv_bytes)} of KV "
        f"cache, and {gib(RESERVE_BYTES)} is kept for activations: {gib(needed)} in all, but "
        f"only {gib(available)} is available. Free memory, or lower --max-model-len"
        + (", or pass --dtype bfloat16" if dtype_name == "float32" else "")
        + ", or serve a smaller model."
    )


def cpu_kv_budget_for_utilization(utilization: float, num_workers: int) -> int:
    """Each CPU worker's KV share when the engine may use ``utilization`` of the machine's
    memory: that share of the total, less what the workers hold now (the weights) and the
    reserve."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    used = _process_rss_bytes() * num_workers
    return max(int(total * utilization) - used - RESERVE_BYTES, 0) // num_workers


def _process_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gpu_kv_budget(
    total_bytes: int,
    utilization: float,
    peak_torch_bytes: int,
    non_torch_bytes: int,
    encoder_cache_bytes: int,
) -> int:
    """A GPU worker's KV cache: its share ``utilization`` of the device, less the profiled peak
    of torch's allocations (weights and the largest step's and media item's activations), what
    lives outside torch (CUDA context, cuBLAS workspaces, other processes) and the encoder cache
    at capacity. Raises MemoryError naming the sizes when nothing is left."""
    budget = int(total_bytes * utilization) - peak_torch_bytes - non_torch_bytes
    budget -= encoder_cache_bytes
    if budget <= 0:
        raise MemoryError(
            f"No GPU memory is left for a KV cache: --gpu-memory-utilization {utilization} of "
            f"{gib(total_bytes)} is {gib(total_bytes * utilization)}, but the profile run's peak "
            f"(weights and the largest step and media item) took {gib(peak_torch_bytes)}, "
            f"{gib(non_torch_bytes)} is held outside torch and the encoder cache needs "
            f"{gib(encoder_cache_bytes)}. Raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens or the media limits (--limit-mm-per-prompt, "
            "--mm-processor-kwargs), or serve a smaller model."
        )
    return budget


def default_cpu_kv_budget(num_workers: int) -> int:
    """Each of ``num_workers`` CPU workers' KV-cache share of the memory available now."""
    usable = max(available_memory_bytes() - RESERVE_BYTES, 0)
    return int(usable * CPU_KV_FRACTION) // num_workers
