"""POST /v1/audio/speech: teacher-forced speech. The words to say become the start of the
assistant's turn in the model's chat template (after a user turn: the instructions, or the words
themselves), the thinker runs one step over them, and the talker and vocoder speak exactly
those words (``SpeechParams.reply_in_prompt``)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import numpy as np

from omniserve.config import SpeechConfig
from omniserve.entrypoints.openai.audio_encoding import encode_audio, pcm16
from omniserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingError,
    sse_event,
    to_serving_error,
)
from omniserve.entrypoints.openai.speech_protocol import CreateSpeechRequest, VoiceList
from omniserve.sampling_params import RequestOutputKind, SamplingParams, SpeechParams


class OpenAIServingSpeech(OpenAIServing):
    def voices(self) -> VoiceList:
        speech = self._speech()
        return VoiceList(voices=list(speech.voices), default_voice=speech.default_voice)

    def _speech(self) -> SpeechConfig:
        config = self.engine.model_config
        if config.speech is None:
            raise ServingError(f"This model does not speak: {config.no_speech_reason}.")
        return config.speech

    async def create_speech(
        self, request: CreateSpeechRequest
    ) -> tuple[AsyncIterator[bytes | str], str]:
        """(body chunks, "audio" | "sse") after every check; errors are 400s before any byte."""
        lora = self.check_model(request.model)
        self.check_engine()
        speech = self._speech()
        try:
            voice = speech.resolve_voice(request.voice_name)
        except ValueError as exc:
            raise ServingError(str(exc), param="voice") from exc
        turn = ChatCompletionRequest(
            messages=[{"role": "user", "content": request.instructions or request.input}]
        )
        try:
            prompt = await self.render_chat(turn)
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        words = self.tokenizer.encode(request.input, add_special_tokens=False)
        options = request.speech.model_dump(exclude_none=True) if request.speech else {}
        params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            output_modalities=["audio"],
            output_kind=RequestOutputKind.DELTA,
            speech=SpeechParams(voice=voice, reply_in_prompt=True, **options),
        )
        (generator,) = await self.start_generation(
            [EnginePrompt(text=None, token_ids=prompt.token_ids + words)],
            params,
            self.new_request_id("speech", None),
            lora_request=lora,
        )

        async def chunks() -> AsyncIterator[tuple[np.ndarray, int]]:
            """(new samples, frames spoken so far) as the engine streams them."""
            try:
                async for output in generator:
                    out = output.outputs[0]
                    if out.audio is not None and (len(out.audio) or output.finished):
                        yield out.audio, out.num_audio_tokens
            finally:
                await generator.aclose()

        if request.stream_format == "sse":
            return _sse(chunks(), len(words)), "sse"
        if request.encoding == "pcm16":
            return _pcm_chunks(chunks()), "audio"
        return _whole_file(chunks(), request.encoding, speech.sample_rate), "audio"


async def _pcm_chunks(chunks: AsyncIterator[tuple[np.ndarray, int]]) -> AsyncIterator[bytes]:
    async for samples, _ in chunks:
        yield pcm16(samples)


async def _whole_file(
    chunks: AsyncIterator[tuple[np.ndarray, int]], fmt: str, rate: int
) -> AsyncIterator[bytes]:
    pieces = [samples async for samples, _ in chunks]
    yield encode_audio(np.concatenate(pieces) if pieces else np.zeros(0, np.float32), fmt, rate)


async def _sse(
    chunks: AsyncIterator[tuple[np.ndarray, int]], input_tokens: int
) -> AsyncIterator[str]:
    """OpenAI's speech events: ``speech.audio.delta`` per chunk, then ``speech.audio.done``
    with the usage (the words' tokens in, the codec frames out)."""
    frames = 0
    async for samples, spoken in chunks:
        frames = spoken
        if len(samples):
            yield sse_event(
                {"type": "speech.audio.delta", "audio": base64.b64encode(pcm16(samples)).decode()}
            )
    yield sse_event(
        {
            "type": "speech.audio.done",
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": frames,
                "total_tokens": input_tokens + frames,
            },
        }
    )
