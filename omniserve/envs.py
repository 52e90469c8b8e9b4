"""Every environment variable omniserve reads, in one place (style.md §7.9)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def _user_dir(env_name: str, xdg_name: str, default: str) -> Path:
    explicit = os.environ.get(env_name)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get(xdg_name) or str(Path.home() / default)
    return Path(base).expanduser() / "omniserve"


def cache_dir() -> Path:
    """Where built tiny checkpoints and other caches live (``OMNISERVE_CACHE_DIR``)."""
    return _user_dir("OMNISERVE_CACHE_DIR", "XDG_CACHE_HOME", ".cache")


def config_dir() -> Path:
    """Where the user's model registry file lives (``OMNISERVE_CONFIG_DIR``)."""
    return _user_dir("OMNISERVE_CONFIG_DIR", "XDG_CONFIG_HOME", ".config")


def device_override() -> str | None:
    """Force a device ("cpu", "cuda") regardless of what is available (``OMNISERVE_DEVICE``)."""
    return os.environ.get("OMNISERVE_DEVICE") or None


def attention_backend() -> str:
    """Default of ``--attention-backend`` (``OMNISERVE_ATTENTION_BACKEND``, "auto")."""
    return os.environ.get("OMNISERVE_ATTENTION_BACKEND") or "auto"


def engine_multiprocessing() -> bool:
    """Run the engine core in its own process (``OMNISERVE_ENABLE_MULTIPROCESSING``, default on)."""
    return os.environ.get("OMNISERVE_ENABLE_MULTIPROCESSING", "1") not in ("0", "false", "False")


def torch_profiler_dir() -> str | None:
    """Where ``start_profile`` / ``stop_profile`` write torch profiler traces and tables
    (``OMNISERVE_TORCH_PROFILER_DIR``, vLLM's ``VLLM_TORCH_PROFILER_DIR``); unset, profiling is
    off and the server has no profile routes."""
    return os.environ.get("OMNISERVE_TORCH_PROFILER_DIR") or None


def allow_runtime_lora_updating() -> bool:
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, vLLM's switch; off by default)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


def server_dev_mode() -> bool:
    """Serve vLLM's developer routes (``/reset_prefix_cache``, ``/reset_mm_cache``;
    ``VLLM_SERVER_DEV_MODE``, vLLM's switch; off by default)."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").lower() in ("1", "true")


def num_threads() -> int | None:
    """Torch intra-op threads for CPU workers (``OMNISERVE_NUM_THREADS``); None keeps torch's."""
    value = os.environ.get("OMNISERVE_NUM_THREADS")
    return int(value) if value else None


def cpu_malloc_tuning() -> bool:
    """Whether CPU workers keep freed activation memory in the heap
    (``OMNISERVE_CPU_MALLOC_TUNING``, default on; see ``worker/host_allocator.py``)."""
    value = os.environ.get("OMNISERVE_CPU_MALLOC_TUNING", "1")
    if value not in ("0", "1"):
        raise ValueError(f"OMNISERVE_CPU_MALLOC_TUNING must be '0' or '1', not {value!r}.")
    return value == "1"


