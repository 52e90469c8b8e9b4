"""Multimodal chat over the OpenAI-compatible server, end to end: real `omniserve serve`
subprocesses on loopback driven by the `openai` SDK, checked against offline ``LLM.chat``.

Three servers: Qwen2-VL (loopback media URLs and a local media dir allowed); Qwen2.5-VL set up
strictly (no private URLs, two images per prompt, a small default ``max_pixels`` and a
32-embedding encoder budget); Qwen2-Audio. Media comes as data URLs, from a loopback http.server
thread and as file:// URLs under the allowed directory.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
from PIL import Image
from transformers import AutoProcessor

from omniserve import LLM, SamplingParams
from tests.server_utils import MODEL, Server, assert_error, free_port, launch_servers, metric
from tests.test_media import _data_url, _serving, _sleepy, _static, _url, _video

pytestmark = pytest.mark.slow  # server start-ups with media, and video decoding

VL_ARCH = "Qwen2VLForConditionalGeneration"
STRICT_ARCH = "Qwen2_5_VLForConditionalGeneration"
AUDIO_ARCH = "Qwen2AudioForConditionalGeneration"
MAX_TOKENS = 8
ENGINE_FLAGS = ("--max-model-len", "1024", "--kv-cache-memory", "64MiB")
IMAGE_TIMEOUT_S = 5.0  # MediaConfig.image_timeout_s (no flag sets it)
GREEDY = {
    "temperature": 0.0,
    "max_tokens": MAX_TOKENS,
    "logprobs": True,
    "extra_body": {"ignore_eos": True},
}


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _wav(waveform: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, waveform, rate, format="WAV", subtype="FLOAT")  # lossless
    return buf.getvalue()


IMAGE = _image(0, 84, 56)
BIG_IMAGE = _image(1, 224, 224)  # 64 tokens at the default max_pixels, 16 on the strict server
WAVEFORM = (0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
WAV = _wav(WAVEFORM, 16000)
VIDEO = _video(num_frames=8, audio_rate=None)  # 8 frames of 64x48 mp4, written with PyAV


def _user(*parts: Any) -> list[dict[str, Any]]:
    """A conversation whose last message holds ``parts`` (so errors name messages[2])."""
    return [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi! Send me something."},
        {"role": "user", "content": list(parts)},
    ]


def _text(text: str = "What is this?") -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def _png_part(image: Image.Image) -> dict[str, Any]:
    return _image_part(_data_url("image/png", _png(image)))


def _input_audio(data: bytes) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
    }


# ---- fixtures: media, servers, offline engines ----


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "image.png").write_bytes(_png(IMAGE))
    (root / "clip.mp4").write_bytes(VIDEO)
    (root.parent / "elsewhere.png").write_bytes(_png(IMAGE))  # outside the allowed dir
    return root


@pytest.fixture(scope="module")
def http_media() -> Iterator[Any]:
    with _serving() as httpd:
        httpd.routes.update(
            {
                "/image.png": _static(_png(IMAGE)),
                "/tone.wav": _static(WAV),
                "/slow.png": _sleepy(IMAGE_TIMEOUT_S + 3, _png(IMAGE)),
            }
        )
        yield httpd


@pytest.fixture(scope="module")
def servers(
    tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory, media_dir: Path
) -> Iterator[dict[str, Server]]:
    """The three servers, started side by side (their start-ups overlap)."""
    local = ("--allowed-local-media-path", str(media_dir))
    flags = {
        "vl": (
            VL_ARCH,
            "--allow-private-media-urls",
            *local,
            "--media-io-kwargs",
            '{"video": {"max_frames": 20}}',
        ),
        # max_pixels 12544 = 8x8 patches: at most 16 image tokens, within the 32-token budget.
        "strict": (
            STRICT_ARCH,
            *local,
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--mm-processor-kwargs",
            '{"max_pixels": 12544}',
            "--max-num-encoder-input-tokens",
            "32",
            "--encoder-cache-size",
            "32",
        ),
        "audio": (
            AUDIO_ARCH,
            "--allow-private-media-urls",
            *local,
            "--media-io-kwargs",
            '{"audio": {"max_seconds": 5}}',
        ),
    }
    specs = [
        (tiny_checkpoint(arch), tmp_path_factory.mktemp(name), (*ENGINE_FLAGS, *rest))
        for name, (arch, *rest) in flags.items()
    ]
    with launch_servers(specs) as running:
        yield dict(zip(flags, running, strict=True))


@pytest.fixture(scope="module")
def vl(servers: dict[str, Server]) -> Server:
    return servers["vl"]


@pytest.fixture(scope="module")
def strict(servers: dict[str, Server]) -> Server:
    return servers["strict"]


@pytest.fixture(scope="module")
def audio(servers: dict[str, Server]) -> Server:
    return servers["audio"]


def _offline_engine(tiny_checkpoint: Any, arch: str) -> Iterator[LLM]:
    """The same checkpoint with its engine core in this process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(tiny_checkpoint(arch)), max_model_len=1024, kv_cache_memory="64MiB")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def vl_llm(tiny_checkpoint: Any) -> Iterator[LLM]:
    yield from _offline_engine(tiny_checkpoint, VL_ARCH)


