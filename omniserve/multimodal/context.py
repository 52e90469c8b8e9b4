"""What a model family states about its multimodal inputs, apart from processing them.

``InputProcessingContext`` (checkpoint, tokenizer, front-end settings and the cached HF
processor), ``BaseProcessingInfo`` (supported modalities and limits, analytic token counts) and
``BaseDummyInputsBuilder`` (worst-case inputs for the profile run).
"""

from __future__ import annotations

import difflib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from omniserve.config import ModelConfig
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media import MediaConfig
from omniserve.multimodal.parse import MODALITIES, MultiModalDataParser
from omniserve.multimodal.pruning import VideoPruning

logger = logging.getLogger(__name__)


class InputProcessingContext:
    """The model's checkpoint, tokenizer and front-end settings, shared by info and processor."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        *,
        mm_processor_kwargs: Mapping[str, object] | None = None,
        limit_mm_per_prompt: Mapping[str, int] | None = None,
        profile_sizes: Mapping[str, Mapping[str, int]] | None = None,
        enable_mm_embeds: bool = False,
        max_audio_seconds: float | None = None,
        video_pruning_rate: float = 0.0,
    ) -> None:
        self.model_config = model_config
        self.video_pruning_rate = video_pruning_rate
        """The share of each video's tokens dropped (``--video-pruning-rate``)."""
        self.max_audio_seconds = (
            MediaConfig().max_audio_seconds if max_audio_seconds is None else max_audio_seconds
        )
        """The longest audio clip taken (``--media-io-kwargs``), offline as over the API."""
        self.tokenizer = tokenizer
        self.enable_mm_embeds = enable_mm_embeds
        """Whether precomputed embeddings may stand for items (``--enable-mm-embeds``)."""
        self.mm_processor_kwargs = dict(mm_processor_kwargs or {})
        """Defaults for every request (``--mm-processor-kwargs``); requests override them."""
        self.limit_mm_per_prompt = dict(limit_mm_per_prompt or {})
        self.profile_sizes = {modality: dict(s) for modality, s in (profile_sizes or {}).items()}
        """Sizes of the start-up profile's items (``MultiModalConfig.mm_profile_sizes``)."""
        self._hf_processors: dict[str, Any] = {}

    @property
    def hf_config(self) -> Any:
        return self.model_config.hf_config

    def get_hf_processor(self, **kwargs: object) -> Any:
        """The checkpoint's HF processor (local files only), built once per distinct kwargs."""
        key = repr(sorted(kwargs.items()))
        if key not in self._hf_processors:
            from transformers import AutoProcessor

            self._hf_processors[key] = AutoProcessor.from_pretrained(
                self.model_config.model, local_files_only=True, **kwargs
            )
        return self._hf_processors[key]


@dataclass(frozen=True)
class RequestKwarg:
    """One ``mm_processor_kwargs`` option a request may set: its type and accepted range."""

    kind: type  # bool, int or float
    low: float | None = None
    high: float | None = None

    def check(self, name: str, value: object) -> None:
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = (
            isinstance(value, bool)
            if self.kind is bool
            else (
                is_number
                and (self.kind is float or isinstance(value, int))
                and math.isfinite(value)  # type: ignore[arg-type]
                and (self.low is None or value >= self.low)  # type: ignore[operator]
                and (self.high is None or value <= self.high)  # type: ignore[operator]
            )
        )
        if not ok:
            rule = (
                "true or false"
                if self.kind is bool
                else (
                    f"{'an integer' if self.kind is int else 'a number'} in "
                    f"[{_fmt(self.low)}, {_fmt(self.high)}]"
                )
            )
            raise MultiModalInputError(
                f"mm_processor_kwargs.{name} must be {rule}, got {value!r}", stage="process"
            )


_HF_KWARGS_GROUPS = {
    "text_kwargs": "tokenizer",
    "images_kwargs": "image_processor",
    "audio_kwargs": "feature_extractor",
    "videos_kwargs": "video_processor",
}
"""An HF processor's kwargs groups and the sub-processor each goes to (transformers' map)."""


def _fmt(bound: float | None) -> str:
    return "-inf" if bound is None else f"{bound:g}"


