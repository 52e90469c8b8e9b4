"""Speech to text (``/v1/audio/transcriptions``, ``/v1/audio/translations``) as the OpenAI SDK
sends it (multipart uploads), on the default omni model: the transcript is what a chat request
with the same audio and instruction answers, in JSON (usage, logprobs), plain text or streamed
events; and what cannot be honoured is a 400 naming the form field."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omniserve.entrypoints.openai.serving_transcription import _join, split_audio
from omniserve.entrypoints.openai.transcription_protocol import TranscriptionRequest
from tests.server_utils import API_KEY, MODEL, Server, assert_error, launch_server
from tests.test_api_multimodal import WAV, _wav

FILE = ("beeps.wav", WAV, "audio/wav")


def _chat_text(server: Server, instruction: str, **kwargs: object) -> object:
    import base64

    audio = "data:audio/wav;base64," + base64.b64encode(WAV).decode()
    return server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [
            {"type": "audio_url", "audio_url": {"url": audio}},
            {"type": "text", "text": instruction}]}],
        temperature=0.0, max_tokens=16, **kwargs,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK's translations
def test_a_transcript_is_the_chat_answer_to_the_audio(default_server: Server) -> None:
    client = default_server.client()
    chat = _chat_text(default_server, "Transcribe the English audio into text.", logprobs=True)
    whole = client.audio.transcriptions.create(
        model=MODEL, file=FILE, language="en", include=["logprobs"],
        extra_body={"max_completion_tokens": 16},
    )  # fmt: skip
    assert whole.text == chat.choices[0].message.content
    usage = whole.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.input_token_details.audio_tokens == chat.usage.prompt_tokens_details.audio_tokens
    assert usage.input_token_details.audio_tokens > 0
    expected = chat.choices[0].logprobs.content  # a prefix-cache hit may round differently
    assert [lp.token for lp in whole.logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in whole.logprobs] == pytest.approx(
        [lp.logprob for lp in expected], abs=1e-4
    )
    text = client.audio.transcriptions.create(
        model=MODEL, file=FILE, language="en", response_format="text",
        extra_body={"max_completion_tokens": 16},
    )  # fmt: skip
    assert text == whole.text
    events = list(client.audio.transcriptions.create(
        model=MODEL, file=FILE, language="en", stream=True,
        extra_body={"max_completion_tokens": 16},
    ))  # fmt: skip
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    assert "".join(e.delta for e in deltas) == whole.text
    assert "".join(e.choices[0]["delta"]["content"] for e in deltas) == whole.text  # vLLM's
    assert events[-1].type == "transcript.text.done" and events[-1].text == whole.text
    translated = client.audio.translations.create(
        model=MODEL, file=FILE, extra_body={"max_completion_tokens": 16}
    )
    chat = _chat_text(default_server, "Translate the audio into English text.")
    assert translated.text == chat.choices[0].message.content


def _post(server: Server, path: str, data: dict, files: dict | None = None) -> httpx.Response:
    return httpx.post(
        server.url + path,
        data=data,
        files=files if files is not None else {"file": FILE},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("data", "files", "param", "match"),
    [
        ({}, {"other": FILE}, "file", "file is required"),
        ({"language": "xx"}, None, "language", "ISO-639-1"),
        ({"response_format": "srt"}, None, "response_format", "json"),
        ({"timestamp_granularities[]": "word"}, None, "timestamp_granularities", "timestamps"),
        ({"seed": "abc"}, None, "seed", "must be a number"),
        ({}, {"file": ("x.wav", b"not audio", "audio/wav")}, "file", "audio"),
    ],
)
def test_bad_forms_are_400s_naming_the_field(
    default_server: Server, data: dict, files: dict | None, param: str, match: str
) -> None:
    error = assert_error(
        _post(default_server, "/v1/audio/transcriptions", {"model": MODEL, **data}, files), 400
    )
    assert match in error["message"] and error["param"] == param, error


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_a_model_without_audio_cannot_transcribe(qwen3_server: Server) -> None:
    error = assert_error(_post(qwen3_server, "/v1/audio/transcriptions", {"model": MODEL}), 400)
    assert "takes no audio" in error["message"] and error["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        qwen3_server.client().audio.translations.create(model=MODEL, file=FILE)


def test_the_instruction_names_the_language_and_carries_the_prompt() -> None:
    request = TranscriptionRequest(language="de", prompt="Guten Tag")
    assert request.instruction("transcribe") == (
        "Transcribe the German audio into text.\nIt follows on from: Guten Tag"
    )
    assert TranscriptionRequest().instruction("translate") == (
        "Translate the audio into English text."
    )


def test_long_audio_is_split_at_quiet_points_into_equal_pieces() -> None:
    rate = 100  # samples per second: a 0.1 s frame is 10 samples
    rng = np.random.default_rng(0)
    loud = rng.uniform(0.5, 1.0, 7_000).astype(np.float32)  # 70 s of "speech"
    for quiet in (2_290, 4_600):  # 0.2 s pauses, in the second before each equal share ends
        loud[quiet : quiet + 20] = 0.0
    pieces = split_audio(loud, rate, 30.0)
    assert [len(p) for p in pieces] == [2_294, 2_313, 2_393]  # three pieces, cut in the pauses
    assert np.array_equal(np.concatenate(pieces), loud)
    assert pieces[1][0] == pieces[2][0] == 0.0
    assert len(split_audio(loud[:3_000], rate, 30.0)) == 1
    # No pause: cut near each equal share; never a sliver at the end.
    flat = np.ones(6_005, np.float32)
    assert [len(p) for p in split_audio(flat, rate, 30.0)] == [1_992, 1_997, 2_016]


@pytest.fixture(scope="module")
def qwen2_audio_server(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen2-Audio: its processor keeps 30 s of a clip."""
    with launch_server(
        tiny_checkpoint("Qwen2AudioForConditionalGeneration"),
        tmp_path_factory.mktemp("qwen2-audio"),
        "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--dtype", "float32",
    ) as server:  # fmt: skip
        yield server


