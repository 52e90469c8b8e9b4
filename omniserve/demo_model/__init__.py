"""A small Qwen3-Omni-MoE thinker trained on synthetic media tasks, meant as omniserve's default.

The generator of its tasks (`tasks`), the training helpers (`training`), scoring through the API
(`evaluate`) and the model card writer (`card`) are used by `scripts/train_demo_model.py`,
`scripts/eval_demo_model.py` and the tests; the server never imports them.
"""
