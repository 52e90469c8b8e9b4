"""The Ray backend on a local Ray instance started on demand: TP=2 Ray actors give the greedy
tokens of TP=1 and of transformers, and the engine leaves no actor or placement group behind."""

from __future__ import annotations

import pytest

from omniserve import LLM
from tests.hf_reference import assert_matches_reference, hf_greedy, make_prompts
from tests.test_tensor_parallel import GREEDY, MAX_TOKENS, _tokens

pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_tp2_matches_tp1_and_hf(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local instance, not someone's cluster
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM", overrides={"num_key_value_heads": 1}))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [5, 23, 40])]
    reference = hf_greedy(model_dir, [p["prompt_token_ids"] for p in prompts], MAX_TOKENS)
    llm = LLM(model_dir, dtype="float32")
    tp1 = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    llm = LLM(
        model_dir, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        tp2 = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert _tokens(tp2) == _tokens(tp1)
    assert_matches_reference(tp2, reference)
