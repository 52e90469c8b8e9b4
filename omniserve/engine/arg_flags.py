"""``EngineArgs``' command-line flags, spelled as vLLM spells them (``--help`` shows every
default); each flag's value lands in the ``EngineArgs`` field of its name."""

from __future__ import annotations

import argparse

from omniserve import envs
from omniserve.config import (
    ATTENTION_BACKENDS,
    DTYPE_CHOICES,
    EXPERT_PLACEMENTS,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    PREFIX_CACHING_HASH_ALGOS,
    QUANTIZATION_METHODS,
)
from omniserve.config.multimodal import MM_ENCODER_ATTN_BACKENDS, MM_ENCODER_TP_MODES
from omniserve.config.structured_outputs import REASONING_TAGS
from omniserve.engine.arg_checks import TASK_RUNNERS, number_in, token_count, vllm_flags
from omniserve.engine.compilation_config import OPTIMIZATION_LEVELS


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    add(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        help="Decode batch sizes captured as CUDA graphs: one is the top of the ladder 1, 2, "
        "4, 8, 16, ...; several are the sizes. Default: the ladder up to --max-num-seqs.",
    )
    add(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="The ladder's top (vLLM's newer spelling of one --cuda-graph-sizes value).",
    )
    add(
        "--compilation-config",
        "-cc",
        default=None,
        help="vLLM's compilation settings (JSON): cudagraph_mode (NONE: no decode graphs), "
        "cudagraph_capture_sizes and max_cudagraph_capture_size take effect; torch.compile's "
        "keys (mode, backend, passes, ...) change nothing here (no torch.compile runs).",
    )
    add(
        "-O",
        "--optimization-level",
        type=int,
        choices=OPTIMIZATION_LEVELS,
        default=None,
        help="vLLM's optimization level: -O0 captures no decode graphs (fastest start); "
        "-O1 to -O3 are the default here.",
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
        "--use-tqdm-on-load",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="A progress bar over the weights as they load (on a terminal).",
    )
    add(
        "--disable-audio-output",
        action="store_true",
        help="Serve a full omni checkpoint's thinker alone (text output only; the talker "
        "and vocoder are not loaded).",
    )
    add(
        "--disable-sliding-window",
        action="store_true",
        help="Layers that attend through a sliding window attend fully, and max-model-len is "
        "capped at the window (where the two agree).",
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
        "--hf-config-path",
        default=None,
        help="A directory whose config.json is read in place of the model's (weights, "
        "tokenizer and processor files stay the model's).",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="The KV cache's element type: auto (the model's), or fp8 (fp8_e4m3) / fp8_e5m2 "
        "at half of bf16's bytes, twice the tokens in the same memory (keys and values "
        "rounded as stored, at the checkpoint's scales or 1).",
    )
    add(
        "--calculate-kv-scales",
        action="store_true",
        help="An fp8 KV cache's scales from each layer's first real step (its largest key "
        "/ 200, value / 100), not the checkpoint's or 1; CUDA decode graphs are then not "
        "captured (they would keep the scales of before).",
    )
    add(
        "--kv-cache-memory",
        *vllm_flags("kv_cache_memory"),
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
        "--logits-processors",
        nargs="+",
        default=None,
        metavar="MODULE:CLASS",
        help="Custom logits processors (subclasses of omniserve.logits_processor."
        "LogitsProcessor, vLLM's interface), by module:Class; each request configures them "
        "through vllm_xargs. Those of the omniserve.logits_processors entry points load too.",
    )
    add(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=LOGPROBS_MODES,
        help="What sampled tokens' logprobs report: the model's own distribution (raw_*) or "
        "the one the token was drawn from (processed_*: after logit_bias, penalties, "
        "temperature, min_p, top_k, top_p), as logprobs or logits. Prompt logprobs are "
        "always the model's raw logprobs.",
    )
    add(
        "--enable-prompt-embeds",
        action="store_true",
        help="Accept prompts given as embeddings (prompt_embeds: [num_tokens, hidden_size] "
        "rows the decoder reads in place of token embeddings).",
    )
    add(
        "--enable-sleep-mode",
        action="store_true",
        help="Allow sleep / wake_up (offline LLM.sleep(level), the server's POST /sleep with "
        "VLLM_SERVER_DEV_MODE=1): release the KV cache (level 1) and the weights (level 2; on "
        "a GPU level 1 too) while idle; wake_up reads the weights again.",
    )
    add(
        "--skip-tokenizer-init",
        action="store_true",
        help="Load no tokenizer: prompts are token ids (or embeddings), outputs token ids with "
        "empty text; text prompts, chat, stop strings, bad_words, grammars and media are "
        "refused.",
    )
    add(
        "--runner",
        choices=["auto", "generate", "pooling"],
        default="auto",
        help="pooling: serve the model as an embedding model (embeddings only; generation "
        "requests are refused). auto: generate (embeddings are answered either way).",
    )
    add(
        "--task",
        default=None,
        choices=TASK_RUNNERS,
        help="vLLM's older flag: generate, or embed / classify / score (--runner pooling).",
    )
    add(
        "--convert",
        choices=["auto", "none", "embed"],
        default="auto",
        help="embed: as --runner pooling (any model pools its last hidden state).",
    )
    add(
        "--pooler-config",
        *vllm_flags("pooler_config"),
        default=None,
        help='JSON: how embeddings pool, {"pooling_type": "MEAN", "normalize": true}: '
        "LAST, MEAN or CLS, and whether to L2-normalise (defaults of requests that omit "
        "them; keys not given come from the checkpoint's sentence-transformers modules.json, "
        "else LAST, normalised).",
    )
    add(
        "--kv-events-config",
        default=None,
        help="JSON (vLLM's): publish the prefix cache's changes for KV-aware routers, "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000, '
        '"hwm": 100000, "max_queue_size": 100000}; with -dp each engine\'s ports are these '
        "plus its index.",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="Send a span per request (vLLM's llm_request, gen_ai.* attributes) to this "
        "OpenTelemetry collector; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (default) or "
        "http/protobuf. Needs omniserve[otel].",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse KV blocks of shared prefixes.",
    )
    add(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=PREFIX_CACHING_HASH_ALGOS,
        help="The blocks' keys: sha256 or xxhash (the same in every process), or vLLM's "
        "sha256_cbor / xxhash_cbor (seeded by PYTHONHASHSEED; the keys a router computes "
        "for vLLM find these blocks).",
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
        help="Cap one request's prefill tokens per step (0: no cap; with the partial-prefill "
        "caps, other than one at a time, 4%% of --max-model-len, as in vLLM).",
    )
    add(
        "--max-num-partial-prefills",
        type=int,
        default=None,
        help="Most requests prefilling in one step (decodes are not counted); the others "
        "wait. Unset: no cap.",
    )
    add(
        "--max-long-partial-prefills",
        type=int,
        default=None,
        help="Most of those whose rest of the prompt exceeds --long-prefill-token-threshold, "
        "so shorter prompts pass long ones in the queue. Unset: no cap.",
    )
    add(
        "--scheduler-cls",
        default="",
        help="module.Class: a subclass of omniserve.core.scheduler.Scheduler to schedule with "
        "(vLLM's; its own default class name means this engine's).",
    )
    add(
        "--stream-interval",
        type=number_in(int, 1),
        default=1,
        help="Send a streamed request's output once this many new tokens are in (its first "
        "token and its end at once): fewer, larger chunks, less front-end work per token.",
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
    add(
        "--worker-extension-cls",
        default="",
        metavar="MODULE.CLASS",
        help="A class whose methods every worker also has (vLLM's), for collective_rpc (e.g. "
        "weight updates from a trainer) to call by name.",
    )
    add(
        "--worker-cls",
        default="",
        metavar="MODULE.CLASS",
        help="A subclass of omniserve.worker.worker.Worker every rank runs (vLLM's; its own "
        "worker class names, and auto, mean this engine's).",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE layers: each tensor-parallel rank holds its share of the experts whole "
        "rather than a slice of every expert (one rank: no change).",
    )
    add(
        "--expert-placement-strategy",
        default="linear",
        choices=EXPERT_PLACEMENTS,
        help="With --enable-expert-parallel: a rank's experts are a contiguous block (linear) "
        "or every tensor-parallel-size-th (round_robin).",
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
        "--disable-chunked-mm-input",
        action="store_true",
        help="Never end a prefill chunk inside a media item's placeholder: end it before the "
        "item, whose tokens then run in one later step (unless the item alone is more than a "
        "step's budget).",
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
        "--disable-mm-preprocessor-cache",
        action="store_true",
        help="vLLM's older spelling of --mm-processor-cache-gb 0.",
    )
    mm.add_argument(
        "--mm-encoder-tp-mode",
        default="weights",
        choices=MM_ENCODER_TP_MODES,
        help="Under tensor parallelism: weights, every rank encodes every item (its towers "
        "whole); data, the ranks split each step's items of a modality and gather the outputs.",
    )
    mm.add_argument(
        "--enable-multimodal-encoder-data-parallel",
        action="store_true",
        help="vLLM's older spelling of --mm-encoder-tp-mode data.",
    )
    mm.add_argument(
        "--language-model-only",
        action="store_true",
        help="Serve text alone: every modality's limit is 0, so the vision and audio "
        "encoders are not loaded (as --limit-mm-per-prompt with 0 for a modality leaves out "
        "the encoders only it needs).",
    )
    mm.add_argument(
        "--video-pruning-rate",
        type=float,
        default=None,
        help="Drop this share (0 <= rate < 1) of each video's tokens before the decoder: "
        "those most like the same spot in the frame group before (Efficient Video Sampling; "
        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the omni thinkers). The first frame group is kept "
        "whole.",
    )
    mm.add_argument(
        "--skip-mm-profiling",
        action="store_true",
        help="The GPU start-up memory profile runs no media: the KV cache may take "
        "what they need (then leave room with --gpu-memory-utilization).",
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
    lora.add_argument(
        "--default-mm-loras",
        default=None,
        help='JSON (vLLM\'s): modality -> a PEFT adapter directory, e.g. {"audio": "DIR"}: a '
        "request with media of one such modality that names no adapter runs with it (served "
        "under the modality's name too).",
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
    structured = parser.add_argument_group("structured outputs and reasoning")
    structured.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="{" + ",".join(sorted(REASONING_TAGS)) + "}",
        help="The model thinks in <think>...</think> before it answers: the server splits "
        "that off chat answers into reasoning_content, and grammars (response_format, "
        "structured_outputs, required tools) apply to the answer after it. A "
        "--reasoning-parser-plugin file may register more names.",
    )
    structured.add_argument(
        "--reasoning-parser-plugin",
        default=None,
        metavar="FILE",
        help="A Python file that registers reasoning parsers (omniserve.entrypoints.openai."
        "reasoning.register_reasoning_parser(name, ReasoningParser(start, end))), run first.",
    )
    structured.add_argument(
        "--structured-outputs-config",
        default=None,
        help='JSON (vLLM\'s): {"backend": "auto" | "xgrammar", "disable_any_whitespace": '
        'true (every JSON grammar without optional whitespace), "enable_in_reasoning": true '
        '(grammars constrain the thinking too), "reasoning_parser": "qwen3"}.',
    )
    return parser
