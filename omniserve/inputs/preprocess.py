"""InputPreprocessor: a prompt in any accepted form -> token ids and multimodal items.

Text and token-id prompts take one path: with ``multi_modal_data`` both go through the model's
multimodal processor, which runs the HF processor on the media only and expands each placeholder
into the item's tokens itself. Embeddings (``prompt_embeds``: a whole prompt, or runs inside a
token prompt, e.g. a chat's ``prompt_embeds`` parts) get placeholder ids, one per row, which only
count positions (the runner feeds the rows).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from omniserve.inputs.data import EMBEDS_SLOT, PROMPT_KEYS, PromptType
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PromptEmbeds
from omniserve.multimodal.parse import embeds_fault
from omniserve.tokenizer import tokenizer_refusal

logger = logging.getLogger(__name__)


@dataclass
class ProcessedInputs:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    num_mm_tokens: dict[str, int] = field(default_factory=dict)
    """Placeholder tokens per modality (for usage.prompt_tokens_details)."""
    prompt_embeds: list[PromptEmbeds] = field(default_factory=list)
    """Runs of the prompt given as embeddings (their ``prompt_token_ids`` are placeholders)."""

    @property
    def given_as_embeds(self) -> bool:
        """The whole prompt was given as embeddings: it has no token ids of its own."""
        runs = self.prompt_embeds
        return len(runs) == 1 and len(runs[0].embeds) == len(self.prompt_token_ids)


PROMPT_EMBEDS_PLACEHOLDER_ID = 0
"""The token id standing for each row of a prompt given as embeddings: never embedded, never
shown; it only gives the row a position (and the scheduler a token to count)."""


class InputPreprocessor:
    def __init__(
        self,
        tokenizer: Any,
        mm_processor: Any | None = None,
        default_mm_kwargs: dict[str, object] | None = None,
        *,
        prompt_embeds_width: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor
        self.prompt_embeds_width = prompt_embeds_width
        """The hidden size prompt embeddings must have; None: they are not accepted."""
        self.default_mm_kwargs = dict(default_mm_kwargs or {})
        self._warned_unused_mm_kwargs = False
        if self.default_mm_kwargs:
            if mm_processor is None:
                raise ValueError(
                    "--mm-processor-kwargs is set, but this model takes no multimodal input."
                )
            mm_processor.info.check_server_kwargs(self.default_mm_kwargs)

    def preprocess(self, prompt: PromptType) -> ProcessedInputs:
        if isinstance(prompt, str):
            return ProcessedInputs(prompt, self._tokenize(prompt))
        if not isinstance(prompt, dict):
            raise TypeError(f"A prompt must be a str or a dict, got {type(prompt).__name__}.")
        _check_keys(prompt)
        if "prompt_embeds" in prompt:
            if "prompt_token_ids" in prompt:
                return self._with_embeds_runs(dict(prompt))
            return self._embeds_prompt(dict(prompt))
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError("'prompt' must be a str.")
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is not None:
            token_ids = checked_token_ids(token_ids)
        if text is None and token_ids is None:
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        mm_data = prompt.get("multi_modal_data")
        if mm_data is not None and not isinstance(mm_data, dict):
            raise TypeError(
                "multi_modal_data must be a dict of modality -> item or items (e.g. "
                f"{{'image': [img1, img2]}}), not {type(mm_data).__name__}."
            )
        uuids = prompt.get("multi_modal_uuids")
        if uuids is not None and not (isinstance(uuids, dict) and mm_data):
            raise TypeError(
                "multi_modal_uuids must be a dict (modality -> uuids) next to the "
                "multi_modal_data its items belong to."
            )
        mm_kwargs = prompt.get("mm_processor_kwargs")
        if mm_data and self.tokenizer is None:
            raise ValueError(tokenizer_refusal("multi_modal_data (the model's processor)"))
        if mm_data:
            return self._process_multimodal(
                text, token_ids, mm_data, {} if mm_kwargs is None else mm_kwargs, uuids
            )
        if mm_kwargs is not None:
            self._check_unused_mm_kwargs(mm_kwargs)
        if token_ids is None:
            token_ids = self._tokenize(text)  # type: ignore[arg-type]
        return ProcessedInputs(text, list(token_ids))

    def _embeds_prompt(self, prompt: dict[str, Any]) -> ProcessedInputs:
        """A prompt given as embeddings alone: checked to be rows the decoder can read."""
        others = sorted(set(prompt) - {"prompt_embeds", "cache_salt"})
        if others:
            raise ValueError(
                f"A prompt given as prompt_embeds takes no {', '.join(others)}: the embeddings "
                "are the whole prompt."
            )
        run = self._checked_run(prompt["prompt_embeds"], "prompt_embeds")
        return self._place_runs({"prompt_token_ids": [EMBEDS_SLOT]}, [run])

    def _checked_run(self, embeds: Any, name: str) -> PromptEmbeds:
        """Rows the decoder can read (floating, [n, hidden], finite), hashed, at offset 0."""
        if self.prompt_embeds_width is None:
            raise ValueError(
                "prompt_embeds needs the engine started with enable_prompt_embeds "
                "(--enable-prompt-embeds)."
            )
        if isinstance(embeds, torch.Tensor) and embeds.ndim == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]  # a batch of one, as an embedding layer returns it
        fault = embeds_fault(embeds, self.prompt_embeds_width, name, "num_tokens")
        if fault is not None:
            raise ValueError(f"{fault}.")
        embeds = embeds.detach().to("cpu").contiguous()
        digest = hashlib.sha256(f"{embeds.dtype}{tuple(embeds.shape)}".encode())
        digest.update(embeds.view(torch.uint8).numpy().data)
        return PromptEmbeds(embeds, digest.hexdigest())

    def _with_embeds_runs(self, prompt: dict[str, Any]) -> ProcessedInputs:
        """A token prompt (with media, if any) whose ids hold ``EMBEDS_SLOT`` where each of
        ``prompt_embeds``' tensors goes."""
        tensors = prompt.pop("prompt_embeds")
        if not isinstance(tensors, list):
            raise TypeError(
                "prompt_embeds beside prompt_token_ids must be a list of tensors (one per "
                f"{EMBEDS_SLOT} in the ids)."
            )
        runs = [self._checked_run(t, f"prompt_embeds[{i}]") for i, t in enumerate(tensors)]
        slots = sum(t == EMBEDS_SLOT for t in prompt.get("prompt_token_ids") or [])
        if slots != len(runs):
            raise ValueError(
                f"prompt_token_ids hold {slots} places ({EMBEDS_SLOT}) for prompt_embeds, but "
                f"{len(runs)} tensors were given."
            )
        return self._place_runs(prompt, runs)

    def _place_runs(self, prompt: dict[str, Any], runs: list[PromptEmbeds]) -> ProcessedInputs:
        """``prompt`` processed as usual (its ``EMBEDS_SLOT`` ids pass through the media
        placeholders' expansion), then each slot replaced by its run's placeholders, and the
        media after a run moved by the positions it adds."""
        inputs = self.preprocess(prompt)  # type: ignore[arg-type]
        ids: list[int] = []
        placed: list[PromptEmbeds] = []
        slots_at: list[tuple[int, int]] = []  # (index in the processed ids, positions added)
        for index, token in enumerate(inputs.prompt_token_ids):
            if token != EMBEDS_SLOT:
                ids.append(token)
                continue
            run = runs[len(placed)]
            placed.append(msgspec.structs.replace(run, offset=len(ids)))
            slots_at.append((index, len(run.embeds) - 1))
            ids += [PROMPT_EMBEDS_PLACEHOLDER_ID] * len(run.embeds)
        features = []
        for feature in inputs.mm_features:  # an item after a run moves by the run's positions
            pos = feature.mm_position
            moved = pos.offset + sum(n for index, n in slots_at if index < pos.offset)
            moved_pos = msgspec.structs.replace(pos, offset=moved)
            features.append(msgspec.structs.replace(feature, mm_position=moved_pos))
        return dataclasses.replace(inputs, prompt_token_ids=ids, mm_features=features,
                                   prompt_embeds=placed)  # fmt: skip

    def _process_multimodal(
        self,
        text: str | None,
        token_ids: list[int] | None,
        mm_data: dict[str, Any],
        mm_kwargs: dict[str, object],
        mm_uuids: dict[str, Any] | None = None,
    ) -> ProcessedInputs:
        if self.mm_processor is None:
            modality = next(iter(mm_data), None)
            raise MultiModalInputError(
                "this model takes no multimodal input", stage="process", modality=modality
            )
        self.check_mm_kwargs(mm_kwargs)
        result = self.mm_processor.apply(
            token_ids if token_ids is not None else text,
            mm_data,
            {**self.default_mm_kwargs, **mm_kwargs},
            mm_uuids,
        )
        return ProcessedInputs(
            text,
            list(result.prompt_token_ids),
            list(result.mm_features),
            dict(result.num_tokens_by_modality),
        )

    def _check_unused_mm_kwargs(self, mm_kwargs: object) -> None:
        """``mm_processor_kwargs`` in a prompt without media: vLLM ignores them (a text model's
        too), and so does this, logging the no-op once; they must still be a dict."""
        if not isinstance(mm_kwargs, dict):
            raise TypeError(f"mm_processor_kwargs must be a dict, not {type(mm_kwargs).__name__}.")
        if mm_kwargs and not self._warned_unused_mm_kwargs:
            self._warned_unused_mm_kwargs = True
            logger.warning(
                "mm_processor_kwargs %s given in a prompt without multi_modal_data have no "
                "effect (logged once).",
                sorted(mm_kwargs),
            )

    def check_mm_kwargs(self, mm_kwargs: object) -> None:
        """A request's ``mm_processor_kwargs``: a dict of the model's declared per-request
        options, each in range (checked before any media is fetched or decoded)."""
        if not isinstance(mm_kwargs, dict):
            raise TypeError(f"mm_processor_kwargs must be a dict, not {type(mm_kwargs).__name__}.")
        if not mm_kwargs:
            return
        if self.mm_processor is None:
            raise MultiModalInputError(
                "mm_processor_kwargs given, but this model takes no multimodal input",
                stage="process",
            )
        self.mm_processor.info.check_request_kwargs(mm_kwargs)

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(tokenizer_refusal("A text prompt"))
        return list(self.tokenizer(text).input_ids)


