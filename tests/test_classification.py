"""Sequence classifiers (transformers' ``*ForSequenceClassification``): ``LLM.classify`` and
``/classify`` answer the labels' probabilities of the prompt's pooled final state, and a
one-label classifier (a cross-encoder reranker) scores pairs for ``LLM.score``, ``/score`` and
``/rerank``; against transformers' own classes on the same weights. ``--hf-overrides`` sets
config.json keys over the checkpoint's."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from omniserve import LLM, PoolingParams, SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error, launch_server

ATOL = 1e-5  # fp32 on both sides: only the order of the sums differs
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
"""A score template (vLLM's ``--chat-template`` for cross-encoders): a query and a document."""


@pytest.fixture(scope="module")
def classifiers(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    """Random-weight classifiers saved by transformers from the tiny causal checkpoints'
    configs (with their tokenizers): Qwen2 with three labels, Qwen3 with one."""
    made = {}
    for arch, labels in (("Qwen2", 3), ("Qwen3", 1)):
        base = tiny_checkpoint(f"{arch}ForCausalLM")
        config = transformers.AutoConfig.from_pretrained(base)
        config.architectures = [f"{arch}ForSequenceClassification"]
        config.num_labels = labels
        config.id2label = {i: f"class_{i}" for i in range(labels)}
        config.label2id = {name: i for i, name in config.id2label.items()}
        config.pad_token_id = 0
        torch.manual_seed(labels)
        model = getattr(transformers, f"{arch}ForSequenceClassification")(config)
        target = tmp_path_factory.mktemp(f"{arch}-classifier")
        model.save_pretrained(target)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(Path(base) / name, target / name)
        made[arch] = str(target)
    return made


def _hf(model_dir: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' label scores of ``ids`` (its last position) and its final states."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        states = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return model(input_ids=torch.tensor([ids])).logits[0], model.score(states.mean(0))


def test_classify_matches_transformers(classifiers) -> None:
    """Probabilities (softmax) and raw scores, prefilled in chunks; MEAN pooling puts the head on
    the mean state; a classifier writes no text, and a causal LM classifies nothing."""
    model_dir = classifiers["Qwen2"]
    prompts = make_prompts(model_dir, [5, 40])
    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=16)
    assert llm.llm_engine.config.model_config.runner == "pooling"
    inputs = [{"prompt_token_ids": p} for p in prompts]
    probs = llm.classify(inputs, use_tqdm=False)
    raw = llm.classify(inputs, PoolingParams(use_activation=False), use_tqdm=False)
    mean = llm.classify(inputs, PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    for ids, got, got_raw, got_mean in zip(prompts, probs, raw, mean, strict=True):
        logits, mean_logits = _hf(model_dir, ids)
        assert got.outputs.num_classes == 3 and got.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(got_raw.outputs.probs), logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(got.outputs.probs), logits.softmax(0),
                                   atol=ATOL, rtol=0)  # fmt: skip
        torch.testing.assert_close(torch.tensor(got_mean.outputs.probs),
                                   mean_logits.softmax(0), atol=ATOL, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"answers classification and scoring \(LLM.classify"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="This model classifies into 3 labels; scoring needs"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: a classification has one score per"):
        llm.classify("Hello", PoolingParams(dimensions=2), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params.task is 'embed'; this call runs"):
        llm.classify("Hello", PoolingParams(task="embed"), use_tqdm=False)
    with pytest.raises(ValueError, match="--runner generate: Qwen2ForSequenceClassification is"):
        EngineArgs(model_dir, runner="generate").create_config()
    llm.llm_engine.shutdown()


def test_async_encode_classifies_on_a_classifier(classifiers) -> None:
    """vLLM's ``AsyncLLM.encode`` on a classifier: its label probabilities (the model's default
    task), or the pooled state when asked to embed."""
    import asyncio

    from omniserve.engine.async_llm import AsyncLLM
    from omniserve.outputs import ClassificationRequestOutput, EmbeddingRequestOutput

    model_dir = classifiers["Qwen2"]
    ids = make_prompts(model_dir, [21])[0]

    async def run() -> list:
        args = EngineArgs(model_dir, dtype="float32", max_model_len=64, kv_cache_memory="16MiB")
        engine = AsyncLLM.from_engine_args(args)
        try:
            prompt = {"prompt_token_ids": ids}
            classified = [o async for o in engine.encode(prompt, None, "classify")]
            embedded = [o async for o in engine.encode(prompt, PoolingParams(task="embed"), "e")]
        finally:
            engine.shutdown()
        return classified + embedded

    classified, embedded = asyncio.run(run())
    logits, _ = _hf(model_dir, ids)
    assert isinstance(classified, ClassificationRequestOutput)
    torch.testing.assert_close(torch.tensor(classified.outputs.probs), logits.softmax(0),
                               atol=ATOL, rtol=0)  # fmt: skip
    assert isinstance(embedded, EmbeddingRequestOutput)
    assert embedded.outputs.hidden_size == 64


def test_cross_encoder_score_matches_transformers(classifiers, tiny_checkpoint) -> None:
    """A one-label classifier scores each pair's prompts joined end to end: the sigmoid of its
    score; a causal LM refuses classification."""
    model_dir = classifiers["Qwen3"]
    query, *docs = make_prompts(model_dir, [7, 11, 20])
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    got = llm.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs],
                    use_tqdm=False)  # fmt: skip
    for doc, output in zip(docs, got, strict=True):
        logits, _ = _hf(model_dir, query + doc)
        assert output.prompt_token_ids == query + doc
        assert output.outputs.score == pytest.approx(logits.sigmoid().item(), abs=ATOL)
    text = llm.score("Is it red?", ["Yes.", "No."], use_tqdm=False)
    joined = llm.classify(["Is it red?Yes.", "Is it red?No."], use_tqdm=False)
    assert [o.outputs.score for o in text] == [o.outputs.probs[0] for o in joined]
    rendered = llm.score("Is it red?", ["Yes."], use_tqdm=False, chat_template=TEMPLATE)
    by_template = llm.classify("<query>Is it red?</query><document>Yes.</document>",
                               use_tqdm=False)  # fmt: skip
    assert rendered[0].outputs.score == by_template[0].outputs.probs[0]
    with pytest.raises(TypeError, match="A cross-encoder scores pairs of texts, or of token"):
        llm.score("a", {"prompt_token_ids": [1, 2]}, use_tqdm=False)
    with pytest.raises(TypeError, match="without a score template"):
        llm.score({"prompt_token_ids": [1]}, {"prompt_token_ids": [2]}, use_tqdm=False,
                  chat_template=TEMPLATE)  # fmt: skip
    llm.llm_engine.shutdown()
    causal = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is no sequence classifier"):
        causal.classify("Hello", use_tqdm=False)


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3"])  # a tied and an untied LM head
def test_causal_lm_as_reranker(tiny_checkpoint, arch) -> None:
    """vLLM's ``classifier_from_token`` through ``--hf-overrides``: a causal LM checkpoint as an
    LLM reranker (Qwen3-Reranker's form: the 2-way softmax of two tokens' logits, the second's
    probability the score) or a classifier of one label per token; against the causal LM's own
    logits of those tokens in transformers."""
    model_dir = str(tiny_checkpoint(f"{arch}ForCausalLM"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    words = tokenizer.convert_ids_to_tokens([854, 1000, 1500])
    ids = tokenizer.convert_tokens_to_ids(words)
    classifier = {"architectures": [f"{arch}ForSequenceClassification"]}
    reranker = LLM(model_dir, dtype="float32", max_model_len=64, hf_overrides={
        **classifier, "classifier_from_token": words[:2], "is_original_qwen3_reranker": True,
    })  # fmt: skip
    query, *docs = make_prompts(model_dir, [7, 11, 20])
    got = reranker.score({"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs],
                         use_tqdm=False)  # fmt: skip
    reranker.llm_engine.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for doc, output in zip(docs, got, strict=True):
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([query + doc])).logits[0, -1]
        expected = logits[ids[:2]].softmax(0)[1].item()
        assert output.outputs.score == pytest.approx(expected, abs=ATOL)

    three = LLM(model_dir, dtype="float32", max_model_len=64,
                hf_overrides={**classifier, "classifier_from_token": words})  # fmt: skip
    raw = three.classify({"prompt_token_ids": query}, PoolingParams(use_activation=False),
                         use_tqdm=False)[0]  # fmt: skip
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([query])).logits[0, -1]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logits[ids], atol=ATOL, rtol=0)
    three.llm_engine.shutdown()
    for overrides, words_ in (
        ({"classifier_from_token": ["no-such-token"]}, "'no-such-token' is not a token"),
        ({"classifier_from_token": words, "method": "from_2_way_softmax"}, "two for"),
        ({"classifier_from_token": words, "method": "mean"}, "method: 'mean' is not one of"),
    ):
        config = EngineArgs(model_dir, hf_overrides={**classifier, **overrides}).create_config()
        with pytest.raises(ValueError, match=words_):
            config.model_config.hf_config  # noqa: B018


def test_reranker_of_a_bf16_checkpoint_in_fp32(bf16_checkpoint) -> None:
    """The head's row difference is taken in the compute dtype: a bf16 checkpoint run in fp32
    gives the fp32 causal LM's softmax (a difference rounded to bf16 was 1e-3 off at real
    size)."""
    model_dir = bf16_checkpoint("Qwen3ForCausalLM")
    words = transformers.AutoTokenizer.from_pretrained(model_dir).convert_ids_to_tokens([854, 1000])
    llm = LLM(model_dir, dtype="float32", max_model_len=64, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": words,
        "is_original_qwen3_reranker": True,
    })  # fmt: skip
    ids = make_prompts(model_dir, [30])[0]
    got = llm.classify({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.probs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    assert got == pytest.approx(logits[[854, 1000]].softmax(0)[1].item(), abs=ATOL)


def test_hf_overrides(classifiers, tiny_checkpoint) -> None:
    """config.json keys over the checkpoint's, a nested config merged key by key: the labels'
    names, the context length, a vision tower's setting."""
    overrides = {"id2label": {"0": "relevant"}, "max_position_embeddings": 48}
    config = EngineArgs(classifiers["Qwen3"], hf_overrides=overrides).create_config()
    assert config.model_config.max_model_len == 48
    assert config.model_config.hf_config.id2label == {0: "relevant"}
    vision = EngineArgs(str(tiny_checkpoint("Qwen2VLForConditionalGeneration")),
                        hf_overrides={"vision_config": {"initializer_range": 0.5}})  # fmt: skip
    hf_config = vision.create_config().model_config.hf_config
    assert hf_config.vision_config.initializer_range == 0.5
    assert (
        hf_config.vision_config.depth
        == transformers.AutoConfig.from_pretrained(vision.model).vision_config.depth
    )
    with pytest.raises(ValueError, match="--hf-overrides must be JSON"):
        EngineArgs(classifiers["Qwen3"], hf_overrides="{nope").create_config()


def test_classification_api(classifiers, tmp_path) -> None:
    """``/classify`` (``input``, or vLLM's chat form), and a cross-encoder's ``/score`` and
    ``/rerank`` (their pairs rendered by the ``--chat-template`` given, vLLM's score template),
    equal to the offline answers; text only; generation refused."""
    model_dir = classifiers["Qwen3"]
    offline = LLM(model_dir, dtype="float32", max_model_len=64)
    texts = ["Is it red?", "A red square.", "A beep."]
    classified = [o.outputs.probs for o in offline.classify(texts, use_tqdm=False)]
    as_chat = offline.classify("<user>Is it red?</user>", use_tqdm=False)[0].outputs.probs
    scored = [o.outputs.score for o in offline.score(texts[0], texts[1:], use_tqdm=False,
                                                     chat_template=TEMPLATE)]  # fmt: skip
    offline.llm_engine.shutdown()
    (tmp_path / "score.jinja").write_text(TEMPLATE)
    flags = ("--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "16MiB",
             "--hf-overrides", '{"id2label": {"0": "relevant"}}',
             "--chat-template", str(tmp_path / "score.jinja"))  # fmt: skip
    with launch_server(model_dir, tmp_path, *flags) as server:
        body = server.post("/classify", {"model": MODEL, "input": texts}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["label"] == "relevant" and d["num_classes"] == 1 for d in body["data"])
        np.testing.assert_allclose([d["probs"] for d in body["data"]], classified, atol=ATOL)
        assert body["usage"]["prompt_tokens"] > 0
        messages = [{"role": "user", "content": texts[0]}]  # rendered by --chat-template
        chat = server.post("/classify", {"model": MODEL, "messages": messages}).json()
        assert chat["data"][0]["probs"] == pytest.approx(as_chat, abs=ATOL)
        raw = server.post("/classify", {"model": MODEL, "input": texts[0],
                                        "use_activation": False}).json()  # fmt: skip
        assert raw["data"][0]["probs"][0] == pytest.approx(
            np.log(classified[0][0] / (1 - classified[0][0])), abs=1e-4
        )
        score = server.post("/score", {"model": MODEL, "text_1": texts[0], "text_2": texts[1:]})
        assert [d["score"] for d in score.json()["data"]] == pytest.approx(scored, abs=ATOL)
        ranked = server.post("/rerank", {"model": MODEL, "query": texts[0],
                                         "documents": texts[1:]}).json()  # fmt: skip
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            sorted(scored, reverse=True), abs=ATOL
        )
        image = {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
        for path, body, field, words in (
            ("/rerank", {"query": "a", "documents": ["b", image]}, "documents[1]", "text"),
            ("/classify", {"input": []}, "input", "must not be an empty list"),
            ("/classify", {"messages": []}, "messages", "at least 1 item"),
            ("/classify", {"input": [[1, 10**9]]}, "input", "outside the vocabulary"),
        ):
            error = assert_error(server.post(path, {"model": MODEL, **body}), 400)
            assert error["param"] == field and words in error["message"], error
        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        refused = assert_error(server.post("/v1/chat/completions", chat), 400)
        assert "/classify" in refused["message"]
