"""Normalise user multimodal data into per-modality lists of items.

``{"image": img, "audio": [(wav, sr), ...], "video": frames}`` becomes one ``*ProcessorItems``
per modality, each a list of items in the form the Hugging Face processor takes. Everything the
processor's output depends on is in the item (audio resampled to the feature extractor's rate,
video metadata such as fps), so hashing a parsed item is enough to key the caches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media_io import media_io_knob

MODALITIES = ("image", "video", "audio")


class ModalityDataItems:
    """The items of one modality, in prompt order."""

    modality = ""
    hf_arg = ""
    """The keyword the Hugging Face processor takes these items under ("images", ...)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def hash_payload(self, index: int) -> object:
        """What identifies item ``index``'s content (hashed with the kwargs that affect it)."""
        return self.items[index]

    def get_processor_data(self, indices: Sequence[int]) -> dict[str, Any]:
        """Keyword arguments for the HF processor covering the items at ``indices``."""
        return {self.hf_arg: [self.items[i] for i in indices]}

    def hf_call_kwargs(self, index: int) -> dict[str, object]:
        """Processor kwargs item ``index`` needs whatever the request asked; items that need
        different ones go to the HF processor in separate calls."""
        return {}


class ImageProcessorItems(ModalityDataItems):
    """PIL images, and arrays as [channels, height, width] (``_channels_first``)."""

    modality, hf_arg = "image", "images"


class AudioProcessorItems(ModalityDataItems):
    """Mono float32 waveforms, already at the feature extractor's sampling rate."""

    modality, hf_arg = "audio", "audio"


class VideoProcessorItems(ModalityDataItems):
    """Videos as [num_frames, height, width, 3] arrays, each with HF-style metadata."""

    modality, hf_arg = "video", "videos"

    def __init__(self, items: list[np.ndarray], metadata: list[dict[str, Any]]) -> None:
        super().__init__(items)
        self.metadata = metadata

    def hash_payload(self, index: int) -> object:
        return (self.items[index], self.metadata[index])

    def get_processor_data(self, indices: Sequence[int]) -> dict[str, Any]:
        # NOTE: the metadata always travels with the frames: it sets fps-based frame sampling,
        # Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps. HF extends the index
        # lists in place, so it gets copies.
        return {
            "videos": [self.items[i] for i in indices],
            "video_metadata": [
                {
                    **{k: v for k, v in self.metadata[i].items() if k != "do_sample_frames"},
                    "frames_indices": list(self.metadata[i]["frames_indices"]),
                }
                for i in indices
            ],
        }

    def hf_call_kwargs(self, index: int) -> dict[str, object]:
        """A sample decoded from a longer file is final: its metadata's indices count source
        frames, which HF's own frame sampling would misread as indices into the sample (vLLM
        turns it off the same way), as are frames whose metadata says do_sample_frames false.
        Other frames that are the whole video keep HF's sampling."""
        meta = self.metadata[index]
        final = meta.get("do_sample_frames") is False or not is_whole_video(meta)
        return {"do_sample_frames": False} if final else {}


class MultiModalDataItems(dict[str, ModalityDataItems]):
    """modality -> its items; modalities without items are absent."""

    def get_all_counts(self) -> dict[str, int]:
        return {modality: len(items) for modality, items in self.items()}


