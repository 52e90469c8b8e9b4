"""``--reasoning-parser qwen3``: ``<think>…</think>`` goes to ``reasoning_content``, streamed and
not; ``chat_template_kwargs={"enable_thinking": false}`` reaches the template. The random model is
made to think on cue with a regex constraint, and the template opens the thinking like Qwen3's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from omniserve.entrypoints.openai.reasoning import ReasoningParser, StreamingSplit
from tests.server_utils import MODEL, Server, launch_server

# Qwen3's switch: thinking opens in the prompt unless enable_thinking is false.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THOUGHT_THEN_ANSWER = r"[a-z]{2,8}</think>[a-z]{2,8}"


@pytest.mark.parametrize(("text", "in_prompt", "expected"), [
    ("<think>\nhmm\n</think>\n\nYes", False, ("\nhmm\n", "Yes")),
    ("plain answer", False, (None, "plain answer")),
    ("<think>cut off", False, ("cut off", None)),
    ("hmm</think>Yes", True, ("hmm", "Yes")),
    ("hmm</think>Yes", False, (None, "hmm</think>Yes")),
])
def test_split(text: str, in_prompt: bool, expected: tuple) -> None:
    assert ReasoningParser().split(text, in_prompt) == expected


def test_streaming_split_matches_the_whole_split_whatever_the_chunks() -> None:
    parser, text = ReasoningParser(), "<think>\nlet me see</think>\n\nThe answer"
    for step in (1, 2, 3, 7):
        split, parts = StreamingSplit(parser, False), []
        for end in range(step, len(text) + step, step):
            parts.append(split.feed(text[:end], final=end >= len(text)))
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            "\nlet me see", "The answer")


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(tiny_checkpoint("Qwen3ForCausalLM"), tmp_path_factory.mktemp("think"),
                       "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                       "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE) as running:
        yield running


def _ask(server: Server, regex: str, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=40, temperature=0.0,
        extra_body={"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})},
        **kwargs)


def test_thinking_is_split_off_streamed_and_not(server: Server) -> None:
    message = _ask(server, THOUGHT_THEN_ANSWER).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{2,8}", reasoning) and re.fullmatch("[a-z]{2,8}", message.content)
    chunks = list(_ask(server, THOUGHT_THEN_ANSWER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    hidden = _ask(server, THOUGHT_THEN_ANSWER, extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None


def test_enable_thinking_false_reaches_the_template(server: Server) -> None:
    message = _ask(server, "[a-z]{2,8}", extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    assert re.fullmatch("[a-z]{2,8}", message.content)
    written = _ask(server, "<think>[a-z]{2,8}</think>[a-z]{2,8}", extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert written.model_extra["reasoning_content"] and written.content  # the model's own tags
