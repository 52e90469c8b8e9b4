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

``QKRotary`` is what attention layers call: optional per-head q/k RMSNorm, then the rotation
(``rotate_qk``), unless a device backend gave it a ``kernel`` (``omniserve.cpu`` does both in one
in-place pass).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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
        mixed = self.mix_axes(freqs)
        emb = torch.cat((mixed, mixed), dim=-1)  # [num_tokens, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def mix_axes(self, freqs: torch.Tensor) -> torch.Tensor:
        """Each frequency's angle from its axis: ``[3, num_tokens, rotary_dim // 2]`` ->
        ``[num_tokens, rotary_dim // 2]``, section i from axis i % 3."""
        sections = freqs.split(self.mrope_section, dim=-1)
        return torch.cat([s[i % 3] for i, s in enumerate(sections)], dim=-1)


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Qwen3-VL's and Qwen3-Omni's M-RoPE layout (``mrope_interleaved``): frequency i rotates by
    the height position when ``i % 3 == 1 and i < 3 * section[1]``, by the width position when
    ``i % 3 == 2 and i < 3 * section[2]``, and by the temporal position otherwise."""

    def mix_axes(self, freqs: torch.Tensor) -> torch.Tensor:
        mixed = freqs[0].clone()  # [num_tokens, rotary_dim // 2]
        for axis in (1, 2):
            picked = slice(axis, 3 * self.mrope_section[axis], 3)
            mixed[:, picked] = freqs[axis, :, picked]
        return mixed


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


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) ``[tokens, heads, head_size]`` -> each normalised per head (when norms are given)
    and rotated. With ``cos``/``sin`` in q's dtype every product is rounded to it (transformers'
    decoders); with fp32 angles for bf16/fp16 q and k (the vision towers'), the rotation runs in
    fp32 and rounds once (transformers' ``apply_rotary_pos_emb_vision``)."""
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if cos.dtype != q.dtype:
        wide = cos.dtype
        return (apply_rotary_emb(q.to(wide), cos, sin).to(q.dtype),
                apply_rotary_emb(k.to(wide), cos, sin).to(k.dtype))  # fmt: skip
    return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


class QKRotaryKernel(Protocol):
    """A backend's ``rotate_qk``; it may write into q and k (fresh activations) and return them."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class QKRotary(nn.Module):
    """``rotate_qk`` as a (parameterless) layer, so a backend can give it a ``kernel``."""

    kernel: QKRotaryKernel | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            return self.kernel(q, k, cos, sin, q_norm, k_norm)
        return rotate_qk(q, k, cos, sin, q_norm, k_norm)


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
        cls = InterleavedMRotaryEmbedding if params.get("mrope_interleaved") else MRotaryEmbedding
        return cls(head_size, rotary_dim, inv_freq, params["mrope_section"], attention_scaling)
    return RotaryEmbedding(head_size, rotary_dim, inv_freq, attention_scaling)
