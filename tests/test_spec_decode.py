"""Speculative decoding (n-gram prompt lookup): the proposer, the config, and the engine's
verification against transformers (fp32 greedy: tokens identical, logprobs close) and against
itself without drafts (random sampling: the same distribution)."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import pytest

from omniserve import LLM, SamplingParams
from omniserve.config import SpeculativeConfig
from omniserve.spec_decode.ngram_proposer import NgramProposer, accept_drafts, takes_drafts
from tests.hf_reference import assert_matches_reference, hf_greedy, make_prompts

MAX_TOKENS = 40


def _proposer(k: int = 3, lookup_min: int = 2, lookup_max: int = 3, max_len: int = 100):
    config = SpeculativeConfig(k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)
    return NgramProposer(config, max_len)


def test_proposer_takes_the_longest_match_then_the_fullest_then_the_latest():
    propose = _proposer().propose
    # "1 2 3" occurs once earlier (followed by 7 8 9); "2 3" alone also before "5 5".
    assert propose(np.array([2, 3, 5, 5, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3])) == [7, 8, 9]
    # Two equal matches of "4 6": the later one is followed by at least k tokens too.
    assert propose(np.array([4, 6, 1, 1, 1, 4, 6, 2, 2, 2, 4, 6])) == [2, 2, 2]
    # ...but a later match with fewer tokens after it loses to a fuller earlier one.
    assert propose(np.array([4, 6, 1, 1, 1, 5, 4, 6, 4, 6])) == [1, 1, 1]
    # A run of one token: the earliest full match has the most tokens after it.
    assert propose(np.array([9, 7, 7, 7, 7, 7])) == [7, 7]


def test_proposer_respects_lookup_bounds_and_max_model_len():
    assert _proposer().propose(np.array([1, 2, 3, 4, 5, 9, 5])) == []  # a 1-gram only
    assert _proposer(lookup_min=1).propose(np.array([1, 2, 3, 4, 5, 9, 5])) == [9, 5]
    assert _proposer().propose(np.array([1, 2])) == []
    # The longest match (3 tokens, ending at 2) wins over a fuller 2-token one.
    assert _proposer().propose(np.array([8, 8, 8, 8])) == [8]
    # Drafts stop below max_model_len (positions 8 and 9 of a 10-token context).
    assert _proposer(max_len=10).propose(np.array([1, 2, 3, 4, 5, 6, 0, 1, 2, 3])) == []
    assert _proposer(max_len=11).propose(np.array([1, 2, 3, 4, 5, 6, 0, 1, 2, 3])) == [4]


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_models_next_token():
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus a bonus
    assert accept_drafts([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the model's 9 replaces draft 6
    assert accept_drafts([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_drafts([5, -1, 7, 8], [5, 6, 7]) == [5, -1]  # no token ends it there
    assert accept_drafts([3], []) == [3]


def test_requests_under_a_grammar_take_no_drafts():
    assert takes_drafts(SamplingParams(temperature=0.7, top_k=5, logprobs=2))
    assert takes_drafts(SamplingParams(repetition_penalty=1.1, min_tokens=4, bad_words=["a"]))
    assert not takes_drafts(SamplingParams(structured_outputs={"regex": "a+"}))


def test_config_follows_vllm():
    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict(
        {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    for value, message in (
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "no draft models"),
        ({"method": "mtp", "num_speculative_tokens": 2}, "'mtp' is not supported"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "n": 1}, "unknown key(s) ['n']"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 3},
            "prompt_lookup_min (4) must be <= prompt_lookup_max (3)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ">= 2"),
        ("{nope", "not valid JSON"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=None) as info:
            SpeculativeConfig.from_dict(value)
        assert message in str(info.value)


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    # The last prompt repeats a phrase, so the real proposer finds matches in it.
    prompts = make_prompts(model_dir, [5, 17, 40, 100]) + [[11, 12, 13, 14, 15] * 8]
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def _oracle(reference: dict[tuple[int, ...], list[int]], prompts: list[list[int]]):
    """A proposer that knows each prompt's greedy continuation and corrupts some drafts, so
    steps keep all, some or none of their drafts."""

    def propose(self, token_ids: np.ndarray) -> list[int]:
        tokens = token_ids.tolist()
        prompt = max((p for p in prompts if tokens[: len(p)] == p), key=len)
        done = len(tokens) - len(prompt)
        drafts = reference[tuple(prompt)][done : done + self.k]
        if done % 3 == 1 and drafts:
            drafts[done % len(drafts)] ^= 1  # rejected there: the model samples its own
        return drafts

    return propose


def _assert_same_with_drafts(model_dir: str, prompts: list, params, expected: list,
                             num_drafts: int, **engine: Any) -> None:  # fmt: skip
    """An engine with (patched) drafts gives ``expected``'s tokens and logprobs, keeping some
    (``engine``: more LLM arguments; ``lora_request`` goes to ``generate``)."""
    lora_request = engine.pop("lora_request", None)
    spec = {"method": "ngram", "num_speculative_tokens": num_drafts}
    llm = LLM(model_dir, dtype="float32", speculative_config=spec, **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    for ours, theirs in zip(outputs, expected, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            # (-inf where a grammar masks the token: isclose takes equal infinities)
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)
    assert llm.llm_engine.engine_core.call_utility("get_stats")["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"max_num_batched_tokens": 24, "max_num_seqs": 3},  # drafts cut by the token budget
        {"max_model_len": 256, "num_gpu_blocks_override": 16, "enable_prefix_caching": False},
    ],
    ids=["plain", "small-budget", "preempted"],
)
def test_verified_drafts_match_hf(case, engine, monkeypatch):
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, reference = case
    greedy = {tuple(p): list(r.token_ids) for p, r in zip(prompts, reference, strict=True)}
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, prompts))
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model_dir, dtype="float32", speculative_config=spec, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    for _ in range(2):  # the second time from the prefix cache (where it is on)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_matches_reference(outputs, reference)
    stats = llm.llm_engine.engine_core.call_utility("get_stats")
    accepted, drafted = (
        stats["spec_decode_num_accepted_tokens"],
        stats["spec_decode_num_draft_tokens"],
    )
    assert 0.3 * drafted < accepted < drafted
    if "num_gpu_blocks_override" in engine:
        assert stats["num_preemptions"] > 0


def test_real_proposer_and_stops_inside_kept_drafts(case, monkeypatch):
    """The n-gram proposer end to end (outputs as without drafts), a stop token and max_tokens
    reached inside a step's kept drafts (the rest is dropped, logprobs too)."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, reference = case
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(model_dir, dtype="float32", speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_reference(outputs, reference)
    assert llm.llm_engine.engine_core.call_utility("get_stats")["spec_decode_num_drafts"] > 0

    greedy = {tuple(p): list(r.token_ids) for p, r in zip(prompts, reference, strict=True)}
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, prompts))
    llm = LLM(model_dir, dtype="float32", speculative_config=spec)
    for prompt, ref in zip(prompts, reference, strict=True):
        stop = ref.token_ids[9]
        cut = ref.token_ids.index(stop) + 1
        for params in (
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                           logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=cut, logprobs=1),
        ):  # fmt: skip
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            assert out.outputs[0].token_ids == ref.token_ids[:cut]
            assert len(out.outputs[0].logprobs) == cut


