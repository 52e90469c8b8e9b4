"""Bytes -> media: images with PIL, audio with soundfile (PyAV fallback), video with PyAV.

Decoders see untrusted bytes. Every failure inside a third-party decoder is the input's fault, so
it surfaces as ``MultiModalInputError(stage="decode")`` naming the modality, never as a crash or
a warning. Audio always comes back as mono float32 at the file's native sample rate; resampling
to a processor's rate is the parser's job, so one decoded clip can serve any model.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soundfile
from PIL import Image

from omniserve.multimodal.errors import MultiModalInputError


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
    return MultiModalInputError(message, stage="decode", modality=modality)


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


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Decode audio to (mono float32 waveform [num_samples], native sample rate).

    soundfile (libsndfile) handles wav/flac/ogg (and mp3 with libsndfile >= 1.1); anything
    else (m4a/aac, webm, mp4 audio, ...) goes through PyAV. Channels are averaged on both paths.
    """
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as sf_exc:  # libsndfile refuses unknown formats with several error types
        try:
            with av.open(io.BytesIO(data)) as container:
                if not container.streams.audio:
                    raise _decode_error("audio", "the file has no audio stream")
                waveform, rate = decode_audio_stream(container, container.streams.audio[0])
        except MultiModalInputError:
            raise
        except Exception as av_exc:
            raise _decode_error(
                "audio", f"cannot decode audio (soundfile: {sf_exc}; PyAV: {av_exc})"
            ) from av_exc
    else:
        waveform = np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32)
    if waveform.size == 0:
        raise _decode_error("audio", "the audio has no samples")
    return waveform, int(rate)


def decode_audio_stream(
    container: av.container.InputContainer, stream: av.AudioStream
) -> tuple[np.ndarray, int]:
    """Decode one audio stream of an open container to (mono float32, native rate)."""
    track = _AudioTrack(stream)
    for frame in container.decode(stream):
        track.add(frame)
    return track.finish()


class _AudioTrack:
    """Collects decoded audio frames as planar float at the stream's own rate, then averages
    the channels (the same downmix as the soundfile path)."""

    def __init__(self, stream: av.AudioStream) -> None:
        self.rate = int(stream.codec_context.sample_rate or stream.rate)
        self._resampler = av.AudioResampler(format="fltp", rate=self.rate)  # layout kept
        self._chunks: list[np.ndarray] = []  # each [channels, n]

    def add(self, frame: av.AudioFrame | None) -> None:
        self._chunks.extend(out.to_ndarray() for out in self._resampler.resample(frame))

    def finish(self) -> tuple[np.ndarray, int]:
        self.add(None)  # flush the resampler
        if not self._chunks:
            return np.zeros(0, dtype=np.float32), self.rate
        waveform = np.concatenate(self._chunks, axis=1).mean(axis=0)  # [num_samples]
        return np.ascontiguousarray(waveform, dtype=np.float32), self.rate


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


def decode_video(
    data: bytes, *, num_frames: int | None, fps: float | None, max_pixels: int
) -> VideoItem:
    """Decode a video's sampled frames (RGB) and its first audio track, if any.

    One demux pass decodes video and audio together, keeping only the sampled frames. The
    sample is planned from the container's frame count; when that is missing or wrong (e.g.
    Matroska stores none), a second pass samples from the count the first pass observed.
    """
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise _decode_error("video", "the file has no video stream")
            video = container.streams.video[0]
            audio = container.streams.audio[0] if container.streams.audio else None
            width, height = video.codec_context.width, video.codec_context.height
            if width * height > max_pixels:
                raise _decode_error(
                    "video",
                    f"video frames are {width}x{height}, over the "
                    f"limit of {max_pixels} pixels per frame",
                )
            source_fps = _source_fps(video)
            expected = video.frames or _estimate_num_frames(video, container, source_fps)
            indices = sample_frame_indices(expected, source_fps, num_frames=num_frames, fps=fps)
            frames, total, track = _decode_pass(container, video, audio, indices)
        if total != expected:
            indices = sample_frame_indices(total, source_fps, num_frames=num_frames, fps=fps)
            with av.open(io.BytesIO(data)) as container:
                frames, _, _ = _decode_pass(container, container.streams.video[0], None, indices)
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


def _source_fps(video: av.VideoStream) -> float:
    rate: Fraction | None = video.average_rate or video.guessed_rate or video.base_rate
    if not rate or rate <= 0:
        raise _decode_error("video", "the video stream has no frame rate")
    return float(rate)


def _estimate_num_frames(
    video: av.VideoStream, container: av.container.InputContainer, source_fps: float
) -> int:
    if video.duration is not None and video.time_base is not None:
        seconds = float(video.duration * video.time_base)
    elif container.duration is not None:
        seconds = container.duration / av.time_base
    else:
        return 0  # unknown: the first pass only counts, the second samples
    return round(seconds * source_fps)


def _decode_pass(
    container: av.container.InputContainer,
    video: av.VideoStream,
    audio: av.AudioStream | None,
    indices: list[int],
) -> tuple[list[np.ndarray], int, tuple[np.ndarray, int] | None]:
    """Decode every video frame (converting only those in ``indices``) and the audio track."""
    wanted = set(indices)
    frames: list[np.ndarray] = []  # each [H, W, 3]
    total = 0
    track = _AudioTrack(audio) if audio is not None else None
    for packet in container.demux(*([video] if audio is None else [video, audio])):
        for frame in packet.decode():
            if isinstance(frame, av.VideoFrame):
                if total in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                total += 1
            elif track is not None:
                track.add(frame)
    return frames, total, None if track is None else track.finish()