class BaseProcessingInfo(ABC):
    """Static facts about a model's multimodal inputs."""

    request_kwargs: Mapping[str, RequestKwarg] = {}
    """The ``mm_processor_kwargs`` a request may set, per name; the server's
    ``--mm-processor-kwargs`` may set any HF processor option, a request only these."""
    model_bound_kwargs: frozenset[str] = frozenset()
    """HF processor options the checkpoint's encoder fixes (patch size, mel bins, windowing):
    another value would make the placeholder count disagree with what the encoder outputs, so
    not even the server's ``--mm-processor-kwargs`` may set them."""
    video_pruning_layout: str | None = None
    """How a pruned video's kept tokens sit in the prompt (``omniserve.multimodal.pruning``):
    "whole", one run of pads; "per_frame", one run per frame group. None: not pruned."""

    def __init__(self, ctx: InputProcessingContext) -> None:
        self.ctx = ctx

    def get_hf_config(self) -> Any:
        return self.ctx.hf_config

    def get_tokenizer(self) -> Any:
        return self.ctx.tokenizer

    def get_hf_processor(self, **kwargs: object) -> Any:
        return self.ctx.get_hf_processor(**kwargs)

    def get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser(max_audio_seconds=self.max_audio_seconds)

    @property
    def max_audio_seconds(self) -> float:
        return self.ctx.max_audio_seconds

    def get_audio_window_seconds(self) -> float | None:
        """The longest audio clip the model hears whole, where its processor cuts longer ones
        (None: no cut); speech to text splits longer files into pieces of this length."""
        return None

    @abstractmethod
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        """Items per prompt for each modality the model takes (None: unlimited)."""

    @abstractmethod
    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        """An upper bound on one item's placeholder tokens per modality, computed analytically
        (no dummy processing), given ``mm_counts`` items share a ``seq_len`` prompt."""

    def hf_processor_kwargs(self) -> frozenset[str]:
        """The options the checkpoint's HF processor reads, as its ``_merge_kwargs`` finds them
        (its kwargs' typed dicts and its sub-processors' ``valid_kwargs``); it ignores others."""
        processor = self.get_hf_processor()
        typed = getattr(processor, "valid_processor_kwargs", None)
        groups = getattr(typed, "__annotations__", {})
        names = set(groups)
        for group, attribute in _HF_KWARGS_GROUPS.items():
            names |= set(getattr(groups.get(group), "__annotations__", {}))
            part = getattr(getattr(processor, attribute, None), "valid_kwargs", None)
            names |= set(getattr(part, "__annotations__", {}))
        return frozenset(names)

    def check_server_kwargs(self, kwargs: Mapping[str, object]) -> None:
        """``--mm-processor-kwargs``: any option of the HF processor or of the model's own
        processing but the model-bound ones, and the per-request options within their ranges;
        raises ValueError at start-up (HF would ignore a misspelt one)."""
        known = self.hf_processor_kwargs() | set(self.request_kwargs)
        for name, value in kwargs.items():
            if name not in known | self.model_bound_kwargs:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"did you mean {' or '.join(close)}?" if close else "HF would ignore it"
                raise ValueError(
                    f"--mm-processor-kwargs: {name} is not an option of this model's "
                    f"processor ({hint})."
                )
            if name in self.model_bound_kwargs:
                fixed = self._checkpoint_values(name)
                if fixed and all(v == value for v in fixed):
                    continue  # the checkpoint's own value, as a shared launch script may set
                raise ValueError(
                    f"--mm-processor-kwargs: {name} is fixed by the checkpoint's "
                    f"encoder{f' ({fixed[0]!r})' if fixed else ''}; another value would not "
                    "match what it computes."
                )
            rule = self.request_kwargs.get(name)
            if rule is not None:
                try:
                    rule.check(name, value)
                except MultiModalInputError as exc:
                    raise ValueError(f"--mm-processor-kwargs: {exc.detail}") from None

    def _checkpoint_values(self, name: str) -> list[object]:
        """The checkpoint's settings of a processor option, one per sub-processor holding it."""
        processor = self.get_hf_processor()
        parts = [getattr(processor, attribute, None) for attribute in _HF_KWARGS_GROUPS.values()]
        return [getattr(part, name) for part in parts if hasattr(part, name)]

    def check_request_kwargs(self, kwargs: Mapping[str, object]) -> None:
        """Refuse options not declared in ``request_kwargs`` and values out of their range."""
        for name, value in kwargs.items():
            rule = self.request_kwargs.get(name)
            if rule is None:
                accepted = ", ".join(sorted(self.request_kwargs)) or "none"
                raise MultiModalInputError(
                    f"mm_processor_kwargs.{name} is not a per-request option of this model "
                    f"(accepted: {accepted})",
                    stage="process",
                )
            rule.check(name, value)
        for name, value in kwargs.items():  # a min_x over the request's own max_x
            upper = kwargs.get(f"max_{name.removeprefix('min_')}")
            if name.startswith("min_") and upper is not None and value > upper:  # type: ignore[operator]
                raise MultiModalInputError(
                    f"mm_processor_kwargs.{name} ({value}) is over "
                    f"max_{name.removeprefix('min_')} ({upper})",
                    stage="process",
                )

    def check_limits(self) -> None:
        """``--limit-mm-per-prompt``: a modality no model takes (a misspelt one, which would
        otherwise limit nothing) is a ValueError at start-up; one this model does not take is
        logged (limits shared by several models' launches, as vLLM allows)."""
        supported = self.get_supported_mm_limits()
        asked = {**dict.fromkeys(self.ctx.profile_sizes), **self.ctx.limit_mm_per_prompt}
        for modality, limit in asked.items():  # (a modality with sizes only: None)
            if modality in supported:
                continue
            where = f"this model does not take {modality} input (it takes: {', '.join(supported)})"
            if modality not in MODALITIES:
                raise ValueError(f"--limit-mm-per-prompt: {where}.")
            if limit != 0:
                logger.warning("--limit-mm-per-prompt: %s; its limit changes nothing.", where)

    def video_pruning(self, num_frames: int, tokens_per_frame: int) -> VideoPruning | None:
        """How a video of this merged grid is pruned (None: it is not)."""
        if not self.ctx.video_pruning_rate or self.video_pruning_layout is None:
            return None
        return VideoPruning(num_frames, tokens_per_frame, self.ctx.video_pruning_rate,
                            per_frame=self.video_pruning_layout == "per_frame")  # fmt: skip

    def check_video_pruning(self) -> None:
        """``--video-pruning-rate`` for a model whose videos are not pruned is a ValueError at
        start-up (where it would otherwise change nothing)."""
        if self.ctx.video_pruning_rate and (
            self.video_pruning_layout is None or "video" not in self.get_supported_mm_limits()
        ):
            raise ValueError(
                f"--video-pruning-rate: {self.ctx.model_config.architecture} does not prune video "
                "tokens (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the omni thinkers do)."
            )

    def get_allowed_mm_limits(self) -> dict[str, int | None]:
        """The model's limits tightened by ``--limit-mm-per-prompt``."""
        allowed: dict[str, int | None] = {}
        for modality, limit in self.get_supported_mm_limits().items():
            user = self.ctx.limit_mm_per_prompt.get(modality)
            allowed[modality] = (
                user if limit is None else limit if user is None else min(limit, user)
            )
        return allowed

    def validate_num_items(self, counts: Mapping[str, int]) -> None:
        allowed = self.get_allowed_mm_limits()
        for modality, count in counts.items():
            if modality not in allowed:
                takes = ", ".join(allowed) or "text only"
                raise MultiModalInputError(
                    f"this model does not take {modality} input (it takes: {takes})",
                    stage="process",
                    modality=modality,
                )
            limit = allowed[modality]
            if limit == 0 and count:
                raise MultiModalInputError(
                    f"this server takes no {modality} input (--limit-mm-per-prompt "
                    f"{modality}: 0, or --language-model-only)",
                    stage="process",
                    modality=modality,
                )
            if limit is not None and count > limit:
                raise MultiModalInputError(
                    f"{count} {modality} items given but at most {limit} per prompt are allowed "
                    "(--limit-mm-per-prompt)",
                    stage="process",
                    modality=modality,
                )


