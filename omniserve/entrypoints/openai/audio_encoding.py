"""Spoken answers as bytes in the formats OpenAI's API names (soundfile / libsndfile encodes).

PCM16 is the one rule for raw samples, whole or streamed: clip to [-1, 1], scale by 32767,
round half to even, little-endian int16. Each sample maps on its own, so the chunks of a stream
concatenate to exactly the bytes of the whole answer.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile

# format -> (libsndfile container, subtype); pcm16 is raw samples, no container.
_CONTAINERS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
AUDIO_FORMATS = ("wav", "pcm16", "flac", "mp3", "opus")
"""What chat completions' ``audio.format`` may be (OpenAI's, less aac: no encoder here)."""
STREAM_FORMAT = "pcm16"
"""Streamed audio is raw PCM16 (OpenAI's rule for streaming)."""
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm16": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}


def pcm16(samples: np.ndarray) -> bytes:
    return (np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")).tobytes()


def encode_audio(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """Mono float samples -> one file (or raw PCM16) in ``fmt``."""
    if fmt == "pcm16":
        return pcm16(samples)
    if fmt not in _CONTAINERS:
        raise ValueError(f"audio format {fmt!r} is not one of {', '.join(AUDIO_FORMATS)}.")
    container, subtype = _CONTAINERS[fmt]
    if samples.size == 0 and fmt != "wav":
        # libsndfile writes no readable FLAC / MP3 / Ogg for zero samples: an answer with no
        # speech is one silent sample there
        samples = np.zeros(1, dtype=np.float32)
    buffer = io.BytesIO()
    soundfile.write(
        buffer, np.clip(samples, -1.0, 1.0), sample_rate, format=container, subtype=subtype
    )
    return buffer.getvalue()
