"""Scoring's rules that ``LLM.score`` and the ``/score`` and ``/rerank`` routes share: how the two
inputs pair up, and a cross-encoder's prompt of a text pair under a score template."""

from __future__ import annotations

from typing import Any

from omniserve.entrypoints.chat_utils import apply_chat_template


def score_pairs(
    num_1: int, num_2: int, names: tuple[str, str] = ("data_1", "data_2")
) -> list[tuple[int, int]]:
    """Which inputs each score pairs, as vLLM pairs them: one first input with each second one
    (1:1, 1:N) or the i-th with the i-th (N:N). Other counts raise ``ValueError`` naming the
    field (``names``: the two fields as the caller calls them)."""
    if num_1 == 0 or num_2 == 0:
        raise ValueError(f"{names[0] if num_1 == 0 else names[1]} must not be empty.")
    if num_1 > 1 and num_1 != num_2:
        raise ValueError(
            f"{names[1]}: {num_1} {names[0]} and {num_2} {names[1]} do not pair; give 1:1, "
            "1:N or N:N inputs."
        )
    return [(0 if num_1 == 1 else i, i) for i in range(num_2)]


def score_pair_text(tokenizer: Any, query: str, document: str, chat_template: str | None) -> str:
    """A cross-encoder's prompt of a text pair: the two texts end to end (vLLM's form for a
    decoder-based reranker, no separator), or as a score template renders a "query" and a
    "document" message (vLLM's ``--chat-template`` for cross-encoders, e.g. an LLM reranker's
    instruction)."""
    if chat_template is None:
        return query + document
    pair = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    return apply_chat_template(
        tokenizer, pair, chat_template=chat_template, add_generation_prompt=False
    )
