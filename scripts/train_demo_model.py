"""Train omniserve's default model: a small Qwen3-Omni-MoE thinker on the synthetic demo tasks.

    python scripts/train_demo_model.py --out /tmp/demo-model
    python scripts/train_demo_model.py --out /tmp/demo-audio --tasks audio --steps 500  # one task

The model starts from the checkpoint builder's random weights (`training.MODEL_OVERRIDES`), and
trains with transformers' own `Qwen3OmniMoeThinkerForConditionalGeneration` (loss on the answer
tokens only) on batches drawn by `omniserve.demo_model.tasks`, each batch one task, every example
a pure function of (seed, index). Deterministic for a given seed and thread count; resumable:
state is saved to `--work-dir` every `--save-every` steps and a rerun with the same arguments
continues from it. The final weights, the processor and a model card (recipe, generator version,
training figures) go to `--out`; `scripts/eval_demo_model.py --card` adds the accuracy figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from omniserve.demo_model import card
from omniserve.demo_model.tasks import GENERATOR_VERSION, TASK_WEIGHTS, TASKS, make_example
from omniserve.demo_model.training import (
    ARCHITECTURE,
    MODEL_OVERRIDES,
    TowerProbes,
    collate,
    encode,
    init_encoders,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the checkpoint goes")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/omniserve-demo-train"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--encoder-lr",
        type=float,
        default=None,
        help="peak learning rate of the vision and audio towers (default: --lr)",
    )
    parser.add_argument(
        "--probe-weight",
        type=float,
        default=1.0,
        help="weight of the towers' fact-probe loss (training.TowerProbes)",
    )
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=list(TASKS),
        help="train on these tasks only (experiments, or a second stage)",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        type=int,
        default=None,
        help="how often each of --tasks is drawn (default: tasks.TASK_WEIGHTS)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from this trained checkpoint (a second stage) instead of random weights",
    )
    args = parser.parse_args()
    if args.weights is not None and len(args.weights) != len(args.tasks):
        parser.error("--weights needs one weight per task of --tasks")
    return args


class Batches(torch.utils.data.Dataset):
    """Batch `step` of the run: one task (drawn by TASK_WEIGHTS), `batch_size` examples of it."""

    def __init__(self, init_dir: Path, args: argparse.Namespace) -> None:
        self.init_dir, self.seed, self.batch_size, self.steps = (
            init_dir,
            args.seed,
            args.batch_size,
            args.steps,
        )
        self.tasks = tuple(args.tasks)
        self.weights = args.weights or [TASK_WEIGHTS[TASKS.index(task)] for task in self.tasks]
        self.processor: Any = None

    def __len__(self) -> int:
        return self.steps

    def task(self, step: int) -> str:
        return random.Random(f"batch-{self.seed}-{step}").choices(self.tasks, self.weights)[0]

    def __getitem__(self, step: int) -> dict[str, Any]:
        if self.processor is None:  # loaded in the worker process that uses it
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.init_dir)
        task = self.task(step)
        first = step * self.batch_size
        examples = [make_example(self.seed, first + j, task) for j in range(self.batch_size)]
        items = [encode(self.processor, example) for example in examples]
        return {
            "task": task,
            "facts": [example.facts for example in examples],
            **collate(items, self.processor.tokenizer.pad_token_id),
        }


def linear_patch_embed(model: torch.nn.Module) -> None:
    """Run the vision patch embedding (a Conv3d whose stride is its kernel) as the equal matmul:
    the same weights, without mkldnn's slow Conv3d weight gradient (~20% of a video step)."""
    embed = model.model.visual.patch_embed
    proj = embed.proj

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.to(proj.weight.dtype).view(-1, proj.weight[0].numel())
        return torch.nn.functional.linear(flat, proj.weight.flatten(1), proj.bias)

    embed.forward = forward


