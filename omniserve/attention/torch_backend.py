"""Paged attention in plain PyTorch: the reference for every kernel, and the base of the CPU one.

Work per step is split by request kind. Decodes (query length 1) go through one padded gather of
their keys and one ``scaled_dot_product_attention`` call; grouped-query attention is handled by
viewing the query heads as ``[num_kv_heads, group]`` so keys are never repeated. A subclass may
take the decodes instead (``decode_kernel_supports`` / ``decode_kernel``: the CPU backend's C
kernel reads each key and value once straight from the paged cache). Each prefill chunk
gets one SDPA call; a first chunk attends its fresh keys with ``is_causal`` and skips the gather.
The index tensors for this (``_BatchPlan``) are built once per step and reused by every layer, and
gathered keys/values land in one reused workspace (at most the largest gather of a step: a decode
chunk, or the longest prefill's history).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from omniserve.attention.base import AttentionBackend, fp8_scales, is_fp8, to_fp8
from omniserve.attention.metadata import AttentionMetadata

KERNEL_MAX_QUERY = 8
"""With a decode kernel, chunks of at most this many tokens (a decode with drafts to verify, the
last tokens of a prompt) are handed to it too, one row per token, each with its own causal
length: the kernel reads the request's keys in place, where SDPA would first gather them (and
a step's worth of per-request gathers and SDPA calls costs more than the attention itself)."""

# Decodes are gathered in chunks of at most this many (request, key position) pairs so one step's
# padded key copy stays bounded (32k positions x 1k head elements x 4 bytes = 128 MiB for K).
_DECODE_KEYS_PER_CHUNK = 1 << 15


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scatter new keys/values ([num_tokens, num_kv_heads, head_size]) to their slots (an fp8
    cache's divided by ``kv_scales``, as bytes: torch has no fp8 ``index_copy_`` on CPU)."""
    if is_fp8(kv_cache.dtype):
        key, value = (to_fp8(x, kv_cache.dtype, s).view(torch.uint8)
                      for x, s in zip((key, value), kv_scales, strict=True))  # fmt: skip
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].flatten(0, 1).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].flatten(0, 1).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


@dataclass
class _DecodeChunk:
    token_indices: torch.Tensor  # [n] int64: the decode tokens' rows in the flattened batch
    key_slots: torch.Tensor  # [n, max_len] int64: cache slot of each key position (padded)
    key_mask: torch.Tensor  # [n, 1, 1, max_len] bool: position is visible to the query


@dataclass
class _DecodeRows:
    """The C kernel's view of the step's decodes (no padding, no gather)."""

    token_rows: torch.Tensor  # [n] int64: the decode tokens' rows in the flattened batch
    block_table: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32


@dataclass
class _PrefillSeq:
    start: int  # first row of the chunk in the flattened batch
    end: int
    key_slots: torch.Tensor | None  # [seq_len] int64; None: no cached context, use the new keys
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None: plain causal (is_causal)


@dataclass
class _BatchPlan:
    decode_chunks: list[_DecodeChunk] = field(default_factory=list)
    decode_rows: _DecodeRows | None = None
    prefills: list[_PrefillSeq] = field(default_factory=list)


