"""omniserve's default model: a small Qwen3-Omni-MoE thinker trained on synthetic media tasks.

`CHECKPOINT` ships in the package (weights, processor files, training recipe, evaluation figures
and model card), so `omniserve serve` with no model serves it at once. The generator of its tasks
(`tasks`), the training helpers (`training`), scoring through the API (`evaluate`) and the model
card writer (`card`) are used by `scripts/train_demo_model.py`, `scripts/eval_demo_model.py` and
the tests; the server never imports them.
"""

from pathlib import Path

CHECKPOINT = Path(__file__).parent / "checkpoint"
SERVED_NAME = "omniserve-demo"
"""The name `omniserve serve` gives it when no --served-model-name is passed."""
