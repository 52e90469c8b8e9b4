"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: speech to text with the
served audio model, through the chat path.

The uploaded file becomes an audio part of one user turn, followed by the instruction
(``TranscriptionRequest.instruction``), rendered by the model's own chat template; so the model
transcribes with the same media checks, limits and caches as any chat request, and a thinking
model's reasoning (``--reasoning-parser``) is not part of the text. A file longer than the model
hears whole (its processor would cut it: Qwen2-Audio's 30 s) is split into pieces at quiet
points, each transcribed by its own request, side by side, and the texts joined.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from pathlib import PurePath
from typing import Any, Literal

import numpy as np
import pydantic
from starlette.datastructures import FormData, UploadFile

from omniserve import envs
from omniserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omniserve.entrypoints.openai.protocol import validation_message
from omniserve.entrypoints.openai.serving_chat import OpenAIServingChat
from omniserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OutputStream,
    ServingError,
    final_output,
    to_serving_error,
)
from omniserve.entrypoints.openai.transcription_protocol import (
    LIST_FIELDS,
    SAMPLING_FIELDS,
    InputTokenDetails,
    TranscriptionLogprob,
    TranscriptionRequest,
    TranscriptionResponse,
    TranscriptionUsage,
)
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.media_io import audio_seconds
from omniserve.outputs import CompletionOutput, RequestOutput

Task = Literal["transcribe", "translate"]
_AUDIO_PART = "messages[0].content[0]"
"""Where the chat request holds the file (its errors name ``file`` instead)."""
HEADER_SLACK_S = 1.0
"""How far within the window a header's declared length must be to be trusted without decoding:
compressed formats' headers may estimate it (an mp3's from its bitrate)."""


