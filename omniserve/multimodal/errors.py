"""The one error type for bad multimodal input, naming where it went wrong.

The server turns it into an HTTP 400 whose message names the message and part index (when the
item came from a chat message), the modality and the stage, so a client can tell a URL that did
not answer from an image that did not decode or one that is too large.
"""

from __future__ import annotations

from typing import Literal

Stage = Literal["fetch", "decode", "process", "budget"]

MM_EMBEDS_OFF = "precomputed embeddings need the server started with --enable-mm-embeds"
"""Why an embeddings item is refused by an engine that does not take them."""


class MultiModalInputError(ValueError):
    """A multimodal item was rejected at ``stage`` ("fetch", "decode", "process", "budget")."""

    def __init__(
        self,
        message: str,
        *,
        stage: Stage,
        modality: str | None = None,
        location: str | None = None,
    ) -> None:
        self.stage = stage
        self.modality = modality
        self.location = location  # e.g. "messages[1].content[2]"
        where = f"{location}: " if location else ""
        kind = f"{modality} " if modality else ""
        super().__init__(f"{where}{kind}{stage} error: {message}")
        self.detail = message

    def at(self, location: str) -> MultiModalInputError:
        """The same error, located at a chat message part."""
        return MultiModalInputError(
            self.detail, stage=self.stage, modality=self.modality, location=location
        )
