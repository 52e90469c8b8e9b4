"""Worker: owns a device, the model and its ModelRunner; sizes the KV cache."""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PretrainedConfig

from omniserve import envs
from omniserve.attention.base import is_fp8, kv_cache_torch_dtype
from omniserve.attention.encoder import set_encoder_attention
from omniserve.attention.layer import Attention, kv_cache_bytes_per_block
from omniserve.attention.selector import apply_attention_backend
from omniserve.config import OmniConfig, ParallelConfig, QuantizationConfig
from omniserve.core.sched_output import SchedulerOutput
from omniserve.cpu.backend import apply_cpu_backend, keep_bf16_weights
from omniserve.cpu.build import has_native_bf16
from omniserve.layers.fused_moe import FusedMoE, expert_parallel
from omniserve.layers.quantized_loading import QuantizedModel, quantize_layers
from omniserve.layers.tp import get_tp_size
from omniserve.layers.weight_utils import default_dtype
from omniserve.lora.request import LoRARequest
from omniserve.messages import ModelRunnerOutput, PendingOutput
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from omniserve.plugins import load_plugins
from omniserve.registry import ModelRegistry, load_class, load_subclass
from omniserve.tokenizer import get_tokenizer
from omniserve.worker.host_allocator import keep_freed_memory, release_freed_memory
from omniserve.worker.logits_processors import LogitsProcessorBatch
from omniserve.worker.lora_manager import LoRAManager
from omniserve.worker.memory import (
    check_model_fits,
    cpu_kv_budget_for_utilization,
    default_cpu_kv_budget,
    gib,
    gpu_kv_budget,
)
from omniserve.worker.model_loader import checkpoint_tensor_shapes, load_model_weights
from omniserve.worker.model_runner import ModelRunner
from omniserve.worker.pooler import load_projector
from omniserve.worker.profiler import WorkerProfiler

logger = logging.getLogger(__name__)

_ENGINE_CALLS = frozenset({
    "sleep", "wake_up", "rpc", "execute_model", "dispatch_model", "launch_model",
    "dispatch_sampling", "initialize_kv_cache", "initialize_talker_kv_cache", "add_lora",
    "remove_lora",
})  # fmt: skip
"""Worker methods ``collective_rpc`` may not call: the engine core's own."""
_GPU_MEMORY_FRACTION = 0.9
_TALKER_KV_SHARE = 0.25
"""Share of the KV budget a speaking model's talker gets (its sequences are frames, 12.5 per
second of speech, and it keeps no prefix cache)."""


def resolve_device(device: str) -> torch.device:
    device = envs.device_override() or device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine.")
    resolved = torch.device(device)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices."
        )
    return resolved


def checkpoint_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the checkpoint's config declares (its text part's for nested configs)."""
    for config in (hf_config, hf_config.get_text_config()):
        declared = getattr(config, "dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        if isinstance(declared, torch.dtype):
            return declared
    return None


def resolve_dtype(dtype: str, device: torch.device, stored: torch.dtype | None) -> torch.dtype:
    """``dtype`` as asked, or for "auto" the checkpoint's own, as vLLM resolves it: on a GPU a
    bf16/fp16 checkpoint keeps its dtype and an fp32 one runs in bf16; on a CPU a bf16/fp16
    checkpoint runs in bf16 where the CPU has native bf16 (AVX512-BF16, AMX) and in fp32 where
    bf16 would be emulated (a bf16 checkpoint's weights then stay bf16, widened in the kernels:
    ``cpu.backend.keep_bf16_weights``), and an fp32 checkpoint stays fp32."""
    if dtype != "auto":
        return getattr(torch, dtype)
    half = stored in (torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return stored if half else torch.bfloat16
    return torch.bfloat16 if half and has_native_bf16() else torch.float32


VLLM_WORKERS = ("auto", "vllm.v1.worker.gpu_worker.Worker", "vllm.v1.worker.cpu_worker.CPUWorker")
"""vLLM's own ``--worker-cls`` values, taken as this engine's ``Worker``."""


def worker_class(parallel: ParallelConfig) -> type[Worker]:
    """``Worker``, or ``--worker-cls``'s subclass of it, and with ``--worker-extension-cls`` one
    that also has the extension's methods (vLLM's): ValueError when a class does not import, is
    no Worker, or would replace the worker's own methods."""
    base = Worker
    if parallel.worker_cls not in ("", *VLLM_WORKERS):
        base = load_subclass(parallel.worker_cls, Worker, "--worker-cls")
    extension = parallel.worker_extension_cls
    if not extension:
        return base
    cls = load_class(extension, "--worker-extension-cls")
    clash = sorted(n for n in vars(cls) if not n.startswith("__") and hasattr(base, n))
    if clash:
        raise ValueError(f"--worker-extension-cls {extension}: {', '.join(clash)} would replace "
                         "the worker's own.")  # fmt: skip
    return type(cls.__name__, (base, cls), {})


