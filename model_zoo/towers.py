"""transformers' vision and audio towers on our layers, so the device backends' kernels run them.

The towers stay transformers' modules (exact by construction); ``adopt_tower`` swaps the
pieces that have kernels for our layers on the same parameters, under the same names, so
checkpoints load as before and the outputs are transformers' up to the order of sums:
- every ``nn.Linear`` becomes a ``ReplicatedLinear`` (on a CPU: AMX or oneDNN on a packed
  weight, the bias added in the product, where ``F.linear`` first copied the bias into the
  output and reordered the weight on every call);
- a ``Conv3d`` whose stride is its kernel (the patch embedding) becomes ``PatchLinear``: each
  output is one patch's dot product with a filter, i.e. one linear layer over flattened patches;
- transformers' RMSNorm copies become ``RMSNorm``, and their GELUs (torch's erf and tanh forms)
  ``GELU``;
- a Qwen2.5 vision MLP becomes ``GatedMLP`` (its SiLU and product in place);
- the vision attention becomes ``VisionAttention``: the same projections and attention, with the
  rotation through ``QKRotary`` (fp32 angles: rotated in fp32 and rounded once, as
  ``apply_rotary_pos_emb_vision`` does in eight full-size passes; one pass on a CPU or GPU).
Measured (``scripts/bench_towers.py``: towers on random weights in real checkpoints' shapes,
bf16, 2-core Xeon with AMX, alternating with transformers' own modules in one process): on a
448 x 448 image Qwen2.5-Omni-3B's vision tower 1.70-1.91x as fast as transformers' (1.34-1.39x
against them with only the norms swapped, what ran before) and Qwen3-Omni's 1.48-2.08x; on a
10 s clip Qwen2.5-Omni-3B's audio tower 0.99-1.32x (its linear layers only).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh, SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniMLP,
    Qwen2_5OmniRMSNorm,
    Qwen2_5OmniVisionAttention,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLMLP,
    Qwen2_5_VLRMSNorm,
    Qwen2_5_VLVisionAttention,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention as Qwen2VLVisionAttention
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionAttention
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention
from transformers.utils.generic import get_max_seqlen, is_flash_attention_requested

from omniserve.layers.activation import GELU
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import LinearBase, ReplicatedLinear
from omniserve.layers.rotary_embedding import QKRotary
from omniserve.layers.weight_utils import LoadedWeight, copy_weight, set_weight_loader

_HF_RMS_NORMS = (Qwen2_5_VLRMSNorm, Qwen2_5OmniRMSNorm)
"""transformers' RMSNorms that compute what ``RMSNorm`` computes (the towers' own copies)."""
_HF_VISION_ATTENTIONS = (Qwen2VLVisionAttention, Qwen2_5_VLVisionAttention,
                         Qwen2_5OmniVisionAttention, Qwen3VLVisionAttention,
                         Qwen3OmniMoeVisionAttention)  # fmt: skip
"""transformers' vision attentions that ``VisionAttention`` computes: q/k/v projections (fused
or not), ``apply_rotary_pos_emb_vision``, attention within ``cu_seqlens``' segments, ``proj``."""
_HF_GATED_MLPS = (Qwen2_5_VLMLP, Qwen2_5OmniMLP)
"""transformers' gated MLPs of the Qwen2.5 vision towers (``gate_proj``, ``up_proj``,
``down_proj``, ``act_fn``)."""


def adopt_linear(linear: nn.Linear) -> ReplicatedLinear:
    """A ``ReplicatedLinear`` holding ``linear``'s parameters (the same objects)."""
    layer = ReplicatedLinear(linear.in_features, linear.out_features, bias=False)
    layer.weight, layer.bias, layer.keeps_dtype = linear.weight, linear.bias, True
    return layer


