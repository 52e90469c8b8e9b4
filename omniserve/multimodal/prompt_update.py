"""Prompt updates: how one placeholder per item becomes the item's exact run of tokens.

Matching is on token ids only. omniserve requires each item's placeholder to be a special token
(or token sequence) in the prompt, tokenizes the prompt itself and expands every placeholder, so
text prompts and token-id prompts take the same path and no text re-encoding is ever needed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.inputs import PlaceholderRange

PromptSeq = str | list[int]
"""Text (encoded without special-token additions) or token ids."""


@dataclass(frozen=True)
class PromptUpdateDetails:
    """The tokens one item expands to, and which of them take one of its embeddings."""

    full: PromptSeq
    is_embed: list[bool] | None = None
    """Per token of ``full`` (None: every token takes an embedding)."""

    @staticmethod
    def select_token_id(seq: list[int], embed_token_id: int) -> PromptUpdateDetails:
        """Only the ``embed_token_id`` tokens of ``seq`` take embeddings (e.g. not timestamps)."""
        return PromptUpdateDetails(seq, [token == embed_token_id for token in seq])


PromptUpdateContent = (
    PromptSeq | PromptUpdateDetails | Callable[[int], PromptSeq | PromptUpdateDetails]
)
"""Static content, or ``item_idx -> content`` when the length depends on the item."""


@dataclass(frozen=True)
class PromptUpdate(ABC):
    """Base: the ``i``-th occurrence of ``target`` in the prompt belongs to the ``i``-th item of
    ``modality``; there must be exactly one occurrence per item."""

    modality: str
    target: PromptSeq

    keeps_target = False
    """True when the target stays in the prompt and the content follows it."""

    @property
    @abstractmethod
    def content(self) -> PromptUpdateContent:
        """What the target becomes (or is followed by): tokens, text, details, or a function
        of the item index giving one of those."""

    def resolve(self, item_idx: int) -> PromptUpdateDetails:
        content = self.content
        if callable(content):
            content = content(item_idx)
        if isinstance(content, PromptUpdateDetails):
            return content
        return PromptUpdateDetails(content)


@dataclass(frozen=True)
class PromptReplacement(PromptUpdate):
    """Replace the target (e.g. one ``<|image_pad|>``) with the item's tokens."""

    replacement: PromptUpdateContent

    @property
    def content(self) -> PromptUpdateContent:
        return self.replacement


@dataclass(frozen=True)
class PromptInsertion(PromptUpdate):
    """Keep the target and insert the item's tokens right after it."""

    insertion: PromptUpdateContent
    keeps_target = True

    @property
    def content(self) -> PromptUpdateContent:
        return self.insertion


@dataclass(frozen=True)
class PlacedItem:
    """Where one item's tokens landed in the updated prompt."""

    modality: str
    item_idx: int
    position: PlaceholderRange


def apply_prompt_updates(
    token_ids: list[int],
    updates: Sequence[PromptUpdate],
    num_items: Mapping[str, int],
    encode: Callable[[PromptSeq], list[int]],
) -> tuple[list[int], list[PlacedItem]]:
    """Expand every item's placeholder; return the new token ids and the items in prompt order.

    Occurrences are found in the original prompt (an item's expansion may repeat its own
    placeholder token), left to right without overlap. A modality whose placeholder count
    differs from its item count is an error naming both counts.
    """
    if len({u.modality for u in updates}) != len(updates):
        raise ValueError("at most one prompt update per modality")
    matches: list[tuple[int, int, PromptUpdate, int]] = []  # (start, end, update, item_idx)
    for update in updates:
        target = encode(update.target)
        starts = _find_all(token_ids, target)
        expected = num_items.get(update.modality, 0)
        if len(starts) != expected:
            raise MultiModalInputError(
                f"the prompt has {len(starts)} {_describe(update.target)} placeholder(s) but "
                f"{expected} {update.modality} item(s) were given; each item needs exactly one "
                "placeholder (the chat template inserts them)",
                stage="process",
                modality=update.modality,
            )
        matches.extend((s, s + len(target), update, i) for i, s in enumerate(starts))
    matches.sort(key=lambda match: match[0])
    for prev, nxt in zip(matches, matches[1:], strict=False):
        if nxt[0] < prev[1]:
            raise MultiModalInputError(
                f"the {prev[2].modality} and {nxt[2].modality} placeholders overlap",
                stage="process",
            )
    out: list[int] = []
    placed: list[PlacedItem] = []
    pos = 0
    for start, end, update, item_idx in matches:
        out.extend(token_ids[pos:end] if update.keeps_target else token_ids[pos:start])
        details = update.resolve(item_idx)
        tokens = encode(details.full)
        is_embed = details.is_embed
        if is_embed is not None and len(is_embed) != len(tokens):
            raise ValueError(f"is_embed has {len(is_embed)} entries for {len(tokens)} tokens")
        if is_embed is not None and all(is_embed):
            is_embed = None
        placed.append(
            PlacedItem(update.modality, item_idx, PlaceholderRange(len(out), len(tokens), is_embed))
        )
        out.extend(tokens)
        pos = end
    out.extend(token_ids[pos:])
    return out, placed


def _find_all(token_ids: list[int], target: list[int]) -> list[int]:
    """Start of every non-overlapping occurrence of ``target``, left to right."""
    if not target:
        raise ValueError("a prompt update target must not be empty")
    if len(target) == 1:
        token = target[0]
        return [i for i, t in enumerate(token_ids) if t == token]
    starts, i, n = [], 0, len(target)
    while i + n <= len(token_ids):
        if token_ids[i : i + n] == target:
            starts.append(i)
            i += n
        else:
            i += 1
    return starts


def _describe(target: PromptSeq) -> str:
    return repr(target) if isinstance(target, str) else f"token {target}"
