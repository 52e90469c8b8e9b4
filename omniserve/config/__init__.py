"""One frozen config tree. Each component receives the narrowest sub-config it needs.

Values only known at run time (the number of KV blocks after profiling) are not patched in here;
they travel as separate results (see ``omniserve.worker.worker.KVCacheSpec``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from omniserve.config.by_value import ClassesByValue
from omniserve.config.hf_overrides import merged_overrides, set_overrides
from omniserve.config.kv_events import KVEventsConfig
from omniserve.config.lora import LoRAConfig
from omniserve.config.multimodal import MultiModalConfig
from omniserve.config.observability import ObservabilityConfig
from omniserve.config.pooler import PoolerConfig
from omniserve.config.quantization import QUANTIZATION_METHODS, QuantizationConfig
from omniserve.config.scheduler import SchedulerConfig
from omniserve.config.sliding_window import sliding_window, use_full_attention
from omniserve.config.speculative import SpeculativeConfig
from omniserve.config.speech import SpeechConfig, speech_of
from omniserve.config.structured_outputs import StructuredOutputsConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_CHOICES = (*_DTYPES, *_DTYPE_ALIASES)
"""What ``--dtype`` takes: the dtypes and vLLM's other names of them (half, float, ...)."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Local directory of a Hugging Face checkpoint (config.json, safetensors, tokenizer)."""
    architecture: str
    """The checkpoint's ``architectures[0]``; selects the model class through the registry."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    tokenizer: str
    """Directory of the tokenizer (defaults to ``model``)."""
    dtype: str = "auto"
    """"auto" (the checkpoint's dtype; fp32 where a CPU lacks native bf16, bf16 for an fp32
    checkpoint on a GPU), "float32", "bfloat16" or "float16"."""
    device: str = "auto"
    """"auto" (CUDA when present), "cpu" or "cuda"."""
    attention_backend: str = "auto"
    """Paged-attention backend (``attention/selector.py``): "auto" (Triton on CUDA, the CPU
    backend's C decode kernel on CPU), "triton" or "torch"."""
    enforce_eager: bool = False
    """Run decode steps eagerly instead of replaying captured CUDA graphs."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """The decode batch sizes captured (vLLM's several --cuda-graph-sizes, or
    ``cudagraph_capture_sizes``); (): vLLM's ladder (``cuda_graph.graph_batch_sizes``)."""
    max_cudagraph_capture_size: int | None = None
    """The ladder's top (vLLM's one --cuda-graph-sizes value); None: max_num_seqs."""
    seed: int | None = 0
    """Seed for the engine's global RNG (requests may bring their own); None: not seeded."""
    served_model_name: str = ""
    """The name clients use; defaults to ``model``."""
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (vLLM's --max-logprobs; -1: no cap but the
    vocabulary's size)."""
    use_tqdm_on_load: bool = True
    """A progress bar over the weights as they load (on a terminal)."""
    logprobs_mode: str = "raw_logprobs"
    """What sampled tokens' logprobs report (vLLM's ``LOGPROBS_MODES``): the model's own
    distribution ("raw_*"), or the one the token was drawn from ("processed_*": after the token
    rules, penalties, temperature, min-p, top-k and top-p); as log-probabilities or as logits.
    Prompt logprobs are always the model's own."""
    logits_processors: tuple[type, ...] = ()
    """Custom logits processor classes (``omniserve.logits_processor``), each built in every
    worker: those the settings name, then the ``omniserve.logits_processors`` entry points'."""
    enable_prompt_embeds: bool = False
    """Accept prompts given as embeddings (vLLM's --enable-prompt-embeds)."""
    enable_sleep_mode: bool = False
    """Allow ``sleep`` / ``wake_up`` (vLLM's): release the KV cache, and the weights, while the
    engine is idle, to give their memory to another process (a trainer)."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer (vLLM's): prompts come as token ids (or embeddings), outputs are token
    ids; what needs text (text prompts, chat, stop strings, ...) is refused naming it."""
    runner: str = "generate"
    """"generate", or "pooling": the model answers embedding (or, a sequence classifier,
    classification) requests only (vLLM's --runner; ``from_path`` resolves "auto")."""
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    hf_config_path: str = ""
    """vLLM's ``--hf-config-path``: a directory whose config.json is read in place of the
    checkpoint's ("": the checkpoint's own); weights, tokenizer and processor stay the model's."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """vLLM's ``--hf-overrides``: config.json keys set over the checkpoint's (a nested config,
    ``text_config`` and the like, merged key by key), e.g. ``architectures``."""
    generation_config: str = "auto"
    """Where the default sampling settings come from, as vLLM's ``--generation-config``:
    "auto" the checkpoint's generation_config.json, "vllm" none (OpenAI's defaults), or a
    directory holding a generation_config.json."""
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    """generation_config.json keys set over the file's (with "vllm": the only ones), as vLLM's
    ``--override-generation-config``."""
    disable_audio_output: bool = False
    """Load a full omni checkpoint's thinker alone (no talker, no vocoder): text output only."""
    disable_sliding_window: bool = False
    """Sliding-window layers attend fully, max_model_len capped at the window (vLLM's)."""
    speech: SpeechConfig | None = None
    """Set from config.json when the model speaks (and audio output is not disabled)."""
    no_speech_reason: str = ""
    """Why ``speech`` is None, for the error an audio request gets."""
    quantization: str | None = None
    """vLLM's ``--quantization``: the method the checkpoint must be quantized with (None: read
    it from the checkpoint)."""
    quantization_config: QuantizationConfig | None = None
    """Set from config.json's ``quantization_config`` when the checkpoint is quantized."""

    @staticmethod
    def from_path(
        model: str,
        *,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
        **kwargs: Any,
    ) -> ModelConfig:
        """Read config.json and resolve the derived fields; raise a precise error if unusable."""
        path = Path(model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"Model path {model!r} is not a directory. omniserve loads Hugging Face "
                "checkpoints "
                "from a local directory (no hub downloads)."
            )
        config_file = Path(kwargs.get("hf_config_path") or path).expanduser() / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} is missing: not a Hugging Face checkpoint dir.")
        hf_config = merged_overrides(
            json.loads(config_file.read_text()), kwargs.get("hf_overrides") or {}
        )
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{config_file} names no 'architectures'; cannot pick a model class.")
        derived_len = _derive_max_model_len(hf_config)
        requested = max_model_len
        if max_model_len is None:
            max_model_len = derived_len
        elif derived_len is not None and max_model_len > derived_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's maximum "
                f"({derived_len}, from config.json)."
            )
        if max_model_len is None:
            raise ValueError(f"{config_file} gives no max_position_embeddings; pass max_model_len.")
        kwargs["runner"] = _runner_of(architectures[0], kwargs.get("runner", "auto"))
        speech, no_speech_reason = speech_of(
            hf_config, architectures[0], bool(kwargs.get("disable_audio_output")), str(path)
        )
        config = ModelConfig(
            model=str(path),
            architecture=architectures[0],
            speech=speech,
            no_speech_reason=no_speech_reason,
            quantization_config=_quantization_of(hf_config, kwargs.get("quantization"), path),
            max_model_len=max_model_len,
            tokenizer=str(Path(tokenizer).expanduser()) if tokenizer else str(path),
            **kwargs,
        )
        window = None
        if config.disable_sliding_window:
            window = sliding_window(_transformers_config(config))
        if window is None or config.max_model_len <= window:
            return config
        if requested is not None:
            raise ValueError(f"max_model_len={max_model_len} exceeds the sliding window "
                             f"({window}) that --disable-sliding-window caps it at.")  # fmt: skip
        return dataclasses.replace(config, max_model_len=window)

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's transformers config (local files only), loaded once per process and
        shared by the processor, the multimodal context and the worker."""
        config = _transformers_config(self)
        if self.disable_sliding_window:
            use_full_attention(config)
        if getattr(config, "classifier_from_token", None) is not None:
            _labels_from_tokens(config, self.tokenizer)
        return config

    @property
    def num_labels(self) -> int | None:
        """A sequence classifier's number of labels (None: the model is no classifier)."""
        return self.hf_config.num_labels if is_classifier(self.architecture) else None

    @property
    def pooling_task(self) -> str:
        """A pooling request's task when it names none: "classify" on a sequence classifier,
        else "embed"."""
        return "classify" if is_classifier(self.architecture) else "embed"

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks the model answers: the classify tasks need a sequence classifier's
        head."""
        if is_classifier(self.architecture):
            return ("embed", "classify", "token_embed", "token_classify")
        return ("embed", "token_embed")

    def cross_encodes(self) -> bool:
        """Whether scoring runs the model as a cross-encoder (a one-label classifier) rather than
        comparing embeddings; ``ValueError`` for a classifier of more labels, which scores
        neither way."""
        labels = self.num_labels
        if labels is not None and labels != 1:
            raise ValueError(
                f"This model classifies into {labels} labels; scoring needs an embedding model "
                "or a one-label classifier (a cross-encoder)."
            )
        return labels is not None

    def __post_init__(self) -> None:
        dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        object.__setattr__(self, "dtype", dtype)  # normalising an alias, not patching state
        object.__setattr__(self, "logits_processors", ClassesByValue(self.logits_processors))
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                f"{self.attention_backend!r}."
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 (or -1: no cap), got {self.max_logprobs}.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}."
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {sorted(QUANTIZATION_METHODS)}, got "
                f"{self.quantization!r}."
            )
        unknown = self.override_generation_config.keys() - GENERATION_SETTINGS.keys()
        if unknown:
            raise ValueError(
                f"--override-generation-config: {sorted(unknown)} are not among the settings "
                f"taken from a generation config: {sorted(GENERATION_SETTINGS)}."
            )
        if self.generation_config not in ("auto", "vllm"):
            file = Path(self.generation_config).expanduser() / GENERATION_CONFIG_FILE
            if not file.is_file():
                raise ValueError(
                    f"--generation-config {self.generation_config!r}: no "
                    f"{GENERATION_CONFIG_FILE} there (or use 'auto' or 'vllm')."
                )

    def default_sampling_params(self) -> dict[str, Any]:
        """The sampling settings the model's creator recommends, for fields a request omits:
        the ``SamplingParams`` names of what generation_config.json (and the overrides) set
        among temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
        ``max_tokens``)."""
        settings: dict[str, Any] = {}
        folder = self.model if self.generation_config == "auto" else self.generation_config
        file = Path(folder).expanduser() / GENERATION_CONFIG_FILE
        if self.generation_config != "vllm" and file.is_file():
            try:
                settings = json.loads(file.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file} is not valid JSON: {exc}") from exc
        settings.update(self.override_generation_config)
        return {
            name: settings[key]
            for key, name in GENERATION_SETTINGS.items()
            if settings.get(key) is not None
        }

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_SETTINGS = {  # generation_config.json key -> SamplingParams field (vLLM's set)
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _quantization_of(
    hf_config: dict, requested: str | None, path: Path
) -> QuantizationConfig | None:
    """The checkpoint's quantization, checked against ``--quantization``."""
    stored = hf_config.get("quantization_config")
    if stored is None:
        if requested is not None:
            raise ValueError(
                f"--quantization {requested}: {path} is not a quantized checkpoint (its "
                "config.json has no quantization_config); omniserve does not quantize at load."
            )
        return None
    return QuantizationConfig.from_hf(stored, requested)