class OpenAIServingTranscription:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, form: FormData, task: Task) -> TranscriptionResponse | str | EventStream:
        """The transcript as JSON, as plain text (``response_format: text``) or as SSE events
        (``stream``). Raises ``ServingError`` for anything wrong with the request."""
        request, data, suffix = self._read(form)
        lora = self.chat.check_model(request.model)
        self.chat.check_engine()
        processor = self.chat.engine.processor.mm_processor
        if processor is None or "audio" not in processor.info.get_allowed_mm_limits():
            raise ServingError(
                f"The model {self.chat.models.response_name(request.model)!r} takes no audio: "
                "it cannot transcribe.",
                param="model",
            )
        clips = await self._clips(data, suffix, processor.info.get_audio_window_seconds())
        try:
            chat_requests = [
                ChatCompletionRequest.model_validate(self._chat_fields(form, request, clip, task))
                for clip in clips
            ]
        except pydantic.ValidationError as exc:
            raise ServingError(validation_message(exc)) from exc
        except ValueError as exc:  # the language
            raise ServingError(str(exc), param="language") from exc
        request_id = self.chat.new_request_id("trsc", request.request_id)
        generators: list[OutputStream] = []
        try:
            for i, chat_request in enumerate(chat_requests):
                piece_id = request_id if len(clips) == 1 else f"{request_id}-{i}"
                generator, thinking = await self.chat.generate(chat_request, piece_id, lora)
                generators.append(generator)
        except BaseException as exc:
            await asyncio.gather(*(g.aclose() for g in generators))  # aborts them
            if isinstance(exc, ServingError):
                raise _on_file(exc) from exc
            raise
        if request.stream:
            return self._stream(request, chat_requests[0], request_id, generators, thinking)
        return await self._full(request, chat_requests[0], generators, thinking)

    async def _clips(self, data: bytes, suffix: str, window: float | None) -> list[str]:
        """The file as data URLs: itself, or the pieces of a file longer than ``window``
        seconds (``split_audio``), as WAV. A file whose header declares it well within the
        window is not decoded here (the chat path decodes it once)."""
        url = f"data:audio/{suffix};base64,{base64.b64encode(data).decode()}"
        if window is None:
            return [url]
        engine = self.chat.engine
        declared = await engine.run_input_work(audio_seconds, data, media=True)
        if declared is not None and declared <= window - HEADER_SLACK_S:
            return [url]
        connector = self.chat.renderer.connector
        try:
            waveform, rate = await engine.run_input_work(
                connector.load_audio_bytes, data, media=True
            )
        except MultiModalInputError as exc:
            raise ServingError(f"file: {exc}", param="file") from exc
        if len(waveform) <= window * rate:
            return [url]
        return [_wav_url(piece, rate) for piece in split_audio(waveform, rate, window)]

    @staticmethod
    def _read(form: FormData) -> tuple[TranscriptionRequest, bytes, str]:
        """The form's fields, the file and its suffix."""
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ServingError(
                "file is required: the audio, uploaded as a multipart/form-data file.",
                param="file",
            )
        limit = envs.max_audio_clip_filesize_mb()
        data = upload.file.read(int(limit * 2**20) + 1)
        if len(data) > limit * 2**20:
            raise ServingError(
                f"file is over {limit:g} MB (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB).",
                param="file",
                code="request_too_large",
            )
        if not data:
            raise ServingError("file is empty.", param="file")
        fields: dict[str, Any] = {}
        for key in form:  # lists come as repeated fields, named "include[]" or "include"
            if key != "file":
                values = [v for v in form.getlist(key) if isinstance(v, str)]
                name = key.removesuffix("[]")
                listed = name in LIST_FIELDS or key.endswith("[]")
                fields[name] = values if listed else (values[-1] if values else None)
        try:
            request = TranscriptionRequest.model_validate(fields)
        except pydantic.ValidationError as exc:
            raise ServingError(validation_message(exc)) from exc
        return request, data, PurePath(upload.filename or "").suffix.lstrip(".").lower() or "wav"

    def _chat_fields(
        self, form: FormData, request: TranscriptionRequest, audio: str, task: Task
    ) -> dict[str, Any]:
        content = [
            {"type": "audio_url", "audio_url": {"url": audio}},
            {"type": "text", "text": request.instruction(task)},
        ]
        extras = {name: form.get(name) for name in SAMPLING_FIELDS if form.get(name) is not None}
        for name, value in extras.items():  # the chat request's strict fields take numbers
            try:
                extras[name] = json.loads(value)  # type: ignore[arg-type]
            except ValueError:
                raise ServingError(f"{name} must be a number, not {value!r}.", param=name) from None
        return {
            **extras,
            "model": request.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": request.temperature,
            "stream": request.stream,
            "logprobs": "logprobs" in request.include,
            "priority": request.priority,
        }

    def _usage(self, finals: list[RequestOutput], num_tokens: int) -> TranscriptionUsage:
        usage = self.chat.usage(finals, num_tokens)
        audio = usage.prompt_tokens_details.audio_tokens if usage.prompt_tokens_details else 0
        return TranscriptionUsage(
            input_tokens=usage.prompt_tokens,
            input_token_details=InputTokenDetails(
                text_tokens=usage.prompt_tokens - audio, audio_tokens=audio
            ),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )

    def _logprobs(
        self, chat_request: ChatCompletionRequest, out: CompletionOutput
    ) -> list[TranscriptionLogprob] | None:
        if not chat_request.logprobs:
            return None
        return [
            TranscriptionLogprob(token=lp.token, logprob=lp.logprob, bytes=lp.bytes or [])
            for lp in self.chat.logprobs(chat_request, out).content or []
        ]

    async def _full(
        self,
        request: TranscriptionRequest,
        chat_request: ChatCompletionRequest,
        generators: list[OutputStream],
        thinking: bool,
    ) -> TranscriptionResponse | str:
        try:
            finals = await asyncio.gather(*map(final_output, generators))
        except ServingError as exc:
            raise _on_file(exc) from exc
        outs = [final.outputs[0] for final in finals]
        texts = [
            self.chat.answer(chat_request, thinking).feed(out.text, final=True).get("content", "")
            for out in outs
        ]
        text = _join(texts)
        if request.response_format == "text":
            return text
        logprobs = [self._logprobs(chat_request, out) for out in outs]
        return TranscriptionResponse(
            text=text,
            usage=self._usage(finals, sum(len(out.token_ids) for out in outs)),
            logprobs=None if logprobs[0] is None else [lp for lps in logprobs for lp in lps or []],
        )

    async def _stream(
        self,
        request: TranscriptionRequest,
        chat_request: ChatCompletionRequest,
        request_id: str,
        generators: list[OutputStream],
        thinking: bool,
    ) -> EventStream:
        """OpenAI's events, ``transcript.text.delta`` then ``transcript.text.done`` (with the
        usage), each also in vLLM's chunk shape (``choices[0].delta.content``), so clients of
        either read them; then ``[DONE]``. The pieces of a split file follow one another."""
        created = int(time.time())
        model = self.chat.models.response_name(request.model)
        text, num_tokens, finals = "", 0, []

        def event(kind: str, content: dict[str, Any], finish: str | None, **fields: Any) -> str:
            choice = {"index": 0, "delta": content, "finish_reason": finish}
            chunk = {"type": kind, **fields, "id": request_id, "object": "transcription.chunk",
                     "created": created, "model": model, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            for generator in generators:
                answer, piece_text = self.chat.answer(chat_request, thinking), ""
                async for output in generator:
                    out = output.outputs[0]
                    num_tokens += len(out.token_ids)
                    piece = answer.feed(out.text, out.finish_reason is not None).get("content", "")
                    if not piece_text:  # the separator before a piece, as _join puts it
                        piece = _join([text, piece])[len(text) :]
                    logprobs = self._logprobs(chat_request, out) if out.token_ids else None
                    if piece:
                        text, piece_text = text + piece, piece_text + piece
                        extra = {"logprobs": [lp.model_dump() for lp in logprobs or []]}
                        fields = extra if logprobs is not None else {}
                        yield event("transcript.text.delta", {"content": piece}, None,
                                    delta=piece, **fields)  # fmt: skip
                    if out.finish_reason is not None:
                        finals.append(output)
            usage = self._usage(finals, num_tokens).model_dump()
            yield event("transcript.text.done", {}, finals[-1].outputs[0].finish_reason,
                        text=text, usage=usage)  # fmt: skip
        except Exception as exc:  # e.g. the engine died mid-stream: tell the client in-band
            yield f"data: {_on_file(to_serving_error(exc)).to_response().model_dump_json()}\n\n"
        finally:
            await asyncio.gather(*(g.aclose() for g in generators))  # aborts the unfinished
        yield SSE_DONE


def split_audio(waveform: np.ndarray, rate: int, max_seconds: float) -> list[np.ndarray]:
    """``waveform`` in consecutive pieces of at most ``max_seconds``, about equal, each cut at
    the quietest tenth of a second of the second before its end, so a cut rarely splits a word."""
    window = int(max_seconds * rate)
    frame = max(rate // 10, 1)
    pieces, start = [], 0
    while len(waveform) - start > window:
        left = len(waveform) - start
        end = start + -(-left // -(-left // window))  # an equal share of what is left
        low = max(start + 1, end - rate)
        region = waveform[low:end]
        num_frames = max(len(region) // frame, 1)
        energy = np.square(region[: num_frames * frame].reshape(num_frames, -1)).mean(axis=1)
        cut = low + (num_frames - 1 - int(np.argmin(energy[::-1]))) * frame  # the latest
        pieces.append(waveform[start:cut])
        start = cut
    pieces.append(waveform[start:])
    return pieces


def _wav_url(waveform: np.ndarray, rate: int) -> str:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, rate, format="WAV", subtype="FLOAT")
    return f"data:audio/wav;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _join(texts: list[str]) -> str:
    """The pieces' texts, with a space between two that would otherwise touch."""
    joined = ""
    for text in texts:
        if joined and text and not joined[-1].isspace() and not text[0].isspace():
            joined += " "
        joined += text
    return joined


def _on_file(error: ServingError) -> ServingError:
    """A chat-side error about the audio part, naming the form's ``file``."""
    error.message = error.message.replace(_AUDIO_PART, "file")
    error.args = (error.message,)
    if error.param is not None and error.param.startswith(_AUDIO_PART):
        error.param = "file"
    return error