def release_device_memory(device: torch.device) -> None:
    """Hand what was just freed back (sleep mode): to the OS on a CPU, to the driver on CUDA."""
    gc.collect()  # (a model's modules hold each other: LoRA slots, tied weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_freed_memory()


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Leave parameters uninitialised (every one is read from the checkpoint next), so building
    a model touches no memory. omniserve's layers never initialise; transformers' modules (the
    media towers) do, and transformers' ``no_init_weights`` skips that, but it imports
    transformers' modeling code (~200 MB of RSS), so it is used only where that is loaded."""
    if "transformers.modeling_utils" not in sys.modules:
        yield
        return
    from transformers.initialization import no_init_weights

    with no_init_weights():
        yield


def _log_expert_parallel(model: torch.nn.Module, rank: int) -> None:
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not moe:
        logger.info("--enable-expert-parallel: this model has no MoE layers; no change.")
    elif moe[0].placement is None:
        logger.info("--enable-expert-parallel: one rank holds every expert; no change.")
    else:
        logger.info("Expert parallelism: rank %d holds %d of the %d experts of each of %d MoE "
                    "layers (%s).", rank, moe[0].num_local_experts, moe[0].num_experts, len(moe),
                    moe[0].placement)  # fmt: skip


def _log_quantization(
    config: QuantizationConfig, quantized: QuantizedModel, dtype: torch.dtype
) -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    experts = f" and the experts of {quantized.expert_layers} MoE layers"
    experts = experts if quantized.expert_layers else ""
    if config.method == "fp8":
        scales = {(1, 0): "a scale per output feature", (0, 0): "one scale per matrix"}.get(
            (config.row_block, config.group_size),
            f"a scale per {config.row_block} x {config.group_size} block",
        )
        logger.info(
            "FP8 checkpoint: %d linear layers%s hold e4m3 weights (%s), dequantized exactly in "
            "the product; activations stay %s (GPU FP8 kernels would round them to FP8).",
            quantized.linear_layers, experts, scales, dtype_name,
        )  # fmt: skip
    else:
        name = {"pack-quantized": "compressed-tensors W4A16"}.get(config.method)
        logger.info(
            "%s checkpoint: %d linear layers%s hold 4-bit weights (groups of %d).",
            name or config.method.upper(), quantized.linear_layers, experts, config.group_size,
        )  # fmt: skip
    if dequantized := set(quantized.matrices) - quantized.kept:
        logger.warning(
            "%d quantized matrices outside omniserve's linear layers and quantized experts "
            "(media towers, experts whose groups a tensor-parallel rank would split; e.g. %s) "
            "are dequantized to %s at load and take that dtype's memory.",
            len(dequantized), min(dequantized), dtype_name,
        )  # fmt: skip