def is_classifier(architecture: str) -> bool:
    """A ``*ForSequenceClassification`` architecture: it scores labels, and writes no text."""
    return architecture.endswith("ForSequenceClassification")


def _runner_of(architecture: str, runner: str) -> str:
    """vLLM's --runner auto: a sequence classifier pools, any other model generates."""
    if not is_classifier(architecture):
        return "generate" if runner == "auto" else runner
    if runner == "generate":
        raise ValueError(
            f"--runner generate: {architecture} is a sequence classifier; it answers "
            "classification and scoring requests only (--runner pooling)."
        )
    return "pooling"


SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
"""vLLM's ways to make a classifier's head of a causal LM's rows of ``classifier_from_token``."""


def _labels_from_tokens(config: Any, tokenizer_dir: str) -> None:
    """vLLM's ``classifier_from_token`` (with ``method``, or ``is_original_qwen3_reranker``):
    the tokens' ids (``classifier_token_ids``, for the model's loading) and the number of
    labels, one for the 2-way softmax of two tokens, else one per token."""
    from transformers import AutoTokenizer

    tokens = config.classifier_from_token
    method = getattr(config, "method", None) or (
        "from_2_way_softmax"
        if getattr(config, "is_original_qwen3_reranker", False)
        else "no_post_processing"
    )
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"method: {method!r} is not one of {', '.join(SEQ_CLS_METHODS)}.")
    wanted = 2 if method == "from_2_way_softmax" else len(tokens or [])
    if not isinstance(tokens, list) or not tokens or len(tokens) != wanted:
        raise ValueError(
            "classifier_from_token must list the tokens whose LM-head rows make the classifier "
            f"(two for {method!r}), not {tokens!r}."
        )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    for token, token_id in zip(tokens, ids, strict=True):
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the vocabulary.")
    config.method = method
    config.classifier_token_ids = ids
    config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)


