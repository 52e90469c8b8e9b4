"""EngineArgs: the flat set of user-facing knobs (vLLM's names), turned into an ``OmniConfig``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from omniserve import envs
from omniserve.config import (
    ATTENTION_BACKENDS,
    DTYPE_CHOICES,
    GENERATION_SETTINGS,
    MM_ENCODER_ATTN_BACKENDS,
    QUANTIZATION_METHODS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    OmniConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from omniserve.engine.arg_checks import token_count
from omniserve.field_types import check_types
from omniserve.sampling_params import SEED_MAX, SEED_MIN

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
    seed: int | None = 0
    max_model_len: int | None = None
    served_model_name: str | list[str] | None = None
    """The name clients use (a list: the first; the server accepts them all)."""
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None
    hf_overrides: dict[str, Any] | str | None = None
    block_size: int = 16
    kv_cache_memory: str | float | None = None
    talker_kv_cache_memory: str | float | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None
    max_logprobs: int = 20
    enable_prompt_embeds: bool = False
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict[str, Any] | str | None = None
    enable_prefix_caching: bool | None = True  # None (vLLM's unset): the default, on
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = True  # None: on
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = False  # None: off
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    limit_mm_per_prompt: MMLimits | str | None = None
    mm_processor_kwargs: dict[str, object] | str | None = None
    mm_processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    allow_private_media_urls: bool = False
    media_io_kwargs: dict[str, dict[str, object]] | str | None = None
    enable_mm_embeds: bool = False
    mm_encoder_attn_backend: str = "auto"
    disable_audio_output: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        import torch  # (only here: the CLI parses its flags without it)

        if isinstance(self.dtype, torch.dtype):  # as vLLM takes one
            self.dtype = str(self.dtype).removeprefix("torch.")
        check_types(self)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")

    def create_config(self, *, default_batched_tokens: int = 8192) -> OmniConfig:
        model_config = ModelConfig.from_path(
            self.model,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            quantization=self.quantization,
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            served_model_name=self._served_name(),
            generation_config=self.generation_config,
            hf_overrides=json_arg("hf_overrides", self.hf_overrides),
            override_generation_config=json_arg(
                "override_generation_config", self.override_generation_config
            ),
            max_logprobs=self.max_logprobs,
            enable_prompt_embeds=self.enable_prompt_embeds,
            runner=self._runner(),
            pooler_config=PoolerConfig.resolve(
                self.model, json_arg("pooler_config", self.pooler_config)
            ),
            disable_audio_output=self.disable_audio_output,
        )
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = (
                default_batched_tokens
                if self.enable_chunked_prefill is not False
                else max(default_batched_tokens, max_len)
            )
        limits, profile_sizes = _limits(self.limit_mm_per_prompt)
        config = OmniConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=parse_bytes(self.kv_cache_memory, "kv_cache_memory"),
                talker_kv_cache_memory_bytes=parse_bytes(
                    self.talker_kv_cache_memory, "talker_kv_cache_memory"
                ),
                num_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching is not False,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill is not False,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                async_scheduling=bool(self.async_scheduling),
                # Default: as large as the step's token budget, and never below 8192 embeddings.
                max_num_encoder_input_tokens=max(8192, batched)
                if self.max_num_encoder_input_tokens is None
                else self.max_num_encoder_input_tokens,
                encoder_cache_size=max(8192, batched)
                if self.encoder_cache_size is None
                else self.encoder_cache_size,
            ),
            multimodal_config=MultiModalConfig(
                limit_mm_per_prompt=limits,
                mm_profile_sizes=profile_sizes,
                mm_processor_kwargs=json_arg("mm_processor_kwargs", self.mm_processor_kwargs),
                mm_processor_cache_gb=self.mm_processor_cache_gb,
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=tuple(self.allowed_media_domains or ()),
                allow_private_media_urls=self.allow_private_media_urls,
                media_io_kwargs=json_arg("media_io_kwargs", self.media_io_kwargs),
                enable_mm_embeds=self.enable_mm_embeds,
                mm_encoder_attn_backend=self.mm_encoder_attn_backend,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            lora_config=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora
            else None,
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative_config is not None
            else None,
        )
        # Settings that only fail where they are used fail here, at start: --media-io-kwargs and
        # --allowed-local-media-path (numpy, PIL, av), --device (torch).
        from omniserve.multimodal.media import MediaConnector, media_config
        from omniserve.worker.worker import resolve_device

        MediaConnector(media_config(config.multimodal_config))
        resolve_device(model_config.device)
        _check_sampling_defaults(model_config)
        return config

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
        return "pooling" if self.convert == "embed" else self.runner  # auto: ModelConfig's

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags, spelled as vLLM spells them; ``--help`` shows every default."""
        group = parser.add_argument_group("engine")
        add = group.add_argument
        add("--tokenizer", default=None, help="Tokenizer directory; None: the model's.")
        add(
            "--dtype",
            default="auto",
            choices=DTYPE_CHOICES,
            help="Weights and activations dtype; auto = the checkpoint's (on a CPU without "
            "native bf16, fp32; on a GPU, bf16 for an fp32 checkpoint).",
        )
        add(
            "--quantization",
            "-q",
            default=None,
            choices=sorted(QUANTIZATION_METHODS),
            help="The method the checkpoint is quantized with (4-bit AWQ or GPTQ, FP8; the Marlin "
            "names read the same checkpoints). Default: read from its config.json.",
        )
        add("--device", default="auto", help="auto (CUDA when present), cpu or cuda.")
        add(
            "--attention-backend",
            default=envs.attention_backend(),
            choices=ATTENTION_BACKENDS,
            help="Paged attention: auto (Triton on CUDA, C decode kernel on CPU), triton or "
            "torch (the reference). Default: $OMNISERVE_ATTENTION_BACKEND or auto.",
        )
        add(
            "--enforce-eager",
            action="store_true",
            help="Run decode steps eagerly: capture no CUDA graphs (they need an attention "
            "backend without per-step host plans: Triton).",
        )
        add("--seed", type=int, default=0, help="Engine RNG seed.")
        add(
            "--generation-config",
            default="auto",
            help="Default sampling settings for fields a request omits: 'auto' the "
            "checkpoint's generation_config.json, 'vllm' none (OpenAI's defaults), or a "
            "directory holding a generation_config.json.",
        )
        add(
            "--hf-overrides",
            default=None,
            help="JSON object of config.json keys set over the checkpoint's (nested objects "
            'merged), e.g. \'{"architectures": ["Qwen3ForSequenceClassification"]}\'.',
        )
        add(
            "--override-generation-config",
            default=None,
            help="JSON object of generation config settings (temperature, top_p, top_k, min_p, "
            "repetition_penalty, max_new_tokens) over those of --generation-config, e.g. "
            '\'{"temperature": 0.5, "max_new_tokens": 256}\'; with --generation-config vllm the '
            "only defaults.",
        )
        add(
            "--disable-audio-output",
            action="store_true",
            help="Serve a full omni checkpoint's thinker alone (text output only; the talker "
            "and vocoder are not loaded).",
        )
        add(
            "--max-model-len",
            type=token_count,
            default=None,
            help="Longest prompt + output, in tokens (vLLM's forms: 32768, 32k = 32,000, "
            "32K = 32,768); None: the model's max_position_embeddings.",
        )
        add("--block-size", type=int, default=16, help="Tokens per KV-cache block.")
        add(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",  # vLLM's newer name
            default=None,
            help="KV-cache memory, e.g. 4GiB; None: on CPU half the memory available after "
            "loading the weights (less 1 GiB), on GPU 90%% of its memory less what is in use.",
        )
        add(
            "--talker-kv-cache-memory",
            default=None,
            help="A speaking model's talker KV pool, e.g. 256MiB; None: a quarter of the KV "
            "budget (the thinker gets the rest).",
        )
        add(
            "--num-gpu-blocks-override",
            type=int,
            default=None,
            help="Exact number of KV blocks (testing).",
        )
        add(
            "--gpu-memory-utilization",
            type=float,
            default=None,
            help="Share of the device's memory (the machine's on a CPU) for weights, KV cache "
            "and activations; the KV cache gets the rest. None: 0.9 on a GPU, half of what is "
            "available after loading on a CPU. --kv-cache-memory overrides it.",
        )
        add(
            "--max-logprobs",
            type=int,
            default=20,
            help="Most logprobs (and prompt_logprobs) a request may ask for per token.",
        )
        add(
            "--enable-prompt-embeds",
            action="store_true",
            help="Accept prompts given as embeddings (prompt_embeds: [num_tokens, hidden_size] "
            "rows the decoder reads in place of token embeddings).",
        )
        add(
            "--runner",
            choices=["auto", "generate", "pooling"],
            default="auto",
            help="pooling: serve the model as an embedding model (embeddings only; generation "
            "requests are refused). auto: generate (embeddings are answered either way).",
        )
        add(
            "--convert",
            choices=["auto", "none", "embed"],
            default="auto",
            help="embed: as --runner pooling (any model pools its last hidden state).",
        )
        add(
            "--pooler-config",
            default=None,
            help='JSON: how embeddings pool, {"pooling_type": "MEAN", "normalize": true}: '
            "LAST, MEAN or CLS, and whether to L2-normalise (defaults of requests that omit "
            "them; keys not given come from the checkpoint's sentence-transformers modules.json, "
            "else LAST, normalised).",
        )
        add(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Reuse KV blocks of shared prefixes.",
        )
        add("--max-num-seqs", type=int, default=256, help="Most requests running at once.")
        add(
            "--scheduling-policy",
            choices=["fcfs", "priority"],
            default="fcfs",
            help="fcfs: first come, first served; priority: by each request's priority "
            "(lower first), then arrival, preempting the last in that order.",
        )
        add(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Token budget per step; None: 8192 offline, 2048 for the server.",
        )
        add(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Split long prompts across steps.",
        )
        add(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="Schedule and launch the next step while the device runs this one, so it "
            "never waits for the host between steps (the 'uni' and 'mp' executors; off by "
            "default, --no-async-scheduling as in vLLM).",
        )
        add(
            "--long-prefill-token-threshold",
            type=int,
            default=0,
            help="Cap one request's prefill tokens per step (0: no cap).",
        )
        add("--tensor-parallel-size", "-tp", type=int, default=1, help="Tensor-parallel ranks.")
        add("--pipeline-parallel-size", "-pp", type=int, default=1, help="Pipeline stages.")
        add(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=1,
            help="Engine cores, each in its own process with its own KV cache; every new "
            "request goes to the one with the fewest requests in flight.",
        )
        add(
            "--distributed-executor-backend",
            default=None,
            choices=[None, "uni", "mp", "ray"],
            help="How workers run; None: uni for one rank, mp for more.",
        )
        mm = parser.add_argument_group("multimodal")
        mm.add_argument(
            "--limit-mm-per-prompt",
            default=None,
            help='Most items per modality in one prompt, as JSON: {"image": 4}, or with the GPU '
            'memory profile\'s item size: {"image": {"count": 4, "width": 512, "height": 512}}.',
        )
        mm.add_argument(
            "--mm-processor-kwargs",
            default=None,
            help='Default HF processor kwargs as JSON, e.g. {"max_pixels": 200704}.',
        )
        mm.add_argument(
            "--max-num-encoder-input-tokens",
            type=int,
            default=None,
            help="Encoder budget per step, in embeddings; None: max(8192, the token "
            "budget). One item larger than this (or the cache) is rejected.",
        )
        mm.add_argument(
            "--encoder-cache-size",
            type=int,
            default=None,
            help="Encoder-output cache capacity, in embeddings; None: as above.",
        )
        mm.add_argument(
            "--mm-encoder-attn-backend",
            default="auto",
            choices=MM_ENCODER_ATTN_BACKENDS,
            help="The vision and audio towers' attention: FLASH_ATTN (their windows, frames "
            "and chunks in one varlen flash-attention call; CUDA, bf16/fp16), TORCH_SDPA (one "
            "SDPA call per segment), or auto (FLASH_ATTN on CUDA where it passes a start-up "
            "check).",
        )
        mm.add_argument(
            "--mm-processor-cache-gb",
            type=float,
            default=4.0,
            help="Processor-output cache size (0 disables it).",
        )
        mm.add_argument(
            "--allowed-local-media-path",
            default=None,
            help="Serve file:// media only from under this directory.",
        )
        mm.add_argument(
            "--allowed-media-domains",
            nargs="*",
            default=None,
            help="Only fetch http(s) media from these hosts.",
        )
        mm.add_argument(
            "--allow-private-media-urls",
            action="store_true",
            help="Allow http(s) media from loopback/private addresses (testing).",
        )
        mm.add_argument(
            "--enable-mm-embeds",
            action="store_true",
            help="Accept precomputed image_embeds / audio_embeds in place of media "
            "(the encoder is skipped for them; trust the client's tensors).",
        )
        mm.add_argument(
            "--media-io-kwargs",
            default=None,
            help="Media limits per modality, as JSON: image max_bytes, max_pixels; "
            "audio max_bytes, max_seconds; video num_frames, max_bytes, max_seconds, "
            'max_frames, max_total_pixels; e.g. {"video": {"num_frames": 16}}. '
            "Fetch timeouts: VLLM_{IMAGE,AUDIO,VIDEO}_FETCH_TIMEOUT.",
        )
        lora = parser.add_argument_group("LoRA adapters")
        lora.add_argument(
            "--enable-lora",
            action="store_true",
            help="Serve PEFT LoRA adapters of the language model (requests pick one by name; "
            "decode steps then run eagerly, without CUDA graphs).",
        )
        lora.add_argument(
            "--max-loras",
            type=int,
            default=1,
            help="Distinct adapters one step may run (each holds a slot of weights).",
        )
        lora.add_argument(
            "--max-lora-rank", type=int, default=16, help="Largest adapter rank accepted."
        )
        lora.add_argument(
            "--max-cpu-loras",
            type=int,
            default=None,
            help="Adapters kept read in host memory (default: --max-loras).",
        )
        parser.add_argument(
            "--speculative-config",
            default=None,
            help='Speculative decoding, as JSON (vLLM\'s): {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
            '"disable_by_batch_size": 8}. Drafts are copied from each request\'s own earlier '
            "tokens and verified in one forward; outputs keep their distribution (greedy: "
            "the same tokens). Requests under a grammar or with audio output decode one token "
            "per step.",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
