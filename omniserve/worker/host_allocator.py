"""Keep freed activation memory in the worker process (glibc malloc), for CPU workers.

A prefill's activations are tens of MB each. glibc serves blocks that large with mmap, or trims
them off the top of the heap, and gives them back to the OS on free, so the next step faults
every page in again and the kernel zeroes it. On a 2-core VM that made the elementwise ops of a
7.5k-token prefill several times slower than their memory traffic (a 4.9 s prefill step lost
about 1.5 s). Raising the mmap and trim thresholds keeps freed blocks in the heap for reuse: the
process holds on to its peak activation memory, as a caching allocator would (vLLM's CPU
backend gets the same from tcmalloc through LD_PRELOAD). It changes only the process it runs in;
``OMNISERVE_CPU_MALLOC_TUNING=0`` turns it off, and other C libraries are left alone.

What loading frees (weights a kernel replaced by its own layout) is no activation: it is handed
back once, by ``release_freed_memory``, before the KV cache is allocated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from omniserve import envs

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = {
    _M_MMAP_THRESHOLD: 1 << 30,  # blocks below 1 GiB come from the heap...
    _M_TRIM_THRESHOLD: (1 << 31) - 1,  # ...which is not shrunk when they are freed
    _M_TOP_PAD: 64 << 20,  # and grows 64 MiB at a time
}


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)


def keep_freed_memory() -> bool:
    """Apply the settings to this process; True when glibc took all of them."""
    if not envs.cpu_malloc_tuning():
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False  # not glibc: nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = all(mallopt(option, value) == 1 for option, value in _SETTINGS.items())
    if not applied:
        logger.warning("glibc refused a malloc setting; freed activations may be unmapped.")
    return applied
