"""Rotary position embedding (RoPE), neox style (rotate_half), computed as transformers does.

Frequencies come from the config's ``rope_parameters`` (transformers 5.x): the default formula, or
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for linear / llama3 / yarn scaling, so
scaled variants match HF by construction. ``cos``/``sin`` are computed once per forward from the
positions and shared by every layer.

M-RoPE (Qwen2-VL, Qwen2.5-VL): ``MRotaryEmbedding`` takes ``positions`` of shape
``[3, num_tokens]`` (temporal, height, width) and returns the same ``[num_tokens, rotary_dim]``
cos/sin, each frequency section taking its angle from one of the three rows; ``get_rope`` picks
it when ``rope_parameters`` carry an ``mrope_section``. ``apply_rotary_emb`` and the layers stay
unchanged.

``rotate_qk`` is what attention layers call: optional per-head q/k RMSNorm, then the rotation; on
CPU fp32 both run in one in-place pass of ``csrc/qk_rope.c`` (same products and sums, rounded one
by one as torch does; only the norm's sum of squares is added in another order).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from omniserve.cpu_kernels import load_function, plain_fp32
from omniserve.layers.layernorm import RMSNorm

# Static scalings only: "dynamic" and "longrope" change frequencies with the batch's longest
# sequence, which has no single meaning in a continuously batched step.
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """positions -> (cos, sin), each ``[num_tokens, rotary_dim]``."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [rotary_dim // 2]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [num_tokens, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: ``[3, num_tokens]`` positions -> (cos, sin), each ``[num_tokens, rotary_dim]``.

    The ``rotary_dim // 2`` frequencies are cut into consecutive sections (``mrope_section``, e.g.
    16/24/24); section i rotates by the position on axis ``i % 3``, the layout transformers'
    Qwen2-VL rotary embedding builds. Text tokens carry equal rows, which makes this plain RoPE,
    so 1-D positions are accepted as well.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        inv_freq: torch.Tensor,
        mrope_section: list[int],
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__(head_size, rotary_dim, inv_freq, attention_scaling)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must sum to rotary_dim // 2 = {rotary_dim // 2}."
            )
        self.mrope_section = list(mrope_section)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            return super().forward(positions, dtype)
        freqs = positions[..., None].float() * self.inv_freq  # [3, num_tokens, rotary_dim // 2]
        sections = freqs.split(self.mrope_section, dim=-1)
        # [num_tokens, rotary_dim // 2]: section i from axis i % 3
        freqs = torch.cat([s[i % 3] for i, s in enumerate(sections)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of each head of x ``[tokens, heads, head_size]``.

    Equal, float for float, to transformers' ``x * cos + rotate_half(x) * sin``: in the neox
    layout both halves of ``cos``/``sin`` hold the same angles, so each half of the output is one
    product pair, written in place instead of through five full-size temporaries (this runs on
    every query and key of a prefill).
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [num_tokens, 1, rotary_dim // 2]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = torch.empty_like(x)
    out1, out2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, c, out=out1).sub_(x2 * s)
    torch.mul(x2, c, out=out2).add_(x1 * s)
    if 2 * half < x.shape[-1]:  # partial rotary: the rest passes through
        out[..., 2 * half :] = x[..., 2 * half :]
    return out


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_QK_ROPE_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float)
_QK_ROPE_SIGNATURE += (_PTR, _PTR, _I64, _I64, ctypes.c_int)


def _qk_rope_kernel() -> Any:
    source = Path(__file__).with_name("csrc") / "qk_rope.c"
    return load_function(source, "omniserve_qk_norm_rope_f32", _QK_ROPE_SIGNATURE, None)


def _heads_in_rows(x: torch.Tensor) -> bool:
    """``[tokens, heads, head_size]`` with contiguous head rows (a view of a qkv output is)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) ``[tokens, heads, head_size]`` -> each normalised per head (when norms are given)
    and rotated. The kernel path writes into q and k (fresh activations) and returns them."""
    kernel = _qk_rope_kernel()
    tensors = [q, k, cos, sin] + [n.weight for n in (q_norm, k_norm) if n is not None]
    usable = (
        kernel is not None
        and (q_norm is None) == (k_norm is None)
        and plain_fp32(*tensors)
        and _heads_in_rows(q)
        and _heads_in_rows(k)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and q.shape[0] > 0
    )
    if not usable:
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    kernel(
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        q.shape[0],
        q.shape[2],
        None if q_norm is None else q_norm.weight.data_ptr(),
        None if k_norm is None else k_norm.weight.data_ptr(),
        0.0 if q_norm is None else q_norm.variance_epsilon,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        cos.shape[1],
        torch.get_num_threads(),
    )
    return q, k


def _default_inv_freq(rope_theta: float, dim: int) -> torch.Tensor:
    # Same expression as transformers' compute_default_rope_parameters, for identical floats.
    return 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def get_rope(config: Any, head_size: int) -> RotaryEmbedding:
    """Build the rotary embedding a (text) config describes."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" not in params:
        raise ValueError(
            f"Config has no usable rope_parameters ({params!r}); per-layer-type "
            "rope parameters are not supported."
        )
    rope_type = params["rope_type"]
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ROPE_TYPES)}."
        )
    rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        inv_freq, attention_scaling = _default_inv_freq(params["rope_theta"], rotary_dim), 1.0
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    if inv_freq.shape[0] * 2 != rotary_dim:
        raise ValueError(
            f"RoPE produced {inv_freq.shape[0]} frequencies for rotary_dim "
            f"{rotary_dim}; check head_dim / partial_rotary_factor in the config."
        )
    if "mrope_section" in params:
        return MRotaryEmbedding(
            head_size, rotary_dim, inv_freq, params["mrope_section"], attention_scaling
        )
    return RotaryEmbedding(head_size, rotary_dim, inv_freq, attention_scaling)
