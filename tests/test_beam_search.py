"""Beam search (``LLM.beam_search``, ``use_beam_search`` on chat and completions): the search's
bookkeeping on made-up logprobs, the beams against the same search run on transformers' logits
(fp32, tiny Qwen2), and the API's choices and refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from omniserve import LLM
from omniserve.entrypoints.beam_search import BeamSearch, BeamSearchParams
from omniserve.outputs import Logprob
from tests.server_utils import MODEL, Server, assert_error

EOS = 0


def _step(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {token: Logprob(logprob) for token, logprob in pairs}


def test_finished_beams_and_the_length_penalty() -> None:
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3), [EOS], max_model_len=100)
    search.advance([_step((5, -0.1), (EOS, -0.2), (6, -1.0), (7, -3.0))], prompt_len=4)
    assert [b.tokens for b in search.live] == [[5], [6]]
    assert [b.tokens for b in search.finished] == [[EOS]]
    search.advance([_step((8, -0.5), (9, -2.0)), _step((8, -0.1), (EOS, -0.1))], prompt_len=4)
    assert [b.tokens for b in search.live] == [[5, 8], [6, 8]]  # -0.6 / 6, -1.1 / 6
    assert not search.done
    search.advance([_step((1, -5.0)), _step((2, -5.0))], prompt_len=4)
    assert search.done
    best = search.result(str)
    # scores: [0] -0.2 / 4 (the end token not counted); [5, 8, 1] -5.6 / 7; [6, 0] -1.1 / 5
    assert [(b.tokens, b.finish_reason) for b in best] == [([EOS], "stop"), ([6, EOS], "stop")]
    long = BeamSearch(
        BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), [EOS], 100
    )  # no length normalisation: the cumulative logprob alone
    long.advance([_step((EOS, -0.3), (3, -0.2))], prompt_len=1)
    long.advance([_step((4, -0.2))], prompt_len=1)
    assert [(b.tokens, b.finish_reason) for b in long.result(str)] == [([EOS], "stop")]
    ignoring = BeamSearch(BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), [EOS], 3)
    ignoring.advance([_step((EOS, -0.1))], prompt_len=2)
    assert [b.tokens for b in ignoring.live] == [[EOS]] and ignoring.done  # max_model_len
    assert ignoring.result(str)[0].finish_reason == "length"
    with pytest.raises(ValueError, match="at most 10 beams"):
        BeamSearchParams(beam_width=11, max_tokens=1).check_width(20)


def _reference(model: torch.nn.Module, prompt: list[int], params: BeamSearchParams,
               eos: set[int]) -> list[tuple[list[int], float]]:  # fmt: skip
    """The same search on transformers' logits: (tokens, cumulative logprob) of the best."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        length = len(prompt) + len(tokens) - (bool(tokens) and tokens[-1] in eos)
        return cum / length**params.length_penalty

    for _ in range(params.max_tokens):
        grown = []
        for tokens, cum in live:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), -1).topk(2 * params.beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (finished if token in eos else grown).append((tokens + [token], cum + logprob))
        live = sorted(grown, key=score, reverse=True)[: params.beam_width]
    return sorted(finished + live, key=score, reverse=True)[: params.beam_width]


def test_beams_match_the_search_on_transformers(tiny_checkpoint: Callable[..., Path]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    llm = LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.7)
    prompts = [[5, 17, 230, 9], [44, 3, 812]]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = set(llm.llm_engine.processor.eos_token_ids)
    llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = _reference(model, prompt, params, eos)
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in expected]
        assert [beam.cum_logprob for beam in output.sequences] == pytest.approx(
            [cum for _, cum in expected], abs=1e-4
        )
        assert all(beam.text is not None for beam in output.sequences)


def test_the_api_returns_the_best_beams_as_choices(qwen3_server: Server) -> None:
    client = qwen3_server.client()
    ask = {"model": MODEL, "max_tokens": 4, "n": 3, "extra_body": {"use_beam_search": True}}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **ask)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    texts = [c.message.content for c in chat.choices]
    assert len(set(texts)) == 3, texts  # three different beams
    again = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}],
        **{**ask, "extra_body": {"use_beam_search": True, "return_token_ids": True}},
    )
    assert [c.message.content for c in again.choices] == texts  # deterministic
    assert chat.usage.completion_tokens == sum(len(c.token_ids) for c in again.choices)
    completion = client.completions.create(prompt=["Hello", "Good"], **ask)
    assert [c.index for c in completion.choices] == list(range(6))
    # The two prompts' searches step together; each answers as it would alone.
    alone = [client.completions.create(prompt=p, **ask).choices for p in ("Hello", "Good")]
    assert [c.text for c in completion.choices] == [c.text for c in alone[0] + alone[1]]
    for body, param in [
        ({"stream": True}, "use_beam_search"),
        ({"temperature": 0.8}, "use_beam_search"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 11}, "n"),
        ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        response = qwen3_server.post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "use_beam_search": True, **body,
        })  # fmt: skip
        assert assert_error(response, 400)["param"] == param, (body, response.text)


def test_beams_keep_the_prompts_media(default_server: Server) -> None:
    """Each step's requests carry the image and the sound of the prompt."""
    import base64

    from tests.test_default_model import IMAGE, WAV, _messages, _png

    messages = _messages(
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()}},
        {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(WAV).decode(), "format": "wav"}},
    )  # fmt: skip
    chat = default_server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, n=2,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert len(chat.choices) == 2 and chat.choices[0].message.content
    details = chat.usage.prompt_tokens_details
    assert details.image_tokens > 0 and details.audio_tokens > 0
