"""Qwen2.5-Omni thinker: images, videos, audio clips, and videos with their own audio track.

Placeholders, as ``Qwen2_5OmniProcessor`` and the chat template render them: one ``<|IMAGE|>``
inside ``<|vision_bos|>..<|vision_eos|>`` per image, one ``<|VIDEO|>`` (same markers) per video,
one ``<|AUDIO|>`` inside ``<|audio_bos|>..<|audio_eos|>`` per clip. Each expands to the item's
tokens. Per-item data, under HF's names (concatenating the items gives HF's batched tensors):

- image: ``pixel_values`` [num_patches, patch_dim], ``image_grid_thw`` [1, 3]
- video: ``pixel_values_videos`` [num_patches, patch_dim], ``video_grid_thw`` [1, 3],
  ``video_second_per_grid`` [1] (seconds spanned by one temporal patch)
- audio: ``input_features`` [1, num_mel_bins, num_frames], ``feature_attention_mask``
  [1, num_frames] (int32, all ones): the clip's valid frames only. The HF processor pads every
  clip to the feature extractor's window (300 s in the real checkpoints) and truncates longer
  ones, and the encoder drops the padding's frames again; featurizing 300 s of zeros took
  ~0.5 s of one CPU core per clip and made a 15 MB tensor to send to the engine. The frames
  kept are the padded call's, bit for bit (see ``_featurize``). Each clip is featurized on its
  own, so its tensors never depend on the other clips of the request (they can be cached).

Audio-in-video (``mm_processor_kwargs={"use_audio_in_video": True}``): a video that comes with
its audio track is ONE "video" item. Its ``<|VIDEO|>`` becomes ``<|audio_bos|>``, the video and
audio tokens interleaved by time chunks (``seconds_per_chunk`` at ``position_id_per_seconds``),
then ``<|audio_eos|>``, exactly as HF lays them out; the range's ``is_embed`` is False on the
two markers. Its data holds the video fields, the audio fields of its track,
``use_audio_in_video=True`` and ``audio_in_video`` (the layout parameters: ``seconds_per_grid``,
``position_id_per_seconds``, ``seconds_per_chunk``, ``merge_size``).
``get_audio_in_video_order(data)`` gives the item's embeddings in token order ([num_embeds]
bool, True = video embedding), so the model lays them out as the processor did. A video
without an audio track stays a plain video even with the flag on (as in HF).

A video's audio track is given as ``media.VideoItem.audio`` (``(waveform, rate)``, what the
chat API decodes from a file) or offline as ``{"video": (video, (waveform, rate))}`` (or a list
of such pairs), where ``video`` is any accepted video form. Tracks are resampled like clips.

Video timing: HF sets ``video_second_per_grid = temporal_patch_size / fps`` from its ``fps`` kwarg
(default 2.0 here, 1.0 for Qwen3-Omni), never from the video, so the caller must pass the rate
the frames were sampled at. omniserve does that itself: a video that knows its frame rate (a
decoded ``VideoItem``) uses it, which equals HF called with that ``fps``; bare frames use the
``fps`` kwarg or HF's default, exactly as HF.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.parse import (
    MultiModalDataItems,
    MultiModalDataParser,
    VideoProcessorItems,
    _video_to_array,
    is_audio_clip,
    is_one_video,
    sampled_fps,
)
from omniserve.multimodal.processing import (
    MultiModalFieldConfig,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    RequestKwarg,
)
from omniserve.multimodal.pruning import prune_order
from processors.qwen2_5_omni_audio import get_feat_extract_output_lengths
from processors.qwen2_audio import Qwen2AudioProcessingInfo
from processors.qwen2_vl import (
    _MAX_ASPECT_RATIO,
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
    VisionGeometry,
)

_MAX_FRAMES_SEARCHED = 1000
"""Mel frames (10 s) tried when looking for a clip's shortest length that yields a token."""

