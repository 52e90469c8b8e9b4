"""Sampling parameters, with vLLM's names and defaults. Pure Python: the scheduler reads them."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from omniserve.field_types import ParamTypeError, check_types, field_types

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# The sampler computes in float32: a value it divides by must stay a finite, normal float32 and so
# must its reciprocal, or the logits overflow to inf / underflow to 0 and the draw has no mass.
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 1.1754943508222875e-38  # smallest normal float32
# Seeds are what torch.Generator.manual_seed takes (negative ones wrap to unsigned 64-bit).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Ids, counts and top-k travel to the engine as int64 and index int32/int64 tensors.
INT32_MAX = 2**31 - 1


def is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


TRUNCATE_VALUES = "None, -1 (max_model_len) or an integer >= 1"
"""What vLLM's ``truncate_prompt_tokens`` may be."""


def is_truncation(keep: object) -> bool:
    return keep is None or keep == -1 or is_int(keep, 1, INT32_MAX)


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RequestOutputKind(IntEnum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's ``structured_outputs``): exactly one of a JSON schema
    (``json``, a dict or its JSON text), any JSON object (``json_object``), a regular expression,
    a choice among strings, an EBNF ``grammar``, or an xgrammar ``structural_tag`` (JSON text).
    The engine masks every token the constraint does not allow."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (else any amount, as JSON allows)."""
    after_thinking: tuple[int, int] | None = None
    """The ids of the tags the model thinks between, when the grammar applies to the answer
    after that thinking (the Processor sets them under ``--reasoning-parser``): the request
    samples freely until the end tag, and its first token may open the thinking. None: the
    grammar applies from the first token."""
    origin: str | None = None
    """Where a request gave the constraint (the API's ``response_format.json_schema.schema``,
    ``guided_regex``, ``tools[0].function.parameters``, ...), named in its errors; None:
    ``structured_outputs.<kind>``."""

    def __post_init__(self) -> None:
        check_types(self, "structured_outputs.")
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, "
                f"regex, choice, grammar, structural_tag; got {given or 'none'}."
            )
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if self.choice == []:
            raise ValueError(f"{self.where} must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        """The constraint's field name ("json", "regex", ...)."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def where(self) -> str:
        """What the constraint's errors name."""
        return self.origin or f"structured_outputs.{self.kind}"


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

OUTPUT_MODALITIES = ("text", "audio")


@dataclass
class SpeechParams:
    """How to speak a request's answer when ``output_modalities`` has "audio". Unset (None)
    talker settings take the model's defaults: the reference's ``generate`` defaults
    (``SpeechConfig.talker_defaults``)."""

    voice: str | None = None
    """One of the checkpoint's speakers (case-insensitive); None: the model's default voice."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    """Seeds the talker's (and code predictor's) sampling."""
    max_tokens: int | None = None
    """Most codec frames to speak (the talker's max_new_tokens)."""
    reply_in_prompt: bool = False
    """The words to speak are already in the prompt after the assistant's header (teacher-forced
    speech, as /v1/audio/speech sends): all of them are spoken, and nothing generated."""

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"speech.{name} must be {rule}, got {getattr(self, name)!r}.")

        check_types(self, "speech.")
        if self.voice == "":
            fail("voice", "None or a voice name")
        if self.temperature is not None and not (
            is_real(self.temperature) and 0.0 <= self.temperature <= FP32_MAX
        ):
            fail("temperature", f"a finite number in [0, {FP32_MAX:.4g}]")
        if self.top_k is not None and not is_int(self.top_k, 0, INT32_MAX):
            fail("top_k", "0 (disabled) or a positive integer")
        if self.top_p is not None and not (is_real(self.top_p) and FP32_TINY <= self.top_p <= 1.0):
            fail("top_p", "in (0, 1]")
        rep = self.repetition_penalty
        if rep is not None and not (is_real(rep) and FP32_TINY <= rep <= 1.0 / FP32_TINY):
            fail("repetition_penalty", "> 0 (and within float32 range)")
        if self.seed is not None and not is_int(self.seed, SEED_MIN, SEED_MAX):
            fail("seed", f"None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.max_tokens is not None and not is_int(self.max_tokens, 1, INT32_MAX):
            fail("max_tokens", f"an integer in [1, {INT32_MAX}]")


@dataclass
class PoolingParams:
    """How an embedding (or classification) request pools its prompt's final hidden states,
    cut to ``dimensions`` and L2-normalised when asked (or classified); a field left None takes
    the model's default (``--pooler-config``, else the checkpoint's sentence-transformers
    settings, else LAST with normalisation). The token tasks (vLLM's ``token_embed`` and
    ``token_classify``) keep every prompt position instead, each embedded or classified as a
    pooled state would be. Invalid values raise ``ValueError`` naming the field (a value of the
    wrong type ``ParamTypeError``, which is also a ``TypeError``)."""

    normalize: bool | None = None
    """Scale the embedding to unit L2 norm."""
    dimensions: int | None = None
    """Keep the first ``dimensions`` values (before normalising): only for a model whose config
    declares Matryoshka training (``is_matryoshka`` / ``matryoshka_dimensions``); None: all."""
    pooling_type: str | None = None
    """"LAST" (the prompt's last position), "MEAN" (the mean over its positions) or "CLS" (its
    first position)."""
    task: str | None = None
    """One of ``POOLING_TASKS``: "embed" (the pooled state), "classify" (a sequence
    classifier's label scores of it), "token_embed" or "token_classify" (the same of every
    prompt position: one row per position); None: classify on a sequence classifier, else
    embed."""
    use_activation: bool | None = None
    """classify: the labels' probabilities (softmax; a one-label model's sigmoid) rather than
    their raw scores; None: yes."""
    truncate_prompt_tokens: int | None = None
    """Pool only the prompt's last k tokens (-1: its last max_model_len), as
    ``SamplingParams.truncate_prompt_tokens`` runs them."""

    def __post_init__(self) -> None:
        check_types(self)
        if not is_truncation(self.truncate_prompt_tokens):
            raise ValueError(
                f"truncate_prompt_tokens must be {TRUNCATE_VALUES}, got "
                f"{self.truncate_prompt_tokens!r}."
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(
                f"dimensions must be None or a positive integer, got {self.dimensions!r}."
            )
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"task must be None or one of {', '.join(POOLING_TASKS)}, got {self.task!r}."
            )

    @property
    def per_token(self) -> bool:
        """Whether the result has a row per prompt position (the token tasks)."""
        return self.task in TOKEN_TASKS

    @property
    def reads_every_position(self) -> bool:
        """Whether pooling reads prompt positions before the last (which a prefix-cache hit
        would leave uncomputed)."""
        return self.per_token or self.pooling_type not in (None, "LAST")


POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")


_NESTED_PARAMS: dict[str, type] = {
    "structured_outputs": StructuredOutputsParams,
    "speech": SpeechParams,
    "pooling": PoolingParams,
}
"""The SamplingParams fields that take another params object (or a dict of its fields)."""


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the field (a
    value of the wrong type ``ParamTypeError``, which is also a ``TypeError``)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's old spelling) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    """Run only the prompt's last k tokens (-1: its last max_model_len), as vLLM's; a prompt with
    media or embeddings is not cut (it would cut their placeholders)."""
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    """token id -> added to its logit before sampling (OpenAI's, each in [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Sample only among these tokens (vLLM's)."""
    bad_words: list[str] = field(default_factory=list)
    """Words never to write: a word's last token is banned wherever the tokens before it were
    just generated (vLLM's)."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    """``bad_words`` as token sequences, with and without a leading space (the Processor fills
    it from the tokenizer)."""
    thinking_token_budget: int | None = None
    """At most this many tokens inside one ``<think>…</think>`` span: once they are spent, the
    only token the request may sample is the end tag, which closes the thinking (vLLM's). The
    span is the one the prompt leaves open (thinking templates) or one the model opens."""
    think_token_ids: tuple[int, int] | None = None
    """The ids of the thinking tags (``THINK_TAGS``) for ``thinking_token_budget`` (the
    Processor fills it from the tokenizer)."""
    extra_args: dict[str, Any] | None = None
    """Settings for custom logits processors (``omniserve.logits_processor``), which read them;
    the engine itself does not (vLLM's; the API's ``vllm_xargs``)."""
    output_modalities: list[str] = field(default_factory=lambda: ["text"])
    """What the request produces: "text", "audio" or both. Audio needs a model that speaks (a
    full omni checkpoint); the text is generated either way (it is what is spoken)."""
    speech: SpeechParams | None = None
    """The voice and talker settings of audio output (None: the defaults)."""
    pooling: PoolingParams | None = None
    """An embedding request (``LLM.embed``, ``/v1/embeddings``; ``embedding_params``): its
    output carries the prompt's pooled hidden state (``RequestOutput.pooled``) beside the one
    greedy token it samples (the step that computes the prompt's last position), which
    ``LLM.embed`` and the API drop. The request finishes on that token, which is never fed
    back, so the prompt may take all of max_model_len."""

    def __post_init__(self) -> None:
        self._copy_lists()
        if isinstance(self.logit_bias, dict):  # token ids may be digit strings (JSON keys)
            self.logit_bias = {
                int(t) if isinstance(t, str) and t.isdecimal() else t: bias
                for t, bias in self.logit_bias.items()
            }
        for name, kind in _NESTED_PARAMS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                known = {f.name for f in dataclasses.fields(kind)}
                if unknown := sorted(set(value) - known):
                    raise ValueError(
                        f"{name}.{unknown[0]} is not a {name} setting ({sorted(known)})."
                    )
                setattr(self, name, kind(**value))
            elif value is not None and not isinstance(value, kind):
                raise ParamTypeError(f"{name} must be a {kind.__name__} or a dict, got {value!r}.")
        check_types(self)
        pooled = self.pooling.truncate_prompt_tokens if self.pooling is not None else None
        if pooled is not None:  # a pooling request's cut is its pooling params'
            if self.truncate_prompt_tokens not in (None, pooled):
                raise ValueError(
                    f"truncate_prompt_tokens ({self.truncate_prompt_tokens}) contradicts "
                    f"pooling.truncate_prompt_tokens ({pooled})."
                )
            self.truncate_prompt_tokens = pooled
        if self.top_k == -1:
            self.top_k = 0
        if self.wants_audio and self.speech is None:
            self.speech = SpeechParams()
        self._validate()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _copy_lists(self) -> None:
        """The list fields (stop, bad_words, ...) take a copy, of a tuple too; None is [] unless
        the field may be None (allowed_token_ids); a str is one item of a list of strings."""
        for name, (kind, optional) in _LIST_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, str) and kind == list[str]:
                value = [value]  # one word, not its characters (vLLM's stop)
            if value is None or isinstance(value, list | tuple):
                setattr(self, name, list(value or []))

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if not is_int(self.n, 1, INT32_MAX):
            fail("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2.0 <= value <= 2.0:
                fail(name, "in [-2, 2]")
        rep = self.repetition_penalty
        if not is_real(rep) or not FP32_TINY <= rep <= 1.0 / FP32_TINY:
            fail(
                "repetition_penalty",
                f"> 0 and within float32 range [{FP32_TINY:.3g}, "
                f"{1.0 / FP32_TINY:.3g}] (the sampler divides by it)",
            )
        if not is_real(self.temperature) or not 0.0 <= self.temperature <= FP32_MAX:
            fail("temperature", f"a finite number in [0, {FP32_MAX:.4g}] (float32)")
        if not is_real(self.top_p) or not FP32_TINY <= self.top_p <= 1.0:
            fail("top_p", f"in (0, 1] and not below float32's smallest normal ({FP32_TINY:.3g})")
        if not is_int(self.top_k, 0, INT32_MAX):
            fail("top_k", f"0 or -1 (disabled) or an integer in [1, {INT32_MAX}]")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.max_tokens is not None and not is_int(self.max_tokens, 1, INT32_MAX):
            fail("max_tokens", f"an integer in [1, {INT32_MAX}]")
        if not is_int(self.min_tokens, 0, INT32_MAX):
            fail("min_tokens", f"an integer in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not is_int(value, 0, INT32_MAX):
                fail(name, "None or an integer >= 0")
        if not is_truncation(self.truncate_prompt_tokens):
            fail("truncate_prompt_tokens", TRUNCATE_VALUES)
        budget = self.thinking_token_budget
        if budget is not None and not is_int(budget, 0, INT32_MAX):
            fail("thinking_token_budget", f"None or an integer in [0, {INT32_MAX}]")
        if any(not s for s in self.stop):
            fail("stop", "a list of non-empty strings")
        if any(not is_int(t, 0, INT32_MAX) for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of token ids (non-negative integers)")
        if self.seed is not None and not is_int(self.seed, SEED_MIN, SEED_MAX):
            fail("seed", f"None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.logit_bias is not None and not all(
            is_int(t, 0, INT32_MAX) and is_real(b) and -100 <= b <= 100
            for t, b in self.logit_bias.items()
        ):
            fail("logit_bias", "a map of token ids to biases in [-100, 100]")
        if self.allowed_token_ids is not None and not (
            self.allowed_token_ids and all(is_int(t, 0, INT32_MAX) for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "a non-empty list of token ids")
        if any(not w.strip() for w in self.bad_words):
            fail("bad_words", "a list of non-empty strings")
        if any(not ids or not all(is_int(t, 0, INT32_MAX) for t in ids)
               for ids in self.bad_words_token_ids):  # fmt: skip
            fail("bad_words_token_ids", "a list of non-empty lists of token ids")
        if (
            not self.output_modalities
            or len(set(self.output_modalities)) != len(self.output_modalities)
            or not set(self.output_modalities) <= set(OUTPUT_MODALITIES)
        ):
            fail("output_modalities", f"a non-empty list of distinct {OUTPUT_MODALITIES}")

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.output_modalities

    @property
    def reads_prompt_states(self) -> bool:
        """Whether the request reads the final states of prompt positions before the last
        (prompt logprobs, MEAN or CLS pooling), so it must compute them: no prefix-cache hit."""
        return self.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.reads_every_position
        )

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling a token reads the values of the tokens before it (penalties, bad
        words, whether a thinking budget's span is still open): with async scheduling, the
        worker waits for the last step's token before it samples such a request's next one."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words_token_ids
            or self.thinking_token_budget is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def child_seed(self, index: int) -> int | None:
        """The seed of child ``index`` of an n > 1 request: consecutive, wrapping in 64 bits
        (a generator treats a seed and the same seed mod 2**64 alike)."""
        return None if self.seed is None else (self.seed + index) % 2**64

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (used to fan out n > 1 into child requests)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _list_type(hint: Any) -> Any:
    """The list type ``hint`` is or may be (``list[int] | None``: ``list[int]``), else None."""
    return next((h for h in (hint, *typing.get_args(hint)) if typing.get_origin(h) is list), None)


_LIST_FIELDS = {
    name: (kind, kind is not hint)
    for name, hint in field_types(SamplingParams).items()
    if (kind := _list_type(hint)) is not None
}
"""SamplingParams's list fields -> (their list type, whether they may be None)."""


def embedding_params(pooling: PoolingParams | None = None) -> SamplingParams:
    """The params of an embedding request (``pooling``; None: the model's defaults): it runs its
    prompt and samples one greedy token (the step that computes the prompt's last position),
    which is not reported."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        pooling=pooling or PoolingParams(),
    )
