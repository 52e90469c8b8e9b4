"""Bytes -> media: images with PIL, audio with soundfile (PyAV fallback), video with PyAV, and
embeddings sent as base64 of ``torch.save`` (``load_tensor``).

Decoders see untrusted bytes. Every failure inside a third-party decoder is the input's fault, so
it surfaces as ``MultiModalInputError(stage="decode")`` naming the modality, never as a crash or
a warning. Audio always comes back as mono float32 at the file's native sample rate; resampling
to a processor's rate is the parser's job, so one decoded clip can serve any model.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from omniserve.multimodal.errors import MultiModalInputError

if TYPE_CHECKING:
    import av


@dataclass
class VideoItem:
    """Sampled frames of one video, with what a processor needs to place them in time."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    fps: float
    """Frame rate of the sampled frames: source_fps * T / num_source_frames."""
    source_fps: float
    frame_indices: list[int]
    """Index of each sampled frame among the decoded source frames."""
    audio: tuple[np.ndarray, int] | None
    """The file's first audio track as (mono float32 waveform [num_samples], native rate)."""
    num_source_frames: int | None = None
    """Frames in the source video (None when the item was not decoded from a file)."""


def _decode_error(modality: str, message: str) -> MultiModalInputError:
    # decoders name the in-memory file by its repr ("<_io.BytesIO object at 0x7f...>")
    message = _IN_MEMORY_FILE.sub("the data", message)
    return MultiModalInputError(message, stage="decode", modality=modality)


_IN_MEMORY_FILE = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


# ---------------------------------------------------------------------------------------- image


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Decode an image to RGB, refusing more than ``max_pixels`` before any pixel is decoded.

    Transparent images are composited on white, as Hugging Face's ``convert_to_rgb`` does, so
    an RGBA attachment gives the model the same pixels HF would. PIL may still warn for images
    above its own global ``MAX_IMAGE_PIXELS``; the error raised here is what callers act on.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=_image_formats())
        width, height = image.size
        if width * height > max_pixels:
            raise _decode_error(
                "image",
                f"image is {width}x{height} = {width * height} "
                f"pixels, over the limit of {max_pixels} "
                "(decompression-bomb guard)",
            )
        image.load()  # NOTE: raises on truncated data (PIL's LOAD_TRUNCATED_IMAGES stays off)
        return _to_rgb(image)
    except MultiModalInputError:
        raise
    except Image.DecompressionBombError as exc:
        raise _decode_error("image", f"image too large (decompression-bomb guard): {exc}") from exc
    except UnidentifiedImageError as exc:  # its message names an in-memory buffer's address
        raise _decode_error(
            "image",
            f"cannot decode image: not a known image format "
            f"({len(data)} bytes starting {data[:8]!r})",
        ) from exc
    except Exception as exc:  # PIL plugins raise many types (OSError, SyntaxError, ...)
        raise _decode_error("image", f"cannot decode image: {exc}") from exc


@functools.cache
def _image_formats() -> tuple[str, ...]:
    """Every format PIL reads except EPS, whose loading runs Ghostscript on untrusted input."""
    Image.init()
    return tuple(name for name in Image.OPEN if name != "EPS")


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (
        image.mode == "P" and "transparency" in image.info
    )
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


# ---------------------------------------------------------------------------------------- audio