class MultiModalDataParser:
    """Turns ``multi_modal_data`` into ``MultiModalDataItems``, or raises a precise error.

    ``target_sr`` is the sampling rate the model's feature extractor expects; audio given at
    another rate is resampled (librosa) so that hashing and processing see the same samples.
    ``max_audio_seconds``: longer clips are refused before resampling (a short array at 1 Hz
    would resample to gigabytes), as the server refuses longer files.
    """

    def __init__(
        self, *, target_sr: float | None = None, max_audio_seconds: float | None = None
    ) -> None:
        self.target_sr = target_sr
        self.max_audio_seconds = max_audio_seconds

    def parse_mm_data(self, mm_data: Mapping[str, Any]) -> MultiModalDataItems:
        parsed = MultiModalDataItems()
        for modality, data in mm_data.items():
            if modality not in MODALITIES:
                raise MultiModalInputError(
                    f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}",
                    stage="process",
                )
            if data is None:
                continue
            parse = {
                "image": self._parse_image,
                "video": self._parse_video,
                "audio": self._parse_audio,
            }[modality]
            items = parse(data)
            if len(items):
                parsed[modality] = items
        return parsed

    def _parse_image(self, data: Any) -> ImageProcessorItems:
        if _is_array(data) and data.ndim == 4:  # a batch of images
            data = list(data)
        images = list(data) if isinstance(data, list | tuple) else [data]
        for index, image in enumerate(images):
            if isinstance(image, Image.Image) or embeds_of("image", image) is not None:
                continue
            if not _is_array(image) or image.ndim != 3:
                raise _bad_item(
                    "image", index, image, "a PIL image, an HWC ndarray or a CHW tensor"
                )
            _check_finite("image", index, image)
            images[index] = _channels_first(index, image)
        return ImageProcessorItems(images)

    def _parse_audio(self, data: Any) -> AudioProcessorItems:
        clips = data if isinstance(data, list) else [data]
        waveforms = [
            clip if embeds_of("audio", clip) is not None else self._to_waveform(index, clip)
            for index, clip in enumerate(clips)
        ]
        return AudioProcessorItems(waveforms)

    def _to_waveform(self, index: int, clip: Any) -> np.ndarray:
        if not is_audio_clip(clip):
            raise _bad_item(
                "audio",
                index,
                clip,
                "(waveform, sample_rate); a bare waveform has no sampling rate",
            )
        waveform, rate = clip
        if isinstance(waveform, torch.Tensor):
            waveform = waveform.detach().cpu().numpy()
        try:
            waveform = np.asarray(waveform, dtype=np.float32)
        except (TypeError, ValueError):  # a list holding other things than samples
            raise _bad_item("audio", index, clip, "a waveform of numbers") from None
        if waveform.ndim == 2:  # mix channels down; the channel axis is the short one
            waveform = waveform.mean(axis=int(np.argmin(waveform.shape)), dtype=np.float32)
        if waveform.ndim != 1 or waveform.size == 0:
            raise _bad_item("audio", index, clip, "a non-empty mono or multi-channel waveform")
        if not np.isfinite(waveform).all():
            raise MultiModalInputError(
                f"item {index} has samples that are NaN or infinite",
                stage="process",
                modality="audio",
            )
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or rate <= 0:
            raise _bad_item("audio", index, clip, "a positive sample rate")
        seconds = waveform.size / float(rate)
        if self.max_audio_seconds is not None and seconds > self.max_audio_seconds:
            raise MultiModalInputError(
                f"item {index} lasts {seconds:.1f} s, over the limit of "
                f"{self.max_audio_seconds:g} s ({media_io_knob('audio', 'max_seconds')})",
                stage="process",
                modality="audio",
            )
        if self.target_sr is not None and rate != self.target_sr:
            import librosa

            waveform = librosa.resample(waveform, orig_sr=float(rate), target_sr=self.target_sr)
        return np.ascontiguousarray(waveform, dtype=np.float32)

    def _parse_video(self, data: Any) -> VideoProcessorItems:
        videos = [data] if is_one_video(data) else list(data)
        frames, metadata = [], []
        for index, video in enumerate(videos):
            array, meta = _video_to_array(index, video)
            frames.append(array)
            metadata.append(meta)
        return VideoProcessorItems(frames, metadata)


def is_whole_video(metadata: Mapping[str, Any]) -> bool:
    """Whether a video's frames are all of its source's (not a sample of a longer file)."""
    return list(metadata["frames_indices"]) == list(range(metadata["total_num_frames"]))


def sampled_fps(metadata: Mapping[str, Any]) -> float | None:
    """The rate of the frames themselves (HF's ``VideoMetadata.sampled_fps``), None if unknown."""
    fps = metadata.get("fps")
    if fps is None:
        return None
    return len(metadata["frames_indices"]) / metadata["total_num_frames"] * fps


def is_one_video(data: Any) -> bool:
    """Whether a modality's data is one video (frames, a list of frames, ``(frames,
    metadata)``) rather than a list of videos."""
    return _is_frame_list(data) or _has_metadata(data) or not isinstance(data, list | tuple)


def _has_metadata(video: Any) -> bool:
    """vLLM's ``(frames, metadata)``: the frames with HF ``VideoMetadata`` fields."""
    return isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping)


