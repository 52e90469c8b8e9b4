"""Reasoning parsers (``--reasoning-parser``): split a chat answer's thinking from its content.

Qwen3-family models think inside ``<think>…</think>`` before they answer. The server reports the
thinking as ``message.reasoning_content`` (and ``delta.reasoning_content`` when streaming) and the
rest as ``content``, as vLLM does. The answer is in reasoning from its start when it opens with the
start tag, or when the prompt already ends with it (templates that open the thinking for the
model); it stays there until the end tag. Streams hold back a tail that may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniserve.config.structured_outputs import REASONING_TAGS, THINK_TAGS


@dataclass(frozen=True)
class ReasoningParser:
    start: str = THINK_TAGS[0]
    end: str = THINK_TAGS[1]

    def opens_in_prompt(self, prompt: str | None) -> bool:
        """Whether the prompt leaves the model inside its thinking."""
        return bool(prompt) and prompt.rstrip().endswith(self.start)  # type: ignore[union-attr]

    def split(self, text: str, in_reasoning: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for a part that is absent."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text, in_reasoning = stripped[len(self.start) :], True
        if not in_reasoning:
            return None, text or None
        reasoning, found, content = text.partition(self.end)
        if not found:
            return reasoning or None, None  # cut off while thinking
        return reasoning or None, content.lstrip("\n") or None


class StreamingSplit:
    """One streamed answer: feed the text so far, get what is new in reasoning and content."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.sent = ("", "")

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """New (reasoning, content) text since the last call; ``final`` flushes held-back text."""
        shown = text if final else text[: len(text) - self._partial_tag(text)]
        reasoning, content = self.parser.split(shown, self.in_reasoning)
        reasoning, content = reasoning or "", content or ""
        new = (reasoning[len(self.sent[0]) :], content[len(self.sent[1]) :])
        if reasoning.startswith(self.sent[0]) and content.startswith(self.sent[1]):
            self.sent = (reasoning, content)
            return new
        return "", ""  # not a continuation (cannot happen for growing text); send nothing

    def _partial_tag(self, text: str) -> int:
        """Length of a tail of ``text`` that could still become a start or end tag."""
        for tag in (self.parser.start, self.parser.end):
            for size in range(min(len(tag) - 1, len(text)), 0, -1):
                if text.endswith(tag[:size]):
                    return size
        return 0


REASONING_PARSERS = {name: ReasoningParser(*tags) for name, tags in REASONING_TAGS.items()}
"""``--reasoning-parser`` names (vLLM's, and those plugins register) -> parser."""


def register_reasoning_parser(name: str, parser: ReasoningParser) -> None:
    """Make ``parser`` (a ``--reasoning-parser-plugin`` file's) the ``--reasoning-parser NAME``
    parser: the server splits answers at its tags, and the engine's grammars and thinking
    budgets wait for them (``REASONING_TAGS``)."""
    if not isinstance(parser, ReasoningParser):
        raise TypeError(f"reasoning parser {name!r} must be a ReasoningParser, not {parser!r}.")
    if not (parser.start and parser.end and parser.start != parser.end):
        raise ValueError(f"reasoning parser {name!r} needs two different, non-empty tags.")
    REASONING_TAGS[name] = (parser.start, parser.end)
    REASONING_PARSERS[name] = parser
