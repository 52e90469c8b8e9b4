"""A step's host arrays reach the device in one copy: packed back to back into one buffer, each
piece 16-byte aligned so it can be viewed in its own dtype and shape, and Triton's kernels see the
same pointer alignment whatever the step's array lengths (checked here on CPU with a
plain buffer, and through pinned memory on a GPU when one is present); what a step reads back
travels the other way the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniserve.transfers import HostCopy, pack, pack_on_device, packed_size, unpack, upload


def step_arrays() -> list[np.ndarray | torch.Tensor]:
    """What a step uploads: int32 offsets and a 2-D block table, int64 slots, ids and M-RoPE
    rows, float32 sampling knobs, a bool mask, odd sizes and an empty piece; and what an encoder
    step uploads: media in bf16 (no numpy dtype), a 0-d scalar."""
    rng = np.random.default_rng(0)
    return [
        np.array([0, 3, 4, 9], dtype=np.int32),
        rng.integers(0, 1000, (3, 5)).astype(np.int32),
        rng.integers(-1, 1 << 40, 7),
        np.empty(0, dtype=np.int64),
        torch.arange(15).view(3, 5),
        rng.random(3).astype(np.float32),
        np.array([True, False, True]),
        torch.randn(3, 7, generator=torch.Generator().manual_seed(0)).bfloat16(),
        torch.tensor(2.5),
    ]


def check_same(got: list[torch.Tensor], arrays: list[np.ndarray | torch.Tensor]) -> None:
    for out, array in zip(got, arrays, strict=True):
        want = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        assert out.dtype == want.dtype and out.shape == want.shape
        assert torch.equal(out.cpu(), want)


def test_pack_and_unpack_round_trip() -> None:
    arrays = step_arrays()
    tensors = upload(torch.device("cpu"), arrays)  # on CPU: the arrays themselves
    check_same(tensors, arrays)
    buffer = torch.full((packed_size(tensors),), 255, dtype=torch.uint8)
    offsets = pack(tensors, buffer)
    assert all(offset % 16 == 0 for offset in offsets)
    views = unpack(buffer, tensors, offsets)
    check_same(views, arrays)
    assert all((view.data_ptr() - buffer.data_ptr()) % 16 == 0 for view in views)


@pytest.mark.gpu
def test_upload_through_pinned_memory() -> None:
    arrays = step_arrays()
    got = upload(torch.device("cuda"), arrays)
    assert all(t.is_cuda for t in got)
    assert all(t.data_ptr() % 16 == 0 for t in got)
    check_same(got, arrays)


def test_device_tensors_pack_for_one_copy_back() -> None:
    """What a step reads back (sampled ids, logprobs, ranks, prompt logprobs), packed on the
    device for one copy to the host: each piece at an aligned offset, viewed back as it was."""
    tensors = [torch.as_tensor(a) for a in step_arrays()]
    packed, offsets = pack_on_device(tensors)
    assert packed.dtype == torch.uint8 and all(offset % 16 == 0 for offset in offsets)
    check_same(unpack(packed, tensors, offsets), step_arrays())


@pytest.mark.gpu
def test_host_copy_reads_back_through_pinned_memory() -> None:
    arrays = step_arrays()
    copy = HostCopy([torch.as_tensor(a).cuda() for a in arrays])
    got = copy.get()
    assert all(t.is_pinned() for t in got)
    check_same(got, arrays)