@pytest.mark.slow
def test_audio_longer_than_the_model_hears_is_transcribed_in_pieces(
    qwen2_audio_server: Server,
) -> None:
    """A 34 s file on a model that hears 30 s: two pieces, whose transcripts (each the chat
    answer to that piece) are joined, their usage summed; streamed the same."""
    rate = 16_000
    seconds = np.arange(34 * rate) / rate
    waveform = (0.4 * np.sin(2 * np.pi * 220 * seconds) * (seconds % 2 < 1.5)).astype(np.float32)
    client = qwen2_audio_server.client()
    params = {"max_completion_tokens": 8, "ignore_eos": True}
    whole = client.audio.transcriptions.create(
        model=MODEL, file=("long.wav", _wav(waveform, rate), "audio/wav"), language="en",
        extra_body=params,
    )  # fmt: skip
    pieces = split_audio(waveform, rate, 30.0)
    assert len(pieces) == 2
    chats = []
    for piece in pieces:
        audio = "data:audio/wav;base64," + base64.b64encode(_wav(piece, rate)).decode()
        chats.append(client.chat.completions.create(
            model=MODEL, temperature=0.0, max_completion_tokens=8,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "audio_url", "audio_url": {"url": audio}},
                {"type": "text", "text": "Transcribe the English audio into text."}]}],
        ))  # fmt: skip
    texts = [chat.choices[0].message.content for chat in chats]
    assert whole.text == _join(texts) and all(texts)
    assert whole.usage.input_tokens == sum(chat.usage.prompt_tokens for chat in chats)
    assert whole.usage.output_tokens == 16
    events = list(client.audio.transcriptions.create(
        model=MODEL, file=("long.wav", _wav(waveform, rate), "audio/wav"), language="en",
        stream=True, extra_body=params,
    ))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert "".join(deltas) == whole.text
    (done,) = [e for e in events if e.type == "transcript.text.done"]
    assert done.text == whole.text
