"""Prompts given as embeddings (vLLM's ``prompt_embeds``, ``--enable-prompt-embeds``): the
decoder reads the given rows in place of token embeddings, offline and over the completions API;
the prefix cache keys their blocks by the embeddings, not by their placeholder ids."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from omniserve import LLM, SamplingParams
from omniserve.inputs.data import EMBEDS_SLOT
from tests.hf_reference import ReferenceOutput, assert_matches_reference, make_prompts
from tests.server_utils import assert_error, launch_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
LENGTHS = [5, 23, 40]


def _soft_prompts(model_dir: str) -> tuple[list[list[int]], list[torch.Tensor], Any]:
    """Token prompts, and embeddings that are no token's: theirs, scaled and shifted (what a
    soft prompt or another model's projection hands the decoder)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(model_dir, LENGTHS, seed=5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embeds = [
            model.get_input_embeddings()(torch.tensor(ids)) * 1.5
            + 0.02 * torch.randn(len(ids), model.config.hidden_size, generator=gen)
            for ids in prompts
        ]
    return prompts, embeds, model


def _hf_greedy_embeds(
    model: Any, embeds: list[torch.Tensor], **kwargs: Any
) -> list[ReferenceOutput]:
    results = []
    with torch.no_grad():
        for rows in embeds:
            out = model.generate(inputs_embeds=rows[None], max_new_tokens=GREEDY.max_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs)  # fmt: skip
            logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
            results.append(ReferenceOutput(out.sequences[0].tolist(), logprobs))
    return results


@pytest.fixture(scope="module")
def text_model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("Qwen2ForCausalLM"))


@pytest.fixture(scope="module")
def soft(text_model) -> tuple[list[list[int]], list[torch.Tensor], list[ReferenceOutput]]:
    """Token prompts, their soft embeddings, and transformers' greedy run of the embeddings."""
    prompts, embeds, model = _soft_prompts(text_model)
    return prompts, embeds, _hf_greedy_embeds(model, embeds)


