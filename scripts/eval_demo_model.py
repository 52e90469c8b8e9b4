"""Score the demo model as served: per-task accuracy on a held-out set, through the OpenAI API.

    python scripts/eval_demo_model.py --model /tmp/demo-model          # serves it itself
    python scripts/eval_demo_model.py --model /tmp/demo-model --card   # ... and records the
                                                                       # figures in its card
    python scripts/eval_demo_model.py --base-url http://127.0.0.1:8000/v1 --api-key sk-local

The held-out examples come from `omniserve.demo_model.tasks` under `--seed` (training used 0),
`--per-task` of each task. Requests are greedy and sent `--concurrency` at a time. Without
`--base-url` the script starts `omniserve serve [--model]` on a free port and stops it after.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from bench_serving import RunningServer, ServerSpec
from openai import OpenAI

from omniserve.demo_model import card
from omniserve.demo_model.evaluate import accuracy_by_task, grade
from omniserve.demo_model.tasks import GENERATOR_VERSION, TASKS, make_examples

TARGET = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint to serve (default: omniserve serve's default model)",
    )
    parser.add_argument("--base-url", default=None, help="score a running server instead")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--per-task", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--show", type=int, default=3, help="wrong replies shown per task")
    parser.add_argument(
        "--card", action="store_true", help="write the figures into the checkpoint's model card"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.card and (args.base_url or args.model is None):
        raise SystemExit("--card writes into the checkpoint: pass --model (not --base-url)")
    examples = make_examples(args.seed, args.per_task * len(TASKS))
    server = None
    if args.base_url is None:
        command = [
            sys.executable,
            "-m",
            "omniserve.entrypoints.cli",
            "serve",
            *([str(args.model)] if args.model else []),
            "--port",
            "{port}",
        ]
        server = RunningServer(
            ServerSpec("omniserve", command, "", {}), Path(tempfile.mkdtemp(prefix="eval-demo-"))
        )
        server.wait_ready()
        args.base_url = server.url + "/v1"
    try:
        client = OpenAI(base_url=args.base_url, api_key=args.api_key)
        model = client.models.list().data[0].id
        graded = grade(client, model, examples, args.concurrency)
    finally:
        if server is not None:
            server.stop()
    accuracy = accuracy_by_task(graded)
    print(f"{'task':<16}{'accuracy':>10}")
    for task, value in accuracy.items():
        print(f"{task:<16}{value:>10.1%}")
        wrong = [g for g in graded if g.example.task == task and not g.correct]
        for item in wrong[: args.show]:
            print(
                f"    {item.example.question!r}: got {item.reply!r}, "
                f"expected {item.example.answer!r}"
            )
    if args.card:
        checkpoint = args.model
        command = "python scripts/eval_demo_model.py " + " ".join(
            shlex.quote(a) for a in sys.argv[1:] if a != "--card"
        )
        results = {
            "command": command.strip(),
            "seed": args.seed,
            "per_task": args.per_task,
            "generator_version": GENERATOR_VERSION,
            "accuracy": {task: round(value, 4) for task, value in accuracy.items()},
        }
        (checkpoint / card.EVAL_FILE).write_text(json.dumps(results, indent=2) + "\n")
        card.write_card(checkpoint)
        print(f"recorded in {checkpoint / 'README.md'}")
    return 0 if min(accuracy.values()) >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
