"""Custom logits processors (vLLM V1's interface, ``omniserve.logits_processor``).

The worker's batch bookkeeping is checked against a model of vLLM's ``BatchUpdate`` semantics
over random batch changes; the sampler's order (after the token rules and before penalties; the
argmax-invariant ones after temperature, skipped for all-greedy batches) on fixed logits; and
the engine end to end on the tiny fp32 Qwen2, greedy: a request whose ``extra_args`` turn a
processor on gets exactly what it forces, the others exactly their plain answers, in one batch,
with async scheduling too; loading by class, by ``module:Class`` name and from entry points;
bad names, spec decoding, pooling and refused ``extra_args`` fail with the reason.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from omniserve.layers.sampler import Sampler
from omniserve.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
)
from omniserve.worker.input_batch import CachedRequestState
from omniserve.worker.logits_processors import LogitsProcessorBatch
from omniserve.worker.sampling_inputs import build_sampling_metadata
from tests.hf_reference import make_prompts

VOCAB = 32


class TargetToken(LogitsProcessor):
    """vLLM's documented example: a request with ``extra_args["target_token"]`` samples only that
    token; other rows are left alone."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not (isinstance(target, int) and target >= 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.targets.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(index, None)
            else:
                self.targets[index] = target
        for source, target_index, direction in batch_update.moved:
            moving, replaced = self.targets.pop(source, None), self.targets.pop(target_index, None)
            if moving is not None:
                self.targets[target_index] = moving
            if direction == MoveDirectionality.SWAP and replaced is not None:
                self.targets[source] = replaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), device=logits.device)
        cols = torch.tensor(list(self.targets.values()), device=logits.device)
        kept = logits[rows, cols].clone()
        logits[rows] = -torch.inf
        logits[rows, cols] = kept
        return logits


class NoRepeat(AdapterLogitsProcessor):
    """Per request (``extra_args["no_repeat"]``): never the token just generated (reads the
    live output list, so async scheduling must have it read back)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban_last(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            if output_ids:
                row[output_ids[-1]] = -torch.inf
            return row

        return ban_last


class Recorder(LogitsProcessor):
    """Keeps a copy of the logits it is given; argmax-invariant as constructed."""

    invariant = False

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.seen: list[torch.Tensor] = []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        return logits


class InvariantRecorder(Recorder):
    invariant = True


# ---- the batch's bookkeeping ------------------------------------------------------------------


def _state(name: str) -> CachedRequestState:
    return CachedRequestState(name, [1, 2], [], SamplingParams(extra_args={"name": name}), None,
                              None)  # fmt: skip


class _Mirror(LogitsProcessor):
    """Replays each BatchUpdate as vLLM's contract says (removed, added, moved) on a list."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.batch: dict[int, str] = {}
        self.size = 0
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index in batch_update.removed:
            assert index in self.batch, "removed an empty slot"
            del self.batch[index]
        for index, params, _, _ in batch_update.added:
            assert params.extra_args is not None
            self.batch[index] = params.extra_args["name"]
        for source, target, direction in batch_update.moved:
            moving, replaced = self.batch.pop(source), self.batch.pop(target, None)
            self.batch[target] = moving
            if direction == MoveDirectionality.SWAP:
                assert replaced is not None
                self.batch[source] = replaced
            else:
                assert replaced is None, "a one-way move onto a request"
        self.size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def test_batch_updates_follow_vllms_contract() -> None:
    """Random steps (requests join, leave, skip a step, get rebuilt, reorder): after each
    update, the processor's view is the step's rows exactly; no change is None."""
    batch = LogitsProcessorBatch([_Mirror], None, torch.device("cpu"))  # type: ignore[arg-type]
    (mirror,) = batch.others
    assert isinstance(mirror, _Mirror)
    rng = random.Random(0)
    running: list[CachedRequestState] = []
    names = iter(range(10_000))
    for _ in range(400):
        action = rng.random()
        if action < 0.3 or not running:
            running.insert(rng.randrange(len(running) + 1), _state(f"r{next(names)}"))
        elif action < 0.5:
            running.pop(rng.randrange(len(running)))
        elif action < 0.6:  # preempted and rebuilt: the same id, a new state
            i = rng.randrange(len(running))
            running[i] = CachedRequestState(running[i].req_id, [1, 2], [],
                                            running[i].sampling_params, None, None)  # fmt: skip
        elif action < 0.7:
            rng.shuffle(running)
        step = [s for s in running if rng.random() < 0.9]  # some skip the step
        batch.update(step)
        assert mirror.size == len(step)
        assert mirror.batch == {i: s.sampling_params.extra_args["name"]  # type: ignore[index]
                                for i, s in enumerate(step)}  # fmt: skip
        batch.update(step)
        assert mirror.updates[-1] is None


