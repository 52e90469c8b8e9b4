"""`omniserve serve` with no model: the trained demo thinker shipped in the package. It answers
held-out demo questions through the API, the README's client example prints the answer its comment
says, and a chat with an image and an audio clip matches offline `LLM.chat` exactly."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from omniserve import LLM, SamplingParams
from omniserve.demo_model import CHECKPOINT, SERVED_NAME, card
from omniserve.demo_model.evaluate import grade
from omniserve.demo_model.tasks import TASKS, make_examples
from omniserve.demo_model.training import ARCHITECTURE
from omniserve.entrypoints.cli import default_model, main
from tests.server_utils import API_KEY, MODEL
from tests.test_api_multimodal import IMAGE, WAV, WAVEFORM, _png
from tests.test_media import _video

README = Path(__file__).resolve().parents[1] / "README.md"


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


def test_default_model_is_the_shipped_demo_thinker():
    assert Path(default_model()) == CHECKPOINT
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert sum(f.stat().st_size for f in CHECKPOINT.iterdir()) < 50 * 2**20
    figures = json.loads((CHECKPOINT / card.EVAL_FILE).read_text())["accuracy"]
    assert set(figures) == set(TASKS)
    assert f"| image | {figures['image']:.1%} |" in (CHECKPOINT / "README.md").read_text()


@pytest.mark.parametrize(
    ("flags", "name"), [([], [SERVED_NAME]), (["--served-model-name", "mine"], ["mine"])]
)
def test_serve_without_a_model_serves_the_demo_under_its_name(monkeypatch, flags, name):
    from omniserve.entrypoints.openai import api_server

    served = []
    monkeypatch.setattr(api_server, "run_server", served.append)
    assert main(["serve", *flags]) == 0
    assert served[0].model == str(CHECKPOINT) and served[0].served_model_name == name


def test_no_profile_routes_unless_profiling_is_enabled(server):
    """vLLM's /start_profile and /stop_profile exist only with OMNISERVE_TORCH_PROFILER_DIR."""
    assert server.post("/start_profile", {}).status_code == 404
    assert server.post("/stop_profile", {}).status_code == 404


def test_demo_model_answers_held_out_questions(server):
    """A small held-out set (seed 2: no training stage used it, and the model card's figures
    are on seed 1), greedy through the API: at least 90% of the replies are the reference
    sentence."""
    graded = grade(server.client(), MODEL, make_examples(2, 6 * len(TASKS)))
    wrong = [(g.example.question, g.reply, g.example.answer) for g in graded if not g.correct]
    assert len(wrong) <= 0.1 * len(graded), wrong


def test_readme_client_example_prints_the_answer_in_its_comment(server):
    """The README's first Python example, pointed at this server: its first line of output is
    the answer its print line's comment gives."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    expected = re.search(r"print\(reply\.choices\[0\]\.message\.content\)  # (.+)", code).group(1)
    for theirs, ours in (
        ("http://127.0.0.1:8000/v1", server.url + "/v1"),
        ('api_key="none"', f'api_key="{API_KEY}"'),
        (f'model="{SERVED_NAME}"', f'model="{MODEL}"'),
    ):
        assert theirs in code
        code = code.replace(theirs, ours)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    assert out.getvalue().splitlines()[0] == expected


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
    plain, with_audio = (r.usage.prompt_tokens_details for r in responses)
    # the track's tokens joined the video item, and count as audio (the rest as video)
    assert plain.audio_tokens == 0 and with_audio.audio_tokens > 0
    assert with_audio.video_tokens >= plain.video_tokens > 0
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
    assert offline.num_mm_tokens == {"video": with_audio.video_tokens,
                                     "audio": with_audio.audio_tokens}  # fmt: skip
    assert responses[1].choices[0].message.content == offline.outputs[0].text