@pytest.mark.slow
def test_repetition_penalty_counts_the_generated_tokens(text_model) -> None:
    """Positions given as embeddings hold no token: a repetition penalty counts the output (and
    a prompt's own tokens), as transformers' does after ``generate(inputs_embeds=...)``; the
    checkpoint's generation_config may set one (Qwen2.5's 1.05), so it is not refused."""
    _, embeds, model = _soft_prompts(text_model)
    reference = _hf_greedy_embeds(model, embeds, repetition_penalty=1.5)
    llm = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_model_len=256)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, repetition_penalty=1.5)
    outputs = llm.generate([{"prompt_embeds": e} for e in embeds], penalized, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [r.token_ids for r in reference]
    plain = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [r.token_ids for r in reference]


@pytest.mark.slow
def test_matches_transformers_batched_with_token_prompts_and_chunked(text_model, soft) -> None:
    """Embedding prompts beside token prompts in one batch, the longest prefilled in chunks of
    16: transformers' greedy tokens on the same embeddings (``generate(inputs_embeds=...)``)."""
    prompts, embeds, reference = soft
    llm = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip
    mixed: list[Any] = [{"prompt_embeds": e} for e in embeds]
    mixed += [{"prompt_token_ids": ids} for ids in prompts]
    outputs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs[: len(embeds)], reference)
    for out, rows in zip(outputs, embeds, strict=False):
        assert out.prompt_token_ids is None and out.prompt is None
        assert out.num_prompt_tokens == out.num_prompt_embeds == rows.shape[0]
        assert out.outputs[0].text  # detokenized without any prompt context
    # The token prompts in the same steps are unaffected: their own embeddings, as alone.
    alone = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY, use_tqdm=False)
    for ours, theirs in zip(outputs[len(embeds) :], alone, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


@pytest.mark.slow
def test_matches_transformers_preempted_under_async_scheduling(text_model, soft) -> None:
    """Four blocks of 16 do not hold the prompts' growth (5, 23, 40 rows and 24 tokens each):
    requests are preempted and resumed (the workers get their rows again), with async
    scheduling's steps in flight."""
    _, embeds, reference = soft
    llm = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_model_len=64,
              num_gpu_blocks_override=4, enable_prefix_caching=False,
              async_scheduling=True)  # fmt: skip
    outputs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert llm.llm_engine.engine_core.call_utility("get_stats")["num_preemptions"] > 0
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_prefix_cache_keys_blocks_by_the_embeddings(text_model) -> None:
    """Placeholder ids are equal for every prompt of a length: two different embeddings must
    never share blocks, the same embeddings must (bf16 rows sent, fp32 model: cast once)."""
    llm = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_model_len=256)
    gen = torch.Generator().manual_seed(1)
    first, second = (torch.randn(40, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    a = llm.generate({"prompt_embeds": first}, params, use_tqdm=False)[0]
    b = llm.generate({"prompt_embeds": second}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": first.clone()}, params, use_tqdm=False)[0]
    salted = llm.generate({"prompt_embeds": first, "cache_salt": "s"}, params, use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0 and salted.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32  # two full blocks of 16 (and maybe the freed tail)
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert b.outputs[0].token_ids != a.outputs[0].token_ids


@pytest.mark.slow
def test_omni_thinker_takes_embeddings_beside_and_between_media(tiny_checkpoint) -> None:
    """Qwen3-Omni's thinker (M-RoPE, DeepStack on its media rows): the embeddings of tokens
    give those tokens' answer as a whole prompt beside an image prompt, as a run inside a token
    prompt, and as a chat's ``prompt_embeds`` part between two images (the second image's
    placeholders move by the run's rows)."""
    from PIL import Image
    from safetensors.torch import load_file

    model_dir = str(tiny_checkpoint("Qwen3OmniMoeThinkerForConditionalGeneration"))
    table = load_file(f"{model_dir}/model.safetensors")["model.embed_tokens.weight"]
    llm = LLM(model_dir, dtype="float32", enable_prompt_embeds=True, max_model_len=512)
    ids = list(range(100, 137))
    image = Image.new("RGB", (56, 84), "red")
    media = {
        "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?"
        "<|im_end|>\n<|im_start|>assistant\n",
        "multi_modal_data": {"image": image},
    }
    head, tail = [5, 6, 7], [8, 9]
    by_ids, by_embeds, with_media, by_run = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt_embeds": table[ids]}, media,
         {"prompt_token_ids": [*head, EMBEDS_SLOT, *tail], "prompt_embeds": [table[ids]]}],
        GREEDY, use_tqdm=False,
    )  # fmt: skip
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    alone = llm.generate([media, {"prompt_token_ids": [*head, *ids, *tail]}], GREEDY,
                         use_tqdm=False)  # fmt: skip
    assert with_media.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert by_run.outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert by_run.prompt_token_ids == [*head, *[0] * len(ids), *tail]  # placeholders shown
    words = llm.get_tokenizer()("Hello world, how", add_special_tokens=False).input_ids
    picture = {"type": "image_pil", "image_pil": image}
    said = [picture, {"type": "text", "text": "Hello world, how"}, picture, "are you?"]
    given = [picture, {"type": "prompt_embeds", "data": table[words]}, picture, "are you?"]
    text, embedded = (llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
                      for parts in (said, given))  # fmt: skip
    assert embedded.outputs[0].token_ids == text.outputs[0].token_ids
    assert embedded.num_mm_tokens == text.num_mm_tokens and embedded.num_mm_tokens["image"] > 0


def test_refusals(text_model) -> None:
    rows = torch.randn(6, 64)
    plain = LLM(text_model, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        plain.generate({"prompt_embeds": rows}, use_tqdm=False)
    llm = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_model_len=128)
    bad = {
        "floating-point \\[num_tokens, 64\\].*got \\(6, 32\\) float32": torch.randn(6, 32),
        "got \\(6,\\) float32": torch.randn(6),
        "got \\(6, 64\\) int64": torch.ones(6, 64, dtype=torch.long),
        "got \\(0, 64\\)": torch.randn(0, 64),
        "got list": [[0.0] * 64],
        "NaN or infinite": torch.full((6, 64), float("nan")),
    }
    for match, value in bad.items():
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_embeds": value}, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no prompt"):
        llm.generate({"prompt_embeds": rows, "prompt": "Hello"}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a list of tensors"):
        llm.generate({"prompt_embeds": rows, "prompt_token_ids": [1, 2]}, use_tqdm=False)
    with pytest.raises(ValueError, match="hold 1 places \\(-1\\) for prompt_embeds, but 2"):
        llm.generate({"prompt_embeds": [rows, rows], "prompt_token_ids": [1, -1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_embeds\\[1\\] must be a floating-point"):
        llm.generate({"prompt_embeds": [rows, rows[:, :3]], "prompt_token_ids": [-1, 1, -1]},
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="outside the vocabulary"):  # a place with no tensor
        llm.generate({"prompt_token_ids": [1, -1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs reads the prompt's token ids"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_embeds": torch.randn(128, 64)}, use_tqdm=False)
    from omniserve.entrypoints.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="Beam search extends token ids"):
        llm.beam_search([{"prompt_embeds": rows}], BeamSearchParams(beam_width=2, max_tokens=2))
    # The engine serves on after every refusal, a batch of one [1, n, hidden] included.
    out = llm.generate({"prompt_embeds": rows[None]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].num_prompt_tokens == 6


NOT_SAVED = "not base64 of a torch.save()d tensor"


def _b64(tensor: Any) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.slow
def test_the_api(text_model, soft, tmp_path, default_server) -> None:
    """vLLM's completions field: base64 ``torch.save`` tensors, before ``prompt``'s prompts in
    the choices, counted in usage; its chat part ``{"type": "prompt_embeds", "data": ...}``;
    refusals are 400s naming the field."""
    from safetensors.torch import load_file

    _, embeds, _ = soft
    table = load_file(f"{text_model}/model.safetensors")["model.embed_tokens.weight"]
    offline = LLM(text_model, dtype="float32", enable_prompt_embeds=True, max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    expected = offline.generate([{"prompt_embeds": e} for e in embeds[:2]] + ["Hello there"],
                                greedy, use_tqdm=False)  # fmt: skip
    last_ten = offline.generate({"prompt_embeds": embeds[1][-10:]}, greedy, use_tqdm=False)[0]
    offline.llm_engine.shutdown()
    with launch_server(text_model, tmp_path, "--dtype", "float32", "--max-model-len", "256",
                       "--enable-prompt-embeds") as server:  # fmt: skip
        client = server.client()
        reply = client.completions.create(
            model="tiny", prompt="Hello there", max_tokens=6, temperature=0.0,
            extra_body={"prompt_embeds": [_b64(e) for e in embeds[:2]]},
        )  # fmt: skip
        assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [
            e.outputs[0].text for e in expected
        ]
        assert reply.usage.prompt_tokens == sum(e.num_prompt_tokens for e in expected)
        # truncate_prompt_tokens keeps the last rows, as it keeps a prompt's last tokens.
        cut = client.completions.create(
            model="tiny", prompt=None, max_tokens=6, temperature=0.0, n=2,
            extra_body={"prompt_embeds": _b64(embeds[1]), "truncate_prompt_tokens": 10},
        )  # fmt: skip
        assert cut.usage.prompt_tokens == 10
        assert [c.text for c in cut.choices] == [last_ten.outputs[0].text] * 2
        # Alone (no prompt), streamed, in bf16.
        stream = client.completions.create(
            model="tiny", prompt=None, max_tokens=6, temperature=0.0, stream=True,
            extra_body={"prompt_embeds": _b64(embeds[0].to(torch.bfloat16))},
        )  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        body = {"model": "tiny", "max_tokens": 2}
        for extra, field, words in (
            ({"prompt_embeds": "not base64!"}, "prompt_embeds", NOT_SAVED),
            ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds", NOT_SAVED),
            ({"prompt_embeds": _b64({"rows": embeds[0]})}, "prompt_embeds",
             "holds dict, not one dense tensor"),
            ({"prompt_embeds": _b64(torch.randn(3, 7))}, None, "[num_tokens, 64]"),
            ({"prompt_embeds": [_b64(embeds[0]), _b64(torch.tensor([1.0]))]}, None,
             "[num_tokens, 64]"),
            ({"prompt_embeds": _b64(embeds[0]), "echo": True}, "echo", "echo"),
            ({}, None, "prompt, prompt_embeds"),
        ):  # fmt: skip
            error = assert_error(server.post("/v1/completions", {**body, **extra}), 400)
            assert words in error["message"] and (field is None or error["param"] == field)
        assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices
        # The chat part: the embeddings of the words answer as the words do.
        tokenized = {"model": "tiny", "prompt": "Hi you", "add_special_tokens": False}
        words = server.post("/tokenize", tokenized).json()
        said = [{"type": "text", "text": "Hi you"}, {"type": "text", "text": "Go on."}]
        given = [{"type": "prompt_embeds", "data": _b64(table[words["tokens"]])}, said[1]]
        text, embedded = (client.chat.completions.create(
            model="tiny", max_tokens=6, temperature=0.0,
            messages=[{"role": "user", "content": parts}]) for parts in (said, given))  # fmt: skip
        assert embedded.choices[0].message.content == text.choices[0].message.content
        assert embedded.usage.prompt_tokens == text.usage.prompt_tokens
        chat = {"model": "tiny", "max_tokens": 2}
        for part, words_in in (({"type": "prompt_embeds"}, "has no data"),
                               ({"type": "prompt_embeds", "data": "%%"}, "not base64"),
                               ({"type": "prompt_embeds", "data": _b64(table[:3, :5])},
                                "prompt_embeds[0] must be a floating-point")):  # fmt: skip
            messages = [{"role": "user", "content": [part]}]
            error = assert_error(
                server.post("/v1/chat/completions", {**chat, "messages": messages}), 400
            )
            assert words_in in error["message"], error
    refused = default_server.post("/v1/completions", {**body, "prompt_embeds": _b64(embeds[0])})
    error = assert_error(refused, 400)
    assert error["param"] == "prompt_embeds" and "--enable-prompt-embeds" in error["message"]
    part = {"type": "prompt_embeds", "data": _b64(torch.zeros(2, 8))}
    refused = default_server.post(
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]},
    )
    assert "--enable-prompt-embeds" in assert_error(refused, 400)["message"]
