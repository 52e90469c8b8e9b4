"""vLLM's token-level pooling tasks and its raw pooling route: ``LLM.encode`` with
``token_embed`` (every prompt position's final state, embedded as a pooled one is) and
``token_classify`` (a sequence classifier's head on every position) against transformers on the
same weights, prefilled in chunks beside other requests; ``POST /pooling`` for every task, in
floats and in base64 of each ``embed_dtype`` and byte order (also ``/v1/embeddings``'), with
refusals as 400s naming the field."""

from __future__ import annotations

import base64
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

from omniserve import LLM, PoolingParams
from omniserve.sampling_params import embedding_params
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error
from tests.test_classification import classifiers  # noqa: F401 (the fixture)
from tests.test_embeddings import ATOL, BROKEN_IMAGE, LENGTHS, _hidden_states


def test_token_embed_matches_transformers(tiny_checkpoint) -> None:
    """Every position's state across 32-token chunks, raw and normalised row by row, batched
    with LAST embeddings; never from the prefix cache (each position must be computed), so a
    second call gives the same rows from scratch."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    prompts = make_prompts(model_dir, LENGTHS)
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = [_hidden_states(hf, input_ids=torch.tensor([ids])) for ids in prompts]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    tasks = [PoolingParams(normalize=False, task="token_embed"), PoolingParams(normalize=False)]
    params = [embedding_params(p) for p in tasks for _ in prompts]
    for _ in range(2):
        outputs = llm.generate(inputs * 2, params, use_tqdm=False)
        for output, expected in zip(outputs[: len(prompts)], states, strict=True):
            assert output.pooled.shape == expected.shape and output.num_cached_tokens == 0
            torch.testing.assert_close(torch.from_numpy(output.pooled), expected,
                                       atol=ATOL, rtol=0)  # fmt: skip
        for output, expected in zip(outputs[len(prompts) :], states, strict=True):
            torch.testing.assert_close(torch.from_numpy(output.pooled), expected[-1],
                                       atol=ATOL, rtol=0)  # fmt: skip
    unit = llm.encode(inputs[1:2], pooling_task="token_embed", use_tqdm=False)[0]
    assert unit.prompt_token_ids == prompts[1] and isinstance(unit.outputs.data, torch.Tensor)
    torch.testing.assert_close(unit.outputs.data, F.normalize(states[1], dim=1), atol=ATOL, rtol=0)
    # Without a task, encode runs the model's own (embed, here): embed's vector.
    default = llm.encode(inputs[:1], use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(default, F.normalize(states[0][-1], dim=0), atol=ATOL, rtol=0)


def test_token_embed_with_matryoshka_dimensions(tiny_checkpoint) -> None:
    """``dimensions`` cuts each row before it is normalised, as it cuts a pooled vector."""
    model_dir = str(
        tiny_checkpoint("Qwen2ForCausalLM", overrides={"matryoshka_dimensions": [16, 32]})
    )
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    raw = llm.encode("Hello there", PoolingParams(normalize=False), pooling_task="token_embed",
                     use_tqdm=False)[0].outputs.data  # fmt: skip
    cut = llm.encode("Hello there", PoolingParams(dimensions=16, task="token_embed"),
                     use_tqdm=False)[0].outputs.data  # fmt: skip
    torch.testing.assert_close(cut, F.normalize(raw[:, :16], dim=1))


def test_token_classify_matches_transformers(classifiers) -> None:  # noqa: F811
    """The classifier's head on every position (transformers' per-position logits, before it
    picks the last), softmax per row unless ``use_activation`` is False; three labels."""
    model_dir = classifiers["Qwen2"]
    prompts = make_prompts(model_dir, [5, 40])
    llm = LLM(model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    probs = llm.encode(inputs, pooling_task="token_classify", use_tqdm=False)
    raw = llm.encode(inputs, PoolingParams(use_activation=False, task="token_classify"),
                     use_tqdm=False)  # fmt: skip
    last = llm.classify(inputs, use_tqdm=False)
    for ids, got, got_raw, sequence in zip(prompts, probs, raw, last, strict=True):
        with torch.inference_mode():
            logits = hf.score(hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0])
        assert got.outputs.data.shape == (len(ids), 3)
        torch.testing.assert_close(got_raw.outputs.data, logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.outputs.data, logits.softmax(1), atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.outputs.data[-1].numpy(), sequence.outputs.probs,
                                   atol=1e-6)  # fmt: skip


def test_token_task_refusals(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), dtype="float32", max_model_len=64)
    for params, task, words in (
        (None, "token_classify", "is no sequence classifier .* not token_classify"),
        (PoolingParams(pooling_type="MEAN"), "token_embed", "pooling_type: token_embed keeps"),
        (PoolingParams(task="embed"), "token_embed", "pooling_params.task is 'embed'"),
        (PoolingParams(pooling_type="ALL"), None, "pooling_type: 'ALL' is not one of"),
    ):
        with pytest.raises(ValueError, match=words):
            llm.encode("Hello", params, pooling_task=task, use_tqdm=False)
    with pytest.raises(ValueError, match="task must be None or one of embed, classify, token_"):
        PoolingParams(task="encode")


def _decode(text: str, dtype: str, endianness: str) -> np.ndarray:
    """vLLM's base64 bytes as float32 values."""
    raw = base64.b64decode(text)
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    if dtype == "bfloat16":  # the high half of a float32
        ints = np.frombuffer(raw, dtype=f"{order}u2").astype(np.uint32) << 16
        return ints.view(np.float32)
    return np.frombuffer(raw, dtype=f"{order}{dtype[0]}{int(dtype[-2:]) // 8}").astype(np.float32)