@pytest.fixture(scope="module")
def audio_llm(tiny_checkpoint: Any) -> Iterator[LLM]:
    yield from _offline_engine(tiny_checkpoint, AUDIO_ARCH)


# ---- helpers ----


def _offline(llm: LLM, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[float]]:
    """Offline ``LLM.chat``'s greedy text and the logprob of each token."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.chat(messages, params, use_tqdm=False, **kwargs)[0].outputs[0]
    return out.text, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


def _assert_same_answer(response: Any, expected: tuple[str, list[float]]) -> None:
    text, logprobs = expected
    assert response.choices[0].message.content == text
    served = [entry.logprob for entry in response.choices[0].logprobs.content]
    assert served == pytest.approx(logprobs, abs=1e-4)


@functools.cache
def _hf_processor(model_dir: Path) -> Any:
    return AutoProcessor.from_pretrained(model_dir, local_files_only=True)


def _token_id(model_dir: Path, token: str) -> int:
    return _hf_processor(model_dir).tokenizer.convert_tokens_to_ids(token)


def _hf_num_tokens(model_dir: Path, token: str, **media: Any) -> int:
    """How many tokens the checkpoint's own HF processor expands ``token`` into."""
    ids = _hf_processor(model_dir)(text=token, return_tensors="np", **media)["input_ids"][0]
    return int((ids == _token_id(model_dir, token)).sum())


def _tokenize(
    server: Server, messages: list[dict[str, Any]], token_id: int, **body: Any
) -> tuple[int, int]:
    """(prompt length, tokens equal to ``token_id``) of the chat as /tokenize expands it."""
    tokens = server.post("/tokenize", {"messages": messages, **body}).json()["tokens"]
    return len(tokens), tokens.count(token_id)


def _chat(server: Server, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, **{**GREEDY, **kwargs}
    )


# ---- attachment forms vs offline LLM.chat ----


def test_image_attachment_forms_match_offline_chat(
    vl: Server, vl_llm: LLM, http_media: Any, media_dir: Path
) -> None:
    expected = _offline(vl_llm, _user(_text(), {"type": "image_pil", "image_pil": IMAGE}))
    data_url = _data_url("image/png", _png(IMAGE))
    file_url = (media_dir / "image.png").as_uri()
    http_url = _url(http_media, "/image.png")
    forms = [
        _image_part(data_url, detail="low"),
        _image_part(http_url, detail="high"),
        _image_part(file_url, detail="auto"),
        {"type": "image_url", "image_url": http_url},
        {"image_url": data_url},
        {"image_url": {"url": file_url}},
    ]
    for form in forms:
        _assert_same_answer(_chat(vl, _user(_text(), form)), expected)


def test_video_url_matches_offline_chat(
    vl: Server, vl_llm: LLM, media_dir: Path, tiny_checkpoint: Any
) -> None:
    kwargs = {"mm_processor_kwargs": {"num_frames": 4}}
    in_memory = {"type": "video_url", "video_url": {"url": _data_url("video/mp4", VIDEO)}}
    expected = _offline(vl_llm, _user(_text(), in_memory), **kwargs)
    messages = _user(
        _text(), {"type": "video_url", "video_url": {"url": (media_dir / "clip.mp4").as_uri()}}
    )
    response = _chat(vl, messages, extra_body={"ignore_eos": True, **kwargs})
    _assert_same_answer(response, expected)
    model_dir = tiny_checkpoint(VL_ARCH)
    frames = np.zeros((4, 48, 64, 3), np.uint8)  # 4 of the 8 frames, at the clip's size
    num_video = _hf_num_tokens(model_dir, "<|video_pad|>", videos=[frames])
    details = response.usage.prompt_tokens_details
    assert (details.video_tokens, details.image_tokens) == (num_video, 0) and num_video > 0
    assert _tokenize(vl, messages, _token_id(model_dir, "<|video_pad|>"), **kwargs) == (
        response.usage.prompt_tokens,
        num_video,
    )


