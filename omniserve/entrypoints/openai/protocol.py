"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's extra fields.

Requests ignore unknown fields (clients send many we do not need); every value the engine cannot
honour is rejected with a 400 before it reaches the engine. Booleans and integers are strict (no
"yes" for true, no 1.0 for 1), as OpenAI's own API validates them. Responses follow OpenAI's
shapes so the official SDKs parse them; ``stop_reason`` is vLLM's extra field on choices.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar, Literal

import pydantic
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from omniserve.sampling_params import (
    SEED_MAX,
    SEED_MIN,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

MAX_N = 128


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``
    parses to one), which no UTF-8 consumer (tokenizer, template, log) can encode."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode()  # printable as is
            where = f"{path}.{name}" if path else name
            found = _lone_surrogate_at(key, where) or _lone_surrogate_at(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := _lone_surrogate_at(item, f"{path}[{i}]"):
                return found
    return None


def validation_message(exc: pydantic.ValidationError) -> str:
    """pydantic's errors as one line, "field: problem; ..." (as the API's 400s say them)."""
    problems = []
    for error in exc.errors():
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(f"{path.lstrip('.')}: {message}" if path else message)
    return "; ".join(problems)


def accepted_names(model: type[BaseModel]) -> set[str]:
    """The body keys a request model reads: its fields, their aliases and alias choices."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        if info.alias:
            names.add(info.alias)
        if isinstance(info.validation_alias, AliasChoices):
            names.update(c for c in info.validation_alias.choices if isinstance(c, str))
    return names


class RequestPart(OpenAIBaseModel):
    """A request body, or an object inside one (``stream_options``, a tool, ...): it refuses
    NaN and infinite numbers (JSON has none; Python's parser takes ``NaN`` and ``Infinity``)
    and ignores keys it does not know with one warning naming them, as vLLM does (clients send
    fields of other servers; a misspelt key is then in the log, not dropped unseen)."""

    model_config = ConfigDict(allow_inf_nan=False)

    passed_on: ClassVar[frozenset[str]] = frozenset()
    """Fields the request hands on, unparsed, to another request model that reads them."""

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = accepted_names(cls) | cls.passed_on
            unknown = sorted(str(key) for key in data if key not in known)
            if unknown:
                inside = "" if issubclass(cls, RequestModel) else f" (in {cls.__name__})"
                logger.warning("Ignored request fields this server does not use%s: %s",
                               inside, ", ".join(unknown))  # fmt: skip
        return data


class RequestModel(RequestPart):
    """A request body that also refuses vLLM's fields it cannot honour (``unsupported``) and
    text that is not valid Unicode."""

    unsupported: ClassVar[dict[str, tuple[Any, str]]] = {}
    """vLLM's fields with no meaning here yet, with their no-op value and why: any other value
    is a 400 naming the field (a silently dropped field would change answers without a word)."""

    other_prompt_form: ClassVar[str | None] = None
    """The route's other form of the prompt beside ``messages`` ("input", "prompt"): a body
    may give one of the two, never both (the one left unread would be dropped unseen)."""

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_form(cls, data: Any) -> Any:
        other = cls.other_prompt_form
        if other is not None and isinstance(data, dict) and "messages" in data and other in data:
            raise ValueError(
                f"{other}: give {other} or messages, not both (two forms of the prompt)."
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        if where := _lone_surrogate_at(data, ""):
            raise ValueError(
                f"{where} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), "
                "which is not valid Unicode text."
            )
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> RequestModel:
        for name, (default, reason) in self.unsupported.items():
            if getattr(self, name) not in (default, None):
                raise ValueError(f"{name} is not supported: {reason}.")
        return self


SAMPLING_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "best_of": (1, "sample n instead"),
    "logits_processors": (None, "they are loaded at start (--logits-processors): send vllm_xargs"),
    "kv_transfer_params": (None, "there is no KV transfer between instances"),
    "guided_whitespace_pattern": (
        None,
        "xgrammar takes no whitespace pattern (structured_outputs.disable_any_whitespace turns "
        "free whitespace off)",
    ),
    "media_io_kwargs": (None, "media decoding is set for the server (--media-io-kwargs)"),
    "functions": (None, "that is OpenAI's deprecated function calling: send tools"),
    "function_call": (None, "that is OpenAI's deprecated function calling: send tool_choice"),
}


# ---- errors, models, usage ----


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "omniserve"
    root: str | None = None
    parent: str | None = None
    """For a LoRA adapter: the served model it adapts."""
    max_model_len: int | None = None
    default_sampling_params: dict[str, float] = Field(default_factory=dict)
    """The checkpoint's recommended settings used for fields a request omits
    (``--generation-config``); empty: OpenAI's defaults."""


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestPart):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestPart):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    """Accepted for vLLM's clients; the name decides."""


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    video_tokens: int = 0


