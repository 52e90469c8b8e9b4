"""Encoder attention: the vision and audio towers attend within packed segments in one kernel
call on CUDA (``--mm-encoder-attn-backend``, vLLM's name for the choice).

transformers' towers attend within segments that ``cu_seqlens`` bounds (the windows and frames
of an image or a video, the chunks of an audio clip). Built with SDPA, they split q/k/v by the
segment lengths and call SDPA once per segment: a 448 px image through Qwen2.5's tower is 16
windows in 28 of its 32 layers, a video that many per frame group, so hundreds to thousands of
small kernels per encoder call. When a tower's attention implementation names flash attention,
the tower hands the packed tensors and ``cu_seqlens`` to it in one call instead; ``FLASH_VARLEN``
is registered with transformers as such an implementation and runs torch's own varlen flash
attention (``torch.nn.attention.varlen.varlen_attn``: CUDA, bf16 or fp16).

The bounds are then device tensors (int32) with the longest segment's length beside them as a
host int, both made on the host by ``segment_bounds``, so the tower reads nothing back.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def varlen_attn(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``, imported when first called: its import pulls
    in ``torch._dynamo``, over a second of every worker's start, towers or not."""
    from torch.nn.attention.varlen import varlen_attn as kernel

    return kernel(*args, **kwargs)


def _torch_has_varlen() -> bool:
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:  # an older torch than the pinned one: SDPA only
        return False
    return True


logger = logging.getLogger(__name__)

FLASH_VARLEN = "omniserve_flash_varlen"
"""Its name holds "flash": what the towers test to take their packed (``cu_seqlens``) branch."""
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    scaling: float | None = None,
    is_causal: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[1, heads, tokens, head_dim]`` in,
    ``[1, tokens, heads, head_dim]`` out; segments bounded by ``cu_seq_lens_*``. Towers attend
    both ways within a segment; their scale is the default one, which every torch release of
    ``varlen_attn`` applies (a ``scale`` argument came after 2.10), so it is passed only when
    it differs."""
    if attention_mask is not None or is_causal:
        raise ValueError("Packed encoder attention is bidirectional, bounded by segments.")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    kwargs = {}
    if scaling is not None and abs(scaling * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
        kwargs["scale"] = scaling
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, **kwargs)
    return out.unsqueeze(0), None


def segment_bounds(
    tower: nn.Module, **bounds: torch.Tensor
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A tower's segment-bound kwargs (``cu_seqlens=``, ``cu_window_seqlens=``; host tensors)
    as its attention takes them: ``(host kwargs, kwargs to upload)``. SDPA splits by host bounds;
    packed attention takes them on the device, with each longest length as a host int
    (``max_seqlen``, ``max_window_seqlen``)."""
    if tower.config._attn_implementation != FLASH_VARLEN:
        return dict(bounds), {}
    longest = {
        f"max_{name[3:-1]}": int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        for name, cu in bounds.items()
    }
    return longest, {name: cu.to(torch.int32) for name, cu in bounds.items()}


def _head_dims(tower: nn.Module) -> set[int]:
    return {m.head_dim for m in tower.modules() if isinstance(getattr(m, "head_dim", None), int)}


@functools.cache
def varlen_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why packed attention cannot run here (None: it can). On CUDA it is tried once, against
    SDPA on two segments, so a torch build or GPU without the kernel keeps SDPA."""
    if device.type != "cuda":
        return f"it needs a CUDA device (the model runs on {device.type})"
    if dtype not in VARLEN_DTYPES:
        return f"it runs in bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if not _torch_has_varlen():
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    lengths = [5, 11]
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = torch.randn(3, sum(lengths), 4, head_dim, device=device, dtype=dtype,
                          generator=generator).unbind(0)  # fmt: skip
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    query, key, value = (t.transpose(0, 1)[None] for t in (q, k, v))  # the towers' layout
    try:
        longest = max(lengths)
        out = varlen_attention(None, query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                               max_length_q=longest, max_length_k=longest)[0][0]  # fmt: skip
    except Exception as exc:  # any failure means: not on this build or GPU
        return f"torch's varlen flash attention failed its check ({type(exc).__name__}: {exc})"
    expected = segmented_sdpa(q, k, v, lengths)
    if not torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2):
        return "torch's varlen flash attention disagreed with SDPA in its check"
    return None


def segmented_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Attention within each segment of ``lengths``, one SDPA call per segment, as the towers'
    SDPA path computes it: ``[tokens, heads, head_dim]`` in and out (the packed kernel's
    reference)."""
    segments = zip(*(t.split(lengths) for t in (q, k, v)), strict=True)
    return torch.cat([
        F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv)).transpose(0, 1)
        for qkv in segments
    ])  # fmt: skip


def _towers(model: nn.Module) -> list[nn.Module]:
    towers = [getattr(model, name) for name in getattr(model, "packed_attention_towers", ())]
    return [tower for tower in towers if tower is not None]  # (None: ``drop_towers``')


def pack_towers(model: nn.Module) -> None:
    """Switch ``model.packed_attention_towers`` to ``FLASH_VARLEN`` (every config they hold),
    registered with transformers here: its attention interface lives in ``modeling_utils``,
    whose import (2-3 s) a text model's worker never otherwise makes."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLASH_VARLEN, varlen_attention)
    for tower in _towers(model):
        configs = {id(m.config): m.config for m in tower.modules() if hasattr(m, "config")}
        for config in configs.values():
            config._attn_implementation = FLASH_VARLEN


def set_encoder_attention(
    model: nn.Module, requested: str, device: torch.device, dtype: torch.dtype
) -> str:
    """Give the towers that attend within packed segments (``model.packed_attention_towers``)
    their attention for ``requested`` (one of ``MM_ENCODER_ATTN_BACKENDS``, which
    ``MultiModalConfig`` checks); returns the backend they run ("TORCH_SDPA" or "FLASH_ATTN";
    "" for a model without such towers). FLASH_ATTN asked for where it cannot run is an error."""
    towers = _towers(model)
    if not towers or requested == "TORCH_SDPA" or (requested == "auto" and device.type != "cuda"):
        return "TORCH_SDPA" if towers else ""
    for head_dim in sorted(set().union(*map(_head_dims, towers))):
        reason = varlen_unavailable(device, dtype, head_dim)
        if reason is None:
            continue
        if requested == "FLASH_ATTN":
            raise ValueError(f"mm_encoder_attn_backend FLASH_ATTN cannot run here: {reason}.")
        logger.info("Encoder attention stays on SDPA: packed attention %s.", reason)
        return "TORCH_SDPA"
    pack_towers(model)
    return "FLASH_ATTN"
