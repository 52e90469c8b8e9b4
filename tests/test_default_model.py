"""`omniserve serve` with no model: the tiny Qwen3-Omni-MoE thinker, answering a chat with an image
and an audio clip exactly as offline `LLM.chat` does."""

from __future__ import annotations

import base64

import pytest

from omniserve import LLM, SamplingParams
from omniserve.entrypoints.cli import DEFAULT_ARCHITECTURE, default_model
from tests.server_utils import MODEL
from tests.test_api_multimodal import IMAGE, WAV, WAVEFORM, _png
from tests.test_media import _video


def _messages(image_part: dict, audio_part: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                image_part,
                audio_part,
                {"type": "text", "text": "What do you see and hear?"},
            ],
        }
    ]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


def test_default_model_is_the_omni_thinker():
    assert DEFAULT_ARCHITECTURE == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert "Qwen3OmniMoeThinker" in default_model()


def test_image_and_audio_chat_matches_offline(server, monkeypatch):
    png = base64.b64encode(_png(IMAGE)).decode()
    wav = base64.b64encode(WAV).decode()
    online = server.client().chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        messages=_messages(
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        ),
    )
    details = online.usage.prompt_tokens_details
    assert details.image_tokens > 0 and details.audio_tokens > 0
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(default_model(), dtype="float32")
    offline = llm.chat(
        _messages(
            {"type": "image_pil", "image_pil": IMAGE},
            {"type": "audio_array", "audio_array": (WAVEFORM, 16000)},
        ),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    assert online.choices[0].message.content == offline.text
    ours = [p.logprob for p in online.choices[0].logprobs.content]
    theirs = [lp[t].logprob for t, lp in zip(offline.token_ids, offline.logprobs, strict=True)]
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_audio_in_video_through_the_api_matches_offline(server, monkeypatch, tmp_path):
    """A video_url whose mp4 has an audio track, with use_audio_in_video: one composite item."""
    mp4 = _video(num_frames=8, audio_rate=16000)
    url = f"data:video/mp4;base64,{base64.b64encode(mp4).decode()}"
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    kwargs = {"use_audio_in_video": True, "num_frames": 4}
    responses = [
        server.client().chat.completions.create(
            model=MODEL,
            max_tokens=8,
            temperature=0.0,
            messages=messages,
            extra_body={"mm_processor_kwargs": mm_kwargs},
        )
        for mm_kwargs in ({"num_frames": 4}, kwargs)
    ]
    plain, with_audio = (r.usage.prompt_tokens_details.video_tokens for r in responses)
    assert with_audio > plain > 0  # the audio track's tokens joined the video item
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    video_file = tmp_path / "clip.mp4"
    video_file.write_bytes(mp4)
    llm = LLM(default_model(), dtype="float32", allowed_local_media_path=str(tmp_path))
    offline_messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": f"file://{video_file}"}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    offline = llm.chat(
        offline_messages,
        SamplingParams(temperature=0.0, max_tokens=8),
        mm_processor_kwargs=kwargs,
        use_tqdm=False,
    )[0]
    assert offline.num_mm_tokens["video"] == with_audio
    assert responses[1].choices[0].message.content == offline.outputs[0].text
