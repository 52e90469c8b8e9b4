"""Bodies of ``POST /v1/audio/speech`` (OpenAI's) and ``GET /v1/audio/voices`` (omniserve's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictFloat, model_validator

from omniserve.entrypoints.openai.audio_encoding import AUDIO_FORMATS, STREAM_FORMAT
from omniserve.entrypoints.openai.protocol import OpenAIBaseModel, SpeechOptions, VoiceId


class CreateSpeechRequest(OpenAIBaseModel):
    """OpenAI's ``POST /v1/audio/speech``: speak ``input`` in a voice."""

    model: str | None = None
    input: str = Field(min_length=1)
    voice: str | VoiceId
    instructions: str | None = None
    """Heard as the user's turn before the words are spoken (else the words themselves)."""
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: StrictFloat = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    """"audio": the file as the body (raw PCM is sent as it is spoken); "sse": events
    ``speech.audio.delta`` (base64 PCM16) then ``speech.audio.done``."""
    speech: SpeechOptions | None = None
    """omniserve's extra: the talker's sampling, over the model's defaults."""

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice

    @property
    def encoding(self) -> str:
        """The audio_encoding name of ``response_format``."""
        return "pcm16" if self.response_format == "pcm" else self.response_format

    @model_validator(mode="after")
    def _speakable(self) -> CreateSpeechRequest:
        if self.speed != 1.0:
            raise ValueError(
                "speed other than 1.0 is not supported (the model speaks at its own pace)."
            )
        if self.encoding not in AUDIO_FORMATS:
            raise ValueError(
                f"response_format {self.response_format!r} has no encoder here; "
                "use one of mp3, opus, flac, wav, pcm."
            )
        if self.stream_format == "sse" and self.encoding != STREAM_FORMAT:
            raise ValueError('stream_format "sse" sends PCM16 chunks: use response_format pcm.')
        return self


class VoiceList(OpenAIBaseModel):
    """``GET /v1/audio/voices`` (omniserve's): the model's speakers."""

    voices: list[str]
    default_voice: str