def _slots(
    block_table_rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slots of ``positions`` ([L]) for each block-table row ([n, max_blocks]) -> [n, L]."""
    block_ids = block_table_rows[:, positions // block_size].long()
    return block_ids * block_size + positions % block_size


def _plan_decodes(
    md: AttentionMetadata,
    decode_reqs: list[int],
    token_starts: list[int],
    block_size: int,
    sliding_window: int | None,
) -> list[_DecodeChunk]:
    device = md.block_table.device
    # Sorting by length keeps requests of similar length together, so padding stays small.
    decode_reqs = sorted(decode_reqs, key=lambda r: md.seq_lens_cpu[r])
    groups: list[list[int]] = []
    for r in decode_reqs:
        if groups and (len(groups[-1]) + 1) * md.seq_lens_cpu[r] <= _DECODE_KEYS_PER_CHUNK:
            groups[-1].append(r)
        else:
            groups.append([r])
    chunks = []
    for group in groups:
        rows = torch.tensor(group, device=device)
        max_len = max(md.seq_lens_cpu[r] for r in group)
        positions = torch.arange(max_len, device=device)  # [L]
        seq_lens = torch.tensor([md.seq_lens_cpu[r] for r in group], device=device)[:, None]
        mask = positions[None, :] < seq_lens  # [n, L]
        if sliding_window is not None:
            mask &= positions[None, :] >= seq_lens - sliding_window
        token_indices = torch.tensor([token_starts[r] for r in group], device=device)
        chunks.append(
            _DecodeChunk(
                token_indices=token_indices,
                key_slots=_slots(md.block_table[rows], positions, block_size),
                key_mask=mask[:, None, None, :],
            )
        )
    return chunks


def _plan_prefill(
    md: AttentionMetadata, req: int, start: int, block_size: int, sliding_window: int | None
) -> _PrefillSeq:
    query_len, seq_len = md.query_lens_cpu[req], md.seq_lens_cpu[req]
    num_context = seq_len - query_len
    device = md.block_table.device
    key_slots = None
    if num_context > 0:
        key_slots = _slots(
            md.block_table[req : req + 1], torch.arange(seq_len, device=device), block_size
        )[0]
    mask = None
    if num_context > 0 or sliding_window is not None:
        key_pos = torch.arange(seq_len, device=device)[None, :]  # [1, S]
        query_pos = torch.arange(num_context, seq_len, device=device)[:, None]  # [Q, 1]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
    return _PrefillSeq(start, start + query_len, key_slots, mask)


def _decode_rows(
    md: AttentionMetadata, decode_reqs: list[int], token_starts: list[int]
) -> _DecodeRows:
    """The kernel's rows: each token of ``decode_reqs`` (one for a decode, up to
    ``KERNEL_MAX_QUERY`` for a short chunk), its request's block table and its causal length."""
    if all(q == 1 for q in md.query_lens_cpu):  # decodes only: the runner's tensors as they are
        return _DecodeRows(
            torch.tensor(token_starts, dtype=torch.int64),
            md.block_table.contiguous(),
            md.seq_lens.to(torch.int32).contiguous(),
        )
    reqs, token_rows, seq_lens = [], [], []
    for r in decode_reqs:
        query_len, seq_len = md.query_lens_cpu[r], md.seq_lens_cpu[r]
        for i in range(query_len):
            reqs.append(r)
            token_rows.append(token_starts[r] + i)
            seq_lens.append(seq_len - query_len + 1 + i)
    return _DecodeRows(
        torch.tensor(token_rows, dtype=torch.int64),
        md.block_table[torch.tensor(reqs)].contiguous(),
        torch.tensor(seq_lens, dtype=torch.int32),
    )


def _plan_batch(
    md: AttentionMetadata, block_size: int, sliding_window: int | None, use_kernel: bool
) -> _BatchPlan:
    plan = _BatchPlan()
    decode_reqs, token_starts = [], []
    start = 0
    for req, query_len in enumerate(md.query_lens_cpu):
        token_starts.append(start)
        if query_len == 1 or (use_kernel and 1 < query_len <= KERNEL_MAX_QUERY):
            decode_reqs.append(req)
        elif query_len > 1:
            plan.prefills.append(_plan_prefill(md, req, start, block_size, sliding_window))
        start += query_len
    if decode_reqs and use_kernel:
        plan.decode_rows = _decode_rows(md, decode_reqs, token_starts)
    elif decode_reqs:
        plan.decode_chunks = _plan_decodes(
            md, decode_reqs, token_starts, block_size, sliding_window
        )
    return plan