def test_audio_forms_match_offline_chat(
    audio: Server, audio_llm: LLM, http_media: Any, tiny_checkpoint: Any
) -> None:
    question = _text("What is it?")
    expected = _offline(
        audio_llm, _user({"type": "audio_array", "audio_array": (WAVEFORM, 16000)}, question)
    )
    model_dir = tiny_checkpoint(AUDIO_ARCH)
    num_audio = _hf_num_tokens(model_dir, "<|AUDIO|>", audio=[WAVEFORM], sampling_rate=16000)
    forms = [
        _input_audio(WAV),
        {"type": "audio_url", "audio_url": {"url": _url(http_media, "/tone.wav")}},
        {"audio_url": _data_url("audio/wav", WAV)},
    ]
    for form in forms:
        messages = _user(form, question)
        response = _chat(audio, messages)
        _assert_same_answer(response, expected)
        assert response.usage.prompt_tokens_details.audio_tokens == num_audio > 0
        assert _tokenize(audio, messages, _token_id(model_dir, "<|AUDIO|>")) == (
            response.usage.prompt_tokens,
            num_audio,
        )


# ---- usage, processor kwargs, streaming, the encoder cache ----


def test_image_usage_details_and_cached_tokens(vl: Server, tiny_checkpoint: Any) -> None:
    messages = _user(_text("Compare"), _png_part(IMAGE), _png_part(BIG_IMAGE), _text("please."))
    first = _chat(vl, messages)
    model_dir = tiny_checkpoint(VL_ARCH)
    num_image = sum(
        _hf_num_tokens(model_dir, "<|image_pad|>", images=[image]) for image in (IMAGE, BIG_IMAGE)
    )
    details = first.usage.prompt_tokens_details
    assert (details.image_tokens, details.video_tokens, details.audio_tokens) == (num_image, 0, 0)
    assert _tokenize(vl, messages, _token_id(model_dir, "<|image_pad|>")) == (
        first.usage.prompt_tokens,
        num_image,
    )
    again = _chat(vl, messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    # The shared conversation start may hit already; the images' blocks hit only the 2nd time.
    assert again.usage.prompt_tokens_details.cached_tokens > details.cached_tokens + num_image
    assert again.usage.prompt_tokens_details.image_tokens == num_image


def test_server_and_request_processor_kwargs(strict: Server, tiny_checkpoint: Any) -> None:
    messages = _user(_text(), _png_part(BIG_IMAGE))
    response = _chat(strict, messages)
    assert response.usage.prompt_tokens_details.image_tokens == 16  # --mm-processor-kwargs
    small = {"mm_processor_kwargs": {"max_pixels": 3136}}
    smaller = _chat(strict, messages, extra_body=small)
    assert smaller.usage.prompt_tokens_details.image_tokens == 4
    image_pad = _token_id(tiny_checkpoint(STRICT_ARCH), "<|image_pad|>")
    assert _tokenize(strict, messages, image_pad, **small) == (smaller.usage.prompt_tokens, 4)


def test_stream_with_image_joins_to_full_answer(vl: Server) -> None:
    messages = _user(_png_part(_image(7, 56, 84)), _text())

    async def run() -> None:
        client = vl.async_client()
        full = await client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        usage, full_usage = chunks[-1].usage, full.usage
        assert usage.prompt_tokens == full_usage.prompt_tokens
        assert (
            usage.prompt_tokens_details.image_tokens
            == full_usage.prompt_tokens_details.image_tokens
            > 0
        )

    asyncio.run(run())


def test_same_image_in_concurrent_requests_is_encoded_once(vl: Server) -> None:
    image = _png_part(_image(11, 112, 84))  # never sent before
    before = vl.metrics()

    async def run() -> list[Any]:
        client = vl.async_client()
        # Different text before the image: no prefix-cache block can cover the image's tokens.
        results = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL, messages=_user(_text(lead), image), **GREEDY
                )
                for lead in ("First look:", "Second look, closer:")
            )
        )
        await client.close()
        return results

    responses = asyncio.run(run())
    after = vl.metrics()
    assert all(r.usage.prompt_tokens_details.image_tokens > 0 for r in responses)

    def delta(name: str) -> float:
        return metric(after, f"omniserve:{name}_total") - metric(before, f"omniserve:{name}_total")

    assert (delta("encoder_cache_queries"), delta("encoder_cache_hits")) == (2, 1)


