"""Scoring a served demo model through the OpenAI API, per task."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omniserve.demo_model.tasks import Example


@dataclass
class Graded:
    example: Example
    reply: str

    @property
    def correct(self) -> bool:
        return self.example.is_correct(self.reply)


def ask(client: Any, model: str, example: Example, max_tokens: int = 96) -> str:
    """The served model's greedy reply to the example's question."""
    extra = {"mm_processor_kwargs": kwargs} if (kwargs := example.mm_processor_kwargs()) else {}
    response = client.chat.completions.create(
        model=model,
        messages=example.messages(),
        temperature=0.0,
        max_tokens=max_tokens,
        extra_body=extra or None,
    )
    return response.choices[0].message.content or ""


def grade(
    client: Any, model: str, examples: Iterable[Example], concurrency: int = 8
) -> list[Graded]:
    examples = list(examples)
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda example: ask(client, model, example), examples))
    return [Graded(example, reply) for example, reply in zip(examples, replies, strict=True)]


def accuracy_by_task(graded: list[Graded]) -> dict[str, float]:
    tasks: dict[str, list[bool]] = {}
    for item in graded:
        tasks.setdefault(item.example.task, []).append(item.correct)
    return {task: sum(marks) / len(marks) for task, marks in tasks.items()}
