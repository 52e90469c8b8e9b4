"""Embeddings (vLLM's ``LLM.embed`` and ``/v1/embeddings``): the final hidden states pooled at a
prompt's last position (or their mean, or the first position's), L2-normalised unless asked
otherwise, against transformers' last hidden state on the same weights for text and image
prompts; the pooling a checkpoint's sentence-transformers config asks for; over the API in
OpenAI's shapes and vLLM's chat form, with refusals as 400s naming the field."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from omniserve import LLM, PoolingParams, SamplingParams
from omniserve.config import PoolerConfig
from omniserve.entrypoints.cli import default_model
from omniserve.sampling_params import embedding_params
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error
from tests.test_api_multimodal import _png
from tests.test_fidelity_mm import _hf_inputs, _image

LENGTHS = [3, 17, 40, 100]
ATOL = 1e-4  # fp32 on both sides: only the order of the sums differs
BROKEN_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _hidden_states(model, **inputs) -> torch.Tensor:
    """transformers' final (normed) hidden states of one prompt: ``[positions, hidden]``."""
    with torch.inference_mode():
        return model.model(**inputs).last_hidden_state[0]


def test_text_embeddings_match_transformers(tiny_checkpoint) -> None:
    """Prefilled in chunks of 32 tokens, batched; the second call hits the prefix cache (the last
    position is computed all the same) and gives the same vectors."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    prompts = make_prompts(model_dir, LENGTHS)
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    unit = llm.embed(inputs, use_tqdm=False)
    raw = llm.embed(inputs, PoolingParams(normalize=False), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, got, got_raw in zip(prompts, unit, raw, strict=True):
        expected = _hidden_states(hf, input_ids=torch.tensor([ids]))[-1]
        assert got.prompt_token_ids == ids and got.finished
        assert got.outputs.hidden_size == hf.config.hidden_size
        torch.testing.assert_close(torch.tensor(got_raw.outputs.embedding), expected,
                                   atol=ATOL, rtol=0)  # fmt: skip
        torch.testing.assert_close(torch.tensor(got.outputs.embedding),
                                   F.normalize(expected, dim=0), atol=ATOL, rtol=0)  # fmt: skip
    assert [o.num_cached_tokens for o in raw] == [0, 16, 32, 96]  # whole blocks of 16 reused
    # Text is tokenized as generate tokenizes it; a generation after the embeddings is untouched.
    text = llm.embed("Hello there", use_tqdm=False)[0]
    ids = llm.get_tokenizer()("Hello there").input_ids
    assert text.prompt_token_ids == ids
    last = _hidden_states(hf, input_ids=torch.tensor([ids]))[-1]
    torch.testing.assert_close(torch.tensor(text.outputs.embedding), F.normalize(last, dim=0),
                               atol=ATOL, rtol=0)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    after = llm.generate(inputs[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        reference = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8)[0, len(prompts[0]):].tolist()  # fmt: skip
    assert after == reference


def test_matryoshka_dimensions_and_refusals(tiny_checkpoint) -> None:
    """``dimensions`` cuts before normalising, only on a model whose config declares Matryoshka
    training; bad params raise naming the field."""
    plain = LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="dimensions: Qwen2ForCausalLM does not support Matr"):
        plain.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be None or a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize must be a boolean"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams"):
        plain.embed("Hello", {"normalize": False}, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="An embedding request takes n=1"):
        plain.generate("Hello", SamplingParams(n=2, max_tokens=1, pooling=PoolingParams()))

    model_dir = str(
        tiny_checkpoint("Qwen2ForCausalLM", overrides={"matryoshka_dimensions": [16, 32]})
    )
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    full = llm.embed("Hello", PoolingParams(normalize=False), use_tqdm=False)[0]
    cut = llm.embed("Hello", PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = F.normalize(torch.tensor(full.outputs.embedding[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), expected)
    with pytest.raises(ValueError, match=r"dimensions: 8 is not one of this model's Matryoshka"):
        llm.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)


def test_truncate_prompt_tokens_pools_the_last_tokens(tiny_checkpoint) -> None:
    """vLLM's ``LLM.embed(truncate_prompt_tokens=k)`` (or the params'): the embedding of the
    prompt's last k tokens; the two may not disagree."""
    llm = LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), dtype="float32", max_model_len=64)
    ids = list(range(10, 30))
    (cut,) = llm.embed({"prompt_token_ids": ids}, use_tqdm=False, truncate_prompt_tokens=5)
    (last,) = llm.embed({"prompt_token_ids": ids[-5:]}, use_tqdm=False)
    (by_params,) = llm.embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=5),
                             use_tqdm=False)  # fmt: skip
    assert cut.prompt_token_ids == by_params.prompt_token_ids == ids[-5:]
    assert cut.outputs.embedding == last.outputs.embedding == by_params.outputs.embedding
    (whole,) = llm.encode({"prompt_token_ids": ids}, pooling_task="token_embed",
                          truncate_prompt_tokens=-1, use_tqdm=False)  # fmt: skip
    assert whole.outputs.data.shape[0] == len(ids)  # -1: max_model_len, which it fits
    with pytest.raises(ValueError, match="pooling_params.truncate_prompt_tokens is 5; this call's"):
        llm.embed("Hello", PoolingParams(truncate_prompt_tokens=5), truncate_prompt_tokens=3)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be None, -1 \(max_model_"):
        PoolingParams(truncate_prompt_tokens=0)
    # SamplingParams built by hand take the pooling params' cut too
    by_hand = SamplingParams(max_tokens=1, pooling=PoolingParams(truncate_prompt_tokens=5))
    assert by_hand.truncate_prompt_tokens == 5
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(2\) contradicts pooling"):
        SamplingParams(truncate_prompt_tokens=2, pooling=PoolingParams(truncate_prompt_tokens=5))


def test_mean_and_cls_pooling_match_transformers(tiny_checkpoint) -> None:
    """MEAN and CLS read every chunk of a prompt prefilled 32 tokens at a time, beside LAST
    requests in the same batches; they never take a prefix-cache hit (their earlier positions
    must be computed), so a second call gives the same vectors from scratch."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    prompts = make_prompts(model_dir, LENGTHS)
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = [_hidden_states(hf, input_ids=torch.tensor([ids])) for ids in prompts]
    expected = {"MEAN": [s.mean(0) for s in states], "CLS": [s[0] for s in states],
                "LAST": [s[-1] for s in states]}  # fmt: skip
    kinds = ["MEAN", "CLS", "LAST"]
    params = [embedding_params(PoolingParams(normalize=False, pooling_type=kind.lower()))
              for kind in kinds for _ in prompts]  # fmt: skip
    inputs = [{"prompt_token_ids": p} for _ in kinds for p in prompts]
    for _ in range(2):
        outputs = llm.generate(inputs, params, use_tqdm=False)
        for n, output in enumerate(outputs):
            kind, i = kinds[n // len(prompts)], n % len(prompts)
            torch.testing.assert_close(torch.tensor(output.pooled), expected[kind][i],
                                       atol=ATOL, rtol=0)  # fmt: skip
            if kind != "LAST":
                assert output.num_cached_tokens == 0
    unit = llm.embed(inputs[:1], PoolingParams(pooling_type="MEAN"), use_tqdm=False)[0]
    unit_mean = F.normalize(expected["MEAN"][0], dim=0)
    torch.testing.assert_close(torch.tensor(unit.outputs.embedding), unit_mean, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="pooling_type: 'MAX' is not one of LAST, MEAN, CLS"):
        llm.embed("Hello", PoolingParams(pooling_type="max"), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type must be a string"):
        PoolingParams(pooling_type=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_of_max_model_len(tiny_checkpoint, async_scheduling) -> None:
    """An embedding request's prompt may take all of max_model_len (its one sampled token is
    never fed back), chunked, beside generation; one token more is refused, as is a generation
    prompt of max_model_len."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    full, longer = make_prompts(model_dir, [64, 65])
    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_batched_tokens=24,
              async_scheduling=async_scheduling)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = _hidden_states(hf, input_ids=torch.tensor([full]))
    params = [embedding_params(PoolingParams(normalize=False, pooling_type=kind))
              for kind in ("LAST", "MEAN")]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate([{"prompt_token_ids": full}] * 2 + [{"prompt_token_ids": full[:40]}],
                           [*params, greedy], use_tqdm=False)  # fmt: skip
    torch.testing.assert_close(torch.tensor(outputs[0].pooled), states[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(outputs[1].pooled), states.mean(0), atol=ATOL, rtol=0)
    assert len(outputs[2].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="has 65 input tokens, which is more than it"):
        llm.embed({"prompt_token_ids": longer}, use_tqdm=False)
    with pytest.raises(ValueError, match="has 64 input tokens, which leaves no room to generate"):
        llm.generate({"prompt_token_ids": full}, greedy, use_tqdm=False)


def _with_sentence_transformers(model_dir: Path, target: Path, modules: list[str],
                                flags: dict[str, bool],
                                dense: list[dict[str, Any]] = ()) -> str:  # fmt: skip
    """``model_dir``'s files (linked) with a sentence-transformers pipeline of ``modules``
    (short names; module i in folder ``{i}_{name}``) whose Pooling module sets ``flags`` and
    whose Dense modules, in order, have ``dense``'s configs (plus ``weights``: a state dict,
    and ``file``: the name it is saved under, safetensors or torch's)."""
    from safetensors.torch import save_file

    target.mkdir()
    for item in model_dir.iterdir():
        (target / item.name).symlink_to(item)
    paths = ["" if m == "Transformer" else f"{i}_{m}" for i, m in enumerate(modules)]
    listed = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{m}"}
        for i, (m, path) in enumerate(zip(modules, paths, strict=True))
    ]
    (target / "modules.json").write_text(json.dumps(listed))
    for path in filter(None, paths):
        (target / path).mkdir()
    pooling = target / paths[modules.index("Pooling")] if "Pooling" in modules else None
    if pooling is not None:
        (pooling / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, **flags}
        ))  # fmt: skip
    folders = [target / p for p, m in zip(paths, modules, strict=True) if m == "Dense"]
    for folder, spec in zip(folders, dense, strict=True):
        spec = dict(spec)
        weights, file = spec.pop("weights", None), spec.pop("file", "model.safetensors")
        (folder / "config.json").write_text(json.dumps(spec))
        if weights is not None and file.endswith(".safetensors"):
            save_file(weights, str(folder / file))
        elif weights is not None:
            torch.save(weights, folder / file)
    return str(target)


