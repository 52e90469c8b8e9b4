"""OutputProcessor: n > 1 aggregation, output kinds, stop strings, logprobs, abort."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from omniserve.engine.output_processor import OutputProcessor
from omniserve.messages import EngineCoreOutput, FinishReason, LogprobsLists
from omniserve.outputs import RequestOutput
from omniserve.sampling_params import RequestOutputKind, SamplingParams
from tests.test_detokenizer import byte_token_ids

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Callable[..., Path]) -> Any:
    return AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen2ForCausalLM"))


class ListQueue:
    def __init__(self) -> None:
        self.items: list[RequestOutput | BaseException] = []

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)


def out(
    request_id: str, ids: list[int], finish: FinishReason | None = None, **kwargs: Any
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, ids, finish_reason=finish, **kwargs)


def add(
    processor: OutputProcessor,
    tokenizer: Any,
    request_id: str = "r",
    children: list[str] | None = None,
    **params: Any,
) -> list[int]:
    prompt_ids = tokenizer.encode("Tell me:")
    processor.add_request(request_id, "Tell me:", prompt_ids, SamplingParams(**params), children)
    return prompt_ids


def test_n_children_aggregate_cumulatively(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, children=["0_r", "1_r"], n=2)
    a, b = tokenizer.encode(" alpha beta"), tokenizer.encode(" gamma")
    first = processor.process_outputs([out("1_r", b[:1]), out("0_r", a[:1])]).request_outputs
    assert len(first) == 1 and not first[0].finished
    assert [c.index for c in first[0].outputs] == [0, 1]
    second = processor.process_outputs([out("1_r", b[1:], FinishReason.LENGTH)])
    (output,) = second.request_outputs
    assert output.outputs[1].text == " gamma" and output.outputs[1].finish_reason == "length"
    assert output.outputs[0].finish_reason is None and not output.finished
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (final,) = processor.process_outputs(
        [out("0_r", a[1:] + [eos], FinishReason.STOP, stop_reason=None)]
    ).request_outputs
    assert final.finished and [c.text for c in final.outputs] == [" alpha beta", " gamma"]
    assert final.outputs[0].token_ids == a + [eos] and final.outputs[0].finish_reason == "stop"
    assert not processor.has_unfinished_requests()


def test_delta_outputs_carry_only_what_changed(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, children=["0_r", "1_r"], n=2, output_kind=DELTA)
    a, b = tokenizer.encode(" one two three"), tokenizer.encode(" four")
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    steps = [
        [out("0_r", a[:1])],
        [out("0_r", a[1:2]), out("1_r", b)],
        [out("0_r", a[2:], FinishReason.LENGTH), out("1_r", [], FinishReason.LENGTH)],
    ]
    for step in steps:
        (output,) = processor.process_outputs(step).request_outputs
        assert sorted(c.index for c in output.outputs) == sorted(
            {int(o.request_id[0]) for o in step}
        )
        for completion in output.outputs:
            texts[completion.index] += completion.text
            tokens[completion.index] += completion.token_ids
    assert output.finished
    assert texts == {0: " one two three", 1: " four"} and tokens == {0: a, 1: b}


def test_final_only_emits_once(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, children=["0_r", "1_r"], n=2, output_kind=FINAL_ONLY)
    ids = tokenizer.encode(" yes no")
    assert (
        processor.process_outputs([out("0_r", ids[:1]), out("1_r", ids[:1])]).request_outputs == []
    )
    assert (
        processor.process_outputs([out("0_r", ids[1:], FinishReason.LENGTH)]).request_outputs == []
    )
    (final,) = processor.process_outputs([out("1_r", [], FinishReason.STOP)]).request_outputs
    assert final.finished
    assert [c.text for c in final.outputs] == [" yes no", tokenizer.decode(ids[:1])]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_aborts_the_child(tokenizer: Any, include: bool) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["END"], include_stop_str_in_output=include, output_kind=DELTA)
    streamed = ""
    for piece in ["Done", " E", "N"]:
        result = processor.process_outputs([out("r", tokenizer.encode(piece))])
        assert result.reqs_to_abort == [] and len(result.request_outputs) == 1
        streamed += result.request_outputs[0].outputs[0].text
    # Without the stop string in the output, the last len("END") - 1 chars are held back.
    assert streamed == ("Done EN" if include else "Done ")
    result = processor.process_outputs([out("r", tokenizer.encode("D and more"))])
    assert result.reqs_to_abort == ["r"]
    (output,) = result.request_outputs
    completion = output.outputs[0]
    streamed += completion.text
    assert output.finished and completion.finish_reason == "stop"
    assert completion.stop_reason == "END"
    assert streamed == ("Done END" if include else "Done ")
    # The engine's late output for the aborted child is ignored.
    assert processor.process_outputs([out("r", [5])]).request_outputs == []
    assert not processor.has_unfinished_requests()


def test_multibyte_characters_split_over_tokens(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, output_kind=DELTA)
    ids = byte_token_ids(tokenizer, "日本😀")
    deltas = []
    for i, token in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        (output,) = processor.process_outputs([out("r", [token], finish)]).request_outputs
        deltas.append(output.outputs[0].text)
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["日", "本", "😀"]


def _lists(token_ids: list[list[int]], start: float = -1.0) -> LogprobsLists:
    logprobs = [[start - i - j * 0.5 for j in range(len(ids))] for i, ids in enumerate(token_ids)]
    return LogprobsLists(token_ids, logprobs, [2] * len(token_ids))


def test_prompt_logprobs_accumulate_across_chunks(tokenizer: Any) -> None:
    for kind in (CUMULATIVE, DELTA):
        processor = OutputProcessor(tokenizer)
        prompt_ids = add(processor, tokenizer, prompt_logprobs=1, output_kind=kind)
        first, second = prompt_ids[1:3], prompt_ids[3:]
        # A partial prefill: prompt logprobs only, nothing to emit yet.
        assert (
            processor.process_outputs(
                [out("r", [], new_prompt_logprobs=_lists([[t, 7] for t in first]))]
            ).request_outputs
            == []
        )
        (output,) = processor.process_outputs(
            [
                out(
                    "r",
                    [11],
                    new_prompt_logprobs=_lists([[t, 7] for t in second]),
                    num_cached_tokens=2,
                )
            ]
        ).request_outputs
        logprobs = output.prompt_logprobs
        assert logprobs is not None and len(logprobs) == len(prompt_ids)
        assert logprobs[0] is None
        for position, token in enumerate(prompt_ids[1:], 1):
            entry = logprobs[position]
            assert entry is not None and token in entry and 7 in entry
            assert entry[token].decoded_token == tokenizer.decode([token])
        assert output.num_cached_tokens == 2
        # After a preemption the engine recomputes the prompt: the copy is ignored.
        recomputed = _lists([[t, 7] for t in prompt_ids[1:]])
        (later,) = processor.process_outputs(
            [out("r", [12], new_prompt_logprobs=recomputed)]
        ).request_outputs
        assert later.prompt_logprobs == (None if kind == DELTA else logprobs)
        assert len(logprobs) == len(prompt_ids)


def test_sample_logprobs_dicts_and_cumulative(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, logprobs=2)
    processor.process_outputs(
        [out("r", [40], new_logprobs=LogprobsLists([[40, 41, 40]], [[-0.5, -0.3, -0.5]], [2]))]
    )
    (output,) = processor.process_outputs(
        [
            out(
                "r",
                [50],
                FinishReason.LENGTH,
                new_logprobs=LogprobsLists([[50, 50, 51]], [[-0.1, -0.1, -2.0]], [1]),
            )
        ]
    ).request_outputs
    completion = output.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-0.6)
    assert completion.logprobs is not None and len(completion.logprobs) == 2
    step0, step1 = completion.logprobs
    assert set(step0) == {40, 41} and step0[41].rank == 1 and step0[41].logprob == -0.3
    assert step0[40].logprob == -0.5 and step0[40].decoded_token == tokenizer.decode([40])
    assert set(step1) == {50, 51} and step1[50].rank == 1 and step1[51].rank == 2


def test_no_logprobs_requested_gives_none(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer)
    (output,) = processor.process_outputs([out("r", [5], FinishReason.LENGTH)]).request_outputs
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None
    assert output.prompt_logprobs is None


def test_abort_returns_children_and_notifies_the_queue(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    queue = ListQueue()
    processor.add_request("r", None, [1, 2], SamplingParams(n=2), ["0_r", "1_r"], queue=queue)
    processor.add_request("s", None, [1, 2], SamplingParams())
    result = processor.process_outputs([out("1_r", [5], FinishReason.LENGTH), out("s", [6])])
    assert [o.request_id for o in result.request_outputs] == ["s"]  # "r" went to its queue
    assert len(queue.items) == 1
    assert processor.abort_requests(["r", "unknown"]) == ["0_r"]  # 1_r already finished
    final = queue.items[-1]
    assert isinstance(final, RequestOutput) and final.finished
    assert [c.finish_reason for c in final.outputs] == ["abort", "length"]
    assert processor.process_outputs([out("0_r", [7])]).request_outputs == []
    assert processor.get_num_unfinished_requests() == 1
    assert processor.abort_requests(["s"]) == ["s"]
    assert not processor.has_unfinished_requests()


def test_metrics_and_errors(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    queue = ListQueue()
    processor.add_request("r", None, [1], SamplingParams(), queue=queue, arrival_time=10.0)
    processor.process_outputs([out("r", [5])], now=11.0)
    processor.process_outputs([out("r", [6])], now=12.5)
    output = queue.items[-1]
    assert isinstance(output, RequestOutput)
    assert output.metrics == {
        "arrival_time": 10.0,
        "first_token_time": 11.0,
        "last_token_time": 12.5,
    }
    error = RuntimeError("engine died")
    processor.propagate_error(error)
    assert queue.items[-1] is error and not processor.has_unfinished_requests()


def test_without_detokenization_text_stays_empty() -> None:
    processor = OutputProcessor(None)
    processor.add_request("r", None, [1, 2], SamplingParams(logprobs=0))
    (output,) = processor.process_outputs(
        [out("r", [3], FinishReason.LENGTH, new_logprobs=LogprobsLists([[3]], [[-1.0]], [1]))]
    ).request_outputs
    completion = output.outputs[0]
    assert completion.text == "" and completion.token_ids == [3]
    assert completion.logprobs is not None and completion.logprobs[0][3].decoded_token is None


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_stream_interval_sends_the_first_token_then_every_few_and_the_end(
    tokenizer: Any, kind: RequestOutputKind
) -> None:
    """vLLM's --stream-interval 3: outputs after tokens 1, 4, 7 and at the end (8), the held
    tokens carried by the next output, so the deltas add up to the whole answer."""
    processor = OutputProcessor(tokenizer, stream_interval=3)
    add(processor, tokenizer, output_kind=kind)
    ids = tokenizer.encode(" one two three four five six seven eight")[:8]
    assert len(ids) == 8
    sent: list[tuple[int, RequestOutput]] = []
    for step, token in enumerate(ids, 1):
        finish = FinishReason.LENGTH if step == len(ids) else None
        for output in processor.process_outputs([out("r", [token], finish)]).request_outputs:
            sent.append((step, output))
    assert [step for step, _ in sent] == [1, 4, 7, 8]
    if kind == DELTA:
        assert [len(o.outputs[0].token_ids) for _, o in sent] == [1, 3, 3, 1]
        assert sum((o.outputs[0].token_ids for _, o in sent), []) == ids
        assert "".join(o.outputs[0].text for _, o in sent) == tokenizer.decode(ids)
    else:
        assert [len(o.outputs[0].token_ids) for _, o in sent] == [1, 4, 7, 8]
    assert sent[-1][1].finished and not processor.has_unfinished_requests()
