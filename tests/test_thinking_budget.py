"""``thinking_token_budget`` (vLLM's): at most that many tokens inside ``<think>…</think>``,
then the end tag is the only token a request may sample. On the tiny Qwen3 checkpoint with the
two tags added to its tokenizer (as Qwen3's has them), greedy fp32: the budgeted answer is the
free answer up to the budget, then the tag, then the model's own continuation of that; a span
the prompt already closed is left alone; drafts (speculative decoding) change nothing; a
tokenizer without the tags, a negative budget or a grammar beside it (but under
``--reasoning-parser``, ``test_structured_reasoning``) is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from omniserve import LLM, SamplingParams
from omniserve.spec_decode.ngram_proposer import NgramProposer
from tests.hf_reference import make_prompts

MAX_TOKENS = 8


def _greedy(budget: int | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          thinking_token_budget=budget)  # fmt: skip


def _answer(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_budget_closes_the_thinking_the_prompt_opens(thinking_model) -> None:
    llm = LLM(thinking_model, dtype="float32", max_model_len=128)
    start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    prompt = make_prompts(thinking_model, [12])[0] + [start]  # a thinking template's prompt
    free = _answer(llm, prompt, _greedy())
    assert end not in free  # the random model never closes on its own
    for budget in (0, 3, MAX_TOKENS):
        got = _answer(llm, prompt, _greedy(budget))
        assert got[:budget] == free[:budget]
        if budget < MAX_TOKENS:
            assert got[budget] == end
            rest = _answer(llm, prompt + got[: budget + 1], _greedy(None, MAX_TOKENS - budget - 1))
            assert got[budget + 1 :] == rest, budget  # then the model's own continuation
        else:
            assert got == free  # the budget was never spent
    # A span the prompt closed already, or never opened, is not bounded.
    assert _answer(llm, prompt + [end], _greedy(0)) == _answer(llm, prompt + [end], _greedy())
    assert _answer(llm, prompt[:-1], _greedy(0)) == _answer(llm, prompt[:-1], _greedy())


def test_budget_with_drafts_matches_plain(thinking_model, monkeypatch) -> None:
    """Drafts that run past the budget are cut where the end tag is due (the rows after it are
    sampled as if the drafts were kept)."""
    llm = LLM(thinking_model, dtype="float32", max_model_len=128)
    start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    prompt = make_prompts(thinking_model, [12])[0] + [start]
    free = _answer(llm, prompt, _greedy())
    want = _answer(llm, prompt, _greedy(2))
    llm.llm_engine.shutdown()

    def propose(self, token_ids: np.ndarray) -> list[int]:
        done = len(token_ids) - len(prompt)
        return free[done : done + 3]  # the unbudgeted answer: wrong from the budget on

    monkeypatch.setattr(NgramProposer, "propose", propose)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    drafted = LLM(thinking_model, dtype="float32", max_model_len=128, speculative_config=spec)
    assert _answer(drafted, prompt, _greedy(2)) == want and want[2] == end
    stats = drafted.llm_engine.engine_core.call_utility("get_stats")
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_refusals(tiny_checkpoint, thinking_model) -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="budget: .* has no <think> and </think> tokens"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _greedy(2), use_tqdm=False)
    # Beside a grammar only where grammars wait for the thinking (--reasoning-parser).
    llm = LLM(thinking_model, dtype="float32", max_model_len=64)
    budgeted = SamplingParams(thinking_token_budget=2, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match="does not combine with structured outputs"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, budgeted, use_tqdm=False)


def test_budgets_read_back_before_sampling() -> None:
    """With async scheduling the worker reads the last step's token before it samples a
    budgeted request: whether the span is still open depends on its value."""
    assert SamplingParams(thinking_token_budget=0).reads_output_tokens
    assert not SamplingParams().reads_output_tokens