def test_checkpoint_pooling_config(tiny_checkpoint, tmp_path) -> None:
    """A checkpoint's sentence-transformers ``modules.json`` sets the default pooling as vLLM
    reads it (its Pooling mode; normalised only with a Normalize module), ``--pooler-config``
    wins key by key, and a mode omniserve does not run is refused at start-up unless the type
    is given."""
    from omniserve.engine.arg_utils import EngineArgs

    base = tiny_checkpoint("Qwen2ForCausalLM")
    mean = _with_sentence_transformers(base, tmp_path / "mean", ["Transformer", "Pooling"],
                                       {"pooling_mode_mean_tokens": True})  # fmt: skip
    ids = make_prompts(str(base), [21])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    states = _hidden_states(hf, input_ids=torch.tensor([ids]))
    llm = LLM(mean, dtype="float32", max_model_len=64)
    assert llm.llm_engine.config.model_config.pooler_config == PoolerConfig("MEAN", False)
    got = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), states.mean(0), atol=ATOL, rtol=0)
    llm.llm_engine.shutdown()

    cls_unit = _with_sentence_transformers(
        base, tmp_path / "cls", ["Transformer", "Pooling", "Normalize"],
        {"pooling_mode_cls_token": True},
    )  # fmt: skip
    maxed = _with_sentence_transformers(base, tmp_path / "max", ["Transformer", "Pooling"],
                                        {"pooling_mode_max_tokens": True})  # fmt: skip
    for model, given, want in (
        (cls_unit, None, PoolerConfig("CLS", True)),
        (cls_unit, {"normalize": False}, PoolerConfig("CLS", False)),
        (mean, {"pooling_type": "LAST"}, PoolerConfig("LAST", False)),
        (maxed, {"pooling_type": "MEAN"}, PoolerConfig("MEAN", False)),
        (str(base), None, PoolerConfig("LAST", True)),
    ):
        config = EngineArgs(model, pooler_config=given).create_config().model_config
        assert config.pooler_config == want, (model, given)
    with pytest.raises(ValueError, match=r"1_Pooling/config.json pools by pooling_mode_max_tok"):
        EngineArgs(maxed).create_config()