def decode_audio(data: bytes, *, max_seconds: float) -> tuple[np.ndarray, int]:
    """Decode audio to (mono float32 waveform [num_samples], native sample rate).

    soundfile (libsndfile) handles wav/flac/ogg (and mp3 with libsndfile >= 1.1); anything
    else (m4a/aac, webm, mp4 audio, ...) goes through PyAV. Channels are averaged on both paths.
    A clip longer than ``max_seconds`` is refused from its header, before any sample is decoded
    (a 2 KB file declared at 1 Hz holds 2,000 s), and again while decoding (headers can lie).
    """
    import av
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as sf_exc:  # libsndfile refuses unknown formats with several error types
        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                if not container.streams.audio:
                    raise _decode_error("audio", "the file has no audio stream")
                stream = container.streams.audio[0]
                _check_seconds(
                    "audio",
                    "the audio",
                    _stream_seconds(stream, container),
                    max_seconds,
                    _AUDIO_SECONDS,
                )
                track = _AudioTrack(stream, "audio", "the audio", max_seconds)
                for frame in container.decode(stream):
                    track.add(frame)
                waveform, rate = track.finish()
        except MultiModalInputError:
            raise
        except Exception as av_exc:
            raise _decode_error(
                "audio", f"cannot decode audio (soundfile: {sf_exc}; PyAV: {av_exc})"
            ) from av_exc
    else:
        if info.samplerate > 0:
            _check_seconds(
                "audio", "the audio", info.frames / info.samplerate, max_seconds, _AUDIO_SECONDS
            )
        try:
            samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except Exception as exc:
            raise _decode_error("audio", f"cannot decode audio: {exc}") from exc
        waveform = np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32)
        _check_seconds("audio", "the audio", waveform.size / rate, max_seconds, _AUDIO_SECONDS)
        _check_finite(waveform, "audio", "the audio")
    if waveform.size == 0:
        raise _decode_error("audio", "the audio has no samples")
    return waveform, int(rate)


def audio_seconds(data: bytes) -> float | None:
    """The clip's length as its header declares it, decoding no sample (None: undeclared, or
    not audio this module can open)."""
    import av
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
        return info.frames / info.samplerate if info.samplerate > 0 else None
    except Exception:  # not a libsndfile format: ask PyAV's demuxer
        pass
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            return _stream_seconds(streams[0], container) if streams else None
    except Exception:
        return None


def _check_finite(waveform: np.ndarray, modality: str, what: str) -> np.ndarray:
    """Float formats can carry NaN or infinite samples; the encoder would turn them into NaN
    scores (a meaningless answer), so they are refused here, naming the part."""
    if not np.isfinite(waveform).all():
        raise _decode_error(modality, f"{what} has samples that are NaN or infinite")
    return waveform


def _check_seconds(
    modality: str, what: str, seconds: float | None, limit: float, knob: str, so_far: bool = False
) -> None:
    """``so_far``: ``seconds`` is what decoding has produced yet, not the whole length."""
    if seconds is not None and seconds > limit:
        length = f"at least {seconds:.1f} s" if so_far else f"{seconds:.1f} s"
        raise _decode_error(
            modality, f"{what} lasts {length}, over the limit of {limit:g} s ({knob})"
        )


def media_io_knob(modality: str, key: str) -> str:
    """How an operator raises a limit: the --media-io-kwargs entry that sets it."""
    return f'--media-io-kwargs {{"{modality}": {{"{key}": ...}}}}'


_AUDIO_SECONDS = media_io_knob("audio", "max_seconds")
"""An audio track in a video counts against the audio clip limit."""


def _stream_seconds(
    stream: av.stream.Stream, container: av.container.InputContainer
) -> float | None:
    """A stream's duration as its container declares it (None: not declared)."""
    import av

    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


class _AudioTrack:
    """Collects decoded audio frames as planar float at the stream's own rate, then averages
    the channels (the same downmix as the soundfile path). Refuses more than ``max_seconds``
    as the samples arrive."""

    def __init__(
        self, stream: av.AudioStream, modality: str, what: str, max_seconds: float
    ) -> None:
        import av

        self.rate = int(stream.codec_context.sample_rate or stream.rate)
        self._resampler = av.AudioResampler(format="fltp", rate=self.rate)  # layout kept
        self._chunks: list[np.ndarray] = []  # each [channels, n]
        self._num_samples = 0
        self._limit = (modality, what, max_seconds)

    def add(self, frame: av.AudioFrame | None) -> None:
        for out in self._resampler.resample(frame):
            self._chunks.append(out.to_ndarray())
            self._num_samples += self._chunks[-1].shape[1]
        modality, what, max_seconds = self._limit
        _check_seconds(
            modality, what, self._num_samples / self.rate, max_seconds, _AUDIO_SECONDS, so_far=True
        )

    def finish(self) -> tuple[np.ndarray, int]:
        self.add(None)  # flush the resampler
        if not self._chunks:
            return np.zeros(0, dtype=np.float32), self.rate
        waveform = np.concatenate(self._chunks, axis=1).mean(axis=0)  # [num_samples]
        waveform = np.ascontiguousarray(waveform, dtype=np.float32)
        modality, what, _ = self._limit
        return _check_finite(waveform, modality, what), self.rate


