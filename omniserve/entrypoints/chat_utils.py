"""Chat messages (OpenAI shape) -> a rendered prompt, through the checkpoint's chat template."""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, unsupported part, no template)."""


def parse_chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalise messages to ``{"role", "content": str}`` (plus tool fields passed through)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list.")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(f"messages[{i}] must be an object with a 'role'.")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "\n".join(_part_text(i, j, part) for j, part in enumerate(content))
        else:
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts.")
        conversation.append({**message, "content": text})
    return conversation


def _part_text(i: int, j: int, part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ChatTemplateError(f"messages[{i}].content[{j}] must be an object.")
    kind = part.get("type", "text")
    if kind in TEXT_PART_TYPES:
        text = part.get("text", part.get(kind))
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{i}].content[{j}] ({kind}) has no text.")
        return text
    raise ChatTemplateError(
        f"messages[{i}].content[{j}]: content part type {kind!r} is not supported by this model."
    )


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("The tokenizer has no chat template; pass --chat-template.")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message are exclusive.")
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors are many types; all mean "cannot render"
        raise ChatTemplateError(f"Cannot apply the chat template: {exc}") from exc
