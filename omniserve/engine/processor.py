"""Processor: validate a request against the model and turn it into ``EngineCoreRequest``s.

Runs in the front-end process. ``n > 1`` fans out here into ``n`` child requests with ``n=1``
so that the engine core only ever sees single-sequence requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from omniserve.config import OmniConfig
from omniserve.config.pooler import POOLING_TYPES
from omniserve.core.talker_scheduler import plan_talker_prompt
from omniserve.engine.token_settings import TokenSettings
from omniserve.inputs.data import PromptType
from omniserve.inputs.preprocess import InputPreprocessor, ProcessedInputs
from omniserve.logits_processor import validate_request
from omniserve.lora.request import LoRARequest
from omniserve.messages import EngineCoreRequest, SpeechRequest
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.sampling_params import (
    TOKEN_TASKS,
    PoolingParams,
    SamplingParams,
    SpeechParams,
)
from omniserve.structured_output import validate_structured_outputs
from omniserve.tokenizer import get_eos_token_ids, get_tokenizer, tokenizer_refusal


class _EngineClient(Protocol):
    """What start-up needs of a core client, sync or async."""

    talker_capacity: int

    def shutdown(self) -> None: ...


T = TypeVar("T", bound=_EngineClient)


@dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int] | None
    """None: the prompt was given as embeddings (the engine requests hold placeholder ids)."""
    engine_requests: list[EngineCoreRequest]
    """One per sequence: a single request for n == 1, else the children."""
    num_mm_tokens: dict[str, int]
    """Placeholder tokens per modality in the prompt."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_requests[0].prompt_token_ids)


def start_with_engine(
    config: OmniConfig,
    make_client: Callable[[], T],
    *,
    engine_in_other_process: bool,
    serving: bool = False,
) -> tuple[Processor, T]:
    """The front end's Processor and the engine core client (``make_client``).

    With the core in its own process, the Processor (tokenizer, HF processor, model modules) is
    built on a thread while the client starts the core and waits for it, so the two processes'
    imports and loading overlap (on 2 cores the default model's server was ready in 11.7 s
    instead of 15.8). In-process, they are built one after the other.
    """
    if not engine_in_other_process:
        processor = Processor(config, serving=serving)
        client = make_client()
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="omniserve-processor") as pool:
            future = pool.submit(Processor, config, engine_in_other_process=True, serving=serving)
            client = make_client()  # if it raises, leaving the pool waits for the processor
            try:
                processor = future.result()
            except BaseException:
                client.shutdown()
                raise
    processor.talker_capacity = client.talker_capacity
    return processor, client


TRUNCATE_REFUSAL = (
    "truncate_prompt_tokens cannot cut a prompt with media or prompt_embeds (it would cut "
    "their placeholders)"
)


