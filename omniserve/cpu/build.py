"""Build and load the CPU backend's C kernels (``csrc/*.c``, shared headers in ``csrc/*.h``).

Each kernel source is compiled once per machine with the system C compiler into omniserve's cache
dir (keyed by the sources, the flags and the CPU, since it is built with ``-march=native``) and
loaded with ctypes: no torch headers, so a build takes about a second, done when the backend is
applied at start-up. The libraries link the same ``libgomp`` torch already loaded, so they share
one OpenMP thread pool. Without a compiler, or with ``OMNISERVE_CPU_KERNELS=torch``, the backend
leaves every layer on its torch path (logged once).
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
from typing import Any

import torch

from omniserve import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
"""The kernel sources and the headers they share (every header is part of every build's key)."""
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX): where bf16 weights are
    faster than fp32 rather than emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _build(source_path: Path, compiler: str) -> Path:
    source = source_path.read_bytes()
    source += b"".join(header.read_bytes() for header in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + _cpu_signature().encode() + compiler.encode()
    ).hexdigest()[:16]
    target = envs.cache_dir() / "kernels" / f"{source_path.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, f"-I{CSRC}", str(source_path), "-o", tmp, "-lm"],
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
def load_library(source_name: str) -> ctypes.CDLL | None:
    """The compiled library of ``csrc/<source_name>``, or None (torch paths) when it cannot be
    built."""
    if envs.layer_kernels("cpu") == "torch":
        return None
    source_path = CSRC / source_name
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found: %s is not built; torch paths run.", source_name)
        return None
    try:
        return ctypes.CDLL(str(_build(source_path, compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building %s failed (%s); torch paths run.", source_name, detail)
        return None


@functools.cache
def load_function(source_name: str, name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """Function ``name`` of a source's library with its C signature declared, or None."""
    library = load_library(source_name)
    if library is None:
        return None
    fn = getattr(library, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""The element types the C kernels are built for, and their functions' name suffixes."""


def load_typed(
    source_name: str, name: str, dtype: torch.dtype, argtypes: tuple[Any, ...], restype: Any
) -> Any:
    """``name``'s instance for ``dtype`` (``<name>_f32`` / ``<name>_bf16``), or None when there is
    none or the library cannot be built."""
    suffix = KERNEL_DTYPES.get(dtype)
    return (
        None
        if suffix is None
        else load_function(source_name, f"{name}_{suffix}", argtypes, restype)
    )


def inference_tensors(*tensors: torch.Tensor) -> bool:
    """CPU tensors with no autograd to record: the kernels' domain."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
