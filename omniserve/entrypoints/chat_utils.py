"""Chat messages (OpenAI shape) -> a rendered prompt plus the media they attach.

Content parts: text (``text``, ``input_text``, ``output_text``, ``refusal``), ``image_url``
(``{"url", "detail"}`` or a bare string; ``detail`` is accepted and ignored), ``input_audio``
(``{"data": base64, "format"}``), ``audio_url``, ``video_url``, the shorthand forms
``{"image_url": ...}`` / ``{"audio_url": ...}`` / ``{"video_url": ...}``, and for offline use
``image_pil`` (a PIL image) and ``audio_array`` ((waveform, rate)); with ``--enable-mm-embeds``,
``image_embeds`` / ``audio_embeds`` (base64 of ``torch.save``d tensors); with
``--enable-prompt-embeds``, vLLM's ``{"type": "prompt_embeds", "data": base64}`` (a tensor offline):
rows the decoder reads where the part sits, in place of token embeddings. A media part may carry a
``uuid`` (vLLM's): the item is known by it; a part with a uuid and no data reuses the item last
sent under it (the processor keeps it; an unknown uuid is an error naming the part).

Media parts become placeholders the model's processor later expands: passed to the chat template as
typed parts when the template iterates over content parts ("openai" format), otherwise as the
model's placeholder string inside the text ("string" format), as vLLM's "auto" mode decides.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from omniserve.inputs.data import EMBEDS_SLOT, TokensPrompt
from omniserve.multimodal.errors import MM_EMBEDS_OFF, MultiModalInputError
from omniserve.multimodal.media_io import load_tensor

TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")
MEDIA_PART_TYPES = {
    "image_url": "image",
    "image_pil": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio_array": "audio",
    "video_url": "video",
    "image_embeds": "image",
    "audio_embeds": "audio",
}
EMBEDS_PART_TYPES = ("image_embeds", "audio_embeds")
PROMPT_EMBEDS_MARK = "\U000f0000prompt_embeds\U000f0000"
"""Where a ``prompt_embeds`` part sits in the rendered text (a private-use character no tokenizer
sees: the text is cut at each mark and the pieces tokenized on their own)."""
# A template that reads content parts itself ("openai" content format).
_PARTS_TEMPLATE = re.compile(
    r"""\[\s*['"]type['"]\s*\]|\.type\b|for\s+\w+\s+in\s+message\s*(\[\s*['"]content['"]\s*\]"""
    r"""|\.content)"""
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, unsupported part, no template)."""


@dataclass
class _PendingMedia:
    modality: str
    location: str
    kind: str  # the part type
    payload: Any
    uuid: str | None = None
    """The part's ``uuid`` (vLLM's): the item's identity; without a payload, reuse it."""


@dataclass
class ChatInputs:
    """A parsed conversation: messages for the template, and media to load in order."""

    conversation: list[dict[str, Any]]
    pending: list[_PendingMedia] = field(default_factory=list)
    prompt_embeds: list[tuple[str, Any]] = field(default_factory=list)
    """(the part's location, its data) of each ``prompt_embeds`` part, in prompt order."""

    @property
    def has_media(self) -> bool:
        return bool(self.pending)

    def item_uuids(self) -> dict[str, list[str | None]]:
        """modality -> each item's uuid (None: none given), for modalities where one is."""
        uuids: dict[str, list[str | None]] = {}
        for item in self.pending:
            uuids.setdefault(item.modality, []).append(item.uuid)
        return {m: values for m, values in uuids.items() if any(v is not None for v in values)}

    def item_locations(self) -> dict[str, list[str]]:
        """modality -> the chat part of each of its items, in item order."""
        locations: dict[str, list[str]] = {}
        for item in self.pending:
            locations.setdefault(item.modality, []).append(item.location)
        return locations


CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's --chat-template-content-format: how a message's content reaches the template."""


def detect_content_format(template: str | None, setting: str = "auto") -> str:
    """``setting``, or for "auto" the template's own: "openai" if it reads content parts."""
    if setting != "auto":
        return setting
    return "openai" if template and _PARTS_TEMPLATE.search(template) else "string"