def test_random_sampling_keeps_its_distribution(case, monkeypatch):
    """Drafts of the greedy continuation, verified at temperature 1 with top-k 3: the joint
    distribution of the first three tokens matches the engine's without drafts (seeded, so the
    test is deterministic; a chi-square over the 27 outcomes)."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, reference = case
    prompt = prompts[2]
    greedy = {tuple(prompt): list(reference[2].token_ids)}
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, [prompt]))
    num = 600
    counts = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 2}):
        llm = LLM(model_dir, dtype="float32", speculative_config=spec)
        params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=1000 * bool(spec) + i)
                  for i in range(num)]  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": prompt}] * num, params, use_tqdm=False)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outputs))
        if spec:
            stats = llm.llm_engine.engine_core.call_utility("get_stats")
            assert stats["spec_decode_num_accepted_tokens"] > 0.2 * num
    outcomes = sorted(counts[0].keys() | counts[1].keys())
    a = np.array([counts[0][o] for o in outcomes], float)
    b = np.array([counts[1][o] for o in outcomes], float)
    pooled = (a + b) / 2
    chi2 = float((((a - pooled) ** 2 + (b - pooled) ** 2) / pooled).sum())
    # 99.9% quantile of chi-square with up to 26 degrees of freedom is ~54.
    assert chi2 < 54, (chi2, outcomes, a, b)


def test_mrope_model_with_images(tiny_checkpoint, monkeypatch):
    """Qwen2-VL (M-RoPE: a draft sits at its position + the request's delta on all axes), with
    images: the same tokens and logprobs as the engine without drafts (itself checked against
    transformers in test_fidelity_mm)."""
    from transformers import AutoProcessor

    from tests.test_fidelity_mm import VL_CASES, _engine_prompt

    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    prompts = [
        _engine_prompt(
            processor.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False),
            c.media,
        )
        for c in VL_CASES[:2]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    base = LLM(model_dir, dtype="float32").generate(prompts, params, use_tqdm=False)
    ids = [list(o.prompt_token_ids) for o in base]
    greedy = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ids, base, strict=True)}
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, ids))
    _assert_same_with_drafts(model_dir, prompts, params, base, num_drafts=3)


def test_scheduler_feeds_drafts_rolls_back_rejected_ones_and_stops_them_for_large_batches():
    from omniserve.config import CacheConfig, SchedulerConfig
    from omniserve.core.scheduler import Scheduler
    from omniserve.messages import ACCEPTED_AT_KEY, ModelRunnerOutput
    from tests.utils import make_requests

    spec = SpeculativeConfig(3, disable_by_batch_size=3)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(), 100,
                          speculative_config=spec)  # fmt: skip
    first, second = make_requests(2, 20, max_tokens=6)
    for request in (first, second):
        scheduler.add_request(request)

    def step(sampled: dict[str, list[int]], drafts: dict[str, list[int]]):
        so = scheduler.schedule()
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(ids, [sampled[r] for r in ids], spec_token_ids=drafts)
        scheduler.update_from_output(so, out)
        return so

    step({"req-0": [5], "req-1": [6]}, {"req-0": [7, 8, 9], "req-1": [1, 2, 3]})
    so = step({"req-0": [7, 8, 9, 10], "req-1": [4]}, {"req-0": [11, 12, 13]})
    assert so.scheduled_spec_decode_tokens == {"req-0": [7, 8, 9], "req-1": [1, 2, 3]}
    assert so.num_scheduled_tokens == {"req-0": 4, "req-1": 4}
    # req-0 kept its 3 drafts and one more token; req-1 none (its 3 drafts' KV rolled back).
    assert first.output_token_ids == (5, 7, 8, 9, 10) and second.output_token_ids == (6, 4)
    assert (first.num_computed_tokens, second.num_computed_tokens) == (24, 21)
    stats = scheduler.make_stats()
    assert stats["spec_decode_num_accepted_tokens"] == 3
    assert [stats[f"{ACCEPTED_AT_KEY}{i}"] for i in range(3)] == [1, 1, 1]
    # max_tokens 6: req-0 may sample one more token, so no draft is fed.
    so = step({"req-0": [14], "req-1": [15]}, {"req-1": [1, 2]})
    assert so.scheduled_spec_decode_tokens == {} and first.is_finished
    (third,) = make_requests(1, 20, prefix="late")
    scheduler.add_request(third)
    scheduler.add_request(make_requests(1, 20, prefix="later")[0])
    so = scheduler.schedule()  # three requests in: drafts are off
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens["req-1"] == 1


def test_penalties_bad_words_and_min_tokens_see_the_drafts_before_each_position(case, monkeypatch):
    """Each verifying row samples as the request would at its position, the drafts before it
    counted as its tokens: the same tokens and logprobs as without drafts (fp32). One request
    under a grammar (it takes no drafts) shares the steps: its bitmask row is its own."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, reference = case
    plain = LLM(model_dir, dtype="float32")
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = plain.generate(requests, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, repetition_penalty=1.3,
                       presence_penalty=0.4, frequency_penalty=0.3, min_tokens=12,
                       # the greedy third token stops it, once min_tokens allows
                       stop_token_ids=[o.outputs[0].token_ids[2]],
                       bad_words=[plain.get_tokenizer().decode(o.outputs[0].token_ids[4:6])])
        for o in first
    ]  # fmt: skip
    params[1] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3,
                               structured_outputs={"regex": "(ab|cd)+ ?[0-9]{3}"})  # fmt: skip
    expected = plain.generate(requests, params, use_tqdm=False)
    greedy = {
        tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, expected, strict=True)
    }
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, prompts))
    _assert_same_with_drafts(model_dir, requests, params, expected, num_drafts=4)