class TorchAttentionBackend(AttentionBackend):
    """SDPA over the paged cache; one instance is shared by all layers of a model."""

    name: ClassVar[str] = "torch"

    def __init__(self) -> None:
        # Reused destination of the key/value gathers: a fresh multi-MiB tensor per layer costs
        # more in page faults than the copy itself on CPU.
        self._workspace: torch.Tensor | None = None

    def decode_kernel_supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether ``decode_kernel`` takes this step's decodes (never, in plain torch)."""
        return False

    def decode_kernel(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        token_rows: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        value_scale: float = 1.0,
    ) -> None:
        """Write attention for the decode tokens at ``token_rows`` of ``query`` into ``out``
        (times ``value_scale``: an fp8 cache's values are stored divided by it).

        query/out ``[num_tokens, num_heads, head_size]``; token_rows ``[n]`` int64; block_table
        ``[n, max_blocks]`` int32 and seq_lens ``[n]`` int32 (contiguous) for the same n requests.
        A hook for backends with a decode kernel (the CPU backend's); only called after
        ``decode_kernel_supports`` said yes, which plain torch never does.
        """
        raise RuntimeError(
            f"{type(self).__name__} has no decode kernel; decode_kernel_supports() is False for it."
        )

    def _plan(
        self, md: AttentionMetadata, block_size: int, sliding_window: int | None, use_kernel: bool
    ) -> _BatchPlan:
        """The step's plan, made once and kept on its metadata for every layer."""
        key = ("torch", block_size, sliding_window, use_kernel)
        if key not in md.plans:
            md.plans[key] = _plan_batch(md, block_size, sliding_window, use_kernel)
        return md.plans[key]

    def _gather(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Keys/values at ``slots`` -> two ``[*slots.shape, num_kv_heads, head_size]`` views of
        the workspace, valid until the next gather; an fp8 cache's widened to ``dtype``."""
        if is_fp8(key_cache.dtype):
            k, v = self._gather(key_cache.view(torch.uint8), value_cache.view(torch.uint8),
                                slots, dtype)  # fmt: skip
            return k.view(key_cache.dtype).to(dtype), v.view(key_cache.dtype).to(dtype)
        row_shape = key_cache.shape[1:]
        numel = slots.numel() * key_cache[0].numel()
        ws = self._workspace
        if (
            ws is None
            or ws.dtype != key_cache.dtype
            or ws.device != key_cache.device
            or ws.numel() < 2 * numel
        ):
            with torch.inference_mode(False):  # a normal tensor is writable in and out of it
                ws = self._workspace = key_cache.new_empty(2 * numel)
        flat_slots = slots.flatten()
        k = torch.index_select(key_cache, 0, flat_slots, out=ws[:numel].view(-1, *row_shape))
        v = torch.index_select(
            value_cache, 0, flat_slots, out=ws[numel : 2 * numel].view(-1, *row_shape)
        )
        return k.view(*slots.shape, *row_shape), v.view(*slots.shape, *row_shape)

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
        kv_scales = fp8_scales(kv_cache, kv_scales)
        write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        # What is read back from the cache is value / scale: the key's scale joins the softmax's,
        # the value's multiplies the output.
        cached_scale, value_scale = scale * kv_scales[0], kv_scales[1]
        use_kernel = self.decode_kernel_supports(query, kv_cache)
        plan = self._plan(metadata, kv_cache.shape[2], sliding_window, use_kernel)
        key_cache = kv_cache[0].flatten(0, 1)  # [num_slots, num_kv_heads, head_size]
        value_cache = kv_cache[1].flatten(0, 1)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            self.decode_kernel(
                query,
                out,
                rows.token_rows,
                kv_cache,
                rows.block_table,
                rows.seq_lens,
                scale=cached_scale,
                sliding_window=sliding_window,
                value_scale=value_scale,
            )
        for chunk in plan.decode_chunks:
            k, v = self._gather(key_cache, value_cache, chunk.key_slots, query.dtype)
            # NOTE: padding slots may never have been written (the cache is not zeroed): clear
            # them here, since a masked NaN still poisons SDPA (NaN * 0 is NaN).
            hidden = ~chunk.key_mask.view(k.shape[0], k.shape[1], 1, 1)
            k.masked_fill_(hidden, 0)
            v.masked_fill_(hidden, 0)
            rows = _decode(query, k, v, chunk, cached_scale)
            if value_scale != 1.0:
                rows = rows * value_scale
            out.index_copy_(0, chunk.token_indices, rows)
        for seq in plan.prefills:
            q = query[seq.start : seq.end]  # [Q, num_heads, head_size]
            if seq.key_slots is None:  # no cached context: the new keys are the whole sequence
                k, v = key[seq.start : seq.end], value[seq.start : seq.end]
                out[seq.start : seq.end] = _attend(q, k, v, seq.mask, scale)
                continue
            k, v = self._gather(key_cache, value_cache, seq.key_slots, query.dtype)
            rows = _attend(q, k.to(q.dtype), v.to(q.dtype), seq.mask, cached_scale)
            out[seq.start : seq.end] = rows if value_scale == 1.0 else rows * value_scale
        return out


def _decode(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: _DecodeChunk, scale: float
) -> torch.Tensor:
    """One SDPA call for a chunk of decodes; k/v ``[n, L, num_kv_heads, head_size]`` (padded)."""
    q = query[chunk.token_indices]  # [n, num_heads, head_size]
    n, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    # Query head h reads KV head h // group: view the heads as [num_kv_heads, group] and let the
    # group play the role of the query-length axis, so one KV head serves its whole group.
    q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_size)
    k = k.transpose(1, 2).to(q.dtype)  # [n, num_kv_heads, L, head_size]
    v = v.transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.key_mask, scale=scale)
    return out.reshape(n, num_heads, head_size)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [Q, H, D], k/v [S, num_kv_heads, D]; mask [Q, S] (None: causal) -> [Q, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """All tokens as one causal sequence without a cache: the dummy (profile) forward."""
    mask = None
    if sliding_window is not None:
        pos = torch.arange(query.shape[0], device=query.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
    return _attend(query, key, value, mask, scale)


def reference_attention(
    query: torch.Tensor,
    query_lens: list[int],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Naive ground truth: one request, one query token at a time, over contiguous histories.

    ``keys[r]``/``values[r]`` are request r's full ``[seq_len, num_kv_heads, head_size]`` history
    (its last ``query_lens[r]`` rows are the new tokens). No paging, no batching, no SDPA.
    """
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    row = 0
    for query_len, k, v in zip(query_lens, keys, values, strict=True):
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, D]
        for i in range(query_len):
            pos = k.shape[0] - query_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            scores = torch.einsum("hd,shd->hs", query[row], k[lo : pos + 1]) * scale
            probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)  # [H, s]
            out[row] = torch.einsum("hs,shd->hd", probs, v[lo : pos + 1])
            row += 1
    return out
