"""Worker: owns a device, the model and its ModelRunner; sizes the KV cache."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from transformers import AutoConfig

from omniserve import envs
from omniserve.config import OmniConfig
from omniserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from omniserve.layers.cpu_gemm import pack_weights_for_cpu
from omniserve.layers.tp import get_tp_size
from omniserve.plugins import load_plugins
from omniserve.registry import ModelRegistry
from omniserve.worker.host_allocator import keep_freed_memory
from omniserve.worker.model_loader import load_model_weights
from omniserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 4 << 30
_GPU_MEMORY_FRACTION = 0.9


def resolve_device(device: str) -> torch.device:
    device = envs.device_override() or device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was requested but CUDA is not available.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in ``dtype`` inside the block (the model classes create them plainly)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Worker:
    def __init__(self, config: OmniConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        model_config = config.model_config
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if envs.num_threads():
                # The tensor-parallel ranks of one engine share its threads.
                torch.set_num_threads(max(1, envs.num_threads() // get_tp_size()))
        torch.manual_seed(model_config.seed)
        load_plugins()
        self.hf_config = AutoConfig.from_pretrained(model_config.model)
        model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
        with torch.device(self.device), default_dtype(self.dtype):
            model = model_cls(self.hf_config)
        load_model_weights(model, model_config.model)
        model.eval()
        pack_weights_for_cpu(model)
        vocab_size = self.hf_config.get_text_config().vocab_size
        self.model_runner = ModelRunner(
            model, config.scheduler_config, config.cache_config, vocab_size, self.device
        )

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the memory budget, but no more than the scheduler could ever use."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        if cache.num_blocks_override is not None:
            num_blocks = cache.num_blocks_override
        else:
            per_block = self.model_runner.kv_cache_bytes_per_block(self.dtype)
            num_blocks = min(
                self._kv_budget_bytes() // per_block, sched.max_num_seqs * blocks_per_seq + 1
            )
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer than "
                f"one max_model_len={sched.max_model_len} sequence needs ({blocks_per_seq}). "
                "Raise --kv-cache-memory or lower --max-model-len."
            )
        return int(num_blocks)

    def _kv_budget_bytes(self) -> int:
        budget = self.config.cache_config.kv_cache_memory_bytes
        if budget is not None:
            return budget
        if self.device.type != "cuda":
            return _CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        # Leave room for activations: a rough share of the step's token budget.
        return int(total * _GPU_MEMORY_FRACTION - used_by_others - (1 << 30))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, self.dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens", num_blocks, self.config.cache_config.block_size
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
