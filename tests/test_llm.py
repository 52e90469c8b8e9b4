"""The offline API end to end: sampling features, n > 1, stop strings, prompt logprobs, errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from omniserve import LLM, SamplingParams
from omniserve.engine import llm_engine
from tests.hf_reference import make_prompts

ARCH = "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint(ARCH))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=512)


def test_string_prompts_and_chat(llm):
    outputs = llm.generate(
        ["Hello, my name is", "The sky is"],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    tokenizer = llm.get_tokenizer()
    assert outputs[0].prompt_token_ids == tokenizer("Hello, my name is").input_ids
    assert outputs[0].outputs[0].text == tokenizer.decode(outputs[0].outputs[0].token_ids)
    assert outputs[0].outputs[0].finish_reason == "length"
    chat = llm.chat(
        [{"role": "user", "content": "Hi there"}],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )[0]
    assert "<|im_start|>user\nHi there<|im_end|>\n" in chat.prompt
    assert chat.prompt.endswith("<|im_start|>assistant\n")


def test_n_and_seed_reproducible_across_batches(llm, model_dir):
    prompt = {"prompt_token_ids": make_prompts(model_dir, [12])[0]}
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, n=3, seed=7, max_tokens=12)
    alone = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # children draw differently
    others = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [5, 30, 60], seed=3)]
    mixed = llm.generate(
        others + [prompt],
        [SamplingParams(temperature=0.7, max_tokens=20)] * 3 + [params],
        use_tqdm=False,
    )[-1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]


def test_stop_strings_and_stop_tokens(llm, model_dir):
    prompt = {"prompt_token_ids": make_prompts(model_dir, [20])[0]}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[
        0
    ].outputs[0]
    stop = free.text[5:9]
    assert stop.strip()
    cut = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=16, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]
    stop_id = free.token_ids[3]
    by_token = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_token.stop_reason == stop_id and by_token.finish_reason == "stop"


def test_min_tokens_and_ignore_eos(llm, model_dir):
    prompt = {"prompt_token_ids": make_prompts(model_dir, [10])[0]}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[
        0
    ].outputs[0]
    first = free.token_ids[0]
    held = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=[first]),
        use_tqdm=False,
    )[0].outputs[0]
    assert first not in held.token_ids[:3]
    eos = llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")
    forced = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(forced.token_ids) == 40 and forced.finish_reason == "length"
    assert eos is not None


@pytest.mark.slow
def test_prompt_logprobs_match_hf(model_dir):
    prompt = make_prompts(model_dir, [40])[0]
    # A small token budget makes prompt logprobs arrive over several chunked-prefill steps.
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3),
        use_tqdm=False,
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry and len(entry) >= 3
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - ref[pos - 1, token_id].item()) < 1e-4
        best = int(ref[pos - 1].argmax())
        assert best in entry and entry[best].rank == 1


def test_logprobs_modes_end_to_end(model_dir):
    """``logprobs_mode``: raw logits differ from raw logprobs by the row's log-normalizer (the
    same for every entry of a step); processed logprobs are of the distribution drawn from (top-k
    3: three finite entries, summing to probability 1); prompt logprobs stay the raw ones."""
    prompt = {"prompt_token_ids": make_prompts(model_dir, [12])[0]}
    params = SamplingParams(temperature=0.7, top_k=3, seed=5, max_tokens=6, logprobs=5,
                            prompt_logprobs=2)  # fmt: skip
    outputs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs"):
        llm = LLM(model_dir, dtype="float32", max_model_len=128, logprobs_mode=mode)
        outputs[mode] = llm.generate(prompt, params, use_tqdm=False)[0]
        llm.llm_engine.shutdown()
    raw, logits, processed = outputs.values()
    assert raw.outputs[0].token_ids == logits.outputs[0].token_ids == processed.outputs[0].token_ids
    assert processed.prompt_logprobs == raw.prompt_logprobs
    for step in range(6):
        gaps = {t: logits.outputs[0].logprobs[step][t].logprob - lp.logprob
                for t, lp in raw.outputs[0].logprobs[step].items()}  # fmt: skip
        assert max(gaps.values()) - min(gaps.values()) < 1e-4 and min(gaps.values()) > 0
        entries = processed.outputs[0].logprobs[step]
        finite = [lp.logprob for lp in entries.values() if lp.logprob > -float("inf")]
        assert len(finite) == 3 and abs(sum(math.exp(v) for v in finite) - 1) < 1e-5
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(model_dir, logprobs_mode="logits")


def test_bad_input_is_rejected_and_engine_keeps_serving(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 600}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=1000), use_tqdm=False)
    # Wrong types say what was expected, naming the argument (and the item of a list).
    for args, error, needle in (
        ((None,), TypeError, "prompts must be a prompt"),
        ((["a", 5],), TypeError, r"prompts\[1\] must be text"),
        ((["a"], {"max_tokens": 3}), TypeError, "sampling_params must be a SamplingParams"),
        ((["a", "b"], [params, None]), TypeError, r"sampling_params\[1\] must be"),
        (({"prompt": "a", "multi_modal_data": [1]},), TypeError, "multi_modal_data must be a dict"),
    ):
        with pytest.raises(error, match=needle):
            llm.generate(*args, use_tqdm=False)
    for kwargs, needle in (
        ({"stop": 5}, "stop must be a list"),
        ({"speech": "ethan"}, "speech must be a SpeechParams or a dict"),
        ({"speech": {"foo": 1}}, "speech.foo is not a speech setting"),
    ):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kwargs)
    # A bad prompt in a batch rejects the call without leaving its good prompts running.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [5] * 600}], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(["still works"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_calls_prompts_start_in_the_same_step(llm, model_dir, monkeypatch):
    """A call's requests reach the engine core (in its own process) together, so its first step
    takes them all; sent one by one, it would start on the first alone (a beam search step,
    whose requests each compute one token, would then take two forwards)."""
    monkeypatch.setattr(llm_engine, "ADD_BATCH_WINDOW_S", 60.0)  # however slow the machine
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [9] * 8, seed=5)]
    llm.llm_engine.start_step_timing()
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.llm_engine.get_step_timings()["steps"] == {"prefill": 1.0, "decode": 0.0}


@pytest.mark.slow
def test_bad_model_dirs(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    unknown = tmp_path / "unknown"
    shutil.copytree(model_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM.*not supported"):
        LLM(str(unknown), dtype="float32")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="safetensors"):
        LLM(str(no_weights), dtype="float32")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model_dir, max_model_len=10**7)


def test_allowed_token_ids_bad_words_and_logit_bias(llm):
    """Offline, as over the API: each rule changes what greedy decoding writes, only for the
    request that asked for it."""
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (base,) = llm.generate("Tell me", free, use_tqdm=False)
    ids = base.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    allowed = sorted(set(ids[1:4]) | {7})
    outs = llm.generate(
        ["Tell me"] * 4,
        [
            free.clone(allowed_token_ids=allowed),
            free.clone(bad_words=[tokenizer.decode(ids[:1])]),
            free.clone(logit_bias={7: 100.0}),
            free,
        ],
        use_tqdm=False,
    )
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert ids[0] not in outs[1].outputs[0].token_ids[:1]
    assert outs[2].outputs[0].token_ids == [7] * 8
    assert outs[3].outputs[0].token_ids == ids
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[999999\] are outside"):
        llm.generate("x", free.clone(logit_bias={999_999: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        free.clone(allowed_token_ids=[])


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority=2 needs --scheduling-policy priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[0, 2])
    with pytest.raises(ValueError, match="Got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[0])


@pytest.mark.slow
def test_generate_returns_whole_outputs_whatever_the_output_kind(tiny_checkpoint) -> None:
    """LLM.generate returns finished outputs only, so every kind gives the whole answer (a
    delta request's last output alone would hold its last token)."""
    from omniserve.sampling_params import RequestOutputKind

    llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), dtype="float32", max_model_len=256,
              kv_cache_memory=8 << 20)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(100, 110))}
    answers = [
        llm.generate(
            prompt,
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        for kind in RequestOutputKind
    ]
    assert all(len(a.token_ids) == 6 for a in answers)
    assert len({(tuple(a.token_ids), a.text) for a in answers}) == 1
