"""No request can take the engine down: front-door validation of sampling parameters, a sampler
that is total over everything validation lets through, and a step that raises failing only the
request that caused it (the engine lives on, the other requests finish unchanged)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.core.sched_output import SchedulerOutput
from omniserve.engine.exceptions import EngineGenerateError
from omniserve.engine.output_processor import OutputProcessor
from omniserve.layers.sampler import Sampler
from omniserve.messages import EngineCoreOutput, FinishReason
from omniserve.sampling_params import FP32_MAX, FP32_TINY, RequestOutputKind
from omniserve.worker.model_runner import ModelRunner
from tests.hf_reference import make_prompts
from tests.test_output_processor import ListQueue
from tests.test_sampler import make_metadata

# The payloads that killed the engine before: (field, value, extra fields).
ENGINE_KILLERS = [
    ("temperature", math.inf, {"min_tokens": 4}),
    ("temperature", 1e39, {"min_tokens": 1}),
    ("repetition_penalty", 1e-40, {}),
    ("repetition_penalty", 1e-50, {}),
    ("top_p", 1e-50, {}),
    ("top_k", 2**63, {}),
    ("seed", 2**64, {}),
    ("temperature", math.nan, {}),
    ("stop_token_ids", [2**63], {}),
]


@pytest.mark.parametrize(("name", "value", "extra"), ENGINE_KILLERS)
def test_values_the_sampler_cannot_compute_with_are_refused(
    name: str, value: Any, extra: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**{name: value, **extra})


def test_boundary_values_are_accepted_and_n_children_seeds_wrap() -> None:
    SamplingParams(
        temperature=FP32_MAX,
        repetition_penalty=FP32_TINY,
        top_p=FP32_TINY,
        top_k=2**31 - 1,
        seed=-(2**63),
    )
    params = SamplingParams(n=3, seed=2**64 - 1, temperature=1.0)
    assert [params.child_seed(i) for i in range(3)] == [2**64 - 1, 0, 1]
    with pytest.raises(ValueError, match="^n must be"):
        SamplingParams(n=True)  # a bool is not a count


def _extreme_params(rng: random.Random) -> SamplingParams:
    """Random parameters at and near the edges of what validation accepts."""

    def pick(*values: float) -> float:
        return rng.choice(values)

    return SamplingParams(
        temperature=pick(0.0, 1e-5, 1.0, 1e4, FP32_MAX),
        top_p=pick(FP32_TINY, 1e-6, 0.5, 1.0),
        top_k=rng.choice([0, 1, 5, 2**31 - 1]),
        min_p=pick(0.0, 1e-30, 0.5, 1.0),
        repetition_penalty=pick(FP32_TINY, 1e-3, 1.0, 1e3, 1.0 / FP32_TINY),
        presence_penalty=pick(-2.0, 0.0, 2.0),
        frequency_penalty=pick(-2.0, 0.0, 2.0),
        min_tokens=rng.choice([0, 3]),
        seed=rng.choice([None, 0, 2**64 - 1, -(2**63)]),
        logprobs=rng.choice([None, 0, 5]),
    )


def test_sampler_fuzz_always_returns_in_range_tokens() -> None:
    """Random extreme parameters, and logits with inf, NaN and fully masked rows: every row gets a
    token id inside the vocabulary and logprobs never fail."""
    rng = random.Random(0)
    vocab = 300
    sampler = Sampler()
    for trial in range(60):
        params = [_extreme_params(rng) for _ in range(rng.randint(1, 6))]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in params]
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 4))] for _ in params]
        metadata = make_metadata(
            params, prompts=prompts, outputs=outputs, vocab_size=vocab, eos_token_id=0
        )
        logits = torch.randn(len(params), vocab) * rng.choice([1.0, 30.0, 1e4])
        special = rng.choice(["none", "inf", "nan", "masked", "huge"])
        if special == "inf":
            logits[0, rng.randrange(vocab)] = math.inf
        elif special == "nan":
            logits[0, : vocab // 2] = math.nan
        elif special == "masked":
            logits[0] = -math.inf
        elif special == "huge":
            logits[0] = FP32_MAX
        result = sampler(logits.clone(), metadata)
        tokens = result.sampled_token_ids
        assert tokens.shape == (len(params),), trial
        assert bool(((tokens >= 0) & (tokens < vocab)).all()), (trial, special, tokens)


def test_sampler_takes_the_top_token_when_top_p_rounds_to_nothing() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=1.0, top_p=FP32_TINY, seed=1)]
    tokens = Sampler()(logits.clone(), make_metadata(params, vocab_size=4)).sampled_token_ids
    assert tokens.tolist() == [1]


# ---- a step that raises ----

POISON = 3  # prompts starting with this token id make the model runner raise


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def inproc_llm(tiny_checkpoint: Any, request: pytest.FixtureRequest) -> Any:
    """An engine core in this process, scheduling steps one at a time or ahead (a step that
    raises then fails together with the step launched after it, which built on it)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_seqs=8,
              async_scheduling=request.param)  # fmt: skip
    yield llm, model_dir
    patch.undo()