def test_the_pooling_route(default_server) -> None:
    """Each task of the served omni thinker (a chat with an image among them), equal to its
    other routes' answers; base64 in each dtype and byte order carries the same values
    (rounded to the dtype) on /pooling and /v1/embeddings; refusals name the field."""
    from tests.test_api_multimodal import _png
    from tests.test_fidelity_mm import _image

    def pool(body: dict) -> dict:
        reply = default_server.post("/pooling", {"model": MODEL, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    texts = ["a red square", "a beep"]
    embedded = default_server.post("/v1/embeddings", {"model": MODEL, "input": texts}).json()
    plain = pool({"input": texts})
    assert plain["object"] == "list" and plain["id"].startswith("pool-")
    assert [d["object"] for d in plain["data"]] == ["pooling"] * 2
    for got, want in zip(plain["data"], embedded["data"], strict=True):
        np.testing.assert_allclose(got["data"], want["embedding"], atol=1e-6)
    assert plain["usage"] == embedded["usage"]

    rows = pool({"input": texts, "task": "token_embed", "use_activation": False})
    raw_last = default_server.post(
        "/v1/embeddings", {"model": MODEL, "input": texts, "normalize": False}
    ).json()
    for got, want in zip(rows["data"], raw_last["data"], strict=True):
        np.testing.assert_allclose(got["data"][-1], want["embedding"], atol=1e-5)
    assert sum(len(d["data"]) for d in rows["data"]) == rows["usage"]["prompt_tokens"]
    unit = pool({"input": texts[0], "task": "token_embed"})["data"][0]["data"]
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1, atol=1e-5)

    url = "data:image/png;base64," + base64.b64encode(_png(_image(3, 64, 48))).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "A shape."}]}]  # fmt: skip
    chat_rows = pool({"messages": messages, "task": "token_embed"})
    chat_embedding = default_server.post(
        "/v1/embeddings", {"model": MODEL, "messages": messages}
    ).json()["data"][0]["embedding"]
    assert len(chat_rows["data"][0]["data"]) == chat_rows["usage"]["prompt_tokens"] > 10
    np.testing.assert_allclose(chat_rows["data"][0]["data"][-1], chat_embedding, atol=1e-5)

    floats = np.float32(rows["data"][1]["data"])
    for dtype, endianness in (("float32", "native"), ("float16", "big"), ("bfloat16", "little")):
        body = {
            "input": texts,
            "task": "token_embed",
            "use_activation": False,
            "encoding_format": "base64",
            "embed_dtype": dtype,
            "endianness": endianness,
        }
        packed = pool(body)["data"][1]["data"]
        expected = torch.from_numpy(floats).to(getattr(torch, dtype)).float().numpy()
        np.testing.assert_array_equal(_decode(packed, dtype, endianness), expected.ravel())
    embedding = np.float32(embedded["data"][0]["embedding"])
    half = default_server.post("/v1/embeddings", {
        "model": MODEL, "input": texts[0], "encoding_format": "base64", "embed_dtype": "float16",
        "endianness": "big" if sys.byteorder == "little" else "little",
    }).json()["data"][0]["embedding"]  # fmt: skip
    other = "big" if sys.byteorder == "little" else "little"
    np.testing.assert_array_equal(_decode(half, "float16", other), embedding.astype(np.float16))

    logged = len(default_server.log.read_bytes())
    broken = [{"role": "user", "content": [BROKEN_IMAGE]}]
    for body, field, words in (
        ({"messages": broken}, "messages[0].content[0]", "image"),
        ({"input": "x", "task": "token_classify"}, "task", "answers embed, token_embed, not"),
        ({"input": "x", "task": "encode"}, "task", ""),
        ({"input": "x", "normalize": True, "use_activation": False}, "use_activation",
         "contradicts normalize"),
        ({"input": "x", "task": "token_embed", "dimensions": 4}, "dimensions",
         "does not support Matryoshka"),
        ({"input": "x", "encoding_format": "base64", "embed_dtype": "int8"}, "embed_dtype", ""),
        ({"input": []}, "input", "must not be an empty list"),
        ({"messages": []}, "messages", ""),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input", "not both"),
    ):  # fmt: skip
        error = assert_error(default_server.post("/pooling", {"model": MODEL, **body}), 400)
        assert error["param"] == field and words in error["message"], (body, error)
    # A client's mistake is answered, not logged as an unhandled exception (only our bugs are).
    time.sleep(0.5)
    assert b"Exception in ASGI" not in default_server.log.read_bytes()[logged:]
