"""The worker's persistent batch: per-request state kept across steps, updated by deltas.

Consecutive steps share most requests, so token ids, block tables and sampling knobs live in
preallocated numpy rows (one row per request) that each step indexes, instead of being rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.sampling_params import SamplingParams


def upload(device: torch.device, arrays: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
    """Host arrays of one step on ``device``, each in its own dtype and shape.

    On CUDA they travel in one copy: packed into one pinned buffer, then sent without a stream
    synchronize (each pageable copy synchronized the stream, and a dozen separate pinned copies
    cost ~50 us of host time each: a tenth of a batch-1 decode step on an H200). torch's cached
    host allocator reuses the pinned block only once the copy has run. On CPU they are the
    arrays themselves."""
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray)
               else a.contiguous() for a in arrays]  # fmt: skip
    if device.type != "cuda":
        return tensors
    staging = torch.empty(packed_size(tensors), dtype=torch.uint8, pin_memory=True)
    offsets = pack(tensors, staging)
    return unpack(staging.to(device, non_blocking=True), tensors, offsets)


_PACK_ALIGN = 16
"""Byte alignment of every packed piece: enough to view it in any dtype, and what Triton
specializes a pointer argument on, so kernels fed these views compile once, not once for each
mix of aligned and unaligned pointers that a step's array lengths happen to make."""


def _aligned_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` rounded up to ``_PACK_ALIGN``."""
    return -(-tensor.numel() * tensor.element_size() // _PACK_ALIGN) * _PACK_ALIGN


def packed_size(tensors: Sequence[torch.Tensor]) -> int:
    return max(sum(_aligned_nbytes(t) for t in tensors), _PACK_ALIGN)


def pack(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> list[int]:
    """Copy contiguous host tensors into the uint8 ``buffer`` back to back; their offsets."""
    packed, offsets, offset = buffer.numpy(), [], 0
    for tensor in tensors:
        values = tensor.numpy().reshape(-1)
        packed[offset : offset + values.nbytes].view(values.dtype)[:] = values
        offsets.append(offset)
        offset += _aligned_nbytes(tensor)
    return offsets


def unpack(
    buffer: torch.Tensor, like: Sequence[torch.Tensor], offsets: list[int]
) -> list[torch.Tensor]:
    """Views of the packed ``buffer``, each in the dtype and shape of its ``like``."""
    return [
        buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, offset in zip(like, offsets, strict=True)
    ]


class HostCopy:
    """Device tensors on their way to the host. On CUDA: copies into pinned memory that do not
    synchronize the stream, so the next step can be launched behind them, and ``get()`` waits
    for these copies alone (``tolist()`` on a device tensor would wait for the whole stream)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = list(tensors)
        if self._host and self._host[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def host_to_device(
    values: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One host array on ``device`` (see ``upload``), converted to ``dtype`` first."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    return upload(device, [tensor if dtype is None else tensor.to(dtype)])[0]


@dataclass(eq=False)
class CachedRequestState:
    """The worker's copy of one running request."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens] for M-RoPE models
    mrope_delta: int = 0  # a generated token at position p sits at p + delta on all axes

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    """Rows of request state. Rows are reused after a request leaves; no condensing needed
    because every step addresses its requests by an explicit row index array."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Tokens sampled by launched steps and not yet read back (appended): at most one, the
        # input of the row's next step, which then comes from the device (async scheduling).
        self.num_in_flight = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling knobs, one value per row.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives the lowest

    def add_request(
        self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int
    ) -> int:
        if not self._free_rows:
            raise RuntimeError("InputBatch is full; the scheduler exceeded max_num_seqs.")
        row = self._free_rows.pop()
        self.req_id_to_row[state.req_id] = row
        self.states[row] = state
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_in_flight[row] = 0
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        params = state.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.states[row] = None
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        state = self.states[row]
        assert state is not None
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        state.output_token_ids.append(token_id)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)
