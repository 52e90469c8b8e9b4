"""The demo checkpoint's model card (README.md), rendered from the figures the scripts record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECIPE_FILE = "training_recipe.json"
"""Written by scripts/train_demo_model.py: configuration, schedule, wall time, final losses."""
EVAL_FILE = "eval_results.json"
"""Written by scripts/eval_demo_model.py --card: per-task accuracy on a held-out set."""


def write_card(checkpoint: Path) -> None:
    recipe = json.loads((checkpoint / RECIPE_FILE).read_text())
    results = _read(checkpoint / EVAL_FILE)
    lines = [
        "# omniserve demo model",
        "",
        "omniserve's demo model: a small Qwen3-Omni-MoE thinker "
        f"(`{recipe['architecture']}`, transformers' own architecture and file layout) trained "
        "from random weights on a synthetic multimodal instruction set. It answers short "
        "questions about shapes and colours in images, beeps in sounds, a moving shape in a "
        "video (with or without its soundtrack), and a few chat turns. It knows nothing else: "
        "it shows the serving stack working, it is not a general assistant.",
        "",
        "## Training",
        "",
        "Model: the checkpoint builder's tiny Qwen3-Omni-MoE thinker with "
        f"`{recipe['overrides']}`. Data: `omniserve.demo_model.tasks`, generator version "
        f"{recipe['generator_version']}; one task per batch. Training-only linear probes on each "
        "tower's mean output predict the example's facts (count, colour, shape, position, "
        "direction; beeps, pitch, loudness) beside the answer loss.",
        "",
        *(line for stage in _stages(recipe) for line in _stage_lines(stage)),
        "",
        "## Evaluation",
        "",
    ]
    if results is None:
        lines.append(
            "Not evaluated yet: run `python scripts/eval_demo_model.py --model "
            "<this directory> --card`."
        )
    else:
        lines += [
            f"`{results['command']}`: {results['per_task']} held-out examples per task (seed "
            f"{results['seed']}, generator version {results['generator_version']}), greedy, "
            "served by omniserve through the OpenAI API. A reply counts as correct when it "
            "equals the reference sentence up to case and punctuation.",
            "",
            "| task | accuracy |",
            "|---|---|",
            *(f"| {task} | {acc:.1%} |" for task, acc in results["accuracy"].items()),
        ]
    (checkpoint / "README.md").write_text("\n".join(lines) + "\n")


def _stages(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe's stages, first first (a later stage keeps its predecessor's recipe)."""
    stages = [recipe]
    while "previous_stage" in stages[0]:
        stages.insert(0, stages[0]["previous_stage"])
    return stages


def _stage_lines(stage: dict[str, Any]) -> list[str]:
    return [
        f"- `{stage['command']}` (deterministic for a seed and thread count; resumable): seed "
        f"{stage['seed']}, task weights {stage['task_weights']}, probe weight "
        f"{stage['probe_weight']}; {stage['optimizer']}, gradient clip {stage['grad_clip']}, "
        f"{stage['schedule']}, warmup {stage['warmup']} steps; "
        f"{stage['wall_seconds'] / 60:.1f} min on {stage['threads']} CPU threads "
        f"(torch {stage['torch']}). Final training loss (mean of each task's last 20 batches): "
        + ", ".join(f"{task} {loss}" for task, loss in stage["final_loss_by_task"].items())
        + ".",
    ]


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None