class CompletionTokensDetails(OpenAIBaseModel):
    audio_tokens: int = 0
    """Codec frames of spoken answers."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (token id -> this, per prompt position)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class StreamOptions(RequestPart):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    """vLLM's extra: put the running usage on every chunk."""


# ---- requests ----


class JsonSchemaFormat(RequestPart):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestPart):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required with type json_schema.")
        return self


class StructuredOutputsRequest(RequestPart):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: StrictBool = False
    """An option, not a constraint: may go with response_format or a guided_* field."""


class PromptOptions(RequestModel):
    """vLLM's fields about a request's prompt and its place in the queue, which every route
    that runs prompts takes (``OpenAIServing.apply_prompt_options`` applies the first two)."""

    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    """Keep only the prompt's last k tokens (-1: max_model_len); text prompts only."""
    cache_salt: str | None = Field(None, min_length=1)
    """Only requests with the same salt share prefix-cache blocks."""
    request_id: str | None = None
    """vLLM's: the response id is built from it (a random one when absent)."""
    priority: StrictInt = Field(0, ge=-(2**31), lt=2**31)
    """Lower runs first (the server needs --scheduling-policy priority for any other than 0)."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (max_model_len) or >= 1")
        return value


class SamplingRequest(PromptOptions):
    """The sampling fields chat and completions share (OpenAI's, then vLLM's extras)."""

    unsupported: ClassVar[dict[str, tuple[Any, str]]] = SAMPLING_UNSUPPORTED
    logprobs_field: ClassVar[str]
    """The field that says how many logprobs per token (named in its errors)."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0)
    top_p: StrictFloat | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's form) -> bias in [-100, 100] added to its logit."""
    response_format: ResponseFormat | None = None
    # vLLM's extra body fields
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older spellings of ``structured_outputs`` fields."""
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] = Field(default_factory=list)
    thinking_token_budget: StrictInt | None = Field(None, ge=0)
    """vLLM's: at most this many tokens of thinking (``<think>…</think>``), then the end tag."""
    return_token_ids: StrictBool = False
    """Also return the prompt's and the answer's token ids."""
    return_tokens_as_token_ids: StrictBool = False
    """Logprobs name tokens as "token_id:<id>" (for tokens that are not valid text alone)."""
    prompt_logprobs: StrictInt | None = Field(None, ge=0)
    """vLLM's: each prompt token's logprob and the top k at its position, returned as
    ``prompt_logprobs`` (not with stream, as in vLLM)."""
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    """vLLM's settings for custom logits processors (``SamplingParams.extra_args``)."""
    # vLLM's fields refused unless left at their no-op value (`unsupported`)
    best_of: StrictInt | None = None
    # vLLM's beam search: n is the beam width, the n best beams are the choices
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0
    """Beams are scored by their cumulative logprob over length ** length_penalty."""
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    guided_whitespace_pattern: Any = None
    media_io_kwargs: Any = None
    functions: Any = None
    function_call: Any = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    """vLLM's older backend choice: xgrammar is the one here ("auto" picks it)."""

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The one output constraint the request asks for, as ``StructuredOutputsParams``
        fields: from response_format, structured_outputs, a guided_* field or the tools."""
        found = self._constraints()
        options: dict[str, Any] = {}
        if self.structured_outputs is not None:
            options["disable_any_whitespace"] = self.structured_outputs.disable_any_whitespace
        constraint = next(iter(found.values()), None)
        return None if constraint is None else {**constraint[0], **options}

    @property
    def constraint_field(self) -> str | None:
        """Where in the body the constraint is (what its errors name)."""
        return next((where for _, where in self._constraints().values()), None)

    def _constraints(self) -> dict[str, tuple[dict[str, Any], str]]:
        """Each field that constrains the output -> (its constraint, where it is in the
        body); more than one is an error."""
        found: dict[str, tuple[dict[str, Any], str]] = {}
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                found["response_format"] = ({"json_object": True}, "response_format")
            else:
                assert self.response_format.json_schema is not None
                found["response_format"] = (
                    {"json": self.response_format.json_schema.schema_},
                    "response_format.json_schema.schema",
                )
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            fields.pop("disable_any_whitespace")
            if fields:
                found["structured_outputs"] = (fields, f"structured_outputs.{next(iter(fields))}")
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found[f"guided_{name}"] = ({name: value}, f"guided_{name}")
        found.update(self.forced_output())
        if len(found) > 1:
            raise ValueError(f"Give one output constraint, not {' and '.join(found)}.")
        if self.structured_outputs is not None and not found:
            raise ValueError(
                "structured_outputs has no constraint: give one of json, regex, choice, grammar, "
                "json_object or structural_tag (disable_any_whitespace alone goes with "
                "response_format or a guided_* field)."
            )
        return found

    def forced_output(self) -> dict[str, tuple[dict[str, Any], str]]:
        """Constraints the request implies beyond the constraint fields (named like them),
        with where they are in the body."""
        return {}

    @property
    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias keyed by token id."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings).") from None

    def to_sampling_params(
        self,
        defaults: dict[str, float],
        max_logprobs: int,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The one mapping from request fields to SamplingParams: a field the request omits
        takes ``defaults`` (the checkpoint's recommended values, ``--generation-config``), else
        OpenAI's. ``max_tokens``/``logprobs``: the route's reading of its own fields;
        ``prompt_logprobs``: what the route itself needs of the prompt (echo), beside what the
        request asks for. A ``ValueError`` names the field it refuses first."""
        for name, value in ((self.logprobs_field, logprobs),
                            ("prompt_logprobs", self.prompt_logprobs)):  # fmt: skip
            if value is not None and 0 <= max_logprobs < value:  # -1: no cap
                raise ValueError(
                    f"{name} may be at most {max_logprobs} (--max-logprobs), got {value}."
                )
        wanted = [k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None]

        def field(name: str, openai_default: float) -> Any:
            value = getattr(self, name)
            return defaults.get(name, openai_default) if value is None else value

        constraint = self.constraint
        return SamplingParams(
            n=self.n,
            temperature=field("temperature", 1.0),
            top_p=field("top_p", 1.0),
            top_k=field("top_k", 0),
            min_p=field("min_p", 0.0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=field("repetition_penalty", 1.0),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,  # the engine's processor resolves it against the prompt
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=max(wanted) if wanted else None,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=None
            if constraint is None
            else StructuredOutputsParams(**constraint, origin=self.constraint_field),
            logit_bias=self.token_logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            thinking_token_budget=self.thinking_token_budget,
            extra_args=self.vllm_xargs,
        )

    @model_validator(mode="after")
    def _check_supported(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=true.")
        self.constraint  # noqa: B018  (raises for conflicting constraints)
        self.token_logit_bias  # noqa: B018  (raises for keys that are not token ids)
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM).")
        self._check_beam_search()
        return self

    def _check_beam_search(self) -> None:
        """Beam search picks tokens by the model's own logprobs: it takes no sampling setting,
        and its answer is known only at the end."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies only with use_beam_search.")
            return
        if self.stream:
            raise ValueError("use_beam_search cannot stream: the best beams are known at the end.")
        if self.temperature:
            raise ValueError("use_beam_search takes temperature 0 (or none): it has no sampling.")
        neutral: dict[str, tuple[Any, ...]] = {
            "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "seed": (None,),
            "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
            "repetition_penalty": (None, 1.0), "stop": (None, [], ""), "stop_token_ids": (None, []),
            "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": ([],),
            "min_tokens": (0,), "prompt_logprobs": (None,), "thinking_token_budget": (None,),
        }  # fmt: skip
        for name, values in neutral.items():
            if getattr(self, name) not in values:
                raise ValueError(f"{name} does not apply with use_beam_search (no sampling).")
        if self.constraint is not None:
            raise ValueError(f"{self.constraint_field}: use_beam_search takes no constraint.")
        if getattr(self, "logprobs", None) not in (None, False):
            raise ValueError("logprobs is not available with use_beam_search.")


# ---- tools ----


class FunctionDefinition(RequestPart):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (None: no arguments)."""
    strict: StrictBool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class ChatCompletionTool(RequestPart):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestPart):
    name: str


class NamedToolChoice(RequestPart):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class VoiceId(RequestPart):
    id: str


class ChatCompletionAudioParam(RequestPart):
    """OpenAI's ``audio`` request field. ``voice``: one of the model's speakers
    (``GET /v1/audio/voices``), case-insensitive."""

    voice: str | VoiceId
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice


class SpeechOptions(RequestPart):
    """The talker's sampling settings (``SpeechParams``); unset ones take the model's."""

    model_config = ConfigDict(extra="forbid")
    temperature: StrictFloat | None = Field(None, ge=0.0)
    top_k: StrictInt | None = Field(None, ge=0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: StrictInt | None = Field(None, ge=1)
    """Most codec frames (12.5 per second of speech)."""
