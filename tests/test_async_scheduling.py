"""Async scheduling (``--async-scheduling``): each step is scheduled and launched before the one
before it is read back, its decodes fed the tokens that step sampled, still on the device.

On CPU nothing overlaps, but every decision is the code CUDA runs, so these check that the
outputs equal synchronous scheduling's token for token, through chunked prefill, preemption,
stops inside a step in flight, logprobs, seeded sampling, penalties, min_tokens and bad words
(the worker reads the last step's token before it samples), grammars (a step is sampled once
the step before it is back) and aborts; ``test_reliability`` fails steps under it."""

from __future__ import annotations

import argparse
import pickle
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoProcessor

from omniserve import LLM, SamplingParams
from omniserve.core.request import RequestStatus
from omniserve.core.sched_output import CachedRequestData, SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.core import EngineCore
from omniserve.executor.abstract import Executor
from omniserve.executor.multiproc import serve_calls
from omniserve.executor.uniproc import UniProcExecutor
from omniserve.executor.worker_wrapper import REPLY_ALL, REPLY_RANK0
from omniserve.messages import ModelRunnerOutput
from omniserve.sampling_params import StructuredOutputsParams
from tests.hf_reference import make_prompts
from tests.test_fidelity_omni import _engine_prompt, _media, _text
from tests.utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    make_requests,
    make_scheduler,
    steps_never_synchronizing,
)

ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=6,
    max_num_batched_tokens=64,  # long prompts take several chunks
    num_gpu_blocks_override=24,  # 12 requests of up to 160 tokens do not fit: preemption
    seed=0,
)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Any) -> Iterator[tuple[LLM, LLM, str]]:
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    yield (
        LLM(model_dir, **ENGINE_KWARGS),
        LLM(model_dir, async_scheduling=True, **ENGINE_KWARGS),
        model_dir,
    )
    patch.undo()


def _depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Steps in flight each time the engine core reads one back."""
    depths: list[int] = []
    original = EngineCore._finish_oldest_step

    def finish(self: EngineCore) -> Any:
        depths.append(len(self._in_flight))
        return original(self)

    monkeypatch.setattr(EngineCore, "_finish_oldest_step", finish)
    return depths


def _results(llm: LLM, prompts: list[dict[str, Any]], params: list[SamplingParams]) -> list[Any]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []],
        )
        for o in outputs
    ]


def _assert_same(sync: list[Any], ahead: list[Any]) -> None:
    for (tokens, finish, stop, logprobs), (tokens2, finish2, stop2, logprobs2) in zip(
        sync, ahead, strict=True
    ):
        assert (tokens2, finish2, stop2) == (tokens, finish, stop)
        assert len(logprobs2) == len(logprobs)
        for step, step2 in zip(logprobs, logprobs2, strict=True):
            assert step2.keys() == step.keys()
            # Batches differ between the modes (a waiting request skips a step), and a GEMM's
            # rounding can follow its row count.
            assert list(step2.values()) == pytest.approx(list(step.values()), abs=1e-5)


def test_outputs_equal_synchronous_scheduling(
    engines: tuple[LLM, LLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sync_llm, async_llm, model_dir = engines
    lengths = [5 + 13 * i for i in range(12)]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, lengths, seed=3)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i) for i in range(12)]
    # Each request's 4th greedy token as its stop token: requests stop while a step that
    # already holds their next token is in flight.
    reference = sync_llm.generate(prompts, greedy, use_tqdm=False)
    params = []
    for i, out in enumerate(reference):
        kinds = {
            0: dict(stop_token_ids=[out.outputs[0].token_ids[3]]),
            1: dict(logprobs=2),
            2: dict(repetition_penalty=1.3, presence_penalty=0.5),
            3: dict(min_tokens=5, stop_token_ids=[out.outputs[0].token_ids[1]]),
            4: dict(temperature=0.9, top_p=0.9, seed=i),
            5: dict(bad_words=["the"], logprobs=1),
            6: dict(structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6})*")),
        }
        params.append(greedy[i].clone(**kinds[i % 7]))
    expected = _results(sync_llm, prompts, params)
    depths = _depths(monkeypatch)
    _assert_same(expected, _results(async_llm, prompts, params))
    assert max(depths) == 2  # it did run ahead
    assert {r[1] for r in expected} == {"stop", "length"}
    stats = async_llm.llm_engine.engine_core.call_utility("get_stats")
    assert stats["num_preemptions"] > 0
    assert stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0.0


def test_requests_that_wait_for_their_tokens_launch_no_empty_steps(
    engines: tuple[LLM, LLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every running request waiting for its token (its last one is in flight), nothing
    is launched ahead: an empty step would cost a schedule and a dispatch."""
    sync_llm, async_llm, model_dir = engines
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9, 20], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = _results(sync_llm, prompts, [params] * 2)
    launched: list[int] = []
    original = UniProcExecutor.dispatch_model

    def dispatch(self: UniProcExecutor, so: Any) -> Any:
        launched.append(so.total_num_scheduled_tokens)
        return original(self, so)

    monkeypatch.setattr(UniProcExecutor, "dispatch_model", dispatch)
    assert _results(async_llm, prompts, [params] * 2) == expected
    assert launched == [29, 2, 2]  # the prompts, then one decode each per step