# ---- bad input ----


def _fill(part: Any, **values: str) -> Any:
    """``part`` with ``{name}`` in its strings replaced (URLs known only at run time)."""
    if isinstance(part, dict):
        return {key: _fill(value, **values) for key, value in part.items()}
    return part.format(**values) if isinstance(part, str) else part


# (server, bad part, "<modality> <stage>", a phrase of the message, extra request fields)
BAD_CASES = [
    pytest.param(
        "vl",
        _image_part("http://127.0.0.1:{closed_port}/a.png"),
        "image fetch",
        "cannot connect",
        {},
        id="unreachable url",
    ),
    pytest.param(
        "vl",
        _image_part(_data_url("image/png", b"no png")),
        "image decode",
        "cannot decode image",
        {},
        id="undecodable image",
    ),
    pytest.param(
        "vl",
        _image_part("data:text/plain;base64,aGk="),
        "image decode",
        "'text/plain' is not image/*",
        {},
        id="unsupported format",
    ),
    pytest.param(
        "audio",
        _input_audio(b"not audio"),
        "audio decode",
        "cannot decode audio",
        {},
        id="undecodable audio",
    ),
    pytest.param(
        "audio",
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "xyz"}},
        "audio decode",
        "input_audio.format must be one of wav, mp3",
        {},
        id="unknown audio format",
    ),
    pytest.param(
        "vl",
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": 5}},
        "image fetch",
        "image_url.detail must be one of auto, low, high",
        {},
        id="bad image detail",
    ),
    pytest.param(
        "audio",
        _input_audio(_wav(np.where(np.arange(16000) == 700, np.nan, WAVEFORM), 16000)),
        "audio decode",
        "samples that are NaN or infinite",
        {},
        id="NaN samples",
    ),
    pytest.param(
        "vl",
        {"type": "video_url", "video_url": {"url": _data_url("video/mp4", b"x")}},
        "video decode",
        "cannot decode video",
        {},
        id="undecodable video",
    ),
    pytest.param(
        "vl",
        _input_audio(WAV),
        "audio process",
        "does not take audio",
        {},
        id="audio to a vision model",
    ),
    pytest.param(
        "audio",
        {"video_url": "{media_dir}/clip.mp4"},
        "video process",
        "does not take video",
        {},
        id="video to an audio model",
    ),
    pytest.param(
        "vl",
        _image_part("{media_dir}/../elsewhere.png"),
        "image fetch",
        "outside the allowed",
        {},
        id="file outside the allowed dir",
    ),
    pytest.param(
        "strict",
        _image_part("{http}/image.png"),
        "image fetch",
        "loopback",
        {},
        id="private address",
    ),
    pytest.param(
        "strict",
        _png_part(BIG_IMAGE),
        "image budget",
        "needs 64 embeddings",
        {"mm_processor_kwargs": {"max_pixels": 50176}},
        id="item too large",
    ),
    # 1008x1008 kept whole: 1296 image tokens, over max_model_len 1024.
    pytest.param(
        "vl",
        _png_part(Image.new("RGB", (1008, 1008))),
        "image budget",
        "tokens long, which leaves no room to generate within max_model_len=1024 (1296 for image,",
        {"mm_processor_kwargs": {"max_pixels": 1008 * 1008}},
        id="prompt too long",
    ),
    pytest.param(
        "audio",
        _input_audio(_wav(np.zeros(6 * 16000, np.float32), 16000)),
        "audio decode",
        'lasts 6.0 s, over the limit of 5 s (--media-io-kwargs {"audio": {"max_seconds": ...}})',
        {},
        id="audio over --media-io-kwargs",
    ),
    pytest.param(
        "vl",
        {
            "type": "video_url",
            "video_url": {"url": _data_url("video/mp4", _video(num_frames=30, audio_rate=None))},
        },
        "video decode",
        "30 or more frames, over the limit of 20",
        {},
        id="video over --media-io-kwargs",
    ),
]


