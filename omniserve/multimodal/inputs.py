"""Per-item multimodal records that travel from the front end to the scheduler and workers.

Pure Python (the item's tensors are opaque to this module), so the scheduler can import it.
One item = one image, one audio clip or one video (with its audio track, when used). Its
``identifier`` (a content hash that also covers every processor kwarg that changes the output)
keys the processor cache, the encoder cache and the prefix-cache block hashes alike.
"""

from __future__ import annotations

from typing import Any

import msgspec


class PlaceholderRange(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where an item's tokens sit in the prompt: ``[offset, offset + length)``.

    ``is_embed`` marks which of those positions take one of the item's encoder embeddings
    (None: all of them). Positions that do not (e.g. timestamps or start/end markers inside an
    expanded placeholder) keep their token embedding.
    """

    offset: int
    length: int
    is_embed: list[bool] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embeds_in(self, start: int, end: int) -> tuple[int, int]:
        """The slice ``[first, last)`` of this item's embeddings that prompt positions
        ``[start, end)`` consume (clipped to the range)."""
        lo, hi = max(start, self.offset) - self.offset, min(end, self.end) - self.offset
        if hi <= lo:
            return (0, 0)
        if self.is_embed is None:
            return (lo, hi)
        return (sum(self.is_embed[:lo]), sum(self.is_embed[:hi]))


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """One multimodal item of a request, in prompt order."""

    modality: str
    """"image", "video" or "audio" (a video with its audio track stays "video")."""
    identifier: str
    """Content hash of the item plus the processor kwargs that affect it."""
    mm_position: PlaceholderRange
    data: dict[str, Any] | None = None
    """The encoder's inputs for this item alone (tensors, e.g. pixel_values + image_grid_thw)."""


class PromptEmbeds(msgspec.Struct, array_like=True, omit_defaults=True):
    """Embeddings given for a run of prompt positions (vLLM's ``prompt_embeds``: a whole
    prompt, or a chat's ``prompt_embeds`` part): rows the decoder reads in place of those
    positions' (placeholder) token embeddings, as it reads an item's encoder output in place of
    its placeholders'."""

    embeds: Any
    """``[num_tokens, hidden_size]`` floating-point tensor on the CPU, as the client sent it."""
    identifier: str
    """Content hash (dtype, shape, values): what the prefix cache keys their blocks by."""
    offset: int = 0
    """The prompt position of the first row."""


class EncoderItem(dict[str, Any]):
    """An item's data as the model's encoder gets it: its tensors on the model's device, and
    ``host``, the same data where the processor made it. Encoders read their metadata (grids,
    lengths, masks, token orders) from ``host``: reading a value from a GPU waits for everything
    queued before it (the step in flight, under async scheduling the next one too)."""

    def __init__(self, on_device: dict[str, Any], host: dict[str, Any]) -> None:
        super().__init__(on_device)
        self.host = host


def host_data(item: dict[str, Any]) -> dict[str, Any]:
    """The host data of an encoder's item; a plain dict (a direct call) is its own."""
    return item.host if isinstance(item, EncoderItem) else item