def test_penalties_min_tokens_and_bad_words_run_ahead(
    engines: tuple[LLM, LLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """These read the tokens before the one they sample; the worker reads the last step's token
    back before it samples (behind the launched forward on CUDA), so they keep two steps in
    flight and give synchronous scheduling's tokens."""
    sync_llm, async_llm, model_dir = engines
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9, 20, 14], seed=6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    reference = sync_llm.generate(prompts, [greedy] * 3, use_tqdm=False)
    repeated = reference[2].outputs[0].token_ids
    params = [
        greedy.clone(repetition_penalty=1.4, frequency_penalty=0.4),
        greedy.clone(temperature=0.8, seed=3, presence_penalty=0.7, min_tokens=10,
                     stop_token_ids=list(reference[1].outputs[0].token_ids[2:6])),
        greedy.clone(bad_words_token_ids=[[repeated[3]], [repeated[5], repeated[6]]]),
    ]  # fmt: skip
    expected = _results(sync_llm, prompts, params)
    assert [r[0] for r in expected] != [o.outputs[0].token_ids for o in reference]
    depths = _depths(monkeypatch)
    _assert_same(expected, _results(async_llm, prompts, params))
    assert depths.count(2) >= 12


def test_grammar_steps_are_sampled_once_the_step_before_is_back(
    engines: tuple[LLM, LLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a constrained request is launched up to its logits while the step before it
    is in flight, and sampled once that step's tokens have advanced the grammars: the tokens of
    synchronous scheduling, with two steps in flight."""
    sync_llm, async_llm, model_dir = engines
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9, 14, 7], seed=5)]
    base = SamplingParams(temperature=0.0, max_tokens=24)
    params = [
        base.clone(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
        base.clone(structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}-[0-9]{2,5}"),
                   logprobs=1),
        base.clone(ignore_eos=True),
    ]  # fmt: skip
    expected = _results(sync_llm, prompts, params)
    assert re.fullmatch("[a-z]{3,9}-[0-9]{2,5}", _text_of(async_llm, expected[1][0]))
    split: list[int] = []
    original = UniProcExecutor.launch_model

    def launch(self: UniProcExecutor, so: Any) -> None:
        split.append(so.total_num_scheduled_tokens)
        original(self, so)

    monkeypatch.setattr(UniProcExecutor, "launch_model", launch)
    depths = _depths(monkeypatch)
    _assert_same(expected, _results(async_llm, prompts, params))
    assert len(split) >= 5 and max(depths) == 2


def test_a_request_left_no_token_ends_alone_while_others_run_ahead(
    engines: tuple[LLM, LLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose rules exclude every token at its third output token (a choice whose
    end min_tokens forbids), beside free and constrained ones: under async scheduling, with
    its next step already launched on a stand-in token, it ends in error and the others get
    synchronous scheduling's tokens."""
    sync_llm, async_llm, model_dir = engines
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9, 14, 7, 11], seed=6)]
    base = SamplingParams(temperature=0.0, max_tokens=20)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [
        base.clone(ignore_eos=True),
        base.clone(structured_outputs=choice, min_tokens=8),
        base.clone(structured_outputs=choice),
        base.clone(temperature=1.0, seed=3, ignore_eos=True),
    ]
    expected = _results(sync_llm, prompts, params)
    assert [r[1] for r in expected] == ["length", "error", "stop", "length"]
    depths = _depths(monkeypatch)
    _assert_same(expected, _results(async_llm, prompts, params))
    assert max(depths) == 2


def _text_of(llm: LLM, token_ids: list[int]) -> str:
    return llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)


