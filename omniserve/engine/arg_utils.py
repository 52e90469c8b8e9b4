"""EngineArgs: the flat set of user-facing knobs (vLLM's names), turned into an ``OmniConfig``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omniserve import envs
from omniserve.config import (
    GENERATION_SETTINGS,
    CacheConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ObservabilityConfig,
    OmniConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from omniserve.config.hf_overrides import overrides_of
from omniserve.engine.arg_checks import TASK_RUNNERS
from omniserve.engine.arg_flags import add_engine_flags
from omniserve.engine.compilation_config import GraphSettings, read_compilation_config
from omniserve.field_types import check_types
from omniserve.plugins import run_plugin_file
from omniserve.sampling_params import SEED_MAX, SEED_MIN

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def json_arg(name: str, value: dict | str | None) -> dict:
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--{name.replace('_', '-')} must be JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"--{name.replace('_', '-')} must be a JSON object.")
    return parsed


def _check_sampling_defaults(model_config: ModelConfig) -> None:
    """Overridden defaults that no request could run with fail at start, not in every request."""
    from omniserve.sampling_params import SamplingParams

    overrides = model_config.override_generation_config
    try:
        SamplingParams(**{GENERATION_SETTINGS[key]: value for key, value in overrides.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--override-generation-config: {exc}") from exc


def _class_path(spec: str | type) -> str:
    """A class setting as the ``module.Class`` path the engine core's process imports (vLLM's
    settings take the class itself too)."""
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, type) or "<locals>" in spec.__qualname__:
        raise ValueError(f"{spec!r}: give a class importable from its module (module.Class).")
    return f"{spec.__module__}:{spec.__qualname__}"


MMLimits = dict[str, int | dict[str, int]]


def _limits(value: MMLimits | str | None) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """``--limit-mm-per-prompt`` -> (counts, profile sizes): JSON of a count or, in vLLM's
    object form, ``{"count": 2, "width": 512, ...}`` per modality; or ``image=2,video=1``."""
    if isinstance(value, str) and re.fullmatch(r"\s*\w+=\d+\s*(,\s*\w+=\d+\s*)*", value):
        return {k.strip(): int(n) for k, n in (pair.split("=") for pair in value.split(","))}, {}
    counts, sizes = {}, {}
    for modality, limit in json_arg("limit_mm_per_prompt", value).items():
        if isinstance(limit, dict):
            sizes[modality] = {name: size for name, size in limit.items() if name != "count"}
            limit = limit.get("count")
            if not sizes[modality]:
                del sizes[modality]
        if limit is not None:
            counts[modality] = limit
    return counts, sizes


def parse_bytes(value: str | float | None, name: str = "size") -> int | None:
    """ "4GiB", "512MiB", "1e9" or a number -> bytes; ``name`` is the setting's, for errors."""
    if value is None:
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        try:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else None
        except (ValueError, KeyError):
            number = None
    else:
        number = value
    if number is None or not math.isfinite(number):
        raise ValueError(f"--{name.replace('_', '-')}: cannot read {value!r} as a size in bytes "
                         "(e.g. 4GiB, 512MiB, 1e9).")  # fmt: skip
    return int(number)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    attention_backend: str = field(default_factory=envs.attention_backend)
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    """vLLM's newer spelling of a one-size ``cuda_graph_sizes``."""
    compilation_config: dict[str, Any] | str | int | None = None
    """vLLM's (``engine/compilation_config.py``: its CUDA-graph keys take effect)."""
    optimization_level: int | None = None
    """vLLM's -O0..-O3: 0 captures no decode graphs."""
    seed: int | None = 0
    max_model_len: int | None = None
    served_model_name: str | list[str] | None = None
    """The name clients use (a list: the first; the server accepts them all)."""
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None
    hf_overrides: dict[str, Any] | str | Callable[[Any], Any] | None = None
    """config.json keys set over the checkpoint's (a dict or its JSON text), or vLLM's function
    of the transformers config returning it changed (read once, as the keys it changed)."""
    hf_config_path: str | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    kv_cache_memory: str | float | None = None
    talker_kv_cache_memory: str | float | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    logits_processors: list[str | type] | None = None
    """Custom logits processors (``omniserve.logits_processor``): classes, or their
    ``module:Class`` names."""
    use_tqdm_on_load: bool = True
    enable_prompt_embeds: bool = False
    skip_tokenizer_init: bool = False
    enable_sleep_mode: bool = False
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    """vLLM's older ``--task`` (``TASK_RUNNERS``): the runner it names."""
    pooler_config: dict[str, Any] | str | None = None
    enable_prefix_caching: bool | None = True  # None (vLLM's unset): the default, on
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = True  # None: on
    long_prefill_token_threshold: int = 0
    prefix_caching_hash_algo: str = "sha256"
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    stream_interval: int = 1
    scheduler_cls: str | type = ""
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = False  # None: off
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    disable_chunked_mm_input: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_extension_cls: str = ""
    worker_cls: str | type = ""
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    limit_mm_per_prompt: MMLimits | str | None = None
    mm_processor_kwargs: dict[str, object] | str | None = None
    mm_processor_cache_gb: float = 4.0
    disable_mm_preprocessor_cache: bool = False
    """vLLM's older spelling of ``mm_processor_cache_gb=0``."""
    skip_mm_profiling: bool = False
    video_pruning_rate: float | None = None
    language_model_only: bool = False
    mm_encoder_tp_mode: str = "weights"
    enable_multimodal_encoder_data_parallel: bool = False
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    allow_private_media_urls: bool = False
    media_io_kwargs: dict[str, dict[str, object]] | str | None = None
    enable_mm_embeds: bool = False
    mm_encoder_attn_backend: str = "auto"
    disable_audio_output: bool = False
    disable_sliding_window: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    default_mm_loras: dict[str, str] | str | None = None
    """vLLM's: modality -> the LoRA adapter requests with that modality run with by default."""
    speculative_config: dict[str, Any] | str | None = None
    structured_outputs_config: dict[str, Any] | str | None = None
    kv_events_config: dict[str, Any] | str | None = None
    otlp_traces_endpoint: str | None = None
    reasoning_parser: str | None = None
    """vLLM's: the model thinks between this parser's tags first (grammars apply after them;
    the server splits the thinking off answers)."""
    reasoning_parser_plugin: str | None = None
    """A file that registers reasoning parsers (``register_reasoning_parser``), run before
    ``reasoning_parser`` is looked up."""

    def __post_init__(self) -> None:
        import torch  # (only here: the CLI parses its flags without it)

        if isinstance(self.dtype, torch.dtype):  # as vLLM takes one
            self.dtype = str(self.dtype).removeprefix("torch.")
        check_types(self)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")

    def create_config(self, *, default_batched_tokens: int = 8192) -> OmniConfig:
        graphs = read_compilation_config(self.compilation_config, self.optimization_level)
        graph_sizes, graph_max = self._graph_sizes(graphs)
        model_config = ModelConfig.from_path(
            self.model,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            quantization=self.quantization,
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager or graphs.eager,
            cuda_graph_sizes=graph_sizes,
            max_cudagraph_capture_size=graph_max,
            seed=self.seed,
            served_model_name=self._served_name(),
            generation_config=self.generation_config,
            hf_config_path=self.hf_config_path or "",
            hf_overrides=overrides_of(self.hf_config_path or self.model, self.hf_overrides)
            if callable(self.hf_overrides)
            else json_arg("hf_overrides", self.hf_overrides),
            override_generation_config=json_arg(
                "override_generation_config", self.override_generation_config
            ),
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            use_tqdm_on_load=self.use_tqdm_on_load,
            enable_prompt_embeds=self.enable_prompt_embeds,
            skip_tokenizer_init=self.skip_tokenizer_init,
            enable_sleep_mode=self.enable_sleep_mode,
            runner=self._runner(),
            pooler_config=PoolerConfig.resolve(
                self.model, json_arg("pooler_config", self.pooler_config)
            ),
            disable_audio_output=self.disable_audio_output,
            disable_sliding_window=self.disable_sliding_window,
        )
        model_config = self._with_logits_processors(model_config)
        if self.reasoning_parser_plugin:
            run_plugin_file(self.reasoning_parser_plugin, "--reasoning-parser-plugin")
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = (
                default_batched_tokens
                if self.enable_chunked_prefill is not False
                else max(default_batched_tokens, max_len)
            )
        limits, profile_sizes = _limits(self.limit_mm_per_prompt)
        if self.language_model_only:
            from omniserve.multimodal.parse import MODALITIES

            if on := {m: n for m, n in limits.items() if n}:
                raise ValueError(f"--language-model-only turns every modality off, but "
                                 f"--limit-mm-per-prompt allows {on}.")  # fmt: skip
            limits = dict.fromkeys(MODALITIES, 0)
        config = OmniConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                cache_dtype=self.kv_cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
                kv_cache_memory_bytes=parse_bytes(self.kv_cache_memory, "kv_cache_memory"),
                talker_kv_cache_memory_bytes=parse_bytes(
                    self.talker_kv_cache_memory, "talker_kv_cache_memory"
                ),
                num_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching is not False,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill is not False,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_num_partial_prefills=self.max_num_partial_prefills,
                max_long_partial_prefills=self.max_long_partial_prefills,
                stream_interval=self.stream_interval,
                scheduler_cls=_class_path(self.scheduler_cls),
                policy=self.scheduling_policy,
                async_scheduling=bool(self.async_scheduling),
                # Default: as large as the step's token budget, and never below 8192 embeddings.
                max_num_encoder_input_tokens=max(8192, batched)
                if self.max_num_encoder_input_tokens is None
                else self.max_num_encoder_input_tokens,
                encoder_cache_size=max(8192, batched)
                if self.encoder_cache_size is None
                else self.encoder_cache_size,
                disable_chunked_mm_input=self.disable_chunked_mm_input,
            ),
            multimodal_config=MultiModalConfig(
                limit_mm_per_prompt=limits,
                mm_profile_sizes=profile_sizes,
                mm_processor_kwargs=json_arg("mm_processor_kwargs", self.mm_processor_kwargs),
                mm_processor_cache_gb=0.0
                if self.disable_mm_preprocessor_cache
                else self.mm_processor_cache_gb,
                skip_mm_profiling=self.skip_mm_profiling,
                video_pruning_rate=self.video_pruning_rate or 0.0,
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=tuple(self.allowed_media_domains or ()),
                allow_private_media_urls=self.allow_private_media_urls,
                media_io_kwargs=json_arg("media_io_kwargs", self.media_io_kwargs),
                enable_mm_embeds=self.enable_mm_embeds,
                mm_encoder_attn_backend=self.mm_encoder_attn_backend,
                mm_encoder_tp_mode="data"
                if self.enable_multimodal_encoder_data_parallel
                else self.mm_encoder_tp_mode,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                worker_extension_cls=self.worker_extension_cls,
                worker_cls=_class_path(self.worker_cls),
                enable_expert_parallel=self.enable_expert_parallel,
                expert_placement_strategy=self.expert_placement_strategy,
            ),
            lora_config=self._lora_config(),
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config is not None
            else None,
            structured_outputs_config=StructuredOutputsConfig.from_dict(
                json_arg("structured_outputs_config", self.structured_outputs_config),
                self.reasoning_parser,
            ),
            kv_events_config=KVEventsConfig.from_dict(
                json_arg("kv_events_config", self.kv_events_config)
            ),
            observability_config=ObservabilityConfig(self.otlp_traces_endpoint),
        )
        # Settings that only fail where they are used fail here, at start: --media-io-kwargs and
        # --allowed-local-media-path (numpy, PIL, av), --device (torch), the worker extension.
        from omniserve.engine.core import scheduler_class
        from omniserve.multimodal.media import MediaConnector, media_config
        from omniserve.worker.worker import resolve_device, worker_class

        MediaConnector(media_config(config.multimodal_config))
        resolve_device(model_config.device)
        worker_class(config.parallel_config)
        scheduler_class(config.scheduler_config.scheduler_cls)
        _check_sampling_defaults(model_config)
        return config

    def _lora_config(self) -> LoRAConfig | None:
        """``--enable-lora``'s settings; each ``--default-mm-loras`` adapter is read here, so
        one that cannot run stops start-up."""
        defaults = json_arg("default_mm_loras", self.default_mm_loras)
        if not self.enable_lora:
            if defaults:
                raise ValueError("--default-mm-loras needs --enable-lora.")
            return None
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, defaults)
        from omniserve.lora.adapter import read_adapter
        from omniserve.lora.request import default_mm_lora_requests
        from omniserve.multimodal.parse import MODALITIES

        for modality, lora in default_mm_lora_requests(config).items():
            if modality not in MODALITIES:
                raise ValueError(f"--default-mm-loras: {modality!r} is no modality (one of "
                                 f"{', '.join(MODALITIES)}).")  # fmt: skip
            if not isinstance(lora.lora_path, str):
                raise ValueError(f"--default-mm-loras: {modality}'s adapter must be a path.")
            read_adapter(lora, self.max_lora_rank)
        return config

    def _with_logits_processors(self, model_config: ModelConfig) -> ModelConfig:
        """``model_config`` with the processors' classes: those named (importing them here, so
        a bad name stops start-up), then the entry points' where processors run (vLLM loads
        none for pooling or speculative decoding; the named ones are refused there)."""
        from omniserve.logits_processor import resolve_logits_processors

        runs = model_config.runner == "generate" and self.speculative_config is None
        classes = resolve_logits_processors(self.logits_processors or [], entry_points=runs)
        if not classes:
            return model_config
        return dataclasses.replace(model_config, logits_processors=classes)

    def _graph_sizes(self, graphs: GraphSettings) -> tuple[tuple[int, ...], int | None]:
        """(the captured sizes, the ladder's top) from the flags that set them: several
        --cuda-graph-sizes or ``cudagraph_capture_sizes`` are the sizes; one
        --cuda-graph-sizes, --max-cudagraph-capture-size or ``max_cudagraph_capture_size``
        the top."""
        sizes = self.cuda_graph_sizes or []
        if any(size < 1 for size in sizes):
            raise ValueError(f"--cuda-graph-sizes must be batch sizes >= 1, got {sizes}.")
        given = [
            (name, value) for name, value in (
                ("--cuda-graph-sizes", tuple(sizes) if len(sizes) > 1 else None),
                ("--cuda-graph-sizes", sizes[0] if len(sizes) == 1 else None),
                ("--max-cudagraph-capture-size", self.max_cudagraph_capture_size),
                ("--compilation-config cudagraph_capture_sizes", graphs.sizes),
                ("--compilation-config max_cudagraph_capture_size", graphs.max_size),
            ) if value is not None
        ]  # fmt: skip
        if len(given) > 1:
            raise ValueError(f"{' and '.join(name for name, _ in given)} are one setting: give "
                             "one of them.")  # fmt: skip
        value = given[0][1] if given else ()
        return (value, None) if isinstance(value, tuple) else ((), value)

    def _served_name(self) -> str:
        names = self.served_model_name
        if isinstance(names, list):
            if not names:
                raise ValueError("served_model_name: an empty list names nothing.")
            return names[0]
        return names or ""

    def _runner(self) -> str:
        """vLLM's --runner and --convert: any model here pools (its last hidden state), so
        ``--convert embed`` is what ``--runner pooling`` is."""
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"--runner must be auto, generate or pooling, not {self.runner!r}.")
        if self.convert not in ("auto", "none", "embed"):
            raise ValueError(f"--convert must be auto, none or embed, not {self.convert!r}.")
        if self.convert == "embed" and self.runner == "generate":
            raise ValueError("--convert embed makes an embedding model: use --runner pooling.")
        runner = "pooling" if self.convert == "embed" else self.runner  # auto: ModelConfig's
        if self.task in (None, "auto"):
            return runner
        if self.task not in TASK_RUNNERS:
            raise ValueError(f"--task must be one of {', '.join(TASK_RUNNERS)}, not "
                             f"{self.task!r}.")  # fmt: skip
        if runner not in ("auto", TASK_RUNNERS[self.task]):
            raise ValueError(f"--task {self.task} contradicts --runner {runner}.")
        logger.info("--task %s (vLLM's older flag) is --runner %s.", self.task,
                    TASK_RUNNERS[self.task])  # fmt: skip
        return TASK_RUNNERS[self.task]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The engine flags (``arg_flags``)."""
        return add_engine_flags(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