# ---------------------------------------------------------------------------------------- video


def sample_frame_indices(
    num_source_frames: int, source_fps: float, *, num_frames: int | None, fps: float | None
) -> list[int]:
    """Evenly spaced frame indices, first and last frame included.

    ``num_frames`` and ``fps`` are both upper bounds on the count (fps as frames per second of
    source duration); with neither, every frame is kept.
    """
    count = num_source_frames
    if num_frames is not None:
        count = min(count, num_frames)
    if fps is not None:
        count = min(count, max(1, math.floor(num_source_frames / source_fps * fps)))
    if count <= 0:
        return []
    # NOTE: spacing is >= 1 because count <= num_source_frames, so rounding keeps them distinct.
    return np.linspace(0, num_source_frames - 1, count).round().astype(int).tolist()


@dataclass(frozen=True)
class VideoBudget:
    """What decoding one video may cost. Checked from the container's header before any frame
    is decoded, and again while decoding, since headers can lie."""

    max_frame_pixels: int
    """Pixels of one frame (the decompression-bomb guard images have too)."""
    max_frames: int
    """Source frames decoded (every frame is decoded, even those not sampled)."""
    max_seconds: float
    max_total_pixels: int
    """Source frames x their pixels: the decoding work itself."""
    max_audio_seconds: float
    """The audio track, as for an audio clip."""


