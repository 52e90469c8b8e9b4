"""Multimodal processing: prompt + media -> token ids with expanded placeholders + per-item tensors.

One path for text and token-id prompts (design.md §2.4, vllm-v1-notes §9.2): omniserve tokenizes
the prompt itself, runs the Hugging Face processor on the media only (just the items the processor
cache misses), cuts its batched output into per-item tensors with field configs, and expands each
item's single placeholder into its exact token count. A model family supplies three classes:
``BaseProcessingInfo`` (static facts: limits, analytic token counts), ``BaseDummyInputsBuilder``
(worst-case inputs for profiling) and a ``BaseMultiModalProcessor`` subclass with two hooks
(``_get_mm_fields_config``, ``_get_prompt_updates``). The first two live in ``context.py``
and are re-exported here with the prompt-update types, so model families import from one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch

from omniserve.multimodal.cache import ProcessorCache
from omniserve.multimodal.context import (
    BaseDummyInputsBuilder,
    BaseProcessingInfo,
    InputProcessingContext,
    RequestKwarg,
)
from omniserve.multimodal.errors import MM_EMBEDS_OFF, MultiModalInputError
from omniserve.multimodal.hasher import MultiModalHasher
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.parse import (
    MultiModalDataItems,
    MultiModalDataParser,
    embeds_fault,
    embeds_of,
)
from omniserve.multimodal.prompt_update import (
    PromptInsertion,
    PromptReplacement,
    PromptSeq,
    PromptUpdate,
    PromptUpdateDetails,
    apply_prompt_updates,
)

__all__ = [
    "BaseDummyInputsBuilder",
    "BaseMultiModalProcessor",
    "BaseProcessingInfo",
    "InputProcessingContext",
    "MultiModalFieldConfig",
    "MultiModalInputs",
    "PromptInsertion",
    "PromptReplacement",
    "PromptUpdate",
    "PromptUpdateDetails",
    "RequestKwarg",
]

# modality -> (the HF processor's kwargs group, the sub-processor attribute that consumes it)
_SUBPROCESSORS = {
    "image": ("images_kwargs", "image_processor"),
    "video": ("videos_kwargs", "video_processor"),
    "audio": ("audio_kwargs", "feature_extractor"),
}


@dataclass
class MultiModalInputs:
    """What the processor hands to the engine for one prompt."""

    prompt: str | None
    prompt_token_ids: list[int]
    """With every placeholder expanded to its item's tokens."""
    mm_features: list[MultiModalFeatureSpec]
    """One per item, sorted by placeholder offset."""
    num_tokens_by_modality: dict[str, int] = field(default_factory=dict)
    """Placeholder tokens per modality (usage.prompt_tokens_details)."""


@dataclass(frozen=True)
class MultiModalFieldConfig:
    """How one key of the HF processor's batched output is cut into per-item tensors.

    Every piece keeps the batch layout, so ``torch.cat(pieces, dim)`` over items rebuilds the
    HF tensor: "batched" items are ``value[i:i+1]`` (e.g. ``image_grid_thw`` [1, 3]); "flat"
    items are consecutive runs of ``sizes`` rows along ``dim`` (e.g. ``pixel_values`` with
    ``grid_thw.prod()`` rows each); "shared" items all get the whole value.
    """

    modality: str
    kind: Literal["batched", "flat", "shared"]
    sizes: tuple[int, ...] = ()
    dim: int = 0

    @staticmethod
    def batched(modality: str) -> MultiModalFieldConfig:
        return MultiModalFieldConfig(modality, "batched")

    @staticmethod
    def flat_from_sizes(
        modality: str, size_per_item: Sequence[int] | torch.Tensor, dim: int = 0
    ) -> MultiModalFieldConfig:
        sizes = size_per_item.tolist() if isinstance(size_per_item, torch.Tensor) else size_per_item
        return MultiModalFieldConfig(modality, "flat", tuple(int(s) for s in sizes), dim)

    @staticmethod
    def shared(modality: str) -> MultiModalFieldConfig:
        return MultiModalFieldConfig(modality, "shared")

    def split(self, value: Any, num_items: int) -> list[Any]:
        value = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        if self.kind == "shared":
            return [value] * num_items
        if self.kind == "batched":
            pieces = list(torch.split(value, 1, dim=0))
        else:
            pieces = list(torch.split(value, list(self.sizes), dim=self.dim))
        if len(pieces) != num_items:
            raise ValueError(
                f"{self.kind} field cut into {len(pieces)} pieces for {num_items} "
                f"{self.modality} items"
            )
        # NOTE: clone so a cached item does not pin the whole batch's storage.
        return pieces if num_items == 1 else [piece.clone() for piece in pieces]