def test_metrics_count_drafts_and_acceptance_per_position():
    from omniserve.messages import ACCEPTED_AT_KEY
    from omniserve.metrics import PrometheusStatLogger

    metrics = PrometheusStatLogger("m")
    for drafted, kept, kept_at in ((8.0, 3.0, (2.0, 1.0)), (12.0, 5.0, (4.0, 1.0))):
        metrics.record_scheduler_stats({
            "spec_decode_num_draft_tokens": drafted, "spec_decode_num_accepted_tokens": kept,
            **{f"{ACCEPTED_AT_KEY}{i}": n for i, n in enumerate(kept_at)},
        })  # fmt: skip
    body = metrics.render()[0].decode()
    assert 'omniserve:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in body
    assert 'omniserve:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in body
    per_pos = "omniserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{engine="0",model_name="m",position="0"}} 4.0' in body
    assert f'{per_pos}{{engine="0",model_name="m",position="1"}} 1.0' in body


@pytest.mark.gpu
def test_verified_drafts_on_gpu_match_hf(case, monkeypatch):
    """On CUDA (Triton attention takes a verifying chunk as a prefill chunk; steps with drafts
    run eagerly, the others replay graphs), fp32 against transformers' fp32 on the CPU."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, reference = case
    greedy = {tuple(p): list(r.token_ids) for p, r in zip(prompts, reference, strict=True)}
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, prompts))
    llm = LLM(model_dir, dtype="float32", device="cuda",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_reference(outputs, reference, atol=1e-3)
    assert llm.llm_engine.engine_core.call_utility("get_stats")["spec_decode_num_accepted_tokens"]


def test_lora_requests_verify_their_drafts_with_their_adapter(case, tmp_path, monkeypatch):
    """A verifying chunk's rows all take the request's adapter (the step's token -> slot groups
    count draft rows): with an adapter and without, in one batch, the same tokens and logprobs
    as the engine without drafts."""
    from omniserve.checkpoint_builder.lora import build_random_adapter
    from omniserve.lora.request import LoRARequest

    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir, prompts, _ = case
    adapter = LoRARequest("a", 1, str(build_random_adapter(model_dir, tmp_path / "a", 8)))
    loras = [adapter if i % 2 else None for i in range(len(prompts))]
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    expected = LLM(model_dir, dtype="float32", enable_lora=True).generate(
        requests, params, use_tqdm=False, lora_request=loras
    )
    greedy = {
        tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, expected, strict=True)
    }
    monkeypatch.setattr(NgramProposer, "propose", _oracle(greedy, prompts))
    _assert_same_with_drafts(model_dir, requests, params, expected, num_drafts=4,
                             enable_lora=True, lora_request=loras)  # fmt: skip