VIDEO_METADATA_KEYS = ("total_num_frames", "fps", "duration", "frames_indices", "width",
                       "height", "video_backend", "do_sample_frames")  # fmt: skip
"""The keys of a ``(frames, metadata)`` video: HF's ``VideoMetadata`` fields and the
``do_sample_frames`` of vLLM's loaders."""


def _video_to_array(index: int, video: Any) -> tuple[np.ndarray, dict[str, Any]]:
    """[T, H, W, 3] uint8-or-float frames and the HF `VideoMetadata` fields for them: those of
    their source when known (so Qwen3-VL's timestamps are source times), else the frames'."""
    fps = total = indices = None  # fps: the source's, or of the frames when they are all
    given: Mapping[str, Any] = {}
    if hasattr(video, "frames") and hasattr(video, "fps"):  # media.VideoItem (duck-typed)
        if getattr(video, "num_source_frames", None) is not None:  # decoded from a file
            total, fps, indices = video.num_source_frames, video.source_fps, video.frame_indices
        else:
            fps = video.fps
        video = video.frames
    elif _has_metadata(video):
        video, given = video
        total, fps, indices = _given_metadata(index, given)
    if _is_frame_list(video):
        video = np.stack([np.asarray(frame) for frame in video])
    if isinstance(video, torch.Tensor):
        video = video.detach().cpu().numpy()
    if not (isinstance(video, np.ndarray) and video.ndim == 4 and video.shape[-1] == 3):
        raise _bad_item(
            "video",
            index,
            video,
            "a [num_frames, height, width, 3] array, a list of frames or a loaded video",
        )
    num_frames, height, width = (int(n) for n in video.shape[:3])
    if num_frames == 0:
        raise MultiModalInputError(f"item {index} has no frames", stage="process", modality="video")
    _check_finite("video", index, video)
    total = num_frames if total is None else int(total)
    indices = list(range(num_frames)) if indices is None else [int(i) for i in indices]
    if len(indices) != num_frames or not all(0 <= i < total for i in indices):
        raise _bad_metadata(index, f"{num_frames} frames but frame_indices {indices} of {total} "
                                   "source frames")  # fmt: skip
    meta: dict[str, Any] = {
        "height": height,
        "width": width,
        "total_num_frames": total,
        "fps": None if fps is None else float(fps),
        "duration": None if fps is None else total / float(fps),
        "frames_indices": indices,
    }
    for name in ("height", "width"):
        if given.get(name, meta[name]) != meta[name]:
            raise _bad_metadata(index, f"metadata {name} {given[name]} for frames of {meta[name]}")
    if given.get("do_sample_frames") is False:  # taken as final, as in vLLM
        meta["do_sample_frames"] = False
    elif given.get("do_sample_frames") and not is_whole_video(meta):
        detail = "do_sample_frames true for a sample of its source (frames_indices)"
        raise _bad_metadata(index, f"{detail}: sampling it again would misread them")
    return np.ascontiguousarray(video), meta


