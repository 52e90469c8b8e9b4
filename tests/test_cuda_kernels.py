"""The CUDA backend's Triton kernels (RMSNorm with the residual add, q/k norm + RoPE, SiLU-and-mul)
against the torch layers they replace: on CPU under TRITON_INTERPRET=1 (in a child process, so
the interpreter is chosen before triton is imported), compiled on a GPU when one is present;
and where the backend places them.

Under the interpreter fp32 matches to the last bit or so (a norm's sum of squares is ordered
differently, and exp is not torch's), and fp16, whose casts numpy rounds to nearest, matches
bit for bit but for SiLU: the kernels round where torch rounds. The interpreter's bf16 casts
truncate, so there bf16 is checked to within three units; compiled on a GPU, the half-precision
rotation is bit-equal to torch's.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")  # a dependency only on Linux x86_64 (pyproject.toml)

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
Runner = Callable[..., Pairs]

# (q heads, kv heads, head size, rotary dim, q/k norm): GQA, a head size padded to a power of
# two, partial rotary (its tail passes through, normed), Qwen3's per-head norms
ROPE_CASES = [(8, 2, 64, 64, False), (4, 4, 80, 80, True), (6, 1, 64, 32, False),
              (16, 2, 128, 128, True), (4, 2, 64, 48, True)]  # fmt: skip


def kernel_pairs(dtype_name: str, device: str, seed: int = 0) -> Pairs:
    """(kernel output, torch layers' output) for each case, as CPU tensors."""
    from omniserve.cuda import kernels
    from omniserve.layers.activation import SiluAndMul
    from omniserve.layers.layernorm import RMSNorm
    from omniserve.layers.rotary_embedding import rotate_qk

    torch.set_grad_enabled(False)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    def norm(size: int) -> RMSNorm:
        layer = RMSNorm(size, eps=1e-6).to(device, dtype)
        layer.weight.copy_(rand(size, scale=0.3) + 1)
        return layer

    pairs: Pairs = {}
    for rows, width in ((7, 300), (1, 2048), (0, 64)):
        layer, x, residual = norm(width), rand(rows, width, scale=3), rand(rows, width)
        pairs[f"rms {rows}x{width}"] = (kernels.rms_norm(x, layer.weight, 1e-6)[1], layer(x))
        summed, normed = kernels.rms_norm(x, layer.weight, 1e-6, residual)
        pairs[f"add {rows}x{width}"] = (summed, residual + x)
        pairs[f"add+rms {rows}x{width}"] = (normed, layer(residual + x))
    wide = rand(5, 400)
    layer = norm(300)
    pairs["rms strided rows"] = (kernels.rms_norm(wide[:, :300], layer.weight, 1e-6)[1],
                                 layer(wide[:, :300]))  # fmt: skip
    for rows, d in ((4, 2500), (1, 1024), (0, 8)):
        x = rand(rows, 2 * d, scale=3)
        pairs[f"silu {rows}x{d}"] = (kernels.silu_and_mul(x), SiluAndMul()(x))
    # angles in the element type, and fp32 angles (the vision towers': rotated in fp32)
    for (heads, kv_heads, size, rotary, with_norm), angle_dtype in itertools.product(
        ROPE_CASES, dict.fromkeys((dtype, torch.float32))
    ):
        tokens = 5
        qkv = rand(tokens, (heads + 2 * kv_heads) * size, scale=2)
        q, k, v = qkv.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
        q, k = q.view(tokens, heads, size), k.view(tokens, kv_heads, size)
        angles = torch.rand(tokens, rotary // 2, generator=gen) * 50
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = (f(angles).to(device, angle_dtype) for f in (torch.cos, torch.sin))
        q_norm, k_norm = (norm(size), norm(size)) if with_norm else (None, None)
        want_q, want_k = rotate_qk(q.clone(), k.clone(), cos, sin, q_norm, k_norm)
        v_before = v.clone()
        got_q, got_k = kernels.qk_norm_rope(q, k, cos, sin, q_norm, k_norm)
        name = f"rope {heads}/{kv_heads}x{size} rotary {rotary}{' norm' if with_norm else ''}"
        name += " fp32 angles" if angle_dtype != dtype else ""
        pairs[name + " q"] = (got_q, want_q)
        pairs[name + " k"] = (got_k, want_k)
        pairs[name + " in place, v untouched"] = (torch.cat([q.flatten(1), k.flatten(1), v], -1),
                                                  torch.cat([got_q.flatten(1), got_k.flatten(1),
                                                             v_before], -1))  # fmt: skip
    return {name: (got.cpu(), want.cpu()) for name, (got, want) in pairs.items()}


@pytest.fixture(scope="module")
def interpreted() -> Iterator[Runner]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pool = multiprocessing.get_context("spawn").Pool(1)
    with pool:

        def run(*args: Any) -> Pairs:
            return pool.apply_async(kernel_pairs, args).get(timeout=300)

        yield run


def check(
    pairs: Pairs, *, ulps: float, exact: tuple[str, ...] = (), inexact: tuple[str, ...] = ()
) -> None:
    """Each kernel output within ``ulps`` units in the last place of its tensor's largest
    magnitude from the torch one (a rotation's cancellations make element-relative error
    meaningless); names containing one of ``exact`` (and none of ``inexact``) bit-equal."""
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if any(part in name for part in exact) and not any(part in name for part in inexact):
            assert torch.equal(got, want), name
        elif want.numel():
            tol = ulps * torch.finfo(want.dtype).eps * want.abs().max().item()
            torch.testing.assert_close(got, want, atol=tol, rtol=0, msg=name)


def test_interpreted_fp32(interpreted: Runner) -> None:
    check(interpreted("float32", "cpu"), ulps=4, exact=("add ", "in place"))


def test_interpreted_fp16_rounds_where_torch_rounds(interpreted: Runner) -> None:
    """numpy's fp16 casts round to nearest: everything but SiLU's exp is torch's to the bit,
    and but a norm before an fp32 rotation, which rounds only once, so a normalised feature a
    unit apart (the sum of squares in another order) can show."""
    check(interpreted("float16", "cpu"), ulps=1, exact=("add", "rms", "rope"),
          inexact=("norm fp32 angles",))  # fmt: skip


def test_interpreted_bf16(interpreted: Runner) -> None:
    check(interpreted("bfloat16", "cpu"), ulps=3, exact=("in place",))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_compiled_on_gpu(dtype: str) -> None:
    """Compiled, casts round to nearest: the residual add, and in half precision the rotation
    without a norm (products exact in fp32, rounded where torch rounds), are torch's to the bit;
    the rest within one unit of the activation dtype. fp32 has no rounding to hide the
    hardware's approximate rsqrt and exp and fused multiply-adds: within four units, as under
    the interpreter."""
    rotations = [f"rotary {r} {t}" for r in (32, 64) for t in "qk"] if dtype != "float32" else []
    check(kernel_pairs(dtype, "cuda"), ulps=4 if dtype == "float32" else 1,
          exact=("add ", "in place", *rotations))  # fmt: skip


def test_placement_by_dtype(tiny_checkpoint: Callable[..., Path],
                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """bf16/fp16 models get the kernels on every norm, rotary and SiLU-and-mul (Qwen3 has
    per-head q/k norms, which the rotary kernel folds in); fp32 and the torch switch, none."""
    from omniserve.cuda.backend import TritonRMSNorm, apply_cuda_backend
    from omniserve.layers.layernorm import RMSNorm
    from tests.test_models_forward import load_ours

    model = load_ours(tiny_checkpoint("Qwen3ForCausalLM"))
    layers = model.config.num_hidden_layers
    assert apply_cuda_backend(model, torch.float32).placements == {}
    monkeypatch.setenv("OMNISERVE_CUDA_KERNELS", "torch")
    assert apply_cuda_backend(model, torch.bfloat16).placements == {}
    monkeypatch.delenv("OMNISERVE_CUDA_KERNELS")
    report = apply_cuda_backend(model.bfloat16(), torch.bfloat16)
    assert report.placements == {
        "RMSNorm (+ residual add): Triton": 4 * layers + 1,  # 2 per layer, q/k norms, final
        "q/k norm + RoPE: Triton": layers,
        "SiLU-and-mul: Triton": layers,
    }
    assert report.summary().startswith("CUDA backend: ")
    norm = model.model.norm
    assert isinstance(norm, RMSNorm) and isinstance(norm.kernel, TritonRMSNorm)
    assert norm.add_kernel == norm.kernel.add
