"""Checked name-to-parameter weight loading, reading checkpoint bytes straight into parameters.

A model routes each checkpoint key to ``(parameter name, shard args)``; the parameter's own
``weight_loader(param, tensor, *shard_args)`` (set by the layer that owns it) writes the tensor into
the right slice of this rank's partition. A fused parameter (q/k/v, gate/up, stacked experts)
declares the shard args it expects in ``param.shard_ids`` and counts as loaded only once every
shard has arrived, so a half-loaded fused weight is reported as missing.

Weights arrive as ``torch.Tensor``s or as ``LazyTensor``s (the checkpoint reader's). A loader
calls ``copy_weight(dest, loaded, dim, start)``: for a ``LazyTensor`` whose bytes are one range of
the file and match ``dest``'s dtype, they are read from the file into ``dest``'s memory directly
(no temporary, no memory map whose pages would count against the process), so loading holds each
weight once; otherwise (a dtype cast, a column slice for tensor parallelism) one tensor is staged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import torch
from torch import nn

WeightRoute = tuple[str, tuple[Any, ...]]
"""(parameter name, extra arguments for the parameter's weight_loader)."""

StackedParams = tuple[tuple[str, str, Any], ...]
"""(fused module, checkpoint module, shard id) triples, e.g. ("qkv_proj", "q_proj", "q")."""

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 << 20


class SafetensorsFile:
    """One ``.safetensors`` file opened for positioned reads (``os.preadv``), header parsed.

    Format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
    dtype, shape and ``data_offsets`` (relative to the end of the header), then the data.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            (header_len,) = struct.unpack("<Q", self._read_exact(8, 0))
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"{self.path}: implausible safetensors header ({header_len} B)")
            header = json.loads(self._read_exact(header_len, 8))
        except (ValueError, struct.error) as exc:
            self.close()
            raise ValueError(f"{self.path} is not a valid safetensors file: {exc}") from exc
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.entries: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> LazyTensor:
        entry = self.entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = torch.Size(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes for {shape}")
        return LazyTensor(self, name, shape, dtype, self._data_start + begin)

    def read_into(self, dest: torch.Tensor, offset: int) -> None:
        """Fill a contiguous CPU tensor with the file's bytes from ``offset``: a large one in
        a piece per thread, read side by side (most of a read's time is the kernel faulting in
        the tensor's fresh pages, which the threads then share)."""
        nbytes = dest.numel() * dest.element_size()
        view = memoryview((ctypes.c_char * nbytes).from_address(dest.data_ptr())).cast("B")
        pieces = min(torch.get_num_threads(), nbytes // _PARALLEL_READ_BYTES)
        if pieces <= 1:
            self._read_range(view, offset, 0, nbytes)
            return
        bounds = [nbytes * i // pieces // 4096 * 4096 for i in range(pieces)] + [nbytes]
        pool = _read_pool()
        for future in [pool.submit(self._read_range, view, offset, begin, end)
                       for begin, end in itertools.pairwise(bounds)]:  # fmt: skip
            future.result()

    def _read_range(self, view: memoryview, offset: int, begin: int, end: int) -> None:
        done = begin
        while done < end:  # preadv may return short counts on large reads
            count = os.preadv(self._fd, [view[done:end]], offset + done)
            if count == 0:
                raise ValueError(f"{self.path} is truncated at byte {offset + done}")
            done += count

    def _read_exact(self, nbytes: int, offset: int) -> bytes:
        data = os.pread(self._fd, nbytes, offset)
        if len(data) != nbytes:
            raise ValueError("truncated")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PARALLEL_READ_BYTES = 4 << 20
"""Reads of at least twice this are split among threads."""


@functools.cache
def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max(1, torch.get_num_threads()), thread_name_prefix="omniserve-read"
    )


class LazyTensor:
    """A checkpoint tensor that is read only when (and as far as) a loader asks for it."""

    def __init__(
        self, source: SafetensorsFile, name: str, shape: torch.Size, dtype: torch.dtype, offset: int
    ) -> None:
        self._source = source
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self._offset = offset

    def _region(self, dim: int, start: int, length: int) -> tuple[int, torch.Size] | None:
        """(file offset, shape) of the slice ``[start, start + length)`` along ``dim`` when it is
        one contiguous byte range (the whole tensor, or every dimension before ``dim`` has size
        1), else None."""
        if start == 0 and length == self.shape[dim]:  # a row-parallel layer's single rank
            return self._offset, self.shape
        if math.prod(self.shape[:dim]) != 1:
            return None
        row_bytes = math.prod(self.shape[dim + 1 :]) * self.dtype.itemsize
        shape = torch.Size((*self.shape[:dim], length, *self.shape[dim + 1 :]))
        return self._offset + start * row_bytes, shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        region = self._region(dim, start, length)
        if region is None:
            return self.materialize().narrow(dim, start, length)
        offset, shape = region
        out = torch.empty(shape, dtype=self.dtype)
        self._source.read_into(out, offset)
        return out

    def materialize(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0]) if self.shape else self._read_scalar()

    def _read_scalar(self) -> torch.Tensor:
        out = torch.empty((), dtype=self.dtype)
        self._source.read_into(out, self._offset)
        return out

    def copy_into(self, dest: torch.Tensor, dim: int = 0, start: int = 0) -> None:
        """``dest.copy_(self.narrow(dim, start, dest.shape[dim]))``, read in place when it can."""
        dim = dim % max(len(self.shape), 1)
        length = dest.shape[dim] if dest.dim() else 1
        region = self._region(dim, start, length) if self.shape else (self._offset, self.shape)
        direct = (
            region is not None
            and dest.dtype == self.dtype
            and dest.device.type == "cpu"
            and dest.is_contiguous()
            and dest.shape == region[1]
        )
        if direct:
            self._source.read_into(dest, region[0])  # type: ignore[index]
        else:
            dest.copy_(self.narrow(dim, start, length) if self.shape else self._read_scalar())


LoadedWeight: TypeAlias = torch.Tensor | LazyTensor
"""What a ``weight_loader`` receives."""


def materialize(loaded: LoadedWeight) -> torch.Tensor:
    return loaded.materialize() if isinstance(loaded, LazyTensor) else loaded


def copy_weight(dest: torch.Tensor, loaded: LoadedWeight, dim: int = 0, start: int = 0) -> None:
    """Write ``loaded`` narrowed to ``[start, start + dest.shape[dim])`` along ``dim`` into
    ``dest`` (a parameter or a slice of one), reading the checkpoint in place when it can."""
    if isinstance(loaded, LazyTensor):
        loaded.copy_into(dest, dim, start)
    elif dest.dim() and dest.shape[dim] != loaded.shape[dim]:
        dest.copy_(loaded.narrow(dim, start, dest.shape[dim]))
    else:
        dest.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: LoadedWeight) -> None:
    """Copy a whole, unsharded tensor (casting to the parameter's dtype and device)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"Shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
            f"{tuple(loaded_weight.shape)}."
        )
    copy_weight(param.data, loaded_weight)


def set_weight_loader(
    param: nn.Parameter, loader: Callable[..., None], shard_ids: set[tuple[Any, ...]] | None = None
) -> None:
    param.weight_loader = loader
    if shard_ids is not None:
        param.shard_ids = shard_ids


def route_stacked(name: str, stacked: StackedParams) -> WeightRoute:
    """Map ``...q_proj.weight`` to ``(...qkv_proj.weight, ("q",))``; other names pass through."""
    dotted = f".{name}"  # so a module at the top level matches as well
    for fused, ckpt, shard_id in stacked:
        part = f".{ckpt}."
        if part in dotted:
            return dotted.replace(part, f".{fused}.", 1)[1:], (shard_id,)
    return name, ()


def load_weights_by_route(
    module: nn.Module,
    weights: Iterable[tuple[str, LoadedWeight]],
    route: Callable[[str], WeightRoute | None],
) -> set[str]:
    """Load every routed tensor; return the names of fully loaded parameters.

    ``route`` returns None for keys the model deliberately ignores. Keys that route to no
    parameter are collected and raised together as one ValueError naming them. While
    ``module.find_quantized`` is set (``layers.quantization.quantize_layers``), nothing is
    loaded: each routed key goes to it instead, so the model's own routing names its layers.
    """
    find_quantized = getattr(module, "find_quantized", None)
    params = dict(module.named_parameters())
    shards_seen: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        target = route(ckpt_name)
        if target is None:
            continue
        param_name, shard_args = target
        if find_quantized is not None:
            find_quantized(ckpt_name, param_name)
            continue
        param = params.get(param_name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, *shard_args)
        except ValueError as e:
            raise ValueError(
                f"Cannot load checkpoint tensor {ckpt_name!r} into {param_name!r}: {e}"
            ) from e
        shards_seen[param_name].add(shard_args)
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else "")
        raise ValueError(
            f"{len(unexpected)} checkpoint tensor(s) match no parameter of "
            f"{type(module).__name__}: {shown}"
        )
    return {
        name
        for name, seen in shards_seen.items()
        if seen >= getattr(params[name], "shard_ids", {()})
    }


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in ``dtype`` inside the block (the model classes create them plainly)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