def _given_metadata(index: int, given: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(total_num_frames, fps, frames_indices) of a ``(frames, metadata)`` video, each None
    when not given; wrong keys and values are refused by name."""
    for key in given:
        if key not in VIDEO_METADATA_KEYS:
            raise _bad_metadata(index, f"a metadata key {key!r}; the keys may be: "
                                       f"{', '.join(VIDEO_METADATA_KEYS)}")  # fmt: skip
    names = ("total_num_frames", "fps", "frames_indices", "duration")
    values: list[Any] = [given.get(name) for name in names]
    total, fps, indices, duration = values
    checks = (
        ("total_num_frames", total, _is_count(total) and total > 0, "an integer >= 1"),
        ("fps", fps, _is_real(fps) and 0 < fps < math.inf, "a positive number"),
        ("duration", duration, _is_real(duration) and 0 < duration < math.inf, "a positive number"),
        ("frames_indices", indices, isinstance(indices, list | tuple | range)
         and all(map(_is_count, indices)), "a list of frame numbers"),
        ("do_sample_frames", given.get("do_sample_frames"),
         isinstance(given.get("do_sample_frames"), bool), "true or false"),
        ("video_backend", given.get("video_backend"), isinstance(given.get("video_backend"), str),
         "a string"),
    )  # fmt: skip
    for name, value, good, expected in checks:
        if value is not None and not good:
            raise _bad_metadata(index, f"metadata {name} must be {expected}, got {value!r}")
    if duration is not None:
        if total is None:
            raise _bad_metadata(index, "metadata duration needs total_num_frames")
        if fps is None:
            fps = total / duration
        elif abs(duration - total / fps) > 1 / fps:
            raise _bad_metadata(index, f"metadata duration {duration} s is not total_num_frames "
                                       f"/ fps ({total} / {fps} = {total / fps:g} s)")  # fmt: skip
    return total, fps, indices


def _bad_metadata(index: int, detail: str) -> MultiModalInputError:
    return MultiModalInputError(f"item {index} has {detail}", stage="process", modality="video")


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


IMAGE_CHANNELS = (1, 3, 4)
"""The channel counts an image array may have: grey, RGB or RGBA (whose alpha is dropped, as
HF's ``convert("RGB")`` drops a PIL image's)."""


def _channels_first(index: int, image: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A 3-D image array as [channels, height, width] of 1 or 3 channels (RGBA's alpha
    dropped). An ndarray is [height, width, channels]
    (PIL's and OpenCV's layout) when its last dim can be channels (1, 3 or 4), else CHW; a
    tensor is CHW (torchvision's) when its first can, else HWC. HF's processors would guess
    by shape and take a leading 1 or 3 as channels (a 1x1 or 3-wide HWC image read as CHW);
    given CHW, their guess is always right."""
    shape = tuple(int(n) for n in image.shape)
    if 0 in shape:
        raise _bad_item("image", index, image, "a non-empty image")
    first, last = (n in IMAGE_CHANNELS for n in (shape[0], shape[2]))
    if not (first or last):
        raise _bad_item(
            "image", index, image, "an HWC ndarray or a CHW tensor with 1, 3 or 4 channels"
        )
    hwc = last and (isinstance(image, np.ndarray) or not first)
    if hwc:
        image = (
            image.permute(2, 0, 1) if isinstance(image, torch.Tensor) else image.transpose(2, 0, 1)
        )
    if image.shape[0] == 4:
        image = image[:3]
    if isinstance(image, torch.Tensor):
        return image.contiguous()
    return np.ascontiguousarray(image)


def _check_finite(modality: str, index: int, pixels: np.ndarray | torch.Tensor) -> None:
    """Float pixels must be numbers (NaN would reach the encoder and end in NaN scores)."""
    values = torch.as_tensor(pixels)
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise MultiModalInputError(
            f"item {index} has pixels that are NaN or infinite", stage="process", modality=modality
        )


def embeds_of(modality: str, item: Any) -> dict[str, Any] | None:
    """An item given as precomputed embeddings (``--enable-mm-embeds``): a dict holding
    ``<modality>_embeds`` ([num_embeds, hidden]) and any fields the model's placeholders need
    (e.g. ``image_grid_thw``); None for media."""
    if isinstance(item, Mapping) and f"{modality}_embeds" in item:
        return dict(item)
    return None


def embeds_fault(
    value: Any, width: int, name: str, rows: str, what: str = "the model's hidden size"
) -> str | None:
    """Why ``value`` cannot stand in for token embeddings ``width`` wide (``what``: the width's
    meaning; it must be a floating-point ``[rows, width]`` tensor, rows > 0, finite); None: it
    can."""
    if not (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.ndim == 2
        and value.shape[0] > 0
        and value.shape[1] == width
    ):
        got = (
            f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        return f"{name} must be a floating-point [{rows}, {width}] tensor ({what}), got {got}"
    if not bool(torch.isfinite(value).all()):
        return f"{name} holds NaN or infinite values"
    return None


def is_audio_clip(value: Any) -> bool:
    """``(waveform, sample_rate)``, the waveform an array or (as vLLM takes it) a list."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], np.ndarray | torch.Tensor | list)
    )


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray | torch.Tensor)


def _is_frame_list(value: Any) -> bool:
    """One video given as a list of frames (PIL images or HWC arrays)."""
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(f, Image.Image) or (_is_array(f) and f.ndim == 3) for f in value)
    )


def _bad_item(modality: str, index: int, value: Any, expected: str) -> MultiModalInputError:
    got = type(value).__name__
    if _is_array(value):
        got += f" of shape {tuple(value.shape)}"
    return MultiModalInputError(
        f"item {index} is a {got}; expected {expected}", stage="process", modality=modality
    )