def test_checkpoint_dense_modules(tiny_checkpoint, tmp_path) -> None:
    """A sentence-transformers pipeline's Dense modules (Qwen2-based embedders such as
    stella's project the pooled state) run after the pooling and before the normalisation,
    as sentence-transformers runs them: weights from safetensors or torch files, their
    activations, the embedding their width; ``dimensions`` bounded by it. Pipelines omniserve
    would compute otherwise are refused at start-up, naming the file."""
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.worker.pooler import load_projector

    base = tiny_checkpoint("Qwen2ForCausalLM")
    gen = torch.Generator().manual_seed(0)
    first = {"linear.weight": torch.randn(32, 64, generator=gen) / 8,
             "linear.bias": torch.randn(32, generator=gen)}  # fmt: skip
    second = {"linear.weight": torch.randn(24, 32, generator=gen) / 4}
    dense = [
        {"in_features": 64, "out_features": 32, "bias": True,
         "activation_function": "torch.nn.modules.activation.Tanh", "weights": first},
        {"in_features": 32, "out_features": 24, "bias": False,
         "activation_function": "torch.nn.modules.linear.Identity", "weights": second,
         "file": "pytorch_model.bin"},
    ]  # fmt: skip
    pipeline = ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    model = _with_sentence_transformers(base, tmp_path / "dense", pipeline,
                                        {"pooling_mode_mean_tokens": True}, dense)  # fmt: skip
    ids = make_prompts(str(base), [21])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    pooled = _hidden_states(hf, input_ids=torch.tensor([ids])).mean(0)
    hidden = torch.tanh(F.linear(pooled, first["linear.weight"], first["linear.bias"]))
    projected = F.linear(hidden, second["linear.weight"])
    llm = LLM(model, dtype="float32", max_model_len=64)
    config = llm.llm_engine.config.model_config.pooler_config
    assert [(d.in_features, d.out_features, d.activation) for d in config.dense] == [
        (64, 32, "Tanh"),
        (32, 24, "Identity"),
    ]
    unit, raw = (
        torch.tensor(llm.embed({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                     .outputs.embedding)
        for params in (None, PoolingParams(normalize=False))
    )  # fmt: skip
    torch.testing.assert_close(raw, projected, atol=ATOL, rtol=0)
    torch.testing.assert_close(unit, F.normalize(projected, dim=0), atol=ATOL, rtol=0)
    # token_embed projects every position's state the same way (vLLM's token head).
    states = _hidden_states(hf, input_ids=torch.tensor([ids]))
    rows = F.linear(torch.tanh(F.linear(states, first["linear.weight"], first["linear.bias"])),
                    second["linear.weight"])  # fmt: skip
    token_rows = llm.encode({"prompt_token_ids": ids}, pooling_task="token_embed",
                            use_tqdm=False)[0].outputs.data  # fmt: skip
    torch.testing.assert_close(token_rows, F.normalize(rows, dim=1), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"dimensions: 48 is not one of .*\(1 to 24\)"):
        # As if Matryoshka-trained: the bound is the projection's width, not the hidden size.
        llm.llm_engine.processor.model_config.hf_config.get_text_config().is_matryoshka = True
        llm.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=48), use_tqdm=False)
    llm.llm_engine.shutdown()

    def refused(name: str, modules: list[str], specs: list[dict[str, Any]], match: str) -> None:
        path = _with_sentence_transformers(base, tmp_path / name, modules,
                                           {"pooling_mode_mean_tokens": True}, specs)  # fmt: skip
        with pytest.raises(ValueError, match=match):
            EngineArgs(path).create_config()

    spec = {"in_features": 64, "out_features": 32, "bias": True,
            "activation_function": "torch.nn.modules.linear.Identity"}  # fmt: skip
    refused("order", ["Transformer", "Pooling", "Normalize", "Dense"], [spec],
            "runs its modules in the order .*Normalize -> .*Dense")  # fmt: skip
    refused(
        "unknown",
        ["Transformer", "Pooling", "LayerNorm"],
        [],
        r"modules omniserve does not run \(sentence_transformers.models.LayerNorm\)",
    )
    odd = {**spec, "activation_function": "my_package.Swish"}
    refused(
        "activation",
        ["Transformer", "Pooling", "Dense"],
        [odd],
        "activation_function 'my_package.Swish' is not one omniserve runs",
    )
    refused(
        "chain",
        ["Transformer", "Pooling", "Dense", "Dense"],
        [spec, spec],
        "takes 64 features but the Dense module before it gives 32",
    )
    wide = {**spec, "in_features": 128}
    config = EngineArgs(_with_sentence_transformers(
        base, tmp_path / "wide", ["Transformer", "Pooling", "Dense"],
        {"pooling_mode_mean_tokens": True}, [wide],
    )).create_config().model_config.pooler_config  # fmt: skip
    with pytest.raises(
        ValueError, match="takes 128 features but the model's hidden states have 64"
    ):
        load_projector(config.dense, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="holds no model.safetensors or pytorch_model.bin"):
        load_projector(config.dense, 128, torch.device("cpu"))
    torch.save(
        {"linear.weight": torch.zeros(32, 64)}, Path(config.dense[0].path) / "pytorch_model.bin"
    )
    with pytest.raises(ValueError, match=r"the weights hold .* its config asks"):
        load_projector(config.dense, 128, torch.device("cpu"))