def _poison_runner(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    """Make every step that holds a poisoned request raise, as a model bug would."""
    original = ModelRunner.dispatch
    poisoned: set[str] = set()

    def dispatch(self: ModelRunner, so: SchedulerOutput) -> Any:
        poisoned.update(r.req_id for r in so.scheduled_new_reqs if r.prompt_token_ids[0] == POISON)
        calls.append(len(so.num_scheduled_tokens))
        if poisoned & set(so.num_scheduled_tokens):
            raise RuntimeError("injected failure")
        return original(self, so)

    monkeypatch.setattr(ModelRunner, "dispatch", dispatch)


def test_a_failing_request_fails_alone_and_the_engine_lives_on(
    inproc_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, model_dir = inproc_llm
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    good = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9, 17, 5], seed=11)]
    reference = [o.outputs[0].token_ids for o in llm.generate(good, greedy, use_tqdm=False)]
    calls: list[int] = []
    _poison_runner(monkeypatch, calls)
    bad = {"prompt_token_ids": [POISON, *good[0]["prompt_token_ids"]]}
    outputs = llm.generate([good[0], bad, good[1], good[2]], greedy, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length", "length"]
    assert [outputs[i].outputs[0].token_ids for i in (0, 2, 3)] == reference
    assert calls[0] == 4 and 1 in calls  # it failed in a batch, then alone
    # Nothing leaked, and the engine serves the next request as before.
    stats = llm.llm_engine.engine_core.call_utility("get_stats")
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0.0
    again = llm.generate(good[:1], greedy, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference[0]


def test_engine_error_reaches_only_that_requests_consumer(tiny_checkpoint: Any) -> None:
    from transformers import AutoTokenizer

    processor = OutputProcessor(AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen3ForCausalLM")))
    params = SamplingParams(n=2, max_tokens=4, output_kind=RequestOutputKind.DELTA)
    failed, healthy = ListQueue(), ListQueue()
    processor.add_request("a", None, [1, 2], params, ["a-0", "a-1"], queue=failed)
    processor.add_request("b", None, [1, 2], SamplingParams(max_tokens=4), queue=healthy)
    result = processor.process_outputs(
        [
            EngineCoreOutput("a-0", [], finish_reason=FinishReason.ERROR),
            EngineCoreOutput("b", [5]),
        ]
    )
    assert result.reqs_to_abort == ["a-1"]  # the sibling stops running
    assert len(failed.items) == 1 and isinstance(failed.items[0], EngineGenerateError)
    assert "Request a failed" in str(failed.items[0])
    assert not isinstance(healthy.items[-1], BaseException)
    assert processor.get_num_unfinished_requests() == 1