class BaseMultiModalProcessor(ABC):
    """Turns a prompt and its media into ``MultiModalInputs``.

    ``apply`` -> ``_to_mm_items`` (parse, validate counts) -> ``_cached_apply_hf_processor``
    (hash each item, HF on cache misses only, per-item tensors) -> ``_maybe_apply_prompt_updates``
    (expand placeholders) -> ``MultiModalInputs``.
    """

    def __init__(
        self,
        info: BaseProcessingInfo,
        dummy_inputs: BaseDummyInputsBuilder,
        *,
        cache: ProcessorCache | None = None,
    ) -> None:
        self.info = info
        self.dummy_inputs = dummy_inputs
        self.cache = cache

    def apply(
        self,
        prompt: str | list[int],
        mm_data: Mapping[str, Any],
        hf_processor_mm_kwargs: Mapping[str, object] | None = None,
        mm_uuids: Mapping[str, Any] | None = None,
    ) -> MultiModalInputs:
        """Process one prompt; bad media raise ``MultiModalInputError`` (stage "process").

        ``mm_uuids`` (vLLM's ``multi_modal_uuids``): modality -> one uuid (or None) per item
        of ``mm_data[modality]``, then a list. An item with a uuid is known by it instead of
        its content; an item given as None with a uuid is the one last sent under that uuid,
        kept in the processor cache (an error names it when it is not there)."""
        mm_data, uuids = self._resolve_uuids(mm_data, mm_uuids or {})
        return self._apply(prompt, mm_data, hf_processor_mm_kwargs, use_cache=True, uuids=uuids)

    def get_dummy_mm_inputs(self, seq_len: int, mm_counts: Mapping[str, int]) -> MultiModalInputs:
        """Worst-case processed inputs for the profile run (bypasses the cache)."""
        text = self.dummy_inputs.get_dummy_text(mm_counts)
        mm_data = self.dummy_inputs.get_dummy_mm_data(seq_len, mm_counts)
        return self._apply(text, mm_data, None, use_cache=False)

    # -- hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        """How to cut each output key of the HF processor into items (unlisted keys are
        dropped)."""

    @abstractmethod
    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        """One update per supported modality (also those without items, so that stray
        placeholders are caught); ``out_items[modality][i]`` holds item ``i``'s tensors."""

    def _call_hf_processor(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, Any]:
        """Run the HF processor on media only (``text=None``: no tokenization, no placeholder
        checks), exactly as its ``__call__`` would process the same media with text."""
        hf_processor = self.info.get_hf_processor()
        return hf_processor(**{**mm_kwargs, **mm_data, "return_tensors": "pt"})

    # -- pipeline ------------------------------------------------------------------------------

    def _apply(
        self,
        prompt: str | list[int],
        mm_data: Mapping[str, Any],
        hf_processor_mm_kwargs: Mapping[str, object] | None,
        *,
        use_cache: bool,
        uuids: Mapping[str, list[str | None]] | None = None,
    ) -> MultiModalInputs:
        mm_kwargs = {**self.info.ctx.mm_processor_kwargs, **(hf_processor_mm_kwargs or {})}
        mm_items = self._to_mm_items(mm_data, mm_kwargs)
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = list(self.info.get_tokenizer().encode(prompt, add_special_tokens=True))
        else:
            prompt_text, token_ids = None, [int(t) for t in prompt]
        hashed = self._cached_apply_hf_processor(
            mm_items, mm_kwargs, use_cache=use_cache, uuids=uuids or {}
        )
        token_ids, features = self._maybe_apply_prompt_updates(
            token_ids, mm_items, mm_kwargs, hashed
        )
        counts: dict[str, int] = {}
        for feature in features:
            for modality, count in self.token_counts(feature).items():
                counts[modality] = counts.get(modality, 0) + count
        return MultiModalInputs(prompt_text, token_ids, features, counts)

    def token_counts(self, feature: MultiModalFeatureSpec) -> Mapping[str, int]:
        """An item's prompt tokens by modality (usage's prompt_tokens_details): all of them
        its own modality's, unless a model's composite items say otherwise."""
        return {feature.modality: feature.mm_position.length}

    @cached_property
    def _data_parser(self) -> MultiModalDataParser:
        return self.info.get_data_parser()

    def _to_mm_items(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> MultiModalDataItems:
        """Parse and count-check the items (``mm_kwargs`` may change how they pair up)."""
        mm_items = self._data_parser.parse_mm_data(mm_data)
        self.info.validate_num_items(mm_items.get_all_counts())
        return mm_items

    def _resolve_uuids(
        self, mm_data: Mapping[str, Any], mm_uuids: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, list[str | None]]]:
        """``mm_data`` with each item given as None replaced by the one kept under its uuid
        (and each item sent with a uuid kept), and the uuids per modality as lists."""
        data = dict(mm_data)
        uuids: dict[str, list[str | None]] = {}
        for modality, given in mm_uuids.items():
            values = given if isinstance(given, list) else [given]
            items = data.get(modality)
            items = items if isinstance(items, list) else [items]
            if len(items) != len(values) or not all(
                u is None or (isinstance(u, str) and u) for u in values
            ):
                raise MultiModalInputError(
                    f"multi_modal_uuids[{modality!r}] must give one uuid (a non-empty string) or "
                    f"None per item: {len(values)} for {len(items)} items",
                    stage="process",
                    modality=modality,
                )
            for index, (uuid, item) in enumerate(zip(values, items, strict=True)):
                key = f"uuid/{modality}/{uuid}"
                if uuid is None:
                    if item is None:
                        raise MultiModalInputError(
                            f"item {index} has neither data nor a uuid",
                            stage="process",
                            modality=modality,
                        )
                elif item is not None:
                    if self.cache is not None:
                        self.cache.put(key, {"item": item})
                else:
                    items[index] = self._kept_item(modality, uuid, key)
            data[modality], uuids[modality] = items, values
        return data, uuids

    def _checked_embeds(self, modality: str, index: int, embeds: dict[str, Any]) -> dict[str, Any]:
        """An embeddings item's processed fields, after checking it can stand for the item."""

        def fail(why: str) -> MultiModalInputError:
            return MultiModalInputError(f"item {index}: {why}", stage="process", modality=modality)

        if not self.info.ctx.enable_mm_embeds:
            raise fail(MM_EMBEDS_OFF)
        tensor = embeds[f"{modality}_embeds"]
        width, what = self._embeds_width(modality)
        fault = embeds_fault(tensor, width, f"{modality}_embeds", "num_embeds", what)
        if fault is not None:
            raise fail(fault)
        return self._embeds_fields(modality, {**embeds, f"{modality}_embeds": tensor.detach()})

    def _embeds_width(self, modality: str) -> tuple[int, str]:
        """How wide an item's precomputed embeddings are, and what that width is."""
        return self.info.ctx.hf_config.get_text_config().hidden_size, "the model's hidden size"

    def _embeds_fields(self, modality: str, embeds: dict[str, Any]) -> dict[str, Any]:
        """What this model's placeholder update (and positions) read from an item given as
        ``<modality>_embeds`` (checked: floating, [n, hidden], finite), besides the embeddings;
        a model that takes none of ``modality`` refuses here."""
        raise MultiModalInputError(
            f"this model takes no precomputed {modality} embeddings",
            stage="process",
            modality=modality,
        )

    def _kept_item(self, modality: str, uuid: str, key: str) -> Any:
        if self.cache is None:
            raise MultiModalInputError(
                f"an item sent by uuid {uuid!r} alone needs the processor cache, which is off "
                "(--mm-processor-cache-gb 0); send its data",
                stage="process",
                modality=modality,
            )
        kept = self.cache.get(key, count=False)
        if kept is None:
            raise MultiModalInputError(
                f"no {modality} is kept under uuid {uuid!r} (never sent with its data, or "
                "evicted from the processor cache); send its data again",
                stage="process",
                modality=modality,
            )
        return kept["item"]

    def _cached_apply_hf_processor(
        self,
        mm_items: MultiModalDataItems,
        mm_kwargs: Mapping[str, object],
        *,
        use_cache: bool,
        uuids: Mapping[str, list[str | None]],
    ) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """modality -> [(identifier, tensors)] per item; HF runs once, on the distinct misses.
        An item with a uuid is identified by it (and the kwargs), not by its content."""
        cache = self.cache if use_cache else None

        def identifier(modality: str, items: Any, i: int) -> str:
            given = uuids.get(modality, [])
            uuid = given[i] if i < len(given) and len(given) == len(items) else None
            payload = ("uuid", uuid) if uuid is not None else items.hash_payload(i)
            return MultiModalHasher.hash_item(
                modality, payload, self._kwargs_affecting(modality, mm_kwargs)
            )

        hashes = {
            modality: [identifier(modality, items, i) for i in range(len(items))]
            for modality, items in mm_items.items()
        }
        found: dict[str, dict[str, Any]] = {}
        missing: dict[str, dict[str, int]] = {}  # modality -> {hash: index of its first item}
        for modality, item_hashes in hashes.items():
            for index, item_hash in enumerate(item_hashes):
                if item_hash in found or item_hash in missing.get(modality, {}):
                    continue  # the same item twice in one prompt
                embeds = embeds_of(modality, mm_items[modality].items[index])
                if embeds is not None:
                    found[item_hash] = self._checked_embeds(modality, index, embeds)
                    continue
                cached = cache.get(item_hash) if cache is not None else None
                if cached is not None:
                    found[item_hash] = cached
                else:
                    missing.setdefault(modality, {})[item_hash] = index
        if missing:
            indices = {modality: list(by_hash.values()) for modality, by_hash in missing.items()}
            processed = self._apply_hf_processor(mm_items, indices, mm_kwargs)
            for modality, by_hash in missing.items():
                for item_hash, data in zip(by_hash, processed[modality], strict=True):
                    found[item_hash] = data
                    if cache is not None:
                        cache.put(item_hash, data)
        return {
            modality: [(h, dict(found[h])) for h in item_hashes]
            for modality, item_hashes in hashes.items()
        }

    def _apply_hf_processor(
        self,
        mm_items: MultiModalDataItems,
        indices: Mapping[str, list[int]],
        mm_kwargs: Mapping[str, object],
    ) -> dict[str, list[dict[str, Any]]]:
        """Process the items at ``indices`` in one HF call per set of the items' own kwargs
        (``hf_call_kwargs``; usually one call) and cut the output per item."""
        calls: dict[tuple, dict[str, list[int]]] = {}
        for modality, modality_indices in indices.items():
            for index in modality_indices:
                own = tuple(sorted(mm_items[modality].hf_call_kwargs(index).items()))
                calls.setdefault(own, {}).setdefault(modality, []).append(index)
        done: dict[tuple[str, int], dict[str, Any]] = {}
        for own, call_indices in calls.items():
            call_kwargs = {**mm_kwargs, **dict(own)}
            for modality, items in self._call_once(mm_items, call_indices, call_kwargs).items():
                pairs = zip(call_indices[modality], items, strict=True)
                done.update(((modality, i), item) for i, item in pairs)
        return {m: [done[m, i] for i in idx] for m, idx in indices.items()}

    def _call_once(
        self,
        mm_items: MultiModalDataItems,
        indices: Mapping[str, list[int]],
        mm_kwargs: Mapping[str, object],
    ) -> dict[str, list[dict[str, Any]]]:
        mm_data: dict[str, Any] = {}
        for modality, modality_indices in indices.items():
            mm_data.update(mm_items[modality].get_processor_data(modality_indices))
        try:
            hf_inputs = self._call_hf_processor(mm_data, mm_kwargs)
        except MultiModalInputError:
            raise
        except Exception as exc:
            only = next(iter(indices)) if len(indices) == 1 else None
            raise MultiModalInputError(
                f"the {type(self.info.get_hf_processor()).__name__} rejected the input: {exc}",
                stage="process",
                modality=only,
            ) from exc
        fields = self._get_mm_fields_config(hf_inputs, mm_kwargs)
        out: dict[str, list[dict[str, Any]]] = {m: [{} for _ in idx] for m, idx in indices.items()}
        for key, value in hf_inputs.items():
            config = fields.get(key)
            if config is None or config.modality not in out:
                continue
            pieces = config.split(value, len(out[config.modality]))
            for item, piece in zip(out[config.modality], pieces, strict=True):
                item[key] = piece
        return out

    def _maybe_apply_prompt_updates(
        self,
        token_ids: list[int],
        mm_items: MultiModalDataItems,
        mm_kwargs: Mapping[str, object],
        hashed: Mapping[str, list[tuple[str, dict[str, Any]]]],
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        out_items = {modality: [data for _, data in items] for modality, items in hashed.items()}
        updates = self._get_prompt_updates(mm_items, mm_kwargs, out_items)
        new_ids, placed = apply_prompt_updates(
            token_ids, updates, mm_items.get_all_counts(), self._encode
        )
        features = []
        for item in placed:
            identifier, data = hashed[item.modality][item.item_idx]
            features.append(MultiModalFeatureSpec(item.modality, identifier, item.position, data))
        return new_ids, features

    def _encode(self, seq: PromptSeq) -> list[int]:
        if isinstance(seq, str):
            return list(self.info.get_tokenizer().encode(seq, add_special_tokens=False))
        return list(seq)

    # -- kwargs routing for hashing ------------------------------------------------------------

    @cached_property
    def _kwarg_owners(self) -> dict[str, set[str]]:
        """modality -> the kwargs the HF processor routes to that modality's sub-processor."""
        hf_processor = self.info.get_hf_processor()
        typed = getattr(
            getattr(hf_processor, "valid_processor_kwargs", None), "__annotations__", {}
        )
        owners = {}
        for modality, (group, attr) in _SUBPROCESSORS.items():
            keys = set(getattr(typed.get(group), "__annotations__", {}))
            sub = getattr(hf_processor, attr, None)
            keys |= set(getattr(getattr(sub, "valid_kwargs", None), "__annotations__", {}))
            owners[modality] = keys | {group}
        return owners

    def _kwargs_affecting(self, modality: str, mm_kwargs: Mapping[str, object]) -> dict:
        """The kwargs that can change this modality's output: all but those the HF processor
        routes only to other modalities (so a video's fps never splits an image's cache key)."""
        if not mm_kwargs:
            return {}
        owners = self._kwarg_owners
        mine = owners.get(modality, set())
        others = set().union(*(keys for m, keys in owners.items() if m != modality))
        return {k: v for k, v in mm_kwargs.items() if k in mine or k not in others}