def test_image_prompt_embeddings_match_transformers(tiny_checkpoint) -> None:
    """Media merged into the prompt as for generation (a 16-token budget cuts the image's
    placeholders across steps): two images give two vectors, each transformers', by LAST and
    by MEAN pooling (which averages the image's positions too)."""
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [_image(1, 112, 140), _image(2, 56, 84)]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)
    prompts = [{"prompt": text, "multi_modal_data": {"image": [im]}} for im in images]
    got = llm.embed(prompts, use_tqdm=False)
    means = llm.embed(prompts, PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    for image, output, mean in zip(images, got, means, strict=True):
        inputs = _hf_inputs(processor, text, {"image": [image]})
        states = _hidden_states(hf, **inputs)
        vector = torch.tensor(output.outputs.embedding)
        torch.testing.assert_close(vector, F.normalize(states[-1], dim=0), atol=ATOL, rtol=0)
        expected_mean = F.normalize(states.mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(mean.outputs.embedding), expected_mean,
                                   atol=ATOL, rtol=0)  # fmt: skip
        vectors.append(vector)
    assert not torch.allclose(vectors[0], vectors[1], atol=1e-3)  # the image is in the vector


def test_the_api(default_server) -> None:
    """OpenAI's form (the SDK unmodified) and vLLM's chat form, equal to ``LLM.embed`` on the
    same checkpoint; base64 carries the same floats; refusals are 400s naming the field."""
    image_url = "data:image/png;base64," + base64.b64encode(_png(_image(3, 64, 48))).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": "A shape."}]}]  # fmt: skip
    client = default_server.client()
    texts = ["a red square", "a beep"]
    reply = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in reply.data] == [0, 1] and reply.model == MODEL
    packed = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    ids = default_server.post("/tokenize", {"model": MODEL, "prompt": texts[0]}).json()["tokens"]
    by_ids = default_server.post("/v1/embeddings", {"model": MODEL, "input": ids}).json()
    chat = default_server.post("/v1/embeddings", {"model": MODEL, "messages": messages})
    assert chat.status_code == 200, chat.text
    unnormalized = {"model": MODEL, "input": texts[0], "normalize": False}
    raw = default_server.post("/v1/embeddings", unnormalized).json()

    offline = LLM(default_model(), dtype="float32", max_model_len=1024)
    expected = offline.embed(texts, use_tqdm=False)
    rendered = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                            add_generation_prompt=False)[0]  # fmt: skip
    offline.llm_engine.shutdown()
    for data, want in zip(reply.data, expected, strict=True):
        np.testing.assert_allclose(data.embedding, want.outputs.embedding, atol=1e-5)
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
    for data, plain in zip(packed.data, reply.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(data.embedding), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.float32(plain.embedding))
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], reply.data[0].embedding, atol=1e-6)
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens
    assert chat.json()["usage"]["prompt_tokens"] == len(rendered.prompt_token_ids)
    assert np.linalg.norm(raw["data"][0]["embedding"]) > 1.5  # a hidden state, not unit

    for body, field, words in (
        ({"input": "x", "dimensions": 8}, "dimensions", "does not support Matryoshka"),
        ({"input": []}, "input", "must not be an empty list"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", ""),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1"),
        ({"input": "x" * 10**6}, "input", "maximum context length"),
        ({"input": [[1, 2], [3, 10**9]]}, "input", "outside the vocabulary"),
        ({"messages": [{"role": "user", "content": [BROKEN_IMAGE]}]}, "messages[0].content[0]",
         "image"),
    ):  # fmt: skip
        error = assert_error(default_server.post("/v1/embeddings", {"model": MODEL, **body}), 400)
        assert error["param"] == field and words in error["message"], error
    missing = default_server.post("/v1/embeddings", {"model": "nope", "input": "x"})
    assert assert_error(missing, 404)["param"] == "model"


