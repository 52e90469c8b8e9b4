"""``--reasoning-parser qwen3``: ``<think>…</think>`` goes to ``reasoning_content``, streamed and
not; ``chat_template_kwargs={"enable_thinking": false}`` reaches the tiny Qwen3's own template,
which has Qwen3's switch. The random model is made to think on cue with a regex constraint."""

from __future__ import annotations

import re
from typing import Any

import pytest

from omniserve.entrypoints.openai.reasoning import ReasoningParser, StreamingSplit
from tests.server_utils import MODEL, Server

pytestmark = pytest.mark.slow  # a server with a reasoning parser

THOUGHT_THEN_ANSWER = r"<think>\n[a-z]{2,8}\n</think>\n\n[a-z]{2,8}"


@pytest.mark.parametrize(
    ("text", "in_prompt", "expected"),
    [
        ("<think>\nhmm\n</think>\n\nYes", False, ("\nhmm\n", "Yes")),
        ("plain answer", False, (None, "plain answer")),
        ("<think>cut off", False, ("cut off", None)),
        ("hmm</think>Yes", True, ("hmm", "Yes")),
        ("hmm</think>Yes", False, (None, "hmm</think>Yes")),
    ],
)
def test_split(text: str, in_prompt: bool, expected: tuple) -> None:
    assert ReasoningParser().split(text, in_prompt) == expected


def test_streaming_split_matches_the_whole_split_whatever_the_chunks() -> None:
    parser, text = ReasoningParser(), "<think>\nlet me see</think>\n\nThe answer"
    for step in (1, 2, 3, 7):
        split, parts = StreamingSplit(parser, False), []
        for end in range(step, len(text) + step, step):
            parts.append(split.feed(text[:end], final=end >= len(text)))
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            "\nlet me see",
            "The answer",
        )


@pytest.fixture(scope="module")
def server(qwen3_server: Server) -> Server:
    return qwen3_server


def _ask(server: Server, regex: str, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=40,
        temperature=0.0,
        extra_body={"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})},
        **kwargs,
    )


def test_thinking_is_split_off_streamed_and_not(server: Server) -> None:
    message = _ask(server, THOUGHT_THEN_ANSWER).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("\n[a-z]{2,8}\n", reasoning) and re.fullmatch("[a-z]{2,8}", message.content)
    chunks = list(_ask(server, THOUGHT_THEN_ANSWER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    hidden = _ask(server, THOUGHT_THEN_ANSWER, extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.model_extra.get("reasoning_content") is None


def test_enable_thinking_false_closes_the_thinking_in_the_template(server: Server) -> None:
    """The checkpoint's own (Qwen3) template: with the switch off, the prompt already holds an
    empty thinking block, so what the model writes is all content."""
    prompt = server.post(
        "/tokenize",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "return_token_strs": True,
        },
    ).json()
    assert "".join(prompt["token_strs"]).endswith("<think>ĊĊ</think>ĊĊ")
    message = (
        _ask(server, "[a-z]{2,8}", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        .choices[0]
        .message
    )
    assert message.model_extra.get("reasoning_content") is None
    assert re.fullmatch("[a-z]{2,8}", message.content)