def _check_keys(prompt: Mapping[str, object]) -> None:
    """A prompt dict holds only ``PROMPT_KEYS``: any other key is a mistake (most often a typo
    of one), which would otherwise be ignored."""
    unknown = sorted(map(str, set(prompt) - PROMPT_KEYS))
    if not unknown:
        return
    if "token_type_ids" in unknown:
        raise TypeError(
            "token_type_ids: vLLM's field for BERT-style cross-encoders; the models served here "
            "have no token types."
        )
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, PROMPT_KEYS, n=1)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"Unknown prompt key{'s' if len(unknown) > 1 else ''} {', '.join(named)}; a prompt "
        f"dict takes {', '.join(sorted(PROMPT_KEYS))}."
    )


def checked_token_ids(token_ids: object) -> list[int]:
    """A list of ints from a list, a tuple or a 1-D integer array (``True`` is an int to
    Python, never a token id)."""
    if isinstance(token_ids, tuple):
        token_ids = list(token_ids)
    elif getattr(token_ids, "ndim", None) == 1 and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # a numpy or torch vector
    if not isinstance(token_ids, list):
        raise TypeError(
            "prompt_token_ids must be a list of ints (or a tuple, or a 1-D integer array), not "
            f"{type(token_ids).__name__}."
        )
    plain = True
    for index, token in enumerate(token_ids):
        if type(token) is int:
            continue
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(
                f"prompt_token_ids[{index}] must be an int, not {type(token).__name__}."
            )
        plain = False
    return token_ids if plain else [int(token) for token in token_ids]