class BaseDummyInputsBuilder(ABC):
    """Worst-case inputs (largest image, longest audio) for the start-up profile run."""

    def __init__(self, info: BaseProcessingInfo) -> None:
        self.info = info

    @abstractmethod
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """A prompt with one placeholder per item."""

    @abstractmethod
    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> dict[str, Any]:
        """``multi_modal_data`` whose items each have the most tokens an item can have."""

    def _profile_size(self, modality: str, name: str, largest: int) -> int:
        """The profile item's ``name`` (e.g. width): the largest the processor takes, or a
        smaller one that ``--limit-mm-per-prompt`` asks for."""
        asked = self.info.ctx.profile_sizes.get(modality, {}).get(name)
        if asked is None:
            return largest
        if asked > largest:
            logger.warning("--limit-mm-per-prompt: %s %s %d is over the largest the processor "
                           "takes (%d); the memory profile uses %d.", modality, name, asked,
                           largest, largest)  # fmt: skip
            return largest
        return asked

    def _get_dummy_images(self, width: int, height: int, num_images: int) -> list[Image.Image]:
        if not num_images:
            return []
        size = (self._profile_size("image", "width", width),
                self._profile_size("image", "height", height))  # fmt: skip
        return [Image.new("RGB", size, color=(255, 255, 255))] * num_images

    def _get_dummy_videos(
        self, width: int, height: int, num_frames: int, num_videos: int
    ) -> list[np.ndarray]:
        if not num_videos:
            return []
        shape = (self._profile_size("video", "num_frames", num_frames),
                 self._profile_size("video", "height", height),
                 self._profile_size("video", "width", width), 3)  # fmt: skip
        return [np.full(shape, 255, dtype=np.uint8)] * num_videos

    def _get_dummy_audios(
        self, length: int, sampling_rate: int, num_audios: int
    ) -> list[tuple[np.ndarray, int]]:
        if not num_audios:
            return []
        samples = np.zeros(self._profile_size("audio", "length", length), dtype=np.float32)
        return [(samples, sampling_rate)] * num_audios
