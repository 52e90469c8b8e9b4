"""The CUDA backend: Triton kernels for the elementwise ops of a loaded model's decoder layers.

``apply_cuda_backend(model)`` (``backend.py``) is the one place that decides what runs where; the
kernels are ``kernels.py``. Attention has its own selector (``omniserve.attention.selector``).
"""