@pytest.mark.parametrize(("server_name", "part", "where", "phrase", "extra"), BAD_CASES)
def test_bad_input_is_a_located_400(
    server_name: str,
    part: Any,
    where: str,
    phrase: str,
    extra: dict[str, Any],
    request: pytest.FixtureRequest,
    http_media: Any,
    media_dir: Path,
) -> None:
    server: Server = request.getfixturevalue(server_name)
    hits = dict(http_media.hits)
    part = _fill(
        part, closed_port=str(free_port()), media_dir=media_dir.as_uri(), http=_url(http_media, "")
    )
    body = {"model": MODEL, "messages": _user(_text(), part), "max_tokens": 4, **extra}
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert error["message"].startswith(f"messages[2].content[1]: {where} error: "), error
    assert phrase in error["message"], error
    assert error["param"] == "messages[2].content[1]", error
    assert http_media.hits == hits  # nothing fetched from a refused address


def test_processor_option_errors_name_the_option(vl: Server) -> None:
    for kwargs, phrase in (
        ({"fps": 1000}, "mm_processor_kwargs.fps must be a number in"),
        ({"min_pixels": 10**5, "max_pixels": 10**3}, "min_pixels (100000) is over max_pixels"),
    ):
        body = {"model": MODEL, "messages": _user(_text(), _png_part(IMAGE)),
                "mm_processor_kwargs": kwargs}  # fmt: skip
        error = assert_error(vl.post("/v1/chat/completions", body), 400)
        assert phrase in error["message"], error
        assert error["param"] == f"mm_processor_kwargs.{next(iter(kwargs))}", error


def test_too_many_items_names_the_first_part_over_the_limit(strict: Server) -> None:
    images = [_png_part(_image(i, 28, 28)) for i in range(3)]
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(strict, _user(_text(), *images))
    message = bad.value.body["message"]
    assert message.startswith("messages[2].content[3]: image process error: ")
    assert "--limit-mm-per-prompt" in message
    assert _chat(strict, _user(_text(), *images[:2])).usage.prompt_tokens_details.image_tokens


def test_bad_requests_leave_concurrent_good_ones_alone(
    vl: Server, strict: Server, vl_llm: LLM, http_media: Any
) -> None:
    """Bad requests (a fetch that times out, bytes that do not decode, a modality the model
    lacks, an item over the encoder budget) beside good ones on the same servers: each bad one
    gets its 400, each good one its usual answer, without waiting for the slow rejection."""
    expected = _offline(vl_llm, _user(_text(), {"type": "image_pil", "image_pil": IMAGE}))
    strict_expected = _chat(strict, _user(_text(), _png_part(IMAGE)))
    too_large = {"mm_processor_kwargs": {"max_pixels": 50176}, "ignore_eos": True}
    # name -> (server, part, extra body); a name starting "bad:" is what its error must say
    requests = {
        "bad: image fetch error: timed out": (vl, _image_part(_url(http_media, "/slow.png")), {}),
        "bad: image decode error": (vl, _image_part(_data_url("image/png", b"garbage")), {}),
        "bad: audio process error": (vl, {"input_audio": {"data": "AAAA"}}, {}),
        "bad: image budget error": (strict, _png_part(BIG_IMAGE), too_large),
        "good": (vl, _png_part(IMAGE), {}),
        "good strict": (strict, _png_part(IMAGE), {}),
    }
    finished: dict[str, float] = {}

    async def send(name: str, server: Server, part: Any, extra: dict[str, Any]) -> Any:
        client = server.async_client()
        try:
            return await client.chat.completions.create(
                model=MODEL,
                messages=_user(_text(), part),
                **{**GREEDY, "extra_body": extra or GREEDY["extra_body"]},
            )
        except openai.BadRequestError as exc:
            return exc
        finally:
            finished[name] = time.monotonic()
            await client.close()

    async def run() -> dict[str, Any]:
        results = await asyncio.gather(*(send(name, *r) for name, r in requests.items()))
        return dict(zip(requests, results, strict=True))

    start = time.monotonic()
    results = asyncio.run(run())
    for name, result in results.items():
        if name.startswith("bad: "):
            assert isinstance(result, openai.BadRequestError), name
            prefix = f"messages[2].content[1]: {name.removeprefix('bad: ')}"
            assert result.body["message"].startswith(prefix), result.body
    _assert_same_answer(results["good"], expected)
    assert (
        results["good strict"].choices[0].message.content
        == strict_expected.choices[0].message.content
    )
    timed_out = finished["bad: image fetch error: timed out"]
    assert timed_out - start >= IMAGE_TIMEOUT_S
    assert max(finished["good"], finished["good strict"]) < timed_out - 1.0