_FLAG_KWARGS = ("use_audio_in_video", "load_audio_from_video")
"""Both names HF accepts for audio-in-video; omniserve handles the flag itself."""


def uses_audio_in_video(mm_kwargs: Mapping[str, object]) -> bool:
    """Whether the processor kwargs turn audio-in-video on (under either HF name)."""
    flags = [mm_kwargs.get(key) for key in _FLAG_KWARGS]
    for key, value in zip(_FLAG_KWARGS, flags, strict=True):
        if value is not None and not isinstance(value, bool):
            raise MultiModalInputError(
                f"{key} must be true or false, got {value!r}", stage="process", modality="video"
            )
    return any(flags)


def _video_times(data: Mapping[str, Any]) -> np.ndarray:
    """Time of each video token in position ids, as HF computes it ([num_video_tokens] f64)."""
    params = data["audio_in_video"]
    t, h, w = (int(n) for n in data["video_grid_thw"].reshape(3))
    merge = params["merge_size"]
    grid_index = np.repeat(np.arange(t), (h // merge) * (w // merge))
    return grid_index * params["seconds_per_grid"] * params["position_id_per_seconds"]


def _chunk_sizes(times: np.ndarray, tokens_per_chunk: int) -> list[int]:
    """Split non-decreasing ``times`` where one first reaches the next chunk boundary.

    NOTE: the boundary advances one chunk per split even when the times jump several chunks,
    exactly as the reference's ``get_chunked_index`` does.
    """
    sizes, start, boundary = [], 0, tokens_per_chunk
    for index, time in enumerate(times):
        if time >= boundary:
            sizes.append(index - start)
            start, boundary = index, boundary + tokens_per_chunk
    sizes.append(len(times) - start)
    return sizes


def get_audio_in_video_order(data: Mapping[str, Any]) -> torch.Tensor:
    """The embeddings of an audio-in-video item in token order: [num_embeds] bool, True for a
    video embedding, False for an audio one. Chunk ``j`` of the video tokens comes before chunk
    ``j`` of the audio tokens; a chunk spans ``seconds_per_chunk`` (Qwen2.5-Omni)."""
    params = data["audio_in_video"]
    num_audio = int(get_feat_extract_output_lengths(int(data["feature_attention_mask"].sum())))
    tokens_per_chunk = int(params["position_id_per_seconds"] * params["seconds_per_chunk"])
    video_chunks = _chunk_sizes(_video_times(data), tokens_per_chunk)
    audio_chunks = _chunk_sizes(np.arange(num_audio), tokens_per_chunk)
    order: list[bool] = []
    for j in range(max(len(video_chunks), len(audio_chunks))):
        order += [True] * (video_chunks[j] if j < len(video_chunks) else 0)
        order += [False] * (audio_chunks[j] if j < len(audio_chunks) else 0)
    return torch.tensor(order, dtype=torch.bool)


class OmniVideoProcessorItems(VideoProcessorItems):
    """Videos with their audio tracks (mono float32 at the extractor's rate; None: no track)."""

    def __init__(
        self,
        items: list[np.ndarray],
        metadata: list[dict[str, Any]],
        audios: list[np.ndarray | None],
    ) -> None:
        super().__init__(items, metadata)
        self.audios = audios

    def hash_payload(self, index: int) -> object:
        return (self.items[index], self.metadata[index], self.audios[index])


def _is_video_with_track(value: Any) -> bool:
    """The offline form ``(video, (waveform, rate))``."""
    return isinstance(value, tuple) and len(value) == 2 and is_audio_clip(value[1])


class OmniDataParser(MultiModalDataParser):
    """The base parser, with videos that may carry their audio track (see the module doc)."""

    def _parse_video(self, data: Any) -> OmniVideoProcessorItems:
        videos = [data] if is_one_video(data) or _is_video_with_track(data) else list(data)
        frames, metadata, audios = [], [], []
        for index, video in enumerate(videos):
            if _is_video_with_track(video):
                video, track = video
            else:
                track = getattr(video, "audio", None)
            array, meta = _video_to_array(index, video)
            frames.append(array)
            metadata.append(meta)
            audios.append(None if track is None else self._track_to_waveform(index, track))
        return OmniVideoProcessorItems(frames, metadata, audios)

    def _track_to_waveform(self, index: int, track: Any) -> np.ndarray:
        try:
            return self._to_waveform(index, track)
        except MultiModalInputError as err:
            raise MultiModalInputError(
                f"the audio track of item {index}: {err.detail}", stage="process", modality="video"
            ) from err


class OmniVisionGeometry(VisionGeometry):
    """Qwen2-VL's geometry; the worst-case frame also tries exact rectangles, since the omni
    video window (768 merged patches) is not a square."""

    def largest_frame_size(self) -> tuple[int, int]:
        f = self.factor
        cells = self.max_pixels // (f * f)
        rectangles = [
            (cells // h * f, h * f)
            for h in range(1, math.isqrt(cells) + 1)
            if cells // h <= _MAX_ASPECT_RATIO * h
        ]
        candidates = [super().largest_frame_size(), *rectangles]
        return max(candidates, key=lambda size: self.tokens_per_frame(*size))


class Qwen2_5OmniThinkerProcessingInfo(Qwen2VLProcessingInfo, Qwen2AudioProcessingInfo):
    """Qwen2-VL's vision geometry and Qwen2-Audio's extractor, read through the omni processor's
    merged kwargs (its class-level video size overrides the video processor's own). A pruned
    video keeps a share per frame group, so a soundtrack's tokens keep their places among them."""

    video_pruning_layout = "per_frame"

    request_kwargs = {
        **Qwen2VLProcessingInfo.request_kwargs,
        **{flag: RequestKwarg(bool) for flag in _FLAG_KWARGS},
    }
    model_bound_kwargs = (
        Qwen2VLProcessingInfo.model_bound_kwargs
        | Qwen2AudioProcessingInfo.model_bound_kwargs
        | {"n_window"}
    )

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": None, "audio": None}

    def get_data_parser(self) -> MultiModalDataParser:
        return OmniDataParser(
            target_sr=self.get_feature_extractor().sampling_rate,
            max_audio_seconds=self.max_audio_seconds,
        )

    def merge_hf_kwargs(self, mm_kwargs: Mapping[str, object] | None = None) -> dict[str, Any]:
        """The HF processor's per-modality kwargs for ``mm_kwargs`` (default: the front end's
        ``--mm-processor-kwargs``), as its ``__call__`` merges them."""
        hf_processor = self.get_hf_processor()
        kwargs = self.ctx.mm_processor_kwargs if mm_kwargs is None else mm_kwargs
        kwargs = {k: v for k, v in kwargs.items() if k not in _FLAG_KWARGS}
        return hf_processor._merge_kwargs(
            tokenizer_init_kwargs=hf_processor.tokenizer.init_kwargs, **kwargs
        )

    def get_geometry(self, modality: str) -> VisionGeometry:
        hf_processor = self.get_hf_processor()
        image = modality == "image"
        sub = hf_processor.image_processor if image else hf_processor.video_processor
        group = self.merge_hf_kwargs()["images_kwargs" if image else "videos_kwargs"]
        size = dict(group.get("size") or sub.size)
        return OmniVisionGeometry(
            patch_size=int(group.get("patch_size", sub.patch_size)),
            merge_size=int(group.get("merge_size", sub.merge_size)),
            temporal_patch_size=int(group.get("temporal_patch_size", sub.temporal_patch_size)),
            min_pixels=int(group.get("min_pixels", size["shortest_edge"])),
            max_pixels=int(group.get("max_pixels", size["longest_edge"])),
        )

    def get_num_audio_tokens(
        self, num_mel_frames: int, mm_kwargs: Mapping[str, object] | None = None
    ) -> int:
        """Placeholder tokens of a clip with ``num_mel_frames`` valid frames."""
        return int(get_feat_extract_output_lengths(num_mel_frames))

    def get_max_audio_tokens(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """A true bound: longer clips are truncated to the extractor's window."""
        return self.get_num_audio_tokens(self.get_feature_extractor().nb_max_frames)

    def get_max_audio_samples(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """Samples of a clip with ``get_max_audio_tokens`` tokens."""
        return int(self.get_feature_extractor().n_samples)

    def get_num_frames_with_most_features(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """Frames of the worst-case video: what the prompt leaves after the images and clips
        (and each video's own track under audio-in-video), split between the videos."""
        geometry = self.get_geometry("video")
        num_videos = max(mm_counts.get("video", 0), 1)
        max_audio = self.get_max_audio_tokens(seq_len, mm_counts)
        room = (
            seq_len
            - mm_counts.get("image", 0) * self.get_max_image_tokens()
            - mm_counts.get("audio", 0) * max_audio
        )
        if uses_audio_in_video(self.ctx.mm_processor_kwargs):
            room -= mm_counts.get("video", 0) * (max_audio + 2)
        grid_t = max(room // num_videos // geometry.max_tokens_per_frame(), 1)
        max_frames = self.get_hf_processor().video_processor.max_frames
        grid_t = min(grid_t, max(max_frames // geometry.temporal_patch_size, 1))
        return grid_t * geometry.temporal_patch_size

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        """Qwen2-VL's image and video bounds, the audio bound, and under a default
        ``use_audio_in_video`` each video's track and its two markers on top."""
        bounds = dict(Qwen2VLProcessingInfo.get_mm_max_tokens_per_item(self, seq_len, mm_counts))
        bounds["audio"] = self.get_max_audio_tokens(seq_len, mm_counts)
        if uses_audio_in_video(self.ctx.mm_processor_kwargs):
            bounds["video"] += bounds["audio"] + 2
        return bounds


class Qwen2_5OmniThinkerDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    info: Qwen2_5OmniThinkerProcessingInfo

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        hf = self.info.get_hf_processor()
        image = f"{hf.vision_bos_token}{hf.image_token}{hf.vision_eos_token}"
        video = f"{hf.vision_bos_token}{hf.video_token}{hf.vision_eos_token}"
        audio = f"{hf.audio_bos_token}{hf.audio_token}{hf.audio_eos_token}"
        return (
            image * mm_counts.get("image", 0)
            + video * mm_counts.get("video", 0)
            + audio * mm_counts.get("audio", 0)
        )

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> dict[str, Any]:
        data = super().get_dummy_mm_data(seq_len, mm_counts)
        rate = self.info.get_feature_extractor().sampling_rate
        num_samples = self.info.get_max_audio_samples(seq_len, mm_counts)
        data["audio"] = self._get_dummy_audios(num_samples, rate, mm_counts.get("audio", 0))
        if uses_audio_in_video(self.info.ctx.mm_processor_kwargs):
            track = (np.zeros(num_samples, dtype=np.float32), rate)  # the video's, not capped
            data["video"] = [(video, track) for video in data["video"]]
        return data


class Qwen2_5OmniThinkerMultiModalProcessor(Qwen2VLMultiModalProcessor):
    """Qwen2-VL's image/video handling plus audio clips and audio-in-video items."""

    info: Qwen2_5OmniThinkerProcessingInfo

    default_video_fps = 2.0
    """The fps HF assumes for ``video_second_per_grid`` when none is known."""
    forced_audio_kwargs: Mapping[str, object] = {"padding": "max_length"}
    """What the HF processor's ``_process_audio`` forces on the feature extractor."""
    audio_in_video_order: Callable[[Mapping[str, Any]], torch.Tensor] = staticmethod(
        get_audio_in_video_order
    )

    def _to_mm_items(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> MultiModalDataItems:
        """vLLM's offline form of videos with their audio: ``{"video": v, "audio": a}`` with
        ``use_audio_in_video`` and no track inside any video, audio item i the track of video i
        (only the videos have placeholders). Each track joins its video, as if the video had
        carried it. When videos carry their tracks, audio items are clips of their own.
        With audio turned off (its encoder is not loaded) no video may bring its track."""
        mm_items = super()._to_mm_items(mm_data, mm_kwargs)
        videos = mm_items.get("video")
        if not isinstance(videos, OmniVideoProcessorItems) or not uses_audio_in_video(mm_kwargs):
            return mm_items
        if "audio" in mm_items and all(track is None for track in videos.audios):
            clips = mm_items.pop("audio")
            if len(clips) != len(videos):
                raise MultiModalInputError(
                    f"with use_audio_in_video and videos without tracks, audio item i is the "
                    f"track of video i, but there are {len(clips)} audio items for "
                    f"{len(videos)} videos",
                    stage="process",
                    modality="audio",
                )
            videos.audios = list(clips.items)
        has_tracks = any(track is not None for track in videos.audios)
        if has_tracks and self.info.get_allowed_mm_limits().get("audio") == 0:
            raise MultiModalInputError(
                "use_audio_in_video needs the audio encoder for the videos' soundtracks, and "
                "this server turns audio off (--limit-mm-per-prompt audio: 0 or "
                "--language-model-only)",
                stage="process",
                modality="video",
            )
        return mm_items

    def _call_hf_processor(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, Any]:
        # The omni processors refuse to run without text, so call the image and video
        # sub-processors as their `__call__` does: same merged kwargs, same added fields.
        hf_processor = self.info.get_hf_processor()
        merged = self.info.merge_hf_kwargs(mm_kwargs)
        outputs: dict[str, Any] = {}
        if "images" in mm_data:
            images_kwargs = {**merged["images_kwargs"], "return_tensors": "pt"}
            outputs.update(hf_processor.image_processor(mm_data["images"], **images_kwargs))
        if "videos" in mm_data:
            videos_kwargs = {
                **merged["videos_kwargs"],
                "video_metadata": mm_data["video_metadata"],
                "return_tensors": "pt",
            }
            outputs.update(hf_processor.video_processor(mm_data["videos"], **videos_kwargs))
            seconds = [self._seconds_per_grid(m, merged) for m in mm_data["video_metadata"]]
            outputs["video_second_per_grid"] = torch.tensor(seconds)  # [num_videos] f32, as HF
        return outputs

    def _seconds_per_grid(self, metadata: Mapping[str, Any], merged: Mapping[str, Any]) -> float:
        """``temporal_patch_size / fps`` with the frames' own rate when known (see the module
        doc), else the ``fps`` kwarg, else HF's default."""
        fps = sampled_fps(metadata) or merged["videos_kwargs"].get("fps") or self.default_video_fps
        return self.info.get_hf_processor().video_processor.temporal_patch_size / fps

    def _apply_hf_processor(
        self,
        mm_items: MultiModalDataItems,
        indices: Mapping[str, list[int]],
        mm_kwargs: Mapping[str, object],
    ) -> dict[str, list[dict[str, Any]]]:
        """Images and videos in one HF call; each audio clip (and video track) featurized on
        its own, so an item's tensors never depend on the request's other items."""
        visual = {modality: idx for modality, idx in indices.items() if modality != "audio"}
        out = super()._apply_hf_processor(mm_items, visual, mm_kwargs) if visual else {}
        if "audio" in indices:
            clips = mm_items["audio"].items
            out["audio"] = [
                self._featurize(clips[i], mm_kwargs, "audio", f"audio item {i}")
                for i in indices["audio"]
            ]
        if "video" in indices and uses_audio_in_video(mm_kwargs):
            videos = mm_items["video"]
            assert isinstance(videos, OmniVideoProcessorItems)
            merged = self.info.merge_hf_kwargs(mm_kwargs)
            for data, index in zip(out["video"], indices["video"], strict=True):
                track = videos.audios[index]
                if track is None:
                    continue  # a silent video stays a plain video, as in HF
                what = f"the audio track of video item {index}"
                data.update(self._featurize(track, mm_kwargs, "video", what))
                data["use_audio_in_video"] = True
                data["audio_in_video"] = self._audio_in_video_params(videos.metadata[index], merged)
        return out

    def _featurize(
        self, waveform: np.ndarray, mm_kwargs: Mapping[str, object], modality: str, what: str
    ) -> dict[str, torch.Tensor]:
        """One clip's ``input_features`` [1, mels, frames] and ``feature_attention_mask``."""
        extractor = self.info.get_feature_extractor()
        if waveform.size <= extractor.n_fft // 2:  # the STFT's reflect padding needs more
            raise self._too_short(what, modality, f"{waveform.size} samples", mm_kwargs)
        audio_kwargs = {
            **self.info.merge_hf_kwargs(mm_kwargs)["audio_kwargs"],
            **self.forced_audio_kwargs,
            "return_tensors": "pt",
        }
        clip, valid = waveform, None
        if audio_kwargs.get("padding") == "max_length" and waveform.size < extractor.n_samples:
            # The padded call's frames over the clip, without the window's zeros beyond it:
            # each frame sees the same samples when the clip is followed by a frame's width of
            # zeros, and zeros' frames never raise the log-mel maximum the features clamp to.
            # At least a second is featurized: the mel projection's GEMM may sum a narrower
            # matrix in another order.
            clip = np.pad(waveform, (0, self._featurized_samples(waveform.size)))
            audio_kwargs["padding"] = "longest"
            valid = -(-waveform.size // extractor.hop_length)  # the padded call's mask's count
        try:
            features = extractor([clip], **audio_kwargs)
        except Exception as exc:
            raise MultiModalInputError(
                f"the {type(extractor).__name__} rejected the audio: {exc}",
                stage="process",
                modality=modality,
            ) from exc
        return {
            "input_features": features["input_features"][..., :valid].contiguous(),
            "feature_attention_mask": features["attention_mask"][..., :valid],
        }

    def _featurized_samples(self, num_samples: int) -> int:
        """Zeros after a clip of ``num_samples`` for ``_featurize``'s trimmed call."""
        extractor = self.info.get_feature_extractor()
        wanted = max(num_samples + extractor.n_fft, extractor.sampling_rate)
        return min(wanted, extractor.n_samples) - num_samples

    def _audio_in_video_params(
        self, metadata: Mapping[str, Any], merged: Mapping[str, Any]
    ) -> dict[str, float | int]:
        return {
            "seconds_per_grid": self._seconds_per_grid(metadata, merged),
            "position_id_per_seconds": float(merged["position_id_per_seconds"]),
            "seconds_per_chunk": float(merged["seconds_per_chunk"]),
            "merge_size": int(self.info.get_hf_processor().video_processor.merge_size),
        }

    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        fields["video_second_per_grid"] = MultiModalFieldConfig.batched("video")
        return fields

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        hf_processor = self.info.get_hf_processor()
        image_update, plain_video = super()._get_prompt_updates(
            mm_items, hf_processor_mm_kwargs, out_items
        )
        assert isinstance(plain_video, PromptReplacement)

        def video(i: int) -> Any:
            data = out_items["video"][i]
            if not data.get("use_audio_in_video"):
                return plain_video.replacement(i)
            return self._audio_in_video_tokens(data, i, hf_processor_mm_kwargs)

        def audio(i: int) -> list[int]:
            data = out_items["audio"][i]
            num_frames = int(data["feature_attention_mask"].sum())
            num_tokens = self.info.get_num_audio_tokens(num_frames, hf_processor_mm_kwargs)
            self._check_audio_tokens(
                num_tokens, num_frames, f"audio item {i}", "audio", hf_processor_mm_kwargs
            )
            return [hf_processor.audio_token_id] * num_tokens

        return [
            image_update,
            PromptReplacement("video", hf_processor.video_token, video),
            PromptReplacement("audio", hf_processor.audio_token, audio),
        ]

    def token_counts(self, feature: MultiModalFeatureSpec) -> Mapping[str, int]:
        """A video with its track counts the track's tokens as audio, the rest as video."""
        data = feature.data or {}
        if feature.modality != "video" or not data.get("use_audio_in_video"):
            return super().token_counts(feature)
        audio = int((~self.audio_in_video_order(data)).sum())
        return {"video": feature.mm_position.length - audio, "audio": audio}

    def _audio_in_video_tokens(
        self, data: Mapping[str, Any], i: int, mm_kwargs: Mapping[str, object]
    ) -> PromptUpdateDetails:
        """``<|audio_bos|>`` + the interleaved video/audio tokens + ``<|audio_eos|>``."""
        hf_processor = self.info.get_hf_processor()
        order = self.audio_in_video_order(data)
        t, h, w = (int(n) for n in data["video_grid_thw"].reshape(3))
        merge = data["audio_in_video"]["merge_size"]
        if pruning := self.info.video_pruning(t, h * w // merge**2):  # (--video-pruning-rate)
            order = prune_order(order, pruning.tokens_per_frame, pruning.quotas())
        order = order.tolist()
        num_frames = int(data["feature_attention_mask"].sum())
        what = f"the audio track of video item {i}"
        self._check_audio_tokens(order.count(False), num_frames, what, "video", mm_kwargs)
        video_id, audio_id = hf_processor.video_token_id, hf_processor.audio_token_id
        bos, eos = hf_processor.tokenizer.convert_tokens_to_ids(
            [hf_processor.audio_bos_token, hf_processor.audio_eos_token]
        )
        tokens = [bos, *(video_id if is_video else audio_id for is_video in order), eos]
        return PromptUpdateDetails(tokens, [False, *([True] * len(order)), False])

    def _check_audio_tokens(
        self,
        num_tokens: int,
        num_frames: int,
        what: str,
        modality: str,
        mm_kwargs: Mapping[str, object],
    ) -> None:
        """A clip too short to give one audio token is the caller's error, not the model's."""
        if num_tokens <= 0:
            raise self._too_short(what, modality, f"{num_frames} mel frame(s)", mm_kwargs)

    def _too_short(
        self, what: str, modality: str, got: str, mm_kwargs: Mapping[str, object]
    ) -> MultiModalInputError:
        extractor = self.info.get_feature_extractor()
        min_frames = next(
            (
                n
                for n in range(1, _MAX_FRAMES_SEARCHED + 1)
                if self.info.get_num_audio_tokens(n, mm_kwargs) > 0
            ),
            None,
        )
        if min_frames is None:
            return MultiModalInputError(
                f"{what} gives no audio token ({got}) under these processor settings",
                stage="process",
                modality=modality,
            )
        rate = extractor.sampling_rate
        min_samples = max(min_frames * extractor.hop_length, extractor.n_fft // 2 + 1)
        return MultiModalInputError(
            f"{what} is too short ({got}) to give one audio token; the model needs about "
            f"{1000 * min_samples / rate:.0f} ms of audio ({min_frames} mel frame(s))",
            stage="process",
            modality=modality,
        )

    def _kwargs_affecting(self, modality: str, mm_kwargs: Mapping[str, object]) -> dict:
        """The base routing, with the audio-in-video flag normalised and owned by videos; under
        the flag a video's key also covers the kwargs that shape its track's features."""
        rest = {k: v for k, v in mm_kwargs.items() if k not in _FLAG_KWARGS}
        kwargs = super()._kwargs_affecting(modality, rest)
        if modality == "video" and uses_audio_in_video(mm_kwargs):
            kwargs = {**super()._kwargs_affecting("audio", rest), **kwargs}
            kwargs["use_audio_in_video"] = True
        return kwargs
