"""The CPU backend: oneDNN and small C kernels for the hot ops of a loaded model.

``apply_cpu_backend(model, dtype)`` (``backend.py``) is the one place that decides what runs
where; the kernels' wrappers are ``linear.py``, ``moe.py``, ``attention.py`` and ``norm_rope.py``,
their C sources ``csrc/``, built on first use by ``build.py``.
"""