def test_media_requests_equal_synchronous_scheduling(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The omni thinker (M-RoPE, whose decode positions follow each request's media): prompts
    with images, audio and a video with its track, chunked through the encoders, decode alike."""
    model_dir = str(tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    kinds = [[], ["image"], ["audio"], ["av"], ["image", "audio"]]
    prompts = [_engine_prompt(_text(processor, k), _media(k, seed)) for seed, k in enumerate(kinds)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * i) for i in range(len(kinds))]
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        expected = _results(LLM(model_dir, **kwargs), prompts, params)
        depths = _depths(monkeypatch)
        _assert_same(expected, _results(LLM(model_dir, async_scheduling=True, **kwargs),
                                        prompts, params))  # fmt: skip
    assert max(depths) == 2


def test_the_flag_reaches_an_engine_in_its_own_process(engines: tuple[LLM, LLM, str]) -> None:
    """``--async-scheduling`` from the command line, with the engine core in its own process
    (the server's and ``LLM``'s default): the same tokens as the synchronous engine."""
    sync_llm, _, model_dir = engines
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("model")  # positional, as ``omniserve serve MODEL`` takes it
    args = EngineArgs.from_cli_args(parser.parse_args([model_dir, "--async-scheduling"]))
    assert args.async_scheduling
    # vLLM's spelling to turn it off (its default is on) is taken too.
    off = EngineArgs.from_cli_args(parser.parse_args([model_dir, "--no-async-scheduling"]))
    assert not off.async_scheduling
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [7, 30, 12], seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1)
    expected = _results(sync_llm, prompts, [params] * 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "1")
        kwargs = {**ENGINE_KWARGS, **{f: getattr(args, f) for f in ("model", "async_scheduling")}}
        _assert_same(expected, _results(LLM(**kwargs), prompts, [params] * 3))


def test_async_scheduling_is_refused_with_the_ray_executor(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="needs the 'uni' or 'mp' executor, not RayExecutor"):
        LLM(
            str(tiny_checkpoint("Qwen3ForCausalLM")),
            async_scheduling=True,
            distributed_executor_backend="ray",
        )


@pytest.mark.gpu
def test_async_scheduling_on_gpu_equals_sync(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where steps do overlap: tokens read back through pinned memory, and decodes fed from the
    device inside the captured graphs, give the synchronous engine's outputs in bf16 bit for bit
    (every request is admitted before any finishes and none waits, so both modes run the same
    batches)."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    kwargs = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    lengths = [5 + 11 * i for i in range(8)]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, lengths, seed=7)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20 + 5 * i, ignore_eos=True,
                       logprobs=2 if i % 2 else None)
        for i in range(8)
    ]  # fmt: skip
    expected = _results(LLM(model_dir, **kwargs), prompts, params)
    depths = _depths(monkeypatch)
    assert _results(LLM(model_dir, async_scheduling=True, **kwargs), prompts, params) == expected
    assert max(depths) == 2


@pytest.mark.gpu
def test_async_decode_steps_on_gpu_never_synchronize(
    tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What async scheduling is for: once every request decodes, a step is scheduled, launched
    and sampled without a read of the device (each step's only wait is its own read-back, an
    event), also with penalties, min_tokens, bad words, seeded top-k / top-p / min-p sampling
    and logprobs. A synchronizing op fails the step and names itself."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    llm = LLM(model_dir, async_scheduling=True, dtype="bfloat16", max_model_len=256,
              max_num_seqs=8)  # fmt: skip
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [
        base,
        base.clone(repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2),
        base.clone(temperature=0.8, seed=1, top_p=0.9, presence_penalty=0.2),
        base.clone(temperature=0.7, seed=2, top_k=20, min_tokens=30, stop_token_ids=[3]),
        base.clone(temperature=1.0, seed=3, min_p=0.05, bad_words_token_ids=[[5], [6, 7]]),
        base.clone(temperature=0.9, top_p=0.8, top_k=50, logprobs=0),
    ]
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(
        zip(make_prompts(model_dir, [6, 9, 12, 15, 18, 21], seed=8), params, strict=True)
    ):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    for _ in range(4):  # the prompts and the first decodes
        engine.step()
    steps_never_synchronizing(engine, 20)


# ---- the scheduler alone, two steps in flight ----------------------------------------------


def _launch(scheduler: Scheduler) -> tuple[Any, ModelRunnerOutput]:
    """Schedule a step and make the output a runner would read back for it later: a token for
    each request whose placeholders this step raised, numbered by its position in the output."""
    before = {r.request_id: r.num_output_placeholders for r in scheduler.requests.values()}
    so = scheduler.schedule()
    sampled = []
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        samples = request.num_output_placeholders > before.get(req_id, 0)
        sampled.append(
            [request.num_output_tokens + request.num_output_placeholders] if samples else []
        )
    return so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


def test_the_scheduler_counts_tokens_in_flight_as_known() -> None:
    scheduler = make_scheduler(block_size=4)
    (request,) = make_requests(1, 6, max_tokens=2)
    scheduler.add_request(request)
    first = _launch(scheduler)  # the prompt, sampling output token 1
    second = _launch(scheduler)  # output token 2, fed token 1 from the device
    assert second[0].num_scheduled_tokens == {request.request_id: 1}
    assert request.num_computed_tokens == 7 and request.num_output_placeholders == 2
    # Token 2 is its last (max_tokens): nothing is scheduled past it.
    assert _launch(scheduler)[0].num_scheduled_tokens == {}
    outputs = [o for step in (first, second) for o in scheduler.update_from_output(*step).outputs]
    assert [o.new_token_ids for o in outputs] == [[1], [2]]
    assert outputs[-1].finished and request.num_output_placeholders == 0
    scheduler.schedule()
    assert_all_free(scheduler)


@pytest.mark.parametrize(
    ("params", "waits"),
    [
        ({"max_tokens": 1}, True),  # it ends on its token in flight
        # Sampled once the last step's token is back (worker or engine core).
        ({"structured_outputs": StructuredOutputsParams(choice=["a", "b"])}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"min_tokens": 4}, False),
        ({"bad_words_token_ids": [[5, 6]]}, False),
    ],
)
def test_only_a_length_limit_waits_for_tokens_in_flight(
    params: dict[str, Any], waits: bool
) -> None:
    scheduler = make_scheduler()
    (request,) = make_requests(1, 6, **{"max_tokens": 8, **params})
    scheduler.add_request(request)
    first = _launch(scheduler)
    ahead = _launch(scheduler)[0].num_scheduled_tokens
    assert ahead == ({} if waits else {request.request_id: 1})
    scheduler.update_from_output(*first)
    if waits and not request.is_finished:
        assert _launch(scheduler)[0].num_scheduled_tokens == {request.request_id: 1}


def test_no_request_with_a_step_in_flight_is_preempted() -> None:
    # Two requests of 8 prompt tokens in 4-token blocks, 5 blocks: the 9th tokens need a third
    # block each, and only one is free.
    scheduler = make_scheduler(block_size=4, num_blocks=5, max_model_len=20)
    a, b = make_requests(2, 8, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = _launch(scheduler)
    second = _launch(scheduler)
    assert second[0].num_scheduled_tokens == {a.request_id: 1}
    assert scheduler.blocked_by_steps_in_flight and not second[0].preempted_req_ids
    scheduler.update_from_output(*first)
    scheduler.update_from_output(*second)
    # With nothing in flight, b makes room for a's next step as without async scheduling.
    assert _launch(scheduler)[0].preempted_req_ids == {b.request_id}


@pytest.mark.parametrize("seed", range(3))
def test_randomized_two_steps_in_flight_keep_every_request_exact(seed: int) -> None:
    """Arrivals, aborts (also of requests in flight) and eos, with two steps in flight: every
    request's output is its tokens in order, with nothing after its stop, and every resource
    is free at the end."""
    rng = random.Random(seed)
    scheduler = make_scheduler(block_size=4, num_blocks=16, max_model_len=64, max_num_seqs=6,
                               max_num_batched_tokens=40)  # fmt: skip
    in_flight: list[tuple[Any, ModelRunnerOutput]] = []
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    eos_at: dict[str, int] = {}
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            (request,) = make_requests(1, rng.randrange(1, 30), prefix=f"r{step}-",
                                       max_tokens=rng.randrange(1, 20))  # fmt: skip
            eos_at[request.request_id] = rng.randrange(1, 25)
            scheduler.add_request(request)
        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            finished.add(victim)
        if len(in_flight) < 2 and scheduler.has_unfinished_requests():
            if not (in_flight and scheduler.blocked_by_steps_in_flight):
                so, output = _launch(scheduler)
                # The fake model says eos at each request's chosen position.
                output.sampled_token_ids = [
                    [EOS_TOKEN_ID if t and t[0] == eos_at[r] else t[0]] if t else []
                    for r, t in zip(output.req_ids, output.sampled_token_ids, strict=True)
                ]
                in_flight.append((so, output))
        if in_flight and (len(in_flight) == 2 or rng.random() < 0.5):
            so, output = in_flight.pop(0)
            for out in scheduler.update_from_output(so, output).outputs:
                assert out.request_id not in finished
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finished.add(out.request_id)
    while in_flight:
        scheduler.update_from_output(*in_flight.pop(0))
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    assert_all_free(scheduler)
    assert scheduler.num_preemptions > 0
    for req_id, tokens in outputs.items():
        stop = eos_at[req_id]
        expected = [*range(1, stop), EOS_TOKEN_ID][: len(tokens)]
        assert tokens == expected, req_id


# ---- a tensor-parallel worker's call loop ---------------------------------------------------


class _Step:
    """A fake launched step that is done only once told so."""

    def __init__(self, name: str, events: list[str], done: bool) -> None:
        self.name, self.events, self._done = name, events, done

    def done(self) -> bool:
        return self._done

    def result(self) -> str:
        self.events.append(f"read {self.name}")
        return self.name


@pytest.mark.parametrize("ahead", [True, False])
def test_a_worker_launches_the_next_step_before_it_reads_this_one_back(ahead: bool) -> None:
    """With async scheduling the engine core sends step 2 before it reads step 1's reply; a
    worker that finds it in launches it before it reads step 1 back (its device goes from one
    step to the next), then answers in order; any other call sees every step read back."""
    events: list[str] = []
    messages = [(1, "execute_model", ("s1",), REPLY_RANK0),
                (2, "execute_model", ("s2",), REPLY_RANK0),
                (3, "launch_model", ("s3",), REPLY_RANK0),
                (4, "sample_model", ({},), REPLY_RANK0),
                (5, "model_info", (), REPLY_ALL),
                (None, None, (), REPLY_ALL)]  # fmt: skip

    class Calls:
        def poll(self, timeout_ms: int) -> bool:
            return bool(messages)

        def recv(self) -> Any:
            return messages.pop(0)

    class Worker:
        def dispatch_model(self, so: str) -> _Step:
            events.append(f"launch {so}")
            return _Step(so, events, done=False)

        def dispatch_sampling(self, bitmask: dict) -> _Step:
            events.append("sample s3")
            return _Step("s3", events, done=False)

    class Wrapper:
        rank, worker = 0, Worker()

        def execute_method(self, method: str, args: tuple, mode: str) -> Any:
            events.append(method)
            return method

    replies: list[Any] = []

    class Results:
        def send(self, message: bytes) -> None:
            reply = pickle.loads(message)
            replies.append(reply[0])
            events.append(f"reply {reply[0]}")

    serve_calls(Calls(), Results(), Wrapper(), ahead)  # type: ignore[arg-type]
    if ahead:
        assert events == ["launch s1", "launch s2", "read s1", "reply 1", "launch_model",
                          "reply 3", "sample s3", "read s2", "reply 2", "read s3", "reply 4",
                          "model_info", "reply 5"]  # fmt: skip
    else:
        assert events == ["launch s1", "read s1", "reply 1", "launch s2", "read s2", "reply 2",
                          "launch_model", "reply 3", "sample s3", "read s3", "reply 4",
                          "model_info", "reply 5"]  # fmt: skip
    assert sorted(replies) == [1, 2, 3, 4, 5]


def test_an_executor_that_cannot_split_a_step_runs_it_whole_when_sampled() -> None:
    """The base executor's ``launch_model`` holds the step and ``dispatch_sampling`` runs it with
    the bitmask made meanwhile: correct for any executor, without the overlap."""
    ran: list[Any] = []

    class Whole(Executor):
        def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
            ran.append(args[0])
            return [ModelRunnerOutput(["r"], [[7]])]

        def shutdown(self) -> None:
            pass

    executor = Whole(None)  # type: ignore[arg-type]
    step = SchedulerOutput([], CachedRequestData(), {"r": 1}, 1)
    executor.launch_model(step)
    assert ran == []
    output = executor.dispatch_sampling({"r": b"\xff"}).result()
    assert ran == [step] and step.grammar_bitmask == {"r": b"\xff"}
    assert output.sampled_token_ids == [[7]]
    with pytest.raises(RuntimeError, match="without a step"):
        executor.dispatch_sampling({})