def _param_groups(
    model: torch.nn.Module, probes: TowerProbes, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The towers at `--encoder-lr`, the rest (and the probes) at `--lr` (as a scale of the one
    schedule)."""
    towers = ("model.audio_tower.", "model.visual.")
    named = [*model.named_parameters(), *probes.named_parameters(prefix="probes")]
    scale = (args.encoder_lr or args.lr) / args.lr
    return [
        {"params": [p for n, p in named if not n.startswith(towers)], "lr_scale": 1.0},
        {"params": [p for n, p in named if n.startswith(towers)], "lr_scale": scale},
    ]


OPTIMIZER = {"weight_decay": 0.01, "betas": (0.9, 0.98)}
"""AdamW's settings (the model card reports them as they are)."""
GRAD_CLIP = 1.0


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from omniserve.checkpoint_builder import build_tiny_checkpoint

    args.work_dir.mkdir(parents=True, exist_ok=True)
    init_dir = build_tiny_checkpoint(
        ARCHITECTURE, args.work_dir / "init", seed=args.seed, overrides=MODEL_OVERRIDES
    )
    torch.manual_seed(args.seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        args.init_from or init_dir, dtype=torch.float32
    )
    if args.init_from is None:
        init_encoders(model)
    probes = TowerProbes(model)
    model.train()
    linear_patch_embed(model)
    optimizer = torch.optim.AdamW(_param_groups(model, probes, args), **OPTIMIZER)
    state_file = args.work_dir / f"state-s{args.seed}.pt"
    start, history, seconds = 0, [], 0.0
    if state_file.exists():
        state = torch.load(state_file, weights_only=False)
        if state["args"] != _run_key(args):
            raise SystemExit(f"{state_file} is from a run with other arguments; remove it first")
        model.load_state_dict(state["model"])
        probes.load_state_dict(state["probes"])
        optimizer.load_state_dict(state["optimizer"])
        start, history, seconds = state["step"], state["history"], state["seconds"]
        print(f"resuming at step {start}")
    batches = Batches(init_dir, args)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(batches, range(start, args.steps)),
        batch_size=None,
        num_workers=1,
        prefetch_factor=4,
        persistent_workers=False,
    )
    smoothed: dict[str, float] = {}
    began = time.perf_counter()
    bar = tqdm(loader, initial=start, total=args.steps, desc="training", unit="step")
    for step, batch in enumerate(bar, start=start):
        task, facts = batch.pop("task"), batch.pop("facts")
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args) * group["lr_scale"]
        loss = model(**batch).loss
        probe_loss = probes.loss(facts)
        total = loss if probe_loss is None else loss + args.probe_weight * probe_loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *probes.parameters()], GRAD_CLIP)
        optimizer.step()
        for key, value in ((task, loss), ("probe", probe_loss)):
            if value is not None:
                smoothed[key] = 0.9 * smoothed.get(key, value.item()) + 0.1 * value.item()
        history.append((step, task, round(loss.item(), 5)))
        bar.set_postfix({t[:5]: f"{v:.3f}" for t, v in sorted(smoothed.items())})
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            _save_state(
                state_file,
                model,
                probes,
                optimizer,
                step + 1,
                history,
                seconds + time.perf_counter() - began,
                args,
            )
    seconds += time.perf_counter() - began
    _publish(model, init_dir, args, batches, history, seconds)


def _run_key(args: argparse.Namespace) -> dict[str, Any]:
    return {key: value for key, value in vars(args).items() if key in _RUN_KEYS} | {
        "init_from": str(args.init_from) if args.init_from else None
    }


_RUN_KEYS = (
    "steps",
    "batch_size",
    "lr",
    "encoder_lr",
    "probe_weight",
    "warmup",
    "seed",
    "tasks",
    "weights",
)
"""The arguments a saved state belongs to: a rerun continues it only when they are the same."""


def _save_state(
    path: Path,
    model: torch.nn.Module,
    probes: TowerProbes,
    optimizer: torch.optim.Optimizer,
    step: int,
    history: list,
    seconds: float,
    args: argparse.Namespace,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "probes": probes.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "history": history,
            "seconds": seconds,
            "args": _run_key(args),
        },
        tmp,
    )
    tmp.replace(path)


def _publish(
    model: Any,
    init_dir: Path,
    args: argparse.Namespace,
    batches: Batches,
    history: list,
    seconds: float,
) -> None:
    """The trained checkpoint at `--out`: weights, the builder's processor files, a model card."""
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    # Served greedy unless a request asks otherwise: each question has one exact answer.
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(
        json.dumps({**generation, "temperature": 0.0}, indent=2) + "\n"
    )
    for file in init_dir.iterdir():
        if not file.name.startswith(
            ("model", "config.json", "generation_config", "omniserve_build")
        ):
            shutil.copy(file, out / file.name)
    final = {
        task: sum(losses[-20:]) / len(losses[-20:])
        for task in TASKS
        if (losses := [h[2] for h in history if h[1] == task])
    }
    recipe = {
        "command": " ".join(
            ["python scripts/train_demo_model.py", *(shlex.quote(arg) for arg in sys.argv[1:])]
        ),
        "architecture": ARCHITECTURE,
        "overrides": MODEL_OVERRIDES,
        "generator_version": GENERATOR_VERSION,
        **_run_key(args),
        "threads": args.threads,
        "optimizer": {"name": "AdamW", **OPTIMIZER},
        "grad_clip": GRAD_CLIP,
        "schedule": "linear warmup, cosine to 5%",
        "task_weights": dict(zip(batches.tasks, batches.weights, strict=True)),
        "wall_seconds": round(seconds),
        "final_loss_by_task": {task: round(loss, 4) for task, loss in final.items()},
        "torch": torch.__version__,
    }
    if args.init_from is not None:  # a later stage: its card tells the whole history
        recipe["previous_stage"] = json.loads((args.init_from / card.RECIPE_FILE).read_text())
    (out / card.RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    card.write_card(out)
    print(
        f"trained in {seconds / 60:.1f} min; final loss by task: "
        + ", ".join(f"{k} {v:.4f}" for k, v in final.items())
        + f"; written to {out}"
    )


if __name__ == "__main__":
    main()
