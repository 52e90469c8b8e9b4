"""Paged attention in Triton for CUDA: one kernel for prefill chunks and decodes, reading keys and
values straight from the paged cache (no gather, no padding, no per-request launches).

A program owns one tile of one request's new tokens for one KV head. The tile's rows are
(query token, query head of the group) pairs, so a KV head's keys are read once for its whole
group of query heads (grouped-query attention) and a decode, with one query token, still fills
its rows with the group. Keys are walked ``_BLOCK_N`` positions at a time; each position is
looked up in the block table (any block size) and masked by causality within the chunk, the
sequence length and the sliding window, then folded into an online softmax in fp32
(FlashAttention's recurrence; an fp32 cache multiplies in IEEE fp32, not TF32). Decodes and
prefill chunks are launched separately with tile heights that suit them, from one kernel source.
A step's tiles are planned once on the host from the metadata's host copies and reused by every
layer. The new keys and values reach their slots through a small store kernel first (an fp8
cache's rounded there, and widened to the query's type as the attention kernel loads them).

A decode batch too small to fill the GPU (batch 1 of a 2-KV-head model is 2 programs) splits each
request's keys into up to ``_MAX_SPLITS`` ranges walked by programs of their own, whose softmax
states a second kernel folds together (flash-decoding); otherwise one program walks them all, and
a long multimodal context would take as long as that one program's loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import triton
import triton.language as tl

from omniserve.attention.base import AttentionBackend, fp8_scales, is_fp8
from omniserve.attention.metadata import AttentionMetadata
from omniserve.transfers import upload
from omniserve.triton_utils import INTERPRETED, dot

_DECODE_ROWS = 16
"""Rows of a decode tile: the smallest height ``tl.dot`` takes (more when a group is larger)."""
_PREFILL_ROWS = 64
"""Rows of a prefill tile (query tokens x group heads)."""
_BLOCK_N = 64
"""Key positions per step of the online softmax."""
_MAX_SPLITS = 16
"""Most splits of a decode's keys (flash-decoding): each is folded in by the combine kernel."""
_INTERPRETED_MULTIPROCESSORS = 16
"""What the interpreter counts as the device's multiprocessors."""


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads, head_size, inv_k_scale,
    inv_v_scale, HEAD_PAD: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """Program (token, KV head): that head's key and value of the token to its cache slot (a
    negative slot is a padding row of a captured batch: nothing is written); an fp8 cache's
    times the inverse scales, saturated at ``FP8_MAX`` (0: not fp8)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    mask = (d < head_size) & (slot >= 0)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_MAX), FP8_MAX)
    dst = (slot * num_kv_heads + head) * head_size + d
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# Triton compiles a kernel once for each class of its integer arguments (1, multiples of 16, the
# rest) and of its pointers' alignment. The integers that change from step to step (the block
# table's width, the step's longest request in blocks, and the split count, set by the batch) are
# left unspecialized, and the step's arrays arrive 16-byte aligned (``transfers.upload``), so
# the start-up warm-up compiles every variant a step can launch and none compiles while serving.
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    tile_req_ptr, tile_first_ptr, query_start_ptr, seq_lens_ptr, block_table_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    scale, value_scale, window, num_kv_heads, head_size, block_size, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Program (tile, KV head, split): attention of the tile's (token, group head) rows over
    the split's share of the keys; with SPLIT its softmax state goes to the partial buffers for
    ``_combine_splits_kernel``, else the output is final (times ``value_scale``: an fp8 cache's
    values are stored divided by it; the keys' scale is folded into ``scale``)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    first = tl.load(tile_first_ptr + tile)  # the tile's first query token within its request
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    context = tl.load(seq_lens_ptr + req) - q_len  # keys cached before this step

    rows = tl.arange(0, ROWS)
    token = first + rows // GROUP_PAD
    sub = rows % GROUP_PAD
    head = kv_head * GROUP + sub
    row_ok = (token < q_len) & (sub < GROUP)
    pos = context + token  # each row's absolute position
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_size
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    last = tl.minimum(first + ROWS // GROUP_PAD, q_len) - 1
    end = context + last + 1  # no row of the tile sees a key past its last token
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(context + first - window + 1, 0)
    if SPLIT:  # whole BLOCK_N steps per split; the last splits of a short request are empty
        per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
        start = start + split * per_split
        end = tl.minimum(start + per_split, end)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(block_table_ptr + req * stride_bt + n // block_size, mask=n_ok, other=0)
        slot = page.to(tl.int64) * block_size + n % block_size
        kv_off = (slot * num_kv_heads + kv_head)[:, None] * head_size + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # (fp8: widened)
        s = dot(q, tl.trans(k), tl.zeros([ROWS, BLOCK_N], tl.float32), UPCAST, PRECISION)
        visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
        m_i = m_new
    if SPLIT:
        part = ((tile * num_kv_heads + kv_head) * num_splits + split) * ROWS + rows
        tl.store(part_m_ptr + part, m_i)
        tl.store(part_l_ptr + part, l_i)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc)
    else:
        out = acc * (value_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, tile_req_ptr, tile_first_ptr,
    query_start_ptr, stride_ot, stride_oh, value_scale, num_kv_heads, head_size, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """Program (tile, KV head): the splits' softmax states folded into the rows' outputs (the
    online softmax's recurrence, one split at a time)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    rows = tl.arange(0, ROWS)
    token = first + rows // GROUP_PAD
    sub = rows % GROUP_PAD
    head = kv_head * GROUP + sub
    row_ok = (token < q_len) & (sub < GROUP)
    d = tl.arange(0, HEAD_PAD)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    first_part = (tile * num_kv_heads + kv_head) * num_splits
    for split in range(0, num_splits):
        part = (first_part + split) * ROWS + rows
        m_s = tl.load(part_m_ptr + part)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_i = l_i * alpha + tl.load(part_l_ptr + part) * beta
        acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :])
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    out = acc * (value_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    q_rows = (q_start + token).to(tl.int64)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < head_size)[None, :])  # fmt: skip


