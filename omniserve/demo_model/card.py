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
        f"- Command: `{recipe['command']}` (deterministic for a seed and thread count; resumable).",
        f"- Data: `omniserve.demo_model.tasks`, generator version {recipe['generator_version']},"
        f" seed {recipe['seed']}; one task per batch, drawn with weights "
        f"{recipe['task_weights']}.",
        "- Model: the checkpoint builder's tiny Qwen3-Omni-MoE thinker with "
        f"`{recipe['overrides']}`.",
        f"- Optimiser: {recipe['optimizer']}, gradient clip {recipe['grad_clip']}, "
        f"{recipe['schedule']}, warmup {recipe['warmup']} steps.",
        f"- Wall time: {recipe['wall_seconds'] / 60:.1f} min on {recipe['threads']} CPU threads "
        f"(torch {recipe['torch']}).",
        "- Final training loss (mean of each task's last 20 batches): "
        + ", ".join(f"{task} {loss}" for task, loss in recipe["final_loss_by_task"].items())
        + ".",
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


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None