def test_added_requests_share_their_output_list() -> None:
    batch = LogitsProcessorBatch([_Mirror], None, torch.device("cpu"))  # type: ignore[arg-type]
    state = _state("a")
    batch.update([state])
    (mirror,) = batch.others
    update = mirror.updates[-1]  # type: ignore[attr-defined]
    assert update.added[0][2] is state.prompt_token_ids
    assert update.added[0][3] is state.output_token_ids


# ---- the sampler's order ----------------------------------------------------------------------


def _metadata(processors: LogitsProcessorBatch, temperature: list[float], **kwargs: Any) -> Any:
    import numpy as np

    n = len(temperature)
    return build_sampling_metadata(
        torch.device("cpu"), temperature=np.array(temperature, np.float32),
        top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int64), min_p=np.zeros(n, np.float32),
        generators={}, processors=processors, **kwargs,
    )  # fmt: skip


def test_sampler_runs_processors_in_vllms_order() -> None:
    """Non-invariant processors see the logits after logit_bias and before penalties; the
    argmax-invariant ones after temperature (greedy rows undivided), not at all when every row
    is greedy."""
    import numpy as np

    processors = LogitsProcessorBatch([Recorder, InvariantRecorder], None, torch.device("cpu"))  # type: ignore[arg-type]
    recorder, invariant = processors.others[0], processors.argmax_invariant[0]
    assert isinstance(recorder, Recorder) and isinstance(invariant, Recorder)
    logits = torch.randn(2, VOCAB)
    seen_ids = np.full((2, 1), 3, np.int64)
    md = _metadata(processors, [0.0, 2.0], bias={0: {5: 10.0}}, repetition=np.array([1.0, 4.0]),
                   seen_tokens=lambda rows: (seen_ids[rows], seen_ids[rows][:, :0]))  # fmt: skip
    Sampler()(logits.clone(), md)
    biased = logits.clone()
    biased[0, 5] += 10.0
    torch.testing.assert_close(recorder.seen[-1], biased)  # the bias, no penalty yet
    penalized = biased.clone()
    value = penalized[1, 3]
    penalized[1, 3] = value / 4.0 if value > 0 else value * 4.0
    penalized[1] /= 2.0  # row 1's temperature; row 0 is greedy
    torch.testing.assert_close(invariant.seen[-1], penalized)
    Sampler()(logits.clone(), _metadata(processors, [0.0, 0.0]))
    assert len(recorder.seen) == 2 and len(invariant.seen) == 1


def test_processed_logprobs_include_the_processors() -> None:
    """A token a processor excludes has -inf processed logprobs; raw ones are the model's."""
    processors = LogitsProcessorBatch([TargetToken], None, torch.device("cpu"))  # type: ignore[arg-type]
    state = CachedRequestState("a", [1], [], SamplingParams(extra_args={"target_token": 7}),
                               None, None)  # fmt: skip
    processors.update([state])
    logits = torch.randn(1, VOCAB)
    for mode, finite in (("processed_logprobs", 1), ("raw_logprobs", VOCAB)):
        out = Sampler(mode)(logits.clone(), _metadata(processors, [1.0], max_num_logprobs=VOCAB))
        assert out.sampled_token_ids.tolist() == [7]
        assert out.logprobs is not None
        assert int(out.logprobs.logprobs[0, 1:].isfinite().sum()) == finite