@dataclass
class _Tiles:
    """One launch's tiles: request index and first query token of each."""

    req: torch.Tensor  # [num_tiles] int32
    first: torch.Tensor  # [num_tiles] int32


def plan_tiles(
    query_lens: list[int], tokens_per_tile: int, decodes: bool
) -> tuple[list[int], list[int]]:
    """The (request, first token) tiles of the decodes (query length 1) or of the prefill chunks
    (longer queries), ``tokens_per_tile`` query tokens each."""
    reqs: list[int] = []
    firsts: list[int] = []
    for req, query_len in enumerate(query_lens):
        if (query_len == 1) != decodes:
            continue
        for first in range(0, query_len, tokens_per_tile):
            reqs.append(req)
            firsts.append(first)
    return reqs, firsts


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels above; CUDA (or the Triton interpreter)."""

    name: ClassVar[str] = "triton"
    supports_cuda_graphs: ClassVar[bool] = True

    @staticmethod
    def _tiles_for(metadata: AttentionMetadata, tokens_per_tile: int,
                   decodes: bool) -> _Tiles | None:  # fmt: skip
        """This step's tiles, planned once and reused by every layer (None: no such requests)."""
        key = ("triton", tokens_per_tile, decodes)
        if key not in metadata.plans:
            reqs, firsts = plan_tiles(metadata.query_lens_cpu, tokens_per_tile, decodes)
            tiles = [np.array(reqs, dtype=np.int32), np.array(firsts, dtype=np.int32)]
            metadata.plans[key] = _Tiles(
                *upload(metadata.query_start_loc.device, tiles)
            ) if reqs else None  # fmt: skip
        return metadata.plans[key]

    @staticmethod
    def _partials(metadata: AttentionMetadata, grid: tuple[int, int, int], rows: int,
                  head_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The split programs' softmax states (max, sum, accumulator), allocated once per step
        and shape and reused by every layer: each layer's combine has read them before the
        next layer's attention, in stream order, writes them."""
        key = ("triton-partials", grid, rows, head_pad)
        if key not in metadata.plans:
            device = metadata.query_start_loc.device
            m = torch.empty(grid + (rows,), dtype=torch.float32, device=device)
            acc = torch.empty(grid + (rows, head_pad), dtype=torch.float32, device=device)
            metadata.plans[key] = (m, torch.empty_like(m), acc)
        return metadata.plans[key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        num_tokens, num_heads, head_size = query.shape
        k_scale, v_scale = fp8_scales(kv_cache, kv_scales)
        num_kv_heads = key.shape[1]
        head_pad = max(triton.next_power_of_2(head_size), 16)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key, value = _unit_stride(key), _unit_stride(value)
        if num_tokens:
            _store_kv_kernel[(num_tokens, num_kv_heads)](
                key, value, key_cache, value_cache, metadata.slot_mapping,
                key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                num_kv_heads, head_size, 1.0 / k_scale, 1.0 / v_scale, HEAD_PAD=head_pad,
                FP8_MAX=torch.finfo(kv_cache.dtype).max if is_fp8(kv_cache.dtype) else 0.0,
            )  # fmt: skip
        query = _unit_stride(query)
        out = torch.empty_like(query)
        group = num_heads // num_kv_heads
        group_pad = triton.next_power_of_2(group)
        block_table = metadata.block_table
        for decodes, rows in ((True, _DECODE_ROWS), (False, _PREFILL_ROWS)):
            rows = max(rows, group_pad)
            tiles = self._tiles_for(metadata, rows // group_pad, decodes)
            if tiles is None:
                continue
            num_tiles = tiles.req.shape[0]
            splits = decode_splits(num_tiles * num_kv_heads, query.device) if decodes else 1
            grid = (num_tiles, num_kv_heads, splits)
            part_m, part_l, part_acc = (
                self._partials(metadata, grid, rows, head_pad) if splits > 1 else (out, out, out)
            )
            _paged_attention_kernel[grid](
                out, query, key_cache, value_cache, tiles.req, tiles.first,
                metadata.query_start_loc, metadata.seq_lens, block_table,
                part_m, part_l, part_acc,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                block_table.stride(0), scale * k_scale, v_scale, sliding_window or 0,
                num_kv_heads, head_size,
                kv_cache.shape[2], splits, GROUP=group, GROUP_PAD=group_pad, ROWS=rows,
                HEAD_PAD=head_pad, BLOCK_N=_BLOCK_N, HAS_WINDOW=sliding_window is not None,
                UPCAST=INTERPRETED, PRECISION="ieee" if query.dtype == torch.float32 else None,
                SPLIT=splits > 1,
            )  # fmt: skip
            if splits > 1:
                _combine_splits_kernel[(num_tiles, num_kv_heads)](
                    out, part_m, part_l, part_acc, tiles.req, tiles.first,
                    metadata.query_start_loc, out.stride(0), out.stride(1), v_scale,
                    num_kv_heads, head_size, splits, GROUP=group, GROUP_PAD=group_pad, ROWS=rows,
                    HEAD_PAD=head_pad,
                )  # fmt: skip
        return out


def decode_splits(num_programs: int, device: torch.device) -> int:
    """How many splits of the keys a decode launch of ``num_programs`` (tile, KV head) programs
    takes: enough to give every multiprocessor two programs, at most ``_MAX_SPLITS``. A batch-1
    decode of a 2-KV-head model is otherwise 2 programs walking every key on a 132-SM GPU.

    It depends on the batch alone, never on sequence lengths, so a captured graph keeps it."""
    target = 2 * _multiprocessors(device)
    return max(1, min(_MAX_SPLITS, -(-target // max(num_programs, 1))))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: small, so tests split small batches
        return _INTERPRETED_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension densely."""
    return x if x.stride(-1) == 1 else x.contiguous()