def kept_prompt_start(num_tokens: int, keep: int, max_model_len: int) -> int:
    """Where the part of a prompt that vLLM's ``truncate_prompt_tokens`` keeps begins: its last
    ``keep`` tokens (-1: its last max_model_len)."""
    return max(0, num_tokens - (max_model_len if keep == -1 else keep))


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``num_threads`` torch intra-op threads (None: unchanged)."""
    previous = torch.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ContextLengthError(ValueError):
    """A prompt, or a prompt plus its ``max_tokens``, that does not fit ``max_model_len``.

    ``param`` is the request field at fault ("max_tokens"), or None for the prompt itself.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Processor:
    """Owns the front end's tokenizer and multimodal processor (with its cache), and is the one
    place a request's length limits are decided: the prompt (after media placeholders expand)
    must leave room to generate, and ``max_tokens`` is resolved against what is left.

    ``serving`` (the API server's engine) applies vLLM's server rules: an unset ``max_tokens``
    is the room left capped by the checkpoint's ``max_new_tokens`` (``--generation-config``), and
    an explicit one that does not fit is refused (a 400 naming both counts). Offline, as vLLM's
    ``LLM`` does, an unset one runs to ``max_model_len`` and an explicit one is cut to fit.

    With the engine core in another process (``engine_in_other_process``), featurization runs
    on one torch thread: the core's OpenMP threads already use every core, and a second thread
    team in the front end takes cores from them (and spins after each op), stalling the core at
    its barriers. On 2 cores that made the omni benchmark about 15% slower.
    """

    def __init__(
        self,
        config: OmniConfig,
        *,
        engine_in_other_process: bool = False,
        serving: bool = False,
    ) -> None:
        self.featurize_threads = 1 if engine_in_other_process else None
        self.serving = serving
        self.model_config = model_config = config.model_config
        self.default_max_tokens: int | None = (
            model_config.default_sampling_params().get("max_tokens") if serving else None
        )
        self.tokenizer: Any = (
            None if model_config.skip_tokenizer_init else get_tokenizer(model_config.tokenizer)
        )
        text_config = model_config.hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = get_eos_token_ids(model_config.model, self.tokenizer)
        self.token_settings = TokenSettings(self.tokenizer, self.eos_token_ids,
                                            model_config.architecture,
                                            config.structured_outputs_config)  # fmt: skip
        sched = config.scheduler_config
        self.scheduling_policy = sched.policy
        # An item larger than this can never be encoded in one step or held in the cache.
        self.max_item_embeds = min(sched.max_num_encoder_input_tokens, sched.encoder_cache_size)
        self.mm_processor = (
            _create_mm_processor(config, self.tokenizer) if self.tokenizer is not None else None
        )
        self.talker_capacity = 0
        """Talker positions the engine's speech KV pool holds (set once the engine started)."""
        self.input_preprocessor = InputPreprocessor(
            self.tokenizer,
            self.mm_processor,
            config.multimodal_config.mm_processor_kwargs,
            prompt_embeds_width=text_config.hidden_size
            if model_config.enable_prompt_embeds
            else None,
        )

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate; raise ``ValueError``/``TypeError`` naming the problem.
        ``lora_request``: an adapter the engine core has added."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Expected SamplingParams, got {type(params).__name__}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} needs --scheduling-policy priority (this "
                "engine serves first come, first served)."
            )
        self._validate_params(params)
        if params.pooling is not None:
            params = params.clone(pooling=self._resolve_pooling(params, params.pooling))
        with torch_threads(self.featurize_threads):
            inputs = self.input_preprocessor.preprocess(prompt)
        if params.truncate_prompt_tokens is not None:
            inputs = self._truncated(inputs, params.truncate_prompt_tokens)
        token_ids = inputs.prompt_token_ids
        if inputs.prompt_embeds:
            _check_embeds_params(params)
        self._validate_prompt(token_ids)
        self._validate_mm_budget(inputs)
        pooling_only = params.pooling is not None
        self._validate_length(inputs, pooling_only)
        # An embedding request samples one token it finishes on (never fed back, so it needs no
        # position: its prompt may take all of max_model_len).
        max_tokens = (
            1 if pooling_only else self._resolve_max_tokens(len(token_ids), params.max_tokens)
        )
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        params = self.token_settings.resolve(params)
        arrival = arrival_time if arrival_time is not None else time.time()
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [
                (
                    child_request_id(request_id, i),
                    params.clone(n=1, seed=params.child_seed(i)),
                )
                for i in range(params.n)
            ]
        requests = [
            EngineCoreRequest(
                rid,
                token_ids,
                p,
                eos,
                arrival,
                max_tokens,
                inputs.mm_features,
                _cache_salt(prompt),
                priority,
                self._speech_request(p, token_ids, bool(inputs.mm_features))
                if p.wants_audio
                else None,
                lora_request,
                inputs.prompt_embeds,
            )
            for rid, p in children
        ]
        given_ids = None if inputs.given_as_embeds else token_ids
        return ProcessedRequest(inputs.prompt, given_ids, requests, inputs.num_mm_tokens)

    def _validate_mm_budget(self, inputs: ProcessedInputs) -> None:
        for feature in inputs.mm_features:
            num_embeds = feature.mm_position.num_embeds
            if num_embeds > self.max_item_embeds:
                raise MultiModalInputError(
                    f"the item needs {num_embeds} embeddings, more than one encoder step or the "
                    f"encoder cache can hold ({self.max_item_embeds}); send a smaller item "
                    "(e.g. lower max_pixels or num_frames) or raise --max-num-encoder-input-tokens "
                    "and --encoder-cache-size",
                    stage="budget",
                    modality=feature.modality,
                )

    def _truncated(self, inputs: ProcessedInputs, keep: int) -> ProcessedInputs:
        """The prompt as ``truncate_prompt_tokens`` cuts it; the text no longer matches the
        tokens, so it is dropped."""
        if inputs.mm_features or inputs.prompt_embeds:
            raise ValueError(f"{TRUNCATE_REFUSAL}.")
        start = kept_prompt_start(
            len(inputs.prompt_token_ids), keep, self.model_config.max_model_len
        )
        if start == 0:
            return inputs
        return dataclasses.replace(
            inputs, prompt=None, prompt_token_ids=inputs.prompt_token_ids[start:]
        )

    def reset_mm_cache(self) -> None:
        """Forget processed media (``reset_mm_cache``; uuids sent before name nothing now)."""
        if self.mm_processor is not None and self.mm_processor.cache is not None:
            self.mm_processor.cache.reset()

    def check_mm_kwargs(self, mm_kwargs: object) -> None:
        """A request's ``mm_processor_kwargs``, checked before its media is fetched (the server
        calls this first, so a bad option costs no download)."""
        self.input_preprocessor.check_mm_kwargs(mm_kwargs)

    def _validate_params(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        if self.tokenizer is None:
            _check_tokenless(params)
        processors = self.model_config.logits_processors
        if params.extra_args and not processors:
            raise ValueError(
                "extra_args (vllm_xargs) are not supported here: they configure custom logits "
                "processors, and none is loaded (--logits-processors)."
            )
        validate_request(processors, params)
        cap = self.model_config.max_logprobs  # -1: no cap but the vocabulary
        limit = self.vocab_size if cap < 0 else min(cap, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(
                    f"Requested {name}={value}, but at most {limit} logprobs per token are "
                    f"supported (--max-logprobs {cap}, {self.vocab_size} tokens in the vocabulary)."
                )
        if params.pooling is None and self.model_config.runner == "pooling":
            answers = (
                "classification and scoring (LLM.classify, /classify, /score, /rerank)"
                if self.model_config.num_labels
                else "embeddings (LLM.embed, /v1/embeddings)"
            )
            raise ValueError(
                "This model is served as an embedding model (--runner pooling): it answers "
                f"{answers}, not generation requests."
            )
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            self.check_token_ids(name, list(ids))

    def _resolve_pooling(self, params: SamplingParams, pooling: PoolingParams) -> PoolingParams:
        """``pooling`` with the model's defaults for what it leaves None, checked: an embedding
        request generates one token it does not report, and pools its prompt once: one
        sequence, no audio; ``dimensions`` only where the model was trained for it."""
        if params.n != 1 or params.wants_audio:
            raise ValueError("An embedding request takes n=1 and no audio output.")
        defaults = self.model_config.pooler_config
        if pooling.pooling_type is not None and pooling.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type: {pooling.pooling_type!r} is not one of {', '.join(POOLING_TYPES)}."
            )
        task = pooling.task or self.model_config.pooling_task
        classifies = task in ("classify", "token_classify")
        if task not in self.model_config.pooling_tasks:
            raise ValueError(
                f"{self.model_config.architecture} is no sequence classifier "
                f"(*ForSequenceClassification): it answers embeddings, not {task}."
            )
        if task in TOKEN_TASKS and pooling.pooling_type is not None:
            raise ValueError(
                f"pooling_type: {task} keeps every prompt position; pooling_type applies to "
                "embed and classify."
            )
        resolved = PoolingParams(
            defaults.normalize if pooling.normalize is None else pooling.normalize,
            pooling.dimensions,
            "ALL" if task in TOKEN_TASKS else pooling.pooling_type or defaults.pooling_type,
            task,
            pooling.use_activation is not False,
        )
        dims = pooling.dimensions
        if dims is None:
            return resolved
        if classifies:
            raise ValueError("dimensions: a classification has one score per label; omit it.")
        text = self.model_config.hf_config.get_text_config()
        allowed = getattr(text, "matryoshka_dimensions", None)
        if not (getattr(text, "is_matryoshka", False) or allowed):
            raise ValueError(
                f"dimensions: {self.model_config.architecture} does not support "
                "Matryoshka embeddings (its config declares neither is_matryoshka nor "
                "matryoshka_dimensions); omit dimensions."
            )
        width = defaults.embedding_size(text.hidden_size)
        if dims > width or (allowed and dims not in allowed):
            raise ValueError(
                f"dimensions: {dims} is not one of this model's Matryoshka dimensions "
                f"({allowed or f'1 to {width}'})."
            )
        return resolved

    def _speech_request(
        self, params: SamplingParams, token_ids: list[int], has_media: bool
    ) -> SpeechRequest:
        """The talker's part of an audio-output request: its voice, its sampling (the request's
        ``speech`` settings over the reference's defaults; an ``n > 1`` child's seed is the
        request's own, so children differ as their text does) and its prompt plan."""
        config = self.model_config.speech
        if config is None:
            raise ValueError(f"audio output: {self.model_config.no_speech_reason}.")
        speech = params.speech or SpeechParams()
        voice = config.resolve_voice(speech.voice)
        if config.user_turns_only:
            prompt_positions, text_start = plan_talker_prompt(
                token_ids, config.im_start_token_id, config.user_token_id, config.assistant_token_id
            )
        else:
            text_start = self._reply_start(token_ids) if speech.reply_in_prompt else len(token_ids)
            prompt_positions = list(range(text_start))
        prompt_len = len(prompt_positions) + config.assistant_prompt_len
        settings = {
            **config.talker_defaults,
            **{
                name: getattr(speech, name)
                for name in _TALKER_SETTINGS
                if getattr(speech, name) is not None
            },
        }
        max_frames = min(int(settings.pop("max_tokens")), config.talker_max_len - prompt_len)
        if max_frames < 1:
            raise ValueError(
                f"audio output: the talker's prompt ({prompt_len} tokens) leaves no "
                f"room within its {config.talker_max_len} positions; shorten the "
                "conversation."
            )
        room = self.talker_capacity - prompt_len  # what one request may use of the talker pool
        if speech.max_tokens is not None and max_frames > room or room < 1:
            raise ValueError(
                f"audio output: the talker's prompt ({prompt_len} tokens) and "
                f"{max_frames if speech.max_tokens is not None else 1} frame(s) need more than "
                f"the talker's KV pool holds ({self.talker_capacity} tokens); lower "
                "speech.max_tokens, shorten the conversation, or raise the server's "
                "--talker-kv-cache-memory."
            )
        max_frames = min(max_frames, room)  # the default cap: what the pool can hold
        seed = speech.seed if speech.seed is not None else params.seed
        talker = SamplingParams(max_tokens=max_frames, seed=seed, **settings)
        return SpeechRequest(
            voice,
            talker,
            prompt_positions,
            text_start,
            prompt_len,
            speech.reply_in_prompt,
            reads_prompt_hidden=config.reads_hidden == "all" or has_media,
            reads_reply_hidden=config.reads_hidden == "all",
        )

    def _reply_start(self, token_ids: list[int]) -> int:
        """Where the reply begins in a prompt that carries it: after the last assistant header."""
        header = self._assistant_header
        for start in range(len(token_ids) - len(header), -1, -1):
            if token_ids[start : start + len(header)] == header:
                return start + len(header)
        raise ValueError(
            "audio output of a given reply needs a chat prompt with an "
            "assistant turn (<|im_start|>assistant)."
        )

    @functools.cached_property
    def _assistant_header(self) -> list[int]:
        return self.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty.")
        self.check_token_ids("prompt", token_ids)

    def check_token_ids(self, name: str, token_ids: list[int]) -> None:
        """ValueError naming ``name`` when an id is outside the model's vocabulary."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return  # the common case, in C: prompts can be long
        bad = sorted({t for t in token_ids if not 0 <= t < self.vocab_size})
        if bad:
            raise ValueError(
                f"{name}: token ids {bad[:8]}{' ...' if len(bad) > 8 else ''} are outside the "
                f"vocabulary (size {self.vocab_size})."
            )

    def _resolve_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """Output tokens this request may generate (see the class docstring)."""
        limit = self.model_config.max_model_len
        room = limit - prompt_len
        if requested is None:
            return min(room, self.default_max_tokens or room)
        if requested > room and self.serving:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens (max_model_len). "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"prompt, {requested} in the completion). Please reduce the length of the prompt "
                "or max_tokens.",
                param="max_tokens",
            )
        return min(requested, room)

    def _validate_length(self, inputs: ProcessedInputs, pooling_only: bool) -> None:
        """The prompt must leave room to generate (an embedding request's need only fit); when
        its media made it too long, the error names the modality (the server adds the chat
        part), each one's share, and the stage."""
        num_tokens, max_len = len(inputs.prompt_token_ids), self.model_config.max_model_len
        if num_tokens < max_len or pooling_only and num_tokens == max_len:
            return
        problem = "is more than" if pooling_only else "leaves no room to generate within"
        if not inputs.num_mm_tokens:
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens (max_model_len). "
                f"However, your request has {num_tokens} input tokens, which {problem} it. "
                "Please reduce the length of the input."
            )
        message = f"the prompt is {num_tokens} tokens long, which {problem} max_model_len={max_len}"
        shares = ", ".join(f"{n} for {m}" for m, n in inputs.num_mm_tokens.items())
        num_text = num_tokens - sum(inputs.num_mm_tokens.values())
        raise MultiModalInputError(
            f"{message} ({shares}, {num_text} for text); send shorter or smaller media "
            "(e.g. lower max_pixels, num_frames or fps) or raise --max-model-len",
            stage="budget",
            modality=max(inputs.num_mm_tokens, key=lambda m: inputs.num_mm_tokens[m]),
        )


_TALKER_SETTINGS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_tokens")


def _check_tokenless(params: SamplingParams) -> None:
    """What an engine without a tokenizer cannot honour: settings that are text, or need it."""
    for name, given in (
        ("stop", params.stop),
        ("bad_words", params.bad_words),
        ("structured_outputs", params.structured_outputs is not None),
        ("thinking_token_budget", params.thinking_token_budget is not None),
        ("audio output (output_modalities)", params.wants_audio),
    ):
        if given:
            raise ValueError(tokenizer_refusal(name))


def _check_embeds_params(params: SamplingParams) -> None:
    """What a prompt given as embeddings cannot have: whatever reads its token ids."""
    reads_ids = {
        "prompt_logprobs": params.prompt_logprobs is not None,
        "audio output": params.wants_audio,
    }
    for name, asked in reads_ids.items():
        if asked:
            raise ValueError(
                f"{name} reads the prompt's token ids, which a prompt given as prompt_embeds "
                "does not have."
            )


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError("cache_salt must be a non-empty string.")
    return salt


def _create_mm_processor(config: OmniConfig, tokenizer: Any) -> Any | None:
    """The model's multimodal processor with its cache, or None for a text-only model."""
    from omniserve.multimodal.cache import ProcessorCache
    from omniserve.multimodal.media import media_config
    from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

    mm = config.multimodal_config
    if not MULTIMODAL_REGISTRY.supports_multimodal(config.model_config):
        if any(mm.limit_mm_per_prompt.values()) or mm.mm_profile_sizes:
            raise ValueError("--limit-mm-per-prompt: this model takes no multimodal input.")
        if mm.video_pruning_rate:
            raise ValueError("--video-pruning-rate: this model takes no video input.")
        return None
    cache = (
        ProcessorCache(int(mm.mm_processor_cache_gb * (1 << 30)))
        if mm.mm_processor_cache_gb
        else None
    )
    processor = MULTIMODAL_REGISTRY.create_processor(
        config.model_config,
        tokenizer,
        cache=cache,
        limit_mm_per_prompt=mm.limit_mm_per_prompt,
        profile_sizes=mm.mm_profile_sizes,
        enable_mm_embeds=mm.enable_mm_embeds,
        max_audio_seconds=media_config(mm).max_audio_seconds,
        video_pruning_rate=mm.video_pruning_rate,
    )
    if processor is not None:  # (create_processor's None is a text model's, handled above)
        processor.info.check_limits()
        processor.info.check_video_pruning()
    return processor