def decode_video(
    data: bytes, *, num_frames: int | None, fps: float | None, budget: VideoBudget
) -> VideoItem:
    """Decode a video's sampled frames (RGB) and its first audio track, if any.

    One demux pass decodes video and audio together, keeping only the sampled frames. The
    sample is planned from the container's frame count; when that is missing or wrong (e.g.
    Matroska stores none), a second pass samples from the count the first pass observed.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise _decode_error("video", "the file has no video stream")
            video = container.streams.video[0]
            audio = container.streams.audio[0] if container.streams.audio else None
            width, height = video.codec_context.width, video.codec_context.height
            if width * height > budget.max_frame_pixels:
                raise _decode_error(
                    "video",
                    f"video frames are {width}x{height}, over the limit of "
                    f"{budget.max_frame_pixels} pixels per frame "
                    f"({media_io_knob('image', 'max_pixels')})",
                )
            source_fps = _source_fps(video)
            seconds = _stream_seconds(video, container)
            _check_seconds(
                "video",
                "the video",
                seconds,
                budget.max_seconds,
                media_io_knob("video", "max_seconds"),
            )
            if audio is not None:
                _check_seconds(
                    "video",
                    "the video's audio track",
                    _stream_seconds(audio, container),
                    budget.max_audio_seconds,
                    _AUDIO_SECONDS,
                )
            expected = video.frames or (round(seconds * source_fps) if seconds else 0)
            meter = _DecodeMeter(budget)
            meter.check(expected, expected * width * height)
            indices = sample_frame_indices(expected, source_fps, num_frames=num_frames, fps=fps)
            frames, total, track = _decode_pass(container, video, audio, indices, meter)
        if total != expected:
            indices = sample_frame_indices(total, source_fps, num_frames=num_frames, fps=fps)
            with av.open(io.BytesIO(data), mode="r") as container:
                frames, _, _ = _decode_pass(
                    container, container.streams.video[0], None, indices, _DecodeMeter(budget)
                )
        if not frames:
            raise _decode_error("video", "the video has no frames")
        stacked = np.stack(frames)  # [T, H, W, 3]; raises if the resolution changes midway
    except MultiModalInputError:
        raise
    except Exception as exc:  # FFmpeg and PyAV errors of many kinds
        raise _decode_error("video", f"cannot decode video: {exc}") from exc
    return VideoItem(
        frames=stacked,
        fps=source_fps * len(frames) / total,
        source_fps=source_fps,
        frame_indices=indices,
        audio=track if track is not None and track[0].size else None,
        num_source_frames=total,
    )


class _DecodeMeter:
    """Counts the frames and pixels a decode pass spends, refusing the video once over budget."""

    def __init__(self, budget: VideoBudget) -> None:
        self.budget = budget
        self.frames = 0
        self.pixels = 0

    def add(self, frame: av.VideoFrame) -> None:
        if frame.width * frame.height > self.budget.max_frame_pixels:
            raise _decode_error(
                "video",
                f"a frame is {frame.width}x{frame.height}, over the "
                f"limit of {self.budget.max_frame_pixels} pixels per "
                f"frame ({media_io_knob('image', 'max_pixels')})",
            )
        self.frames += 1
        self.pixels += frame.width * frame.height
        self.check(self.frames, self.pixels)

    def check(self, frames: int, pixels: int) -> None:
        if frames > self.budget.max_frames:
            raise _decode_error(
                "video",
                f"the video has {frames} or more frames, over the "
                f"limit of {self.budget.max_frames} "
                f"({media_io_knob('video', 'max_frames')})",
            )
        if pixels > self.budget.max_total_pixels:
            raise _decode_error(
                "video",
                f"decoding the video means {pixels} or more pixels, "
                f"over the limit of {self.budget.max_total_pixels} "
                f"({media_io_knob('video', 'max_total_pixels')})",
            )


def _source_fps(video: av.VideoStream) -> float:
    rate: Fraction | None = video.average_rate or video.guessed_rate or video.base_rate
    if not rate or rate <= 0:
        raise _decode_error("video", "the video stream has no frame rate")
    return float(rate)


def _decode_pass(
    container: av.container.InputContainer,
    video: av.VideoStream,
    audio: av.AudioStream | None,
    indices: list[int],
    meter: _DecodeMeter,
) -> tuple[list[np.ndarray], int, tuple[np.ndarray, int] | None]:
    """Decode every video frame (converting only those in ``indices``) and the audio track."""
    import av

    wanted = set(indices)
    frames: list[np.ndarray] = []  # each [H, W, 3]
    total = 0
    track = (
        None
        if audio is None
        else _AudioTrack(audio, "video", "the video's audio track", meter.budget.max_audio_seconds)
    )
    for packet in container.demux(*([video] if audio is None else [video, audio])):
        for frame in packet.decode():
            if isinstance(frame, av.VideoFrame):
                meter.add(frame)
                if total in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                total += 1
            elif track is not None and isinstance(frame, av.AudioFrame):
                track.add(frame)
    return frames, total, None if track is None else track.finish()


def load_tensor(text: Any) -> Any:
    """The tensor that ``text`` holds as base64 of ``torch.save(tensor)``, on the CPU, loaded
    with ``weights_only=True`` (so no code runs); a ``ValueError`` saying what it is instead."""
    import torch

    try:
        value = torch.load(io.BytesIO(base64.b64decode(text, validate=True)),
                           weights_only=True, map_location="cpu")  # fmt: skip
    except Exception as exc:  # binascii, pickle and torch errors all mean "not a tensor"
        raise ValueError(f"is not base64 of a torch.save()d tensor ({exc})") from None
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        raise ValueError(f"holds {type(value).__name__}, not one dense tensor")
    return value