class PatchLinear(LinearBase):
    """A ``Conv3d`` whose stride is its kernel, as the linear layer it is: ``[patches, C, T, H,
    W]`` in, ``[patches, out_channels]`` out. The weight is held flat ``[out, C * T * H * W]``
    (what a backend's kernel takes: one product over the flattened patches); the checkpoint's
    ``[out, C, T, H, W]`` loads into it. Without a kernel it convolves, as transformers does."""

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        self.output_size = conv.out_channels
        self.input_size = conv.weight[0].numel()
        self.filter_shape = tuple(conv.weight.shape)
        self.weight = nn.Parameter(conv.weight.detach().reshape(self.output_size, -1),
                                   requires_grad=conv.weight.requires_grad)  # fmt: skip
        self.bias, self.keeps_dtype = conv.bias, True  # the patch embedding casts to it
        set_weight_loader(self.weight, self._load_filters)

    @staticmethod
    def covers(conv: nn.Module) -> bool:
        return (
            type(conv) is nn.Conv3d
            and tuple(conv.stride) == tuple(conv.kernel_size)
            and conv.padding == (0, 0, 0)
            and conv.dilation == (1, 1, 1)
            and conv.groups == 1
        )

    def _load_filters(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        if tuple(loaded.shape) != self.filter_shape:
            raise ValueError(
                f"Shape mismatch: patch filters {self.filter_shape} vs checkpoint "
                f"{tuple(loaded.shape)}."
            )
        copy_weight(param.data.view(self.filter_shape), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:  # torch's convolution: transformers' sums, in their order
            filters = self.weight.view(self.filter_shape)
            return F.conv3d(x, filters, self.bias, stride=self.filter_shape[2:]).flatten(1)
        return self.apply_linear(x.reshape(x.shape[0], self.input_size), self.bias)


class VisionAttention(nn.Module):
    """One of ``_HF_VISION_ATTENTIONS`` on its own parameters (same names), taking the same
    arguments; the attention itself is transformers' (the implementation the config names,
    per segment unless that is a flash one)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.config, self.scaling = attn.config, attn.scaling
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        self.num_key_value_groups, self.is_causal = 1, False  # what eager attention reads
        self.attention_dropout = 0.0
        self.projections = ("qkv",) if hasattr(attn, "qkv") else ("q", "k", "v")
        for name in (*self.projections, "proj"):
            setattr(self, name, adopt_linear(getattr(attn, name)))
        self.rotary = QKRotary()
        self.eager: Callable[..., Any] = sys.modules[type(attn).__module__].eager_attention_forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        max_seqlen: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert position_embeddings is not None, "the towers pass their rotation's cos and sin"
        tokens, shape = hidden_states.shape[0], (self.num_heads, self.head_dim)
        if self.projections == ("qkv",):
            q, k, v = self.qkv(hidden_states).view(tokens, 3, *shape).unbind(1)
        else:
            q, k, v = (getattr(self, n)(hidden_states).view(tokens, *shape) for n in "qkv")
        cos, sin = (t.float() for t in position_embeddings)  # transformers rotates in fp32
        q, k = self.rotary(q, k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, tokens, dim]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          self.eager)  # fmt: skip
        common = {"attention_mask": None, "scaling": self.scaling, "dropout": 0.0,
                  "is_causal": False, **kwargs}  # fmt: skip
        if is_flash_attention_requested(self.config):
            longest = get_max_seqlen(cu_seqlens, self.config, kwargs={"max_seqlen": max_seqlen})
            out = attention(self, q, k, v, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                            max_length_q=longest, max_length_k=longest, **common)[0]  # fmt: skip
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            segments = zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True)
            out = torch.cat([attention(self, *qkv, **common)[0] for qkv in segments], dim=1)
        return self.proj(out.reshape(tokens, -1))


class GatedMLP(nn.Module):
    """One of ``_HF_GATED_MLPS`` (``down(silu(gate(x)) * up(x))``) on its own parameters (same
    names), the activation and the product written into the gate projection's fresh output:
    two full-size passes fewer to memory (the vision tower of Qwen2.5-Omni-3B on a 448 px image
    ran 1.14-1.25x as fast). Bit for bit transformers' (the same ops); out of place while
    autograd records."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, adopt_linear(getattr(mlp, name)))

    @staticmethod
    def covers(mlp: nn.Module) -> bool:
        return isinstance(mlp, _HF_GATED_MLPS) and type(mlp.act_fn) is SiLUActivation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


def _gelu_form(module: nn.Module) -> str | None:
    """``F.gelu``'s ``approximate`` for the GELU modules the towers use (transformers' erf and tanh
    activations on torch's function, ``nn.GELU``); None for anything else."""
    if type(module) is nn.GELU:
        return module.approximate
    act = getattr(module, "act", None)
    if type(module) is GELUActivation and act is F.gelu:
        return "none"
    if type(module) is GELUTanh and isinstance(act, functools.partial) and act.func is F.gelu:
        return act.keywords.get("approximate")
    return None


def adopt_tower(tower: nn.Module) -> nn.Module:
    """Swap ``tower``'s pieces for our layers in place (the module docstring says which);
    returns it."""
    for name, child in list(tower.named_children()):
        if isinstance(child, _HF_VISION_ATTENTIONS):
            setattr(tower, name, VisionAttention(child))
        elif GatedMLP.covers(child):
            setattr(tower, name, GatedMLP(child))
        elif type(child) is nn.Linear:
            setattr(tower, name, adopt_linear(child))
        elif PatchLinear.covers(child):
            setattr(tower, name, PatchLinear(child))
        elif (approximate := _gelu_form(child)) is not None:
            setattr(tower, name, GELU(approximate))
        elif isinstance(child, _HF_RMS_NORMS):
            norm = RMSNorm(child.weight.shape[0], child.variance_epsilon)
            norm.weight = child.weight
            setattr(tower, name, norm)
        else:
            adopt_tower(child)
    return tower