class Worker:
    def __init__(self, config: OmniConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        model_config = config.model_config
        self.device = resolve_device(model_config.device)
        self.profiler = WorkerProfiler(envs.torch_profiler_dir(), rank, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if threads := envs.num_threads():
                # The tensor-parallel ranks of one engine share its threads.
                torch.set_num_threads(max(1, threads // get_tp_size()))
        if model_config.seed is not None:
            torch.manual_seed(model_config.seed)
        load_plugins()
        self.hf_config = model_config.hf_config
        if model_config.speech is None and hasattr(self.hf_config, "enable_audio_output"):
            # The thinker alone (transformers' switch), on a copy: the front end shares it.
            self.hf_config = copy.deepcopy(self.hf_config)
            self.hf_config.enable_audio_output = False
        self.dtype = resolve_dtype(
            model_config.dtype, self.device, checkpoint_dtype(self.hf_config)
        )
        self.kv_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        """The KV caches' element type (the thinker's and the talker's)."""
        self.graph_sizes: list[int] = []  # decode batch sizes replayed from CUDA graphs
        self._gpu_kv_budget: int | None = None  # from the memory profile, once
        self.weights_path = model_config.model
        """Where the weights were read from (``reload_weights`` may change it)."""
        self.sleeping: set[str] = set()
        """What ``sleep`` released: "kv_cache", and "weights" (``wake_up`` restores them)."""
        self.num_kv_blocks = self.num_talker_kv_blocks = 0  # (the engine core sets them)
        self.weight_loads = 0
        """How many times the weights were read (``rpc`` tells the engine core of a change)."""
        self._load_model()

    def _load_model(self) -> None:
        """Build the model, read its weights from ``weights_path`` and set up its kernels, LoRA
        slots and model runner."""
        config, model_config = self.config, self.config.model_config
        self.weight_loads += 1
        model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
        start = time.perf_counter()
        # Parameters are created uninitialised (every one is then read from the checkpoint), so
        # building touches no memory and the fit check below comes before any real allocation.
        stored = checkpoint_tensor_shapes(self.weights_path)
        with (
            torch.device(self.device),
            default_dtype(self.dtype),
            skip_weight_init(),
            expert_parallel(config.parallel_config.expert_placement),
        ):
            model = model_cls(self.hf_config)
            off = config.multimodal_config.modalities_off()
            drop_towers = getattr(model, "drop_towers", None)  # (multimodal models')
            if off and drop_towers is not None and (dropped := drop_towers(off)):
                logger.info("Not loading %s: %s turned off (--limit-mm-per-prompt 0 or "
                            "--language-model-only).",
                            ", ".join(dropped), ", ".join(sorted(off)))  # fmt: skip
            if config.parallel_config.enable_expert_parallel:
                _log_expert_parallel(model, self.rank)
            if rate := config.multimodal_config.video_pruning_rate:
                self._set_video_pruning(model, rate)
            quantized: QuantizedModel | None = None
            if (quantization := model_config.quantization_config) is not None:
                quantized = quantize_layers(model, quantization, stored)
                _log_quantization(quantization, quantized, self.dtype)
            if self.device.type == "cpu":
                if count := keep_bf16_weights(model, self.dtype, stored):
                    logger.info(
                        "%d linear layers keep the checkpoint's bf16 weights, widened to fp32 "
                        "in the kernel (OMNISERVE_CPU_BF16_WEIGHTS=0 widens them at load).",
                        count,
                    )
        self.weight_bytes = sum(
            t.numel() * t.element_size() for t in {*model.parameters(), *model.buffers()}
        )
        if self.device.type == "cpu":
            check_model_fits(
                self.weight_bytes * get_tp_size(),
                kv_cache_bytes_per_block(model, 1, self.kv_dtype)
                * config.scheduler_config.max_model_len,
                str(self.dtype).removeprefix("torch."),
                config.scheduler_config.max_model_len,
            )
        load_model_weights(model, self.weights_path, quantization, quantized,
                           model_config.use_tqdm_on_load)  # fmt: skip
        attention = [m for m in model.modules() if isinstance(m, Attention)]  # (talker's too)
        if config.cache_config.calculate_kv_scales:
            for layer in attention:
                layer.calculate_kv_scales = True
        elif scaled := sum(a.kv_scales != (1.0, 1.0) for a in attention):
            use = "applies them" if is_fp8(self.kv_dtype) else "does not use them"
            logger.info("The checkpoint gives %d attention layers KV-cache scales; the %s KV "
                        "cache %s.", scaled, str(self.kv_dtype).removeprefix("torch."),
                        use)  # fmt: skip
        model.eval()
        if self.device.type == "cpu":
            self.backend_report = apply_cpu_backend(model, self.dtype)
            release_freed_memory()  # the weights the backend replaced
        else:  # triton, which the CUDA kernels need, is a dependency only on Linux x86_64
            from omniserve.cuda.backend import apply_cuda_backend

            self.backend_report = apply_cuda_backend(model, self.dtype)
        logger.info(self.backend_report.summary())
        self.attention_backends = apply_attention_backend(
            model, model_config.attention_backend, self.device, self.dtype
        )
        logger.info("Attention layers by backend: %s", self.attention_backends)
        self.encoder_attention = set_encoder_attention(
            model, config.multimodal_config.mm_encoder_attn_backend, self.device, self.dtype
        )
        if self.encoder_attention:
            logger.info("Encoder towers' attention: %s", self.encoder_attention)
        self.load_seconds = time.perf_counter() - start
        self.lora_manager = (
            LoRAManager(model, config.lora_config, self.dtype, self.device)
            if config.lora_config is not None
            else None
        )
        # The logits' width: a sequence classifier's are its labels' scores.
        vocab_size = model_config.num_labels or self.hf_config.get_text_config().vocab_size
        projector = load_projector(
            model_config.pooler_config.dense, self.hf_config.get_text_config().hidden_size,
            self.device,
        )  # fmt: skip
        processors = model_config.logits_processors
        self.model_runner = ModelRunner(
            model, config.scheduler_config, config.cache_config, vocab_size, self.device,
            self.lora_manager, config.speculative_config, projector, model_config.logprobs_mode,
            LogitsProcessorBatch(processors, config, self.device) if processors else None,
            config.multimodal_config.mm_encoder_tp_mode == "data",
        )  # fmt: skip

    def _set_video_pruning(self, model: Any, rate: float) -> None:
        """``--video-pruning-rate`` on the model, in its processor's layout of the kept tokens
        (checked at start-up in the front end too: a model that does not prune is refused)."""
        factories = MULTIMODAL_REGISTRY.get_factories(self.config.model_config)
        layout = factories.info.video_pruning_layout if factories is not None else None
        if layout is None or not hasattr(model, "set_video_pruning"):
            raise ValueError(f"--video-pruning-rate: {type(model).__name__} does not prune "
                             "video tokens.")  # fmt: skip
        model.set_video_pruning(rate, per_frame=layout == "per_frame")

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the memory budget, but no more than the scheduler could ever use."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        if cache.num_blocks_override is not None:
            num_blocks = cache.num_blocks_override
        else:
            per_block = self.model_runner.kv_cache_bytes_per_block(self.kv_dtype)
            num_blocks = min(
                self._thinker_kv_budget_bytes() // per_block,
                sched.max_num_seqs * cache.blocks_for(sched.max_model_len) + 1,
            )
        cache.check_holds_one_sequence(num_blocks, sched.max_model_len)
        mm = self.config.multimodal_config
        unused = self._gpu_kv_budget is None and (mm.mm_profile_sizes or mm.skip_mm_profiling)
        if unused and self.rank == 0:
            logger.info("--limit-mm-per-prompt's sizes and --skip-mm-profiling shape the start-up "
                        "memory profile, which runs on a GPU without --kv-cache-memory or "
                        "--num-gpu-blocks-override; here they change nothing.")  # fmt: skip
        return int(num_blocks)

    def determine_num_talker_kv_blocks(self) -> int:
        """The speech stage's KV pool (0 when the model does not speak): its own memory when
        given, else that many blocks with ``num_blocks_override``, else a quarter of the KV
        budget."""
        talker = self.model_runner.talker_runner
        if talker is None:
            return 0
        cache = self.config.cache_config
        per_block = talker.kv_cache_bytes_per_block(self.kv_dtype)
        if cache.talker_kv_cache_memory_bytes is not None:
            return max(cache.talker_kv_cache_memory_bytes // per_block, 1)
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        return max(int(self._kv_budget_bytes() * _TALKER_KV_SHARE) // per_block, 1)

    def initialize_talker_kv_cache(self, num_blocks: int) -> None:
        self.num_talker_kv_blocks = num_blocks
        if self.model_runner.talker_runner is not None:
            self.model_runner.talker_runner.initialize_kv_cache(num_blocks, self.kv_dtype)

    def _thinker_kv_budget_bytes(self) -> int:
        talker_own = self.config.cache_config.talker_kv_cache_memory_bytes is not None
        shares = self.model_runner.talker_runner is not None and not talker_own
        return int(self._kv_budget_bytes() * (1.0 - _TALKER_KV_SHARE if shares else 1.0))

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        utilization = cache.gpu_memory_utilization
        if self.device.type != "cuda":
            if utilization is None:
                return default_cpu_kv_budget(get_tp_size())
            return cpu_kv_budget_for_utilization(utilization, get_tp_size())
        if self._gpu_kv_budget is None:
            peak = self.profile_peak_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            non_torch = max(total - free - torch.cuda.memory_reserved(self.device), 0)
            encoder_cache = 0
            if self.model_runner.encoder_runner is not None:
                elem = torch.empty((), dtype=self.dtype).element_size()
                hidden = self.hf_config.get_text_config().hidden_size
                encoder_cache = self.config.scheduler_config.encoder_cache_size * hidden * elem
            self._gpu_kv_budget = gpu_kv_budget(total, utilization or _GPU_MEMORY_FRACTION, peak,
                                                non_torch, encoder_cache)  # fmt: skip
            logger.info("Memory profile: peak %s in torch (weights, the largest step and media "
                        "item), %s outside it; KV budget %s", gib(peak), gib(non_torch),
                        gib(self._gpu_kv_budget))  # fmt: skip
        return self._gpu_kv_budget

    def profile_peak_bytes(self) -> int:
        """torch's peak allocation on the device over one run of the largest step and of the
        largest item of each modality the limits allow (weights included)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run(self.largest_media_items())
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    def largest_media_items(self) -> list[MultiModalFeatureSpec]:
        """One worst-case item per modality this deployment takes, processed as requests are
        (the processor's dummy inputs under --limit-mm-per-prompt and --mm-processor-kwargs)."""
        model_config, mm = self.config.model_config, self.config.multimodal_config
        if (
            mm.skip_mm_profiling
            or model_config.skip_tokenizer_init  # (media are refused: they need the tokenizer)
            or not MULTIMODAL_REGISTRY.supports_multimodal(model_config)
        ):
            return []
        processor = MULTIMODAL_REGISTRY.create_processor(
            model_config, get_tokenizer(model_config.tokenizer),
            limit_mm_per_prompt=mm.limit_mm_per_prompt, profile_sizes=mm.mm_profile_sizes,
            mm_processor_kwargs=mm.mm_processor_kwargs,
        )  # fmt: skip
        assert processor is not None
        items: list[MultiModalFeatureSpec] = []
        for modality, limit in processor.info.get_allowed_mm_limits().items():
            if limit != 0:
                items += processor.get_dummy_mm_inputs(model_config.max_model_len,
                                                       {modality: 1}).mm_features  # fmt: skip
        return items

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, self.kv_dtype)
        self.num_kv_blocks = num_blocks
        start = time.perf_counter()
        if self.model_runner.warm_up_kernels():
            logger.info("Compiled the JIT kernels in %.1f s", time.perf_counter() - start)
        calculating = self.config.cache_config.calculate_kv_scales
        if calculating and self.device.type == "cuda":
            logger.info("--calculate-kv-scales: decode steps run eagerly (captured graphs would "
                        "keep the scales from before the first step).")  # fmt: skip
        if not self.config.model_config.enforce_eager and not calculating:
            start = time.perf_counter()
            model_config = self.config.model_config
            self.graph_sizes = self.model_runner.capture_decode_graphs(
                model_config.cuda_graph_sizes, model_config.max_cudagraph_capture_size
            )
            if self.graph_sizes:
                logger.info("Captured decode graphs for %d batch sizes (1 to %d) in %.1f s",
                            len(self.graph_sizes), self.graph_sizes[-1],
                            time.perf_counter() - start)  # fmt: skip
            elif self.lora_manager is not None and self.device.type == "cuda":
                logger.info("LoRA: decode steps run eagerly (no CUDA graphs).")
        if self.rank == 0:
            info = self.model_info()
            logger.info(
                "Ready: %s in %s on %s; weights %s per worker, KV cache %s per worker "
                "(%d tokens in %d blocks of %d); loaded in %.1f s",
                info["architecture"], info["dtype"], info["device"], gib(info["weight_bytes"]),
                gib(info["kv_cache_bytes"]), info["num_kv_tokens"], num_blocks,
                self.config.cache_config.block_size, info["load_seconds"],
            )  # fmt: skip

    def model_info(self) -> dict[str, Any]:
        """What this worker loaded and allocated (plain values: it crosses processes)."""
        if "weights" in self.sleeping:
            raise ValueError("The model sleeps (its weights were released): wake_up() first.")
        block_size = self.config.cache_config.block_size
        return {
            "architecture": self.config.model_config.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "weight_bytes": self.weight_bytes,
            "lora_slot_bytes": self.lora_manager.slot_bytes if self.lora_manager else 0,
            "lora_layers": self.lora_manager.kernels() if self.lora_manager else {},
            "kv_cache_bytes": self.num_kv_blocks
            * self.model_runner.kv_cache_bytes_per_block(self.kv_dtype),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "num_kv_tokens": self.num_kv_blocks * block_size,
            "load_seconds": self.load_seconds,
            "layer_kernels": dict(self.backend_report.placements),
            "attention_backends": dict(self.attention_backends),
            "mm_encoder_attn_backend": self.encoder_attention,
            "cuda_graph_sizes": list(self.graph_sizes),
            "cuda_graph_replays": (
                graphs.num_replays if (graphs := self.model_runner.decode_graphs) else 0
            ),
        }

    # ---- sleep mode (vLLM's) ------------------------------------------------------------------
    def sleep(self, level: int) -> list[str]:
        """Release the KV cache and, at level 2 (at level 1 too on a GPU, as nothing here keeps
        them in host memory), the weights; ``wake_up`` rebuilds what was released (weights
        read again from ``weights_path``)."""
        released = {"kv_cache", "weights"} if level == 2 or self.device.type == "cuda" else {
            "kv_cache"}  # fmt: skip
        if "weights" in released - self.sleeping:
            del self.model_runner, self.lora_manager  # (every reference to the model)
        elif "kv_cache" in released - self.sleeping:
            self.model_runner.release_caches()
        self.sleeping |= released
        release_device_memory(self.device)
        return sorted(self.sleeping)

    def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Restore what ``sleep`` released of ``tags`` ("weights", "kv_cache"; None: both):
        the weights read again (a new model, whose layers get the KV cache once it wakes)."""
        wanted = self.sleeping & set(tags if tags is not None else ("weights", "kv_cache"))
        if "weights" in wanted:
            self._load_model()
            self.sleeping -= {"weights"}
        elif "weights" in self.sleeping and "kv_cache" in wanted:
            raise ValueError("wake_up(tags=['kv_cache']) needs the weights awake first.")
        if "kv_cache" in wanted:
            self.initialize_kv_cache(self.num_kv_blocks)
            self.initialize_talker_kv_cache(self.num_talker_kv_blocks)
            self.sleeping -= {"kv_cache"}
        return sorted(self.sleeping)

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Read the weights again, from ``weights_path`` (a checkpoint of this model's
        architecture and config; None: where they were read from), rebuilding the model and
        its KV cache: vLLM's ``collective_rpc("reload_weights")``. A checkpoint whose tensors
        differ in name, shape or dtype is refused before anything is dropped."""
        if weights_path is not None:
            try:
                new = checkpoint_tensor_shapes(weights_path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"reload_weights: {exc}") from None
            if new != checkpoint_tensor_shapes(self.weights_path):
                raise ValueError(f"reload_weights: {weights_path} is no checkpoint of this "
                                 "model (tensor names, shapes or dtypes differ).")  # fmt: skip
            self.weights_path = weights_path
        if "weights" not in self.sleeping:
            del self.model_runner, self.lora_manager
            release_device_memory(self.device)
        self._load_model()
        self.sleeping.clear()
        self.initialize_kv_cache(self.num_kv_blocks)
        self.initialize_talker_kv_cache(self.num_talker_kv_blocks)

    def rpc(self, method: str, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, bool, list[str]]:
        """A ``collective_rpc`` call: this worker's method (or its extension's) by name; not
        those the engine core calls itself, which keeps their state (steps, sleep, adapters).
        Returns the result, whether the call read the weights again (the engine core's prefix
        cache then holds blocks of the old ones), and what sleeps now."""
        if method.startswith("_") or not callable(getattr(self, method, None)):
            raise ValueError(f"collective_rpc: the worker has no method {method!r}.")
        if method in _ENGINE_CALLS:
            raise ValueError(f"collective_rpc: the engine core calls {method} itself (sleep and "
                             "wake_up, steps and adapters have their own calls).")  # fmt: skip
        loads = self.weight_loads
        result = getattr(self, method)(*args, **kwargs)
        return result, self.weight_loads != loads, sorted(self.sleeping)

    def add_lora(self, lora: LoRARequest) -> None:
        if self.lora_manager is None:  # the engine core refuses adapters first
            raise RuntimeError("This worker has no LoRA slots.")
        self.lora_manager.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora_manager is not None:
            self.lora_manager.remove(lora_int_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def dispatch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.model_runner.dispatch(scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.launch(scheduler_output)

    def dispatch_sampling(self, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        return self.model_runner.sample(grammar_bitmask)

    def start_step_timing(self) -> None:
        self.model_runner.step_timer.start()

    def profile(self, is_start: bool) -> None:
        """Start or stop the torch profiler (``WorkerProfiler``)."""
        if is_start:
            self.profiler.start()
        else:
            self.profiler.stop()

    def step_timings(self) -> dict[str, dict[str, float]]:
        return self.model_runner.step_timer.snapshot()
