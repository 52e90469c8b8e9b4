"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: speech to text with the
served audio model, through the chat path.

The uploaded file becomes an audio part of one user turn, followed by the instruction
(``TranscriptionRequest.instruction``), rendered by the model's own chat template; so the model
transcribes with the same media checks, limits and caches as any chat request, and a thinking
model's reasoning (``--reasoning-parser``) is not part of the text.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import PurePath
from typing import Any, Literal

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
from omniserve.outputs import CompletionOutput, RequestOutput

Task = Literal["transcribe", "translate"]
_AUDIO_PART = "messages[0].content[0]"
"""Where the chat request holds the file (its errors name ``file`` instead)."""


class OpenAIServingTranscription:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, form: FormData, task: Task) -> TranscriptionResponse | str | EventStream:
        """The transcript as JSON, as plain text (``response_format: text``) or as SSE events
        (``stream``). Raises ``ServingError`` for anything wrong with the request."""
        request, audio = self._read(form)
        lora = self.chat.check_model(request.model)
        self.chat.check_engine()
        processor = self.chat.engine.processor.mm_processor
        if processor is None or "audio" not in processor.info.get_allowed_mm_limits():
            raise ServingError(
                f"The model {self.chat.models.response_name(request.model)!r} takes no audio: "
                "it cannot transcribe.",
                param="model",
            )
        try:
            chat_request = ChatCompletionRequest.model_validate(
                self._chat_fields(form, request, audio, task)
            )
        except pydantic.ValidationError as exc:
            raise ServingError(validation_message(exc)) from exc
        except ValueError as exc:  # the language
            raise ServingError(str(exc), param="language") from exc
        request_id = self.chat.new_request_id("trsc", request.request_id)
        try:
            generator, thinking = await self.chat.generate(chat_request, request_id, lora)
        except ServingError as exc:
            raise _on_file(exc) from exc
        if request.stream:
            return self._stream(request, chat_request, request_id, generator, thinking)
        return await self._full(request, chat_request, generator, thinking)

    @staticmethod
    def _read(form: FormData) -> tuple[TranscriptionRequest, str]:
        """The form's fields, and the file as a data URL."""
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
        suffix = PurePath(upload.filename or "").suffix.lstrip(".").lower() or "wav"
        return request, f"data:audio/{suffix};base64,{base64.b64encode(data).decode()}"

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

    def _usage(self, final: RequestOutput, num_tokens: int) -> TranscriptionUsage:
        usage = self.chat.usage([final], num_tokens)
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
        generator: OutputStream,
        thinking: bool,
    ) -> TranscriptionResponse | str:
        try:
            final = await final_output(generator)
        except ServingError as exc:
            raise _on_file(exc) from exc
        out = final.outputs[0]
        text = (
            self.chat.answer(chat_request, thinking).feed(out.text, final=True).get("content", "")
        )
        if request.response_format == "text":
            return text
        return TranscriptionResponse(
            text=text,
            usage=self._usage(final, len(out.token_ids)),
            logprobs=self._logprobs(chat_request, out),
        )

    async def _stream(
        self,
        request: TranscriptionRequest,
        chat_request: ChatCompletionRequest,
        request_id: str,
        generator: OutputStream,
        thinking: bool,
    ) -> EventStream:
        """OpenAI's events, ``transcript.text.delta`` then ``transcript.text.done`` (with the
        usage), each also in vLLM's chunk shape (``choices[0].delta.content``), so clients of
        either read them; then ``[DONE]``."""
        created = int(time.time())
        model = self.chat.models.response_name(request.model)
        answer = self.chat.answer(chat_request, thinking)
        text, num_tokens = "", 0

        def event(kind: str, content: dict[str, Any], finish: str | None, **fields: Any) -> str:
            choice = {"index": 0, "delta": content, "finish_reason": finish}
            chunk = {"type": kind, **fields, "id": request_id, "object": "transcription.chunk",
                     "created": created, "model": model, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            final: RequestOutput | None = None
            async for output in generator:
                final = output
                out = output.outputs[0]
                num_tokens += len(out.token_ids)
                piece = answer.feed(out.text, out.finish_reason is not None).get("content", "")
                logprobs = self._logprobs(chat_request, out) if out.token_ids else None
                if piece:
                    text += piece
                    extra = {"logprobs": [lp.model_dump() for lp in logprobs or []]}
                    yield event("transcript.text.delta", {"content": piece}, None, delta=piece,
                                **(extra if logprobs is not None else {}))  # fmt: skip
                if out.finish_reason is not None:
                    assert final is not None
                    usage = self._usage(final, num_tokens).model_dump()
                    yield event("transcript.text.done", {}, out.finish_reason, text=text,
                                usage=usage)  # fmt: skip
        except Exception as exc:  # e.g. the engine died mid-stream: tell the client in-band
            yield f"data: {_on_file(to_serving_error(exc)).to_response().model_dump_json()}\n\n"
        finally:
            await generator.aclose()  # aborts it if unfinished
        yield SSE_DONE


def _on_file(error: ServingError) -> ServingError:
    """A chat-side error about the audio part, naming the form's ``file``."""
    error.message = error.message.replace(_AUDIO_PART, "file")
    error.args = (error.message,)
    if error.param is not None and error.param.startswith(_AUDIO_PART):
        error.param = "file"
    return error