def parse_chat_messages(
    messages: list[dict[str, Any]],
    *,
    content_format: str = "string",
    placeholder: Callable[[str, int], str] | None = None,
    check_counts: Callable[[Mapping[str, int]], None] | None = None,
    where: str | None = None,
) -> ChatInputs:
    """Normalise messages; collect media parts (not loaded yet) in prompt order.

    ``placeholder(modality, index)`` gives the model's placeholder text; None means the model
    takes no media, so a media part is an error naming the part. ``check_counts({modality: n})``
    raises ``MultiModalInputError`` when n items of a modality are not allowed (a modality the
    model lacks, ``--limit-mm-per-prompt``): checked per part, so the error names the first part
    too many, and before any media is fetched. ``where``: the request field holding the one
    message's content parts (errors name ``{where}.content[j]``), when it is not ``messages``.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list.")
    inputs = ChatInputs([])
    counts: dict[str, int] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(f"messages[{i}] must be an object with a 'role'.")
        if not isinstance(message["role"], str) or not message["role"]:
            raise ChatTemplateError(
                f"messages[{i}].role must be a non-empty string, not {message['role']!r}."
            )
        if message.get("tool_calls"):
            message = {**message, "tool_calls": _template_tool_calls(i, message["tool_calls"])}
        content = message.get("content")
        if content is None or isinstance(content, str):
            inputs.conversation.append({**message, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts.")
        parts = [
            _parse_part(
                where or f"messages[{i}]", j, part, inputs, counts, placeholder, check_counts
            )  # fmt: skip
            for j, part in enumerate(content)
        ]
        if content_format == "openai":
            rendered: Any = [
                p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts
            ]
        else:
            rendered = "\n".join(p if isinstance(p, str) else p["placeholder"] for p in parts)
        inputs.conversation.append({**message, "content": rendered})
    return inputs


def _template_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each call's JSON arguments as an object, as
    chat templates expect them (they write ``arguments | tojson``), as vLLM passes them."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a list.")
    parsed = []
    for j, call in enumerate(calls):
        location = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{location} needs a function with a name.")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ChatTemplateError(
                    f"{location}.function.arguments is not JSON: {arguments[:80]!r}"
                ) from None
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


def _parse_part(
    message: str,
    j: int,
    part: Any,
    inputs: ChatInputs,
    counts: dict[str, int],
    placeholder: Callable[[str, int], str] | None,
    check_counts: Callable[[Mapping[str, int]], None] | None,
) -> str | dict[str, Any]:
    location = f"{message}.content[{j}]"
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ChatTemplateError(f"{location} must be an object.")
    kind = part.get("type")
    if kind is None:  # shorthand: {"image_url": ...}
        kind = next((k for k in MEDIA_PART_TYPES if k in part), "text")
    if kind in TEXT_PART_TYPES:
        text = part.get("text", part.get(kind))
        if not isinstance(text, str):
            raise ChatTemplateError(f"{location} ({kind}) has no text.")
        return text
    if kind == "prompt_embeds":
        if part.get("data") is None:
            raise ChatTemplateError(f"{location} (prompt_embeds) has no data.")
        inputs.prompt_embeds.append((location, part["data"]))
        return PROMPT_EMBEDS_MARK
    modality = MEDIA_PART_TYPES.get(kind)
    if modality is None:
        raise ChatTemplateError(f"{location}: content part type {kind!r} is not supported.")
    if placeholder is None:
        raise MultiModalInputError(
            "this model takes no multimodal input",
            stage="process",
            modality=modality,
            location=location,
        )
    payload, uuid = part.get(kind), part.get("uuid")
    if uuid is not None and not (isinstance(uuid, str) and uuid):
        raise ChatTemplateError(f"{location}.uuid must be a non-empty string.")
    if payload is None and uuid is None:
        raise MultiModalInputError(
            f"the {kind!r} part has no {kind!r} field (nor a uuid of an item sent before)",
            stage="fetch",
            modality=modality,
            location=location,
        )
    index = counts.get(modality, 0)
    counts[modality] = index + 1
    if check_counts is not None:
        try:
            check_counts({modality: index + 1})
        except MultiModalInputError as exc:
            raise exc.at(location) from exc
    inputs.pending.append(_PendingMedia(modality, location, kind, payload, uuid))
    return {"type": modality, "placeholder": placeholder(modality, index)}


_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm", "mp4")
"""``input_audio.format`` values (OpenAI's wav and mp3, and what the decoders read)."""
_IMAGE_DETAILS = ("auto", "low", "high")
"""OpenAI's ``image_url.detail`` (taken and checked; the model's processor sets the size)."""


def _media_url(item: _PendingMedia) -> str:
    payload = item.payload
    if item.kind == "input_audio":
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise MultiModalInputError(
                "input_audio needs {'data': base64, 'format': ...}",
                stage="decode",
                modality="audio",
                location=item.location,
            )
        audio_format = payload.get("format", "wav")
        if audio_format not in _AUDIO_FORMATS:
            raise MultiModalInputError(
                f"input_audio.format must be one of {', '.join(_AUDIO_FORMATS)}, "
                f"not {audio_format!r}",
                stage="decode",
                modality="audio",
                location=item.location,
            )
        return f"data:audio/{audio_format};base64,{payload['data']}"
    if isinstance(payload, dict) and payload.get("detail", "auto") not in _IMAGE_DETAILS:
        raise MultiModalInputError(
            f"{item.kind}.detail must be one of {', '.join(_IMAGE_DETAILS)}, "
            f"not {payload['detail']!r}",
            stage="fetch",
            modality=item.modality,
            location=item.location,
        )
    url = payload.get("url") if isinstance(payload, dict) else payload
    if not isinstance(url, str) or not url:
        raise MultiModalInputError(
            f"{item.kind} needs a 'url'",
            stage="fetch",
            modality=item.modality,
            location=item.location,
        )
    return url


def _fetch_kwargs(item: _PendingMedia, mm_processor_kwargs: dict[str, Any]) -> dict[str, Any]:
    if item.modality != "video":
        return {}
    return {k: mm_processor_kwargs[k] for k in ("num_frames", "fps") if k in mm_processor_kwargs}


def _decode_embeds(item: _PendingMedia) -> dict[str, Any]:
    """An ``image_embeds`` / ``audio_embeds`` part: base64 of ``torch.save(tensor)`` (the
    embeddings), or a dict of such (the embeddings and the fields the model needs, e.g.
    ``image_grid_thw``); loaded with ``weights_only=True``, so no code runs."""

    fields = item.payload if isinstance(item.payload, dict) else {item.kind: item.payload}
    decoded = {}
    for name, text in fields.items():
        try:
            decoded[name] = load_tensor(text)
        except ValueError as exc:
            raise MultiModalInputError(
                f"{item.kind}.{name} {exc}",
                stage="decode",
                modality=item.modality,
                location=item.location,
            ) from None
    return decoded


def _decode_prompt_embeds(location: str, data: Any) -> Any:
    """A ``prompt_embeds`` part's tensor (``load_tensor``), or the tensor itself (offline)."""
    import torch

    if isinstance(data, torch.Tensor):
        return data
    try:
        return load_tensor(data)
    except ValueError as exc:
        raise ChatTemplateError(f"{location}: prompt_embeds data {exc}") from None


def _local_value(item: _PendingMedia) -> tuple[bool, Any]:
    """(True, the item's value) for parts that need no fetch: in-memory media, embeddings,
    and items reused by uuid (None)."""
    if item.kind in EMBEDS_PART_TYPES and item.payload is not None:
        return True, _decode_embeds(item)
    if item.payload is None or item.kind in ("image_pil", "audio_array"):
        return True, item.payload
    return False, None


def load_media(
    inputs: ChatInputs, connector: Any, mm_processor_kwargs: dict[str, Any] | None = None
) -> dict[str, list[Any]]:
    """Fetch and decode every media part, in order; errors name the part."""
    mm_data: dict[str, list[Any]] = {}
    for item in inputs.pending:
        local, value = _local_value(item)
        if not local:
            fetch = getattr(connector, f"fetch_{item.modality}")
            try:
                value = fetch(_media_url(item), **_fetch_kwargs(item, mm_processor_kwargs or {}))
            except MultiModalInputError as exc:
                raise exc.at(item.location) from exc
        mm_data.setdefault(item.modality, []).append(value)
    return mm_data


def locate_mm_error(
    exc: MultiModalInputError, item_locations: Mapping[str, list[str]]
) -> MultiModalInputError:
    """Name the chat part of an error raised after rendering (processing, encoder budget), which
    knows the item's modality but not its part; with several items of that modality, all of
    their parts are named."""
    parts = item_locations.get(exc.modality or "", [])
    if exc.location is not None or not parts:
        return exc
    return exc.at(parts[0] if len(parts) == 1 else "one of " + ", ".join(parts))


async def load_media_async(
    inputs: ChatInputs, connector: Any, mm_processor_kwargs: dict[str, Any] | None = None
) -> dict[str, list[Any]]:
    """``load_media`` with every fetch running concurrently off the event loop."""

    async def one(item: _PendingMedia) -> Any:
        if item.kind in EMBEDS_PART_TYPES and item.payload is not None:
            return await asyncio.to_thread(_decode_embeds, item)
        local, value = _local_value(item)
        if local:
            return value
        fetch = getattr(connector, f"fetch_{item.modality}_async")
        try:
            return await fetch(_media_url(item), **_fetch_kwargs(item, mm_processor_kwargs or {}))
        except MultiModalInputError as exc:
            raise exc.at(item.location) from exc

    values = await asyncio.gather(*(one(item) for item in inputs.pending))
    mm_data: dict[str, list[Any]] = {}
    for item, value in zip(inputs.pending, values, strict=True):
        mm_data.setdefault(item.modality, []).append(value)
    return mm_data


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the template renders it; ``tools`` (OpenAI's function tools) go to
    templates that list them for the model."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("The tokenizer has no chat template; pass --chat-template.")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message are exclusive.")
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise ChatTemplateError(
            "continue_final_message continues the last message, which must be the assistant's, "
            f"not {conversation[-1].get('role')!r}."
        )
    taken = sorted(set(chat_template_kwargs or {}) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise ChatTemplateError(
            f"chat_template_kwargs.{taken[0]} is set from the request itself; it cannot be a "
            f"template keyword (those are {', '.join(sorted(_TEMPLATE_ARGUMENTS))})."
        )
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})},
        )
    except Exception as exc:  # jinja errors are many types; all mean "cannot render"
        raise ChatTemplateError(f"Cannot apply the chat template: {exc}") from exc


