"""``skip_tokenizer_init`` (vLLM's ``--skip-tokenizer-init``): no tokenizer is loaded; prompts
are token ids, outputs token ids (the same as with the tokenizer, greedy fp32 on the tiny
Qwen2) with empty text, and whatever needs text is refused naming it, offline and on the server
(a 400), while the engine serves on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omniserve import LLM, SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error, launch_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("Qwen2ForCausalLM"))


@pytest.fixture(scope="module")
def reference(qwen2: str) -> list[list[int]]:
    llm = LLM(qwen2, dtype="float32", max_model_len=128)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts(qwen2, [5, 9])],
                               GREEDY, use_tqdm=False)  # fmt: skip
        eos = llm.llm_engine.processor.eos_token_ids
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs] + [eos]


def test_token_ids_in_token_ids_out(qwen2: str, reference: list[list[int]], tmp_path: Any) -> None:
    """On a checkpoint without tokenizer files."""
    for item in Path(qwen2).iterdir():
        if item.suffix == ".safetensors" or item.name in ("config.json", "generation_config.json"):
            (tmp_path / item.name).symlink_to(item)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    try:
        assert llm.llm_engine.processor.eos_token_ids == reference[-1]  # from the config files
        prompts = [{"prompt_token_ids": p} for p in make_prompts(qwen2, [5, 9])]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for output, want in zip(outputs, reference, strict=False):
            sample = output.outputs[0]
            assert list(sample.token_ids) == want and sample.text == ""
            assert sample.logprobs is not None
            assert all(
                entry.decoded_token is None for lp in sample.logprobs for entry in lp.values()
            )
        for params, message in (
            (SamplingParams(stop=["x"]), "stop needs the tokenizer"),
            (SamplingParams(bad_words=["x"]), "bad_words needs the tokenizer"),
            (SamplingParams(structured_outputs={"regex": "a"}), "structured_outputs needs"),
        ):
            with pytest.raises(ValueError, match=message):
                llm.generate(prompts[0], params, use_tqdm=False)
        with pytest.raises(ValueError, match="A text prompt needs the tokenizer"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"get_tokenizer\(\) needs the tokenizer"):
            llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
        # Still serving after the refusals.
        again = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0].outputs[0]
        assert list(again.token_ids) == reference[1]
    finally:
        llm.shutdown()


def test_what_needs_text_is_refused_at_start(qwen2: str, tiny_checkpoint: Any) -> None:
    with pytest.raises(ValueError, match="--reasoning-parser reads the model's text"):
        EngineArgs(qwen2, skip_tokenizer_init=True, reasoning_parser="qwen3").create_config()


def test_media_need_the_tokenizer(tiny_checkpoint: Any) -> None:
    from PIL import Image

    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True)
    try:
        image = Image.new("RGB", (56, 56))
        prompt = {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image}}
        with pytest.raises(ValueError, match=r"multi_modal_data \(the model's processor\) needs"):
            llm.generate(prompt, GREEDY, use_tqdm=False)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


def test_server_without_a_tokenizer(qwen2: str, reference: list[list[int]], tmp_path: Any) -> None:
    prompt = make_prompts(qwen2, [5])[0]
    with launch_server(
        Path(qwen2), tmp_path, "--dtype", "float32", "--skip-tokenizer-init"
    ) as server:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
                "logprobs": 1, "return_token_ids": True}  # fmt: skip
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == reference[0] and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in reference[0]]
        for route, request, param in (
            ("/v1/completions", {"model": MODEL, "prompt": "Hello"}, "prompt"),
            ("/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True}, "echo"),
            ("/v1/completions", {"model": MODEL, "prompt": prompt, "stop": ["a"]}, "stop"),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                  "content": "Hi"}]}, "messages"),
            ("/detokenize", {"model": MODEL, "tokens": [1, 2]}, "tokens"),
            ("/tokenize", {"model": MODEL, "prompt": "Hello"}, "prompt"),
        ):  # fmt: skip
            error = assert_error(server.post(route, request), 400)
            assert "needs the tokenizer" in error["message"], (route, error)
            assert error["param"] == param, (route, error)
        assert (
            server.post("/v1/completions", body).json()["choices"][0]["token_ids"] == reference[0]
        )