def test_pooling_runner_serves_embeddings_only(tiny_checkpoint, tmp_path) -> None:
    """vLLM's ``--runner pooling`` (or ``--convert embed``) and ``--pooler-config``: generation
    is refused, embeddings answer with the configured default normalisation."""
    from omniserve.engine.arg_utils import EngineArgs
    from tests.server_utils import launch_server

    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    llm = LLM(model_dir, dtype="float32", max_model_len=64, convert="embed",
              pooler_config='{"normalize": false}')  # fmt: skip
    raw = llm.embed("Hello", use_tqdm=False)[0].outputs.embedding
    assert np.linalg.norm(raw) > 1.5
    with pytest.raises(ValueError, match=r"embedding model \(--runner pooling\)"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.llm_engine.shutdown()
    for kwargs, words in (
        ({"runner": "score"}, "--runner must be auto, generate or pooling"),
        ({"runner": "generate", "convert": "embed"}, "use --runner pooling"),
        ({"pooler_config": {"pooling_type": "max"}}, "pooling_type 'MAX' is not supported"),
        ({"pooler_config": {"normalise": True}}, "unknown key 'normalise'"),
    ):
        with pytest.raises(ValueError, match=words):
            EngineArgs(model_dir, **kwargs).create_config()

    flags = ("--dtype", "float32", "--max-model-len", "64", "--runner", "pooling",
             "--pooler-config", '{"normalize": false}')  # fmt: skip
    with launch_server(model_dir, tmp_path, *flags) as server:
        body = server.post("/v1/embeddings", {"model": MODEL, "input": "Hello"}).json()
        np.testing.assert_allclose(body["data"][0]["embedding"], raw, atol=1e-5)
        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        refused = server.post("/v1/chat/completions", chat)
        assert "--runner pooling" in assert_error(refused, 400)["message"]


def test_async_encode(tiny_checkpoint) -> None:
    """vLLM's ``AsyncLLM.encode``: one finished output with ``LLM.embed``'s vector (its engine
    core in a process of its own)."""
    import asyncio

    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.engine.async_llm import AsyncLLM

    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    ids = make_prompts(model_dir, [21])[0]

    async def run() -> tuple[list, list]:
        args = EngineArgs(model_dir, dtype="float32", max_model_len=64, kv_cache_memory="16MiB")
        engine = AsyncLLM.from_engine_args(args)
        try:
            prompt = {"prompt_token_ids": ids}
            unit = [o async for o in engine.encode(prompt, None, "unit")]
            raw = [o async for o in engine.encode(prompt, PoolingParams(normalize=False), "raw")]
        finally:
            engine.shutdown()
        return unit, raw

    unit, raw = asyncio.run(run())
    assert [(o.request_id, o.finished) for o in unit + raw] == [("unit", True), ("raw", True)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = _hidden_states(hf, input_ids=torch.tensor([ids]))[-1]
    got_raw = torch.tensor(raw[0].outputs.embedding)
    torch.testing.assert_close(got_raw, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(unit[0].outputs.embedding),
                               F.normalize(expected, dim=0), atol=ATOL, rtol=0)  # fmt: skip
