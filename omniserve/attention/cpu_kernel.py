"""Build, load and call the C paged-decode kernel (``csrc/paged_decode.c``) on CPUs.

The kernel is compiled once per machine with the system C compiler into omniserve's cache dir
(keyed by the source, the flags and the CPU, since it is built with ``-march=native``) and loaded
with ctypes: it needs no torch headers, so the build takes about a second. It links the same
``libgomp`` torch already loaded, so both share one OpenMP thread pool. Without a compiler, or
with ``OMNISERVE_CPU_ATTENTION=torch``, decoding stays on the torch path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from omniserve import envs

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_ERRORS = {-1: "a block id outside the KV cache", -2: "an allocation failure"}


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + _cpu_signature().encode() + compiler.encode()
    ).hexdigest()[:16]
    target = envs.cache_dir() / "kernels" / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> ctypes.CDLL | None:
    if envs.cpu_attention() == "torch":
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found: CPU decode attention uses the torch path.")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the CPU paged-decode kernel failed (%s); using torch.", detail)
        return None
    fn = library.omniserve_paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr]
    fn.argtypes += [i64] * 6 + [ctypes.c_float, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return library


def kernel_available() -> bool:
    """True when decode attention on CPU fp32 tensors can use the C kernel."""
    return _load() is not None


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel's domain: CPU, fp32, head rows contiguous."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and kernel_available()
    )


def paged_decode(
    query: torch.Tensor,
    out: torch.Tensor,
    token_rows: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Write attention for the decode tokens at ``token_rows`` of ``query`` into ``out``.

    query/out ``[num_tokens, num_heads, head_size]``; token_rows ``[n]`` int64; block_table
    ``[n, max_blocks]`` int32 and seq_lens ``[n]`` int32 (contiguous) for the same n requests;
    kv_cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
    """
    library = _load()
    assert library is not None, "paged_decode called without the kernel; check supports()"
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_heads = query.shape[1]
    status = library.omniserve_paged_decode_f32(
        query.data_ptr(),
        query.stride(0),
        out.data_ptr(),
        out.stride(0),
        token_rows.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        token_rows.shape[0],
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        num_blocks,
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"CPU paged-decode kernel failed: {_ERRORS.get(status, status)}.")
