"""Host <-> device transfers that never synchronize the stream.

A copy from pageable host memory (``torch.tensor(list, device=...)``, ``.to(device)``) waits for
everything queued on the stream before it: on a GPU, for the step being computed, and under
async scheduling for the next one too. These go through pinned memory instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(device: torch.device, arrays: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
    """Host arrays of one step on ``device``, each in its own dtype and shape.

    On CUDA they travel in one copy: packed into one pinned buffer, then sent without a stream
    synchronize (each pageable copy synchronized the stream, and a dozen separate pinned copies
    cost ~50 us of host time each: a tenth of a batch-1 decode step on an H200). torch's cached
    host allocator reuses the pinned block only once the copy has run. On CPU they are the
    arrays themselves; other devices (the meta device of tests) get plain copies."""
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray)
               else a.contiguous() for a in arrays]  # fmt: skip
    if device.type == "cpu":
        return tensors
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
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
        if tensor.numel():
            values = tensor.reshape(-1).view(torch.uint8).numpy()  # bytes: any dtype, bf16 too
            packed[offset : offset + values.nbytes] = values
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


def pack_on_device(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes back to back in one uint8 tensor on their device (one copy moves them
    all), and their offsets (each aligned as ``pack``'s)."""
    pieces: list[torch.Tensor] = []
    offsets, offset = [], 0
    for tensor in tensors:
        if pieces and offset % _PACK_ALIGN:  # pad the piece before up to the alignment
            pieces.append(pieces[-1].new_zeros(_PACK_ALIGN - offset % _PACK_ALIGN))
            offset += pieces[-1].numel()
        flat = tensor.contiguous().reshape(-1)
        pieces.append(
            flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
        )
        offsets.append(offset)
        offset += pieces[-1].numel()
    return (torch.cat(pieces) if len(pieces) > 1 else pieces[0]), offsets


class HostCopy:
    """Device tensors on their way to the host. On CUDA: packed on the device and copied in one
    go into pinned memory without synchronizing the stream, so the next step can be launched
    behind the copy, and ``get()`` waits for this copy alone (``tolist()`` on a device tensor
    would wait for the whole stream)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = list(tensors)
        if not self._host or self._host[0].device.type != "cuda":
            return
        packed, offsets = pack_on_device(self._host)
        host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._host = unpack(host, self._host, offsets)

    def ready(self) -> bool:
        """Whether the copy has landed (``get()`` would not wait)."""
        return self._event is None or self._event.query()

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
