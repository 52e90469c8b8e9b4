"""Speech output through the HTTP API with the OpenAI SDK, on the tiny full Qwen3-Omni-MoE
checkpoint: chat completions with ``modalities: ["text", "audio"]`` (a WAV that decodes to the
offline waveform, streamed PCM16 that concatenates to the same samples), an audio-only answer,
``/v1/audio/speech`` (whole and streamed), the voices endpoint, and the 400s; a text-only client
is unaffected. The offline waveform is the reference: ``test_speech`` ties it to transformers.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import soundfile

from omniserve import LLM, SamplingParams
from omniserve.entrypoints.openai.audio_encoding import encode_audio, pcm16
from tests.server_utils import MODEL, launch_server

pytestmark = pytest.mark.slow  # speech servers: talker and vocoder per request

ARCH = "Qwen3OmniMoeForConditionalGeneration"
QUESTION = [{"role": "user", "content": "Hello there, say something"}]
TEXT_TOKENS, FRAMES = 8, 20
LSB = 1 / 32767


@pytest.fixture(scope="module")
def speaking(tiny_checkpoint, tmp_path_factory):
    model = tiny_checkpoint(ARCH)
    llm = LLM(str(model), dtype="float32", max_model_len=1024, kv_cache_memory=16 << 20)
    (offline,) = llm.chat(
        QUESTION,
        SamplingParams(
            temperature=0.0,
            max_tokens=TEXT_TOKENS,
            output_modalities=["text", "audio"],
            speech={"voice": "chelsie", "temperature": 0.0, "max_tokens": FRAMES},
        ),
    )
    del llm
    with launch_server(
        model,
        tmp_path_factory.mktemp("speaking"),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "16MiB",
    ) as server:
        yield server, offline.outputs[0]


def _ask(**changes: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": TEXT_TOKENS,
        "temperature": 0.0,
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "wav"},
        "extra_body": {"speech": {"temperature": 0.0, "max_tokens": FRAMES}},
        **changes,
    }


def test_chat_answers_with_text_and_a_wav(speaking):
    server, offline = speaking
    response = server.client().chat.completions.create(**_ask())
    (choice,) = response.choices
    audio = choice.message.audio
    assert choice.message.content == offline.text == audio.transcript
    assert audio.id.startswith("audio-") and audio.expires_at > 0
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="float32")
    assert rate == 24000 and samples.shape == offline.audio.shape
    np.testing.assert_allclose(samples, offline.audio, rtol=0, atol=LSB)  # 16-bit WAV
    assert response.usage.completion_tokens_details.audio_tokens == offline.num_audio_tokens
    assert response.usage.completion_tokens == len(offline.token_ids) + offline.num_audio_tokens
    # Audio only: the text is the transcript; other formats encode the same samples.
    audio_only = server.client().chat.completions.create(
        **_ask(modalities=["audio"], audio={"voice": "chelsie", "format": "flac"})
    )
    message = audio_only.choices[0].message
    assert message.content is None and message.audio.transcript == offline.text
    flac, _ = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    np.testing.assert_allclose(flac, offline.audio, rtol=0, atol=LSB)


def test_streamed_pcm16_concatenates_to_the_whole_answer(speaking):
    server, offline = speaking
    stream = server.client().chat.completions.create(
        **_ask(
            audio={"voice": "chelsie", "format": "pcm16"},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, pcm, finishes, audio_ids, expiry, usage = "", b"", [], set(), None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            audio = getattr(choice.delta, "audio", None)
            if audio:
                audio_ids.add(audio.id)
                pcm += base64.b64decode(audio.data or "")
                expiry = audio.expires_at or expiry
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert text == offline.text and len(finishes) == 1 and len(audio_ids) == 1
    assert pcm == pcm16(offline.audio) and expiry
    assert usage.completion_tokens_details.audio_tokens == offline.num_audio_tokens


def test_audio_speech_endpoint(speaking):
    server, _ = speaking
    client = server.client()
    seeded = {"speech": {"seed": 7}}  # the talker samples (the model's defaults), seeded
    wav = client.audio.speech.create(
        model=MODEL, voice="ethan", input="Good morning", response_format="wav", extra_body=seeded
    )
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="float32")
    assert rate == 24000 and len(samples) > 1920
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="ethan", input="Good morning", response_format="pcm", extra_body=seeded
    ) as raw:
        streamed = b"".join(raw.iter_bytes())
    np.testing.assert_allclose(np.frombuffer(streamed, "<i2") / 32767, samples, atol=2 * LSB)
    events = server.post(
        "/v1/audio/speech",
        {
            "model": MODEL,
            "voice": "ethan",
            "input": "Good morning",
            "response_format": "pcm",
            "stream_format": "sse",
            **seeded,
        },
    )
    payloads = [
        json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: ")
    ]
    assert payloads[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(p["audio"]) for p in payloads[:-1]) == streamed
    voices = server.client().get("/audio/voices", cast_to=object)
    assert voices == {"voices": ["chelsie", "ethan"], "default_voice": "ethan"}


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "chelsie, ethan"),
        ({"audio": {"voice": "ethan", "format": "aac"}}, "wav, pcm16, flac, mp3, opus"),
        ({"audio": {"voice": "ethan", "format": "wav"}, "stream": True}, "pcm16 when streaming"),
        ({"audio": None}, "audio (voice and format) is required"),
        ({"modalities": ["audio", "audio"]}, "modalities names one twice"),
    ],
)
def test_bad_audio_requests_are_400s(speaking, changes, needle):
    server, _ = speaking
    body = {key: value for key, value in _ask(**changes).items() if key != "extra_body"}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_speech_endpoint_refusals_and_text_clients(speaking, default_server):
    server, offline = speaking
    for body, needle in (
        ({"voice": "ethan", "input": "hi", "speed": 2.0}, "speed"),
        ({"voice": "ethan", "input": "hi", "response_format": "aac"}, "aac"),
        ({"voice": "nobody", "input": "hi"}, "chelsie, ethan"),
    ):
        response = server.post("/v1/audio/speech", {"model": MODEL, **body})
        assert response.status_code == 400 and needle in response.text
    # A thinker-only model says why it cannot speak.
    response = default_server.post(
        "/v1/chat/completions", {key: value for key, value in _ask().items() if key != "extra_body"}
    )
    assert response.status_code == 400
    assert "no talker and vocoder" in response.json()["error"]["message"]
    # A text-only client of the speaking server gets text, no audio.
    text = server.client().chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=TEXT_TOKENS, temperature=0.0
    )
    assert text.choices[0].message.content == offline.text
    assert text.choices[0].message.audio is None
    assert encode_audio(np.zeros(4, np.float32), "pcm16", 24000) == b"\0" * 8
    # An answer with no speech (the talker ended at once) is still a file every format's
    # readers open: no samples in WAV and PCM16, one silent sample where libsndfile needs one.
    for fmt in ("wav", "flac", "mp3", "opus"):
        empty, rate = soundfile.read(io.BytesIO(encode_audio(np.zeros(0, np.float32), fmt, 24000)))
        assert rate == 24000 and len(empty) == (0 if fmt == "wav" else 1)
        assert np.abs(empty).max(initial=0.0) < 1e-6  # silent (opus: codec noise)
    assert encode_audio(np.zeros(0, np.float32), "pcm16", 24000) == b""