def _transformers_config(model_config: ModelConfig) -> Any:
    """The checkpoint's transformers config (or ``hf_config_path``'s) with the overrides set
    (local files only); its ``_name_or_path`` the checkpoint's, where models find their other
    files (an omni model's voices)."""
    from transformers import AutoConfig

    source = model_config.hf_config_path or model_config.model
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    set_overrides(config, model_config.hf_overrides)
    config._name_or_path = model_config.model
    return config


def _derive_max_model_len(hf_config: dict) -> int | None:
    # Multimodal checkpoints nest the decoder config (text_config, thinker_config.text_config).
    for cfg in (
        hf_config,
        hf_config.get("text_config") or {},
        (hf_config.get("thinker_config") or {}).get("text_config") or {},
    ):
        if cfg.get("max_position_embeddings"):
            return int(cfg["max_position_embeddings"])
    return None


EXPERT_PLACEMENTS = ("linear", "round_robin")
"""vLLM's --expert-placement-strategy choices (``omniserve.layers.fused_moe.local_experts``)."""
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's ``--kv-cache-dtype`` values here (``attention.base.kv_cache_torch_dtype``)."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    cache_dtype: str = "auto"
    """vLLM's ``--kv-cache-dtype`` (``KV_CACHE_DTYPES``): "auto" (the model's dtype), or an
    fp8 format for the KV caches (the thinker's and a talker's) at half of bf16's bytes ("fp8" is
    fp8_e4m3)."""
    calculate_kv_scales: bool = False
    """vLLM's: an fp8 cache's scales from each layer's first real step, not the checkpoint's."""
    kv_cache_memory_bytes: int | None = None
    """Memory for the KV cache across all layers; None: a device-dependent default."""
    talker_kv_cache_memory_bytes: int | None = None
    """A speaking model's talker KV pool; None: a quarter of the KV budget (the thinker gets the
    rest), or ``num_blocks_override`` blocks when that is set."""
    num_blocks_override: int | None = None
    """Exact number of KV blocks (tests use it to force preemption)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM's: how the blocks' keys are hashed (``omniserve.core.block_hash``)."""
    gpu_memory_utilization: float | None = None
    """vLLM's: the share of the device's memory (the machine's, on a CPU) this engine may use
    for weights, KV cache and activations; the KV cache gets what the rest leaves. None: 0.9 on a
    GPU, half the memory available after loading on a CPU."""

    def __post_init__(self) -> None:
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.cache_dtype!r}.")  # fmt: skip
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}.")  # fmt: skip
        if self.calculate_kv_scales and self.cache_dtype == "auto":
            raise ValueError("calculate_kv_scales scales an fp8 KV cache: it needs "
                             "--kv-cache-dtype fp8 (or fp8_e4m3, fp8_e5m2).")  # fmt: skip
        for name in ("kv_cache_memory_bytes", "talker_kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive.")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError("num_blocks_override must be >= 1.")

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that hold ``num_tokens`` tokens (a sequence's block-table width)."""
        return blocks_for(num_tokens, self.block_size)

    def check_holds_one_sequence(self, num_blocks: int, max_model_len: int) -> None:
        """Refuse a pool smaller than one max_model_len sequence: a request that outgrows the
        whole pool would preempt itself forever."""
        needed = self.blocks_for(max_model_len)
        if num_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than "
                f"one max_model_len={max_model_len} sequence needs ({needed}). "
                "Raise --kv-cache-memory or lower --max-model-len."
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    """"uni" (one worker in process), "mp" (a process per rank, this machine) or "ray" (Ray
    actors, any machine of the cluster); None: "uni" for one rank, else "mp"."""
    worker_extension_cls: str = ""
    """vLLM's: ``module.Class`` (or ``module:Class``) whose methods every worker also has, for
    ``collective_rpc`` to call by name ("": none)."""
    worker_cls: str = ""
    """vLLM's: ``module.Class``, a subclass of ``omniserve.worker.worker.Worker`` every rank runs
    ("": that class)."""
    enable_expert_parallel: bool = False
    """vLLM's: the tensor-parallel ranks of an engine hold whole MoE experts, each its share,
    rather than a slice of every expert (``omniserve.layers.fused_moe``)."""
    expert_placement_strategy: str = "linear"
    """vLLM's: which experts a rank holds: "linear", a contiguous block; "round_robin"."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.expert_placement_strategy not in EXPERT_PLACEMENTS:
            raise ValueError(f"expert_placement_strategy must be one of {EXPERT_PLACEMENTS}, "
                             f"got {self.expert_placement_strategy!r}.")  # fmt: skip
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'uni', 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_placement(self) -> str | None:
        """How the MoE experts are placed on the ranks (None: sliced by tensor parallelism)."""
        return self.expert_placement_strategy if self.enable_expert_parallel else None


@dataclass(frozen=True)
class OmniConfig:
    """The root: every sub-config of one engine."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    lora_config: LoRAConfig | None = None
    """None: LoRA is off (requests naming an adapter are refused)."""
    speculative_config: SpeculativeConfig | None = None
    """None: one token per request per step."""
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    kv_events_config: KVEventsConfig | None = None
    """None: the prefix cache's changes are not published."""
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self.speculative_config.check_scheduling(self.scheduler_config.async_scheduling)
        if self.model_config.logits_processors:
            # (vLLM's rules: a processor's batch has one row per request, and pooling samples
            # nothing a processor could steer.)
            if self.speculative_config is not None:
                raise ValueError("logits_processors: custom logits processors do not run with "
                                 "speculative decoding (--speculative-config).")  # fmt: skip
            if self.model_config.runner == "pooling":
                raise ValueError("logits_processors: pooling models take no custom logits "
                                 "processors.")  # fmt: skip
        if (
            self.model_config.skip_tokenizer_init
            and self.structured_outputs_config.reasoning_parser
        ):
            raise ValueError("--reasoning-parser reads the model's text: it needs the tokenizer "
                             "that --skip-tokenizer-init leaves unloaded.")  # fmt: skip
