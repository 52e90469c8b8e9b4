"""omniserve vs transformers on the same tiny checkpoints: greedy tokens identical, logprobs close.

Each architecture runs the same batch of prompts of different lengths under several engine
shapes: plain, chunked prefill (small token budget), prefix-cache hits, and preemption forced by
a tiny KV cache.
"""

from __future__ import annotations

import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.cpu.linear import WidenedLinear
from tests.hf_reference import assert_matches_reference, hf_greedy, make_prompts

ARCHITECTURES = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
PROMPT_LENGTHS = [3, 9, 17, 31, 40, 64, 100, 150]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def case(request, tiny_checkpoint):
    model_dir = str(tiny_checkpoint(request.param))
    prompts = make_prompts(model_dir, PROMPT_LENGTHS)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def _generate(model_dir: str, prompts: list[list[int]], **engine_kwargs) -> tuple[LLM, list]:
    llm = LLM(model_dir, dtype="float32", **engine_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, outputs


@pytest.mark.slow
def test_matches_hf(case):
    model_dir, prompts, reference = case
    _, outputs = _generate(model_dir, prompts)
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_matches_hf_with_chunked_prefill(case):
    model_dir, prompts, reference = case
    llm, outputs = _generate(model_dir, prompts, max_num_batched_tokens=32, max_num_seqs=4)
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_matches_hf_with_prefix_cache_hits(case):
    """Each prompt's head ran before (as a beam search step or an earlier chat turn does): its
    full blocks are shared and its partial last block copied, none recomputed, and the answer
    is unchanged."""
    model_dir, prompts, reference = case
    llm = LLM(model_dir, dtype="float32")
    heads = [{"prompt_token_ids": p[:-2]} for p in prompts]
    llm.generate(heads, SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 2 for p in prompts]
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_matches_hf_under_preemption(case):
    model_dir, prompts, reference = case
    # 16 blocks of 16 tokens hold one 256-token sequence but not the whole batch at once.
    llm, outputs = _generate(
        model_dir,
        prompts,
        max_model_len=256,
        num_gpu_blocks_override=16,
        enable_prefix_caching=False,
    )
    assert llm.llm_engine.engine_core.call_utility("get_stats")["num_preemptions"] > 0
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_batch_invariance(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    prompts = make_prompts(model_dir, [5 + 7 * i for i in range(16)], seed=1)
    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate({"prompt_token_ids": prompts[i]}, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bf16_checkpoint_in_fp32_matches_hf(architecture, bf16_checkpoint):
    """A bf16 checkpoint computed in fp32 (what dtype "auto" does on a CPU without native bf16):
    the linear layers keep their bf16 weights, widened in the CPU kernel's registers, and the
    answers are transformers' fp32 ones on the same checkpoint (which widens at load), through
    chunked prefill's and decode's row counts, in half the linear weights' memory."""
    model_dir = bf16_checkpoint(architecture)
    prompts = make_prompts(model_dir, PROMPT_LENGTHS)
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS, dtype=torch.float32)
    llm, outputs = _generate(model_dir, prompts, max_num_batched_tokens=48, max_num_seqs=4)
    assert_matches_reference(outputs, reference)
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    if not WidenedLinear.available():
        pytest.skip("the bf16-weight kernel needs AVX-512: the weights were widened at load")
    linears = {kind: n for kind, n in info["layer_kernels"].items() if kind.startswith("linear")}
    assert info["dtype"] == "float32" and set(linears) <= {
        "linear: C bf16 weights, fp32 activations",
        "linear: C plain-layout bf16 weights, fp32 activations (shared weight)",  # a tied head
    }, linears