def test_a_processor_returning_the_wrong_shape_fails_naming_it() -> None:
    class Wrong(Recorder):
        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits[:, :-1]

    processors = LogitsProcessorBatch([Wrong], None, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Wrong.apply returned"):
        Sampler()(torch.randn(1, VOCAB), _metadata(processors, [0.0]))


# ---- the engine end to end --------------------------------------------------------------------


def _greedy(extra_args: dict[str, Any] | None = None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra_args)  # fmt: skip


def _answers(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("Qwen2ForCausalLM"))


@pytest.fixture(scope="module")
def plain_answers(qwen2: str) -> list[list[int]]:
    llm = LLM(qwen2, dtype="float32", max_model_len=128)
    try:
        return _answers(llm, make_prompts(qwen2, [5, 9, 7, 12]), [_greedy()] * 4)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_processors_steer_only_the_requests_that_ask(
    qwen2: str, plain_answers: list[list[int]], async_scheduling: bool
) -> None:
    llm = LLM(qwen2, dtype="float32", max_model_len=128, async_scheduling=async_scheduling,
              logits_processors=[TargetToken, "tests.test_logits_processors:NoRepeat"])  # fmt: skip
    try:
        prompts = make_prompts(qwen2, [5, 9, 7, 12])
        params = [_greedy({"target_token": 11}), _greedy(), _greedy({"no_repeat": True}),
                  _greedy()]  # fmt: skip
        got = _answers(llm, prompts, params)
        assert got[0] == [11] * 6
        assert got[1] == plain_answers[1] and got[3] == plain_answers[3]
        assert all(a != b for a, b in zip(got[2], got[2][1:], strict=False))
        # The plain answer repeated itself somewhere, so the processor had work to do.
        plain = plain_answers[2]
        if any(a == b for a, b in zip(plain, plain[1:], strict=False)):
            assert got[2] != plain
        # Requests come and go: a second batch reuses the processors' indices.
        again = _answers(llm, prompts[::-1], [_greedy(), _greedy({"target_token": 3}),
                                              _greedy(), _greedy()])  # fmt: skip
        assert again[0] == plain_answers[3] and again[1] == [3] * 6
        with pytest.raises(ValueError, match="TargetToken refuses them: target_token must be"):
            llm.generate({"prompt_token_ids": prompts[0]}, _greedy({"target_token": "x"}))
    finally:
        llm.llm_engine.shutdown()


def test_processors_on_tensor_parallel_workers(qwen2: str, plain_answers: list[list[int]]) -> None:
    llm = LLM(qwen2, dtype="float32", max_model_len=128, tensor_parallel_size=2,
              logits_processors=[TargetToken])  # fmt: skip
    try:
        prompts = make_prompts(qwen2, [5, 9])
        got = _answers(llm, prompts, [_greedy({"target_token": 4}), _greedy()])
        assert got == [[4] * 6, plain_answers[1]]
    finally:
        llm.llm_engine.shutdown()


def test_extra_args_without_processors_are_refused(qwen2: str) -> None:
    llm = LLM(qwen2, dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="none is loaded"):
            llm.generate({"prompt_token_ids": [1, 2, 3]}, _greedy({"target_token": 1}))
    finally:
        llm.llm_engine.shutdown()


def test_entry_points_load(monkeypatch: pytest.MonkeyPatch, qwen2: str) -> None:
    from omniserve import logits_processor

    class Point:
        name, value = "target", "tests.test_logits_processors:TargetToken"

        def load(self) -> type:
            return TargetToken

    monkeypatch.setattr(logits_processor, "_entry_points", lambda: [Point()])
    config = EngineArgs(qwen2, logits_processors=[NoRepeat]).create_config()
    assert config.model_config.logits_processors == (NoRepeat, TargetToken)
    # Where processors do not run, the entry points' are not loaded (the named ones refused).
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineArgs(qwen2, speculative_config=spec).create_config()
    assert config.model_config.logits_processors == ()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"logits_processors": ["tests.nowhere:X"]}, "cannot import 'tests.nowhere'"),
        ({"logits_processors": ["tests.test_logits_processors:Nope"]}, "has no 'Nope'"),
        ({"logits_processors": ["NoColon"]}, "not module:Class"),
        ({"logits_processors": ["omniserve.sampling_params:SamplingParams"]}, "not a subclass"),
        ({"logits_processors": [AdapterLogitsProcessor]}, "does not implement"),
        ({"logits_processors": [TargetToken], "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
        ({"logits_processors": [TargetToken], "runner": "pooling"}, "pooling models"),
    ],
)  # fmt: skip
def test_bad_settings_stop_start_up(qwen2: str, settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(qwen2, **settings).create_config()


def test_cli_flag_names_processors() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--logits-processors", "a.b:C", "d.e.F"])
    assert EngineArgs.from_cli_args(argparse.Namespace(model="m", **vars(args))).logits_processors \
        == ["a.b:C", "d.e.F"]  # fmt: skip


def test_a_class_defined_in_the_users_script_reaches_the_engine_process(
    qwen2: str, tmp_path: Any
) -> None:
    """vLLM's third way: a class from the script itself, whose engine core is a spawned
    process that never runs the script (the class travels by value)."""
    import subprocess
    import sys

    script = tmp_path / "steer.py"
    script.write_text(
        "import sys\n"
        "from omniserve import LLM, SamplingParams\n"
        "from omniserve.logits_processor import AdapterLogitsProcessor\n"
        "def only(token, output_ids, row):\n"
        "    row[:token] = row[token + 1 :] = float('-inf')\n"
        "    return row\n"
        "class Local(AdapterLogitsProcessor):\n"
        "    def is_argmax_invariant(self):\n"
        "        return False\n"
        "    def new_req_logits_processor(self, params):\n"
        "        token = params.extra_args['target_token']\n"
        "        return lambda output_ids, row: only(token, output_ids, row)\n"
        "llm = LLM(sys.argv[1], dtype='float32', max_model_len=64, logits_processors=[Local])\n"
        "params = SamplingParams(max_tokens=3, extra_args={'target_token': 5})\n"
        "(out,) = llm.generate({'prompt_token_ids': [1, 2, 3]}, params, use_tqdm=False)\n"
        "print('TOKENS', list(out.outputs[0].token_ids))\n"
    )
    done = subprocess.run([sys.executable, str(script), qwen2], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300,
                          env={**os.environ, "OMNISERVE_ENABLE_MULTIPROCESSING": "1"})  # fmt: skip
    assert "TOKENS [5, 5, 5]" in done.stdout, done.stderr[-3000:]


def test_server_takes_vllm_xargs(qwen2: str, tmp_path: Any) -> None:
    """``--logits-processors`` on the server; the OpenAI SDK sends ``vllm_xargs`` in its
    extra body, on chat and completions; a value the processor refuses is a 400."""
    from transformers import AutoTokenizer

    from tests.server_utils import MODEL, assert_error, launch_server

    flags = ("--logits-processors", "tests.test_logits_processors:TargetToken")
    with launch_server(Path(qwen2), tmp_path, *flags) as server:
        client = server.client()
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0.0, extra_body={"vllm_xargs": {"target_token": 11},
                                         "return_token_ids": True},
        )  # fmt: skip
        assert chat.choices[0].token_ids == [11] * 4  # type: ignore[attr-defined]
        completion = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, temperature=1.0, seed=1,
            extra_body={"vllm_xargs": {"target_token": 7}, "return_token_ids": True},
        )  # fmt: skip
        assert completion.choices[0].token_ids == [7] * 3  # type: ignore[attr-defined]
        # The Responses API hands vllm_xargs to its chat request.
        tokenizer = AutoTokenizer.from_pretrained(qwen2)
        xargs = {"vllm_xargs": {"target_token": 11}}
        response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                           temperature=0.0, extra_body=xargs)  # fmt: skip
        assert response.output_text == tokenizer.decode([11] * 3)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                "vllm_xargs": {"target_token": "x"}}  # fmt: skip
        error = assert_error(server.post("/v1/completions", body), 400)
        assert "TargetToken refuses them" in error["message"]
