"""vLLM's bi-encoder scoring: ``LLM.score`` and the ``/score`` and ``/rerank`` routes answer the
cosine similarity of two inputs' embeddings, paired 1:1, 1:N or N:N; against transformers' hidden
states offline, against ``LLM.score`` (media items included) and ``/v1/embeddings`` over the API,
with refusals naming the field as the client spelled it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from omniserve import LLM, PoolingParams
from omniserve.entrypoints.cli import default_model
from omniserve.registry import ModelRegistry
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error
from tests.test_api_multimodal import _image, _png_part

ATOL = 1e-5


def _cosines(first: torch.Tensor, seconds: list[torch.Tensor]) -> list[float]:
    return [F.cosine_similarity(first, s, dim=0).item() for s in seconds]


def test_llm_score_matches_transformers(tiny_checkpoint) -> None:
    """1:N and N:N pairs of token prompts, by the model's default (LAST) pooling and by MEAN;
    mismatched counts and non-prompts raise naming the argument."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    prompts = make_prompts(model_dir, [5, 9, 17, 30])
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = [hf.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]
    last, mean = [s[-1] for s in states], [s.mean(0) for s in states]
    inputs = [{"prompt_token_ids": p} for p in prompts]

    one_to_n = llm.score(inputs[0], inputs[1:], use_tqdm=False)
    assert [o.outputs.score for o in one_to_n] == pytest.approx(
        _cosines(last[0], last[1:]), abs=ATOL
    )
    assert one_to_n[1].prompt_token_ids == prompts[0] + prompts[2]
    n_to_n = llm.score(inputs[:2], inputs[2:], use_tqdm=False,
                       pooling_params=PoolingParams(pooling_type="MEAN"))  # fmt: skip
    expected = [_cosines(mean[0], [mean[2]])[0], _cosines(mean[1], [mean[3]])[0]]
    assert [o.outputs.score for o in n_to_n] == pytest.approx(expected, abs=ATOL)
    text = llm.score("Hello there", "Hello there", use_tqdm=False)[0]
    assert text.outputs.score == pytest.approx(1.0, abs=ATOL) and text.finished

    with pytest.raises(ValueError, match="data_2: 2 data_1 and 3 data_2 do not pair"):
        llm.score(inputs[:2], inputs[1:], use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 must not be empty"):
        llm.score([], inputs, use_tqdm=False)
    with pytest.raises(TypeError, match=r"data_2\[0\] must be text or a dict"):
        llm.score("a", [3], use_tqdm=False)  # type: ignore[list-item]


def test_score_and_rerank_api(default_server) -> None:
    """``/score`` in vLLM's four spellings and ``/rerank`` on its three paths equal the cosine of
    ``/v1/embeddings``' vectors; a document with an image (vLLM's ``content`` form) scores as
    ``LLM.score`` scores its placeholder prompt with the image; refusals are 400s naming the
    field as sent."""
    query, texts = "a red square", ["a beep", "a red square, small", "a long sound"]
    vectors = [
        np.asarray(d["embedding"])
        for d in default_server.post(
            "/v1/embeddings", {"model": MODEL, "input": [query, *texts]}
        ).json()["data"]
    ]
    expected = [float(vectors[0] @ v / np.linalg.norm(vectors[0]) / np.linalg.norm(v))
                for v in vectors[1:]]  # fmt: skip
    for first, second in (("text_1", "text_2"), ("queries", "documents"),
                          ("queries", "items"), ("data_1", "data_2")):  # fmt: skip
        reply = default_server.post("/score", {"model": MODEL, first: query, second: texts})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["model"] == MODEL
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=ATOL)
    pairwise = default_server.post("/v1/score", {"model": MODEL, "text_1": [query, query],
                                                 "text_2": texts[:2]}).json()  # fmt: skip
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected[:2], abs=ATOL)
    usage = pairwise["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0

    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = default_server.post(path, {"model": MODEL, "query": query, "documents": texts})
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        assert [r["index"] for r in results] == order
        assert [r["relevance_score"] for r in results] == pytest.approx(
            [expected[i] for i in order], abs=ATOL
        )
        assert [r["document"]["text"] for r in results] == [texts[i] for i in order]
    best = {"query": query, "documents": texts, "top_n": 2, "return_documents": False}
    top = default_server.post("/rerank", {"model": MODEL, **best}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])
    assert top["usage"]["total_tokens"] > 0 and top["id"].startswith("rerank-")

    image = _image(4, 64, 48)
    with_image = {"content": [_png_part(image), {"type": "text", "text": "A shape."}]}
    mixed = default_server.post("/rerank", {"model": MODEL, "query": query,
                                            "documents": [texts[0], with_image]})  # fmt: skip
    assert mixed.status_code == 200, mixed.text
    by_index = {r["index"]: r for r in mixed.json()["results"]}
    assert by_index[1]["document"]["multi_modal"] == with_image["content"]
    offline = LLM(default_model(), dtype="float32", max_model_len=1024)
    placeholder = ModelRegistry.resolve_model_cls(
        offline.llm_engine.config.model_config.architecture
    ).get_placeholder_str("image", 0)
    document = {"prompt": f"{placeholder}\nA shape.", "multi_modal_data": {"image": [image]}}
    want = offline.score(query, [texts[0], document], use_tqdm=False)
    offline.llm_engine.shutdown()
    assert [by_index[i]["relevance_score"] for i in (0, 1)] == pytest.approx(
        [o.outputs.score for o in want], abs=ATOL
    )

    broken = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
    for path, body, field, words in (
        ("/score", {"text_1": [query] * 2, "text_2": texts}, "text_2", "do not pair"),
        ("/score", {"queries": [], "documents": texts}, "queries", "must not be empty"),
        ("/score", {"queries": query, "items": ["", "x"]}, "items[0]", "is empty"),
        ("/score", {"text_1": query}, "documents", "Field required"),
        ("/score", {"data_1": query, "data_2": [texts[0], broken]}, "data_2[1].content[0]", ""),
        ("/rerank", {"query": query, "documents": []}, "documents", "must not be an empty"),
        ("/rerank", {"query": query, "documents": texts, "top_n": -1}, "top_n", ""),
        ("/rerank", {"query": {"content": []}, "documents": texts}, "query", "content"),
        ("/classify", {"input": query}, None, "is no sequence classifier"),
        ("/rerank", {"query": query, "documents": texts, "mm_processor_kwargs": {"fps": "x"}},
         "mm_processor_kwargs.fps", "must be a number"),
    ):  # fmt: skip
        error = assert_error(default_server.post(path, {"model": MODEL, **body}), 400)
        assert error["param"] == field and words in error["message"], (body, error)
    missing = default_server.post("/rerank", {"model": "nope", "query": "a", "documents": ["b"]})
    assert assert_error(missing, 404)["param"] == "model"