def cpu_bf16_weights() -> bool:
    """Whether a bf16 checkpoint computed in fp32 on CPU keeps its weights in bf16, widened in the
    kernels (``OMNISERVE_CPU_BF16_WEIGHTS``, default on; "0" widens them to fp32 at load, for
    oneDNN's packed fp32 products: twice the memory, faster from about 64 rows a step, slower
    below; see ``cpu/backend.py:keep_bf16_weights`` and ``cpu/linear.py``)."""
    value = os.environ.get("OMNISERVE_CPU_BF16_WEIGHTS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"OMNISERVE_CPU_BF16_WEIGHTS must be '0' or '1', not {value!r}.")
    return value == "1"


def cpu_amx() -> bool:
    """Whether bf16 linear layers run ``cpu/csrc/linear_amx.c`` on a CPU with AMX
    (``OMNISERVE_CPU_AMX``, default on: faster decode steps, prefills about 5% slower; "0":
    oneDNN's packed copies and, for a tied head, the plain-layout kernel, as on CPUs without
    AMX; see ``cpu/linear_amx.py``)."""
    value = os.environ.get("OMNISERVE_CPU_AMX", "1")
    if value not in ("0", "1"):
        raise ValueError(f"OMNISERVE_CPU_AMX must be '0' or '1', not {value!r}.")
    return value == "1"


def layer_kernels(device_type: str) -> str:
    """A device backend's switch (``OMNISERVE_CPU_KERNELS`` / ``OMNISERVE_CUDA_KERNELS``): "auto"
    applies it (on CPU oneDNN linears and C kernels for MoE, decode attention, norms and RoPE; on
    CUDA Triton kernels for norms, RoPE and SiLU-and-mul), "torch" leaves every layer on torch."""
    name = f"OMNISERVE_{device_type.upper()}_KERNELS"
    value = os.environ.get(name, "auto")
    if value not in ("auto", "torch"):
        raise ValueError(f"{name} must be 'auto' or 'torch', not {value!r}.")
    return value


def media_fetch_timeout(modality: str) -> float | None:
    """Seconds fetching one media item may take, all of it (DNS, connect, redirects, body):
    ``VLLM_{IMAGE,AUDIO,VIDEO}_FETCH_TIMEOUT``, vLLM's names; None: the built-in default."""
    name = f"VLLM_{modality.upper()}_FETCH_TIMEOUT"
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, not {value!r}.") from None


def media_loading_threads() -> int:
    """Threads that fetch and decode media URLs (``VLLM_MEDIA_LOADING_THREAD_COUNT``, vLLM's
    name, default 8)."""
    value = os.environ.get("VLLM_MEDIA_LOADING_THREAD_COUNT", "8")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"VLLM_MEDIA_LOADING_THREAD_COUNT must be an integer >= 1, not {value!r}.")
    return int(value)


def max_audio_clip_filesize_mb() -> float:
    """``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` (vLLM's name, default 25): the largest audio file
    the transcription and translation routes take."""
    value = os.environ.get("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "25")
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(
            f"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB must be a number, not {value!r}."
        ) from None
    if megabytes <= 0:
        raise ValueError(f"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB must be > 0, not {value!r}.")
    return megabytes


def log_stats_interval() -> float:
    """``VLLM_LOG_STATS_INTERVAL`` (vLLM's name, default 10): seconds between the server's
    periodic stats lines."""
    value = os.environ.get("VLLM_LOG_STATS_INTERVAL", "10")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number, not {value!r}.") from None
    if seconds <= 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be > 0, not {value!r}.")
    return seconds


def responses_store_mb() -> float:
    """``OMNISERVE_RESPONSES_STORE_MB``: memory for stored Responses API responses (their
    conversations, media included); the least recently used go first; 0 stores none."""
    value = os.environ.get("OMNISERVE_RESPONSES_STORE_MB", "256")
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"OMNISERVE_RESPONSES_STORE_MB must be a number, not {value!r}.") from None
    if megabytes < 0:
        raise ValueError(f"OMNISERVE_RESPONSES_STORE_MB must be >= 0, not {value!r}.")
    return megabytes


def configure_logging() -> bool:
    """Whether omniserve sets up its own log output (``OMNISERVE_CONFIGURE_LOGGING``, default 1)."""
    return os.environ.get("OMNISERVE_CONFIGURE_LOGGING", "1") not in ("0", "false", "False")


def logging_level() -> str:
    """Level of omniserve's log output (``OMNISERVE_LOGGING_LEVEL``, default INFO)."""
    return os.environ.get("OMNISERVE_LOGGING_LEVEL", "INFO").upper()


def cuda_visible_devices() -> list[str] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` lists; None when it is unset (all are visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [device for device in value.split(",") if device.strip()]


@contextlib.contextmanager
def config_dir_override(path: Path) -> Iterator[None]:
    """Point ``OMNISERVE_CONFIG_DIR`` at ``path`` inside the block (processes started there
    inherit it): how ``register-model --check`` shows a candidate plugin to a spawned engine
    without touching the user's registry file."""
    previous = os.environ.get("OMNISERVE_CONFIG_DIR")
    os.environ["OMNISERVE_CONFIG_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMNISERVE_CONFIG_DIR", None)
        else:
            os.environ["OMNISERVE_CONFIG_DIR"] = previous