_TEMPLATE_ARGUMENTS = frozenset(
    ("messages", "conversation", "chat_template", "tokenize", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_assistant_tokens_mask")
)  # fmt: skip
"""What ``apply_chat_template`` takes from the request itself, never from chat_template_kwargs
(``tools`` and ``documents`` may come from either)."""


class ChatRenderer:
    """Messages -> an engine prompt (token ids of the templated text + the loaded media).

    Shared by ``LLM.chat`` and the API server, so both render and load media identically.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        placeholder: Callable[[str, int], str] | None = None,
        connector: Any = None,
        check_counts: Callable[[Mapping[str, int]], None] | None = None,
        mm_embeds: bool = True,
        content_format: str = "auto",
    ) -> None:
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"not {content_format!r}.")  # fmt: skip
        self.tokenizer = tokenizer
        self.mm_embeds = mm_embeds
        self.chat_template = chat_template
        self.placeholder = placeholder
        self.connector = connector
        self.check_counts = check_counts
        self.format_setting = content_format
        self.content_format = detect_content_format(
            chat_template or getattr(tokenizer, "chat_template", None), content_format
        )

    @classmethod
    def from_config(
        cls, config: Any, tokenizer: Any, chat_template: str | None = None,
        content_format: str = "auto",
    ) -> ChatRenderer:  # fmt: skip
        from omniserve.multimodal.context import InputProcessingContext
        from omniserve.multimodal.media import MediaConnector, media_config
        from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
        from omniserve.registry import ModelRegistry

        factories = MULTIMODAL_REGISTRY.get_factories(config.model_config)
        if factories is None:
            return cls(tokenizer, chat_template=chat_template, content_format=content_format)
        model_cls = ModelRegistry.resolve_model_cls(config.model_config.architecture)
        mm = config.multimodal_config
        connector = MediaConnector(media_config(mm))
        # The engine's own item-count rules, so a chat part breaking them is named (and nothing
        # is fetched for a request that would be refused).
        info = factories.info(
            InputProcessingContext(
                config.model_config, tokenizer, limit_mm_per_prompt=mm.limit_mm_per_prompt
            )
        )
        return cls(
            tokenizer,
            chat_template=chat_template,
            placeholder=model_cls.get_placeholder_str,  # type: ignore[attr-defined]  # every multimodal model has it
            connector=connector,
            check_counts=info.validate_num_items,
            mm_embeds=mm.enable_mm_embeds,
            content_format=content_format,
        )

    def _parse(self, messages: list[dict[str, Any]], where: str | None = None) -> ChatInputs:
        """The messages' parts; embeddings refused before decoding if off (--enable-mm-embeds)."""
        form = self.content_format if where is None else "string"
        inputs = parse_chat_messages(messages, content_format=form, placeholder=self.placeholder,
                                     check_counts=self.check_counts, where=where)  # fmt: skip
        for item in [] if self.mm_embeds else inputs.pending:
            if item.kind in EMBEDS_PART_TYPES:
                raise MultiModalInputError(
                    MM_EMBEDS_OFF, stage="process", modality=item.modality, location=item.location
                )
        return inputs

    def for_template(self, chat_template: str | None) -> ChatRenderer:
        """This renderer with another template (a request's own); itself for None."""
        if chat_template is None:
            return self
        other = copy.copy(self)
        other.chat_template = chat_template
        other.content_format = detect_content_format(chat_template, self.format_setting)
        return other

    def _prompt(
        self,
        inputs: ChatInputs,
        mm_data: dict[str, list[Any]],
        mm_processor_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
        template: bool = True,
        **template_kwargs: Any,
    ) -> TokensPrompt:
        """The prompt of the conversation, templated (else its messages' texts, one per line, as
        vLLM's score inputs are: with media placeholder strings and the tokenizer's specials)."""
        conversation = inputs.conversation
        text = (
            apply_chat_template(
                self.tokenizer, conversation, chat_template=self.chat_template, **template_kwargs
            )
            if template
            else "\n".join(message["content"] for message in conversation)
        )
        # The template already holds any BOS: the tokenizer adds its specials only on request.
        pieces = text.split(PROMPT_EMBEDS_MARK)
        if len(pieces) != len(inputs.prompt_embeds) + 1:
            raise ChatTemplateError(
                f"The chat template rendered {len(pieces) - 1} of the "
                f"{len(inputs.prompt_embeds)} prompt_embeds parts, or a text holds the "
                "private-use character U+F0000."
            )
        token_ids = self.tokenizer(pieces[0], add_special_tokens=add_special_tokens).input_ids
        for piece in pieces[1:]:  # each run of embeddings, then the text after it
            token_ids += [EMBEDS_SLOT, *self.tokenizer(piece, add_special_tokens=False).input_ids]
        prompt = TokensPrompt(prompt="".join(pieces), prompt_token_ids=token_ids)
        if inputs.prompt_embeds:
            prompt["prompt_embeds"] = [
                _decode_prompt_embeds(*part) for part in inputs.prompt_embeds
            ]
        if mm_data:
            prompt["multi_modal_data"] = mm_data
        if inputs.item_uuids():
            prompt["multi_modal_uuids"] = inputs.item_uuids()
        if mm_processor_kwargs and mm_data:  # (checked before the media was fetched)
            prompt["mm_processor_kwargs"] = dict(mm_processor_kwargs)
        return prompt

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> TokensPrompt:
        inputs = self._parse(messages)
        mm_data = load_media(inputs, self.connector, mm_processor_kwargs)
        return self._prompt(inputs, mm_data, mm_processor_kwargs, **template_kwargs)

    async def render_async(
        self,
        messages: list[dict[str, Any]],
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        executor: Executor | None = None,
        where: str | None = None,
        **template_kwargs: Any,
    ) -> tuple[TokensPrompt, dict[str, list[str]]]:
        """``render`` with the fetches concurrent and the templating and tokenization on
        ``executor`` (the loop's default one if None), never on the event loop; also each item's
        chat part (by modality), to locate errors the engine raises about an item later
        (``locate_mm_error``). ``where``: the request field holding the one message's parts,
        when it is not ``messages`` (``parse_chat_messages``)."""
        inputs = self._parse(messages, where)
        mm_data = await load_media_async(inputs, self.connector, mm_processor_kwargs)
        prompt = await asyncio.get_running_loop().run_in_executor(
            executor,
            functools.partial(
                self._prompt, inputs, mm_data, mm_processor_kwargs, **template_kwargs
            ),
        )
        return prompt, inputs.item_locations()
