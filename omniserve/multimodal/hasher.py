"""Content hashes of multimodal items: the one identity the three caches share.

An item's identifier covers its modality, its decoded content and every processor kwarg that
changes its processed tensors, so two requests share a processor-cache entry, an encoder output
or prefix-cache blocks exactly when the model would see the same inputs.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from PIL import Image


class MultiModalHasher:
    """SHA-256 over a typed, unambiguous serialisation of an item and its kwargs."""

    @classmethod
    def hash_item(cls, modality: str, item: object, kwargs: Mapping[str, object]) -> str:
        hasher = hashlib.sha256()
        for chunk in cls.iter_chunks({"modality": modality, "item": item, "kwargs": kwargs}):
            hasher.update(chunk)
        return hasher.hexdigest()

    @classmethod
    def iter_chunks(cls, obj: object) -> Iterator[bytes]:
        """Bytes that identify ``obj``; every value is prefixed by a type tag and a length,
        so different structures never serialise to the same stream."""
        if isinstance(obj, Image.Image):
            palette = obj.getpalette() if obj.mode == "P" else None
            yield from cls._tagged(b"pil", repr((obj.mode, obj.size, palette)).encode())
            yield from cls._tagged(b"pix", obj.tobytes())
        elif isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            yield from cls._tagged(b"pt", repr((str(obj.dtype), tuple(obj.shape))).encode())
            yield from cls._tagged(b"buf", flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            if array.dtype == object:
                yield from cls._tagged(b"obj", pickle.dumps(array.tolist()))
                return
            yield from cls._tagged(b"np", repr((array.dtype.str, array.shape)).encode())
            yield from cls._tagged(b"buf", array.tobytes())
        elif isinstance(obj, Mapping):
            yield from cls._tagged(b"map", str(len(obj)).encode())
            for key in sorted(obj, key=repr):
                yield from cls.iter_chunks(key)
                yield from cls.iter_chunks(obj[key])
        elif isinstance(obj, list | tuple):
            yield from cls._tagged(type(obj).__name__.encode(), str(len(obj)).encode())
            for value in obj:
                yield from cls.iter_chunks(value)
        elif obj is None or isinstance(obj, str | int | float | bool | bytes):
            yield from cls._tagged(type(obj).__name__.encode(), repr(obj).encode())
        else:
            yield from cls._tagged(b"pickle", pickle.dumps(obj))

    @staticmethod
    def _tagged(tag: bytes, payload: bytes) -> Iterator[bytes]:
        yield tag + b":" + str(len(payload)).encode() + b":"
        yield payload
