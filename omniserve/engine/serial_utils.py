"""msgpack (msgspec) encoding for the front end <-> engine core sockets.

A message is a list of frames: frame 0 is the msgpack body, every further frame is the raw buffer
of one tensor or numpy array, sent zero-copy as its own ZMQ frame. In the body an array is a
msgpack extension ``(dtype, shape, data)`` where ``data`` is either the bytes themselves (arrays
below ``inline_threshold`` bytes, where a frame costs more than a copy) or the index of its frame.
Extensions are self-describing, so arrays may sit in fields typed ``Any`` (multimodal kwargs) as
well as in fields typed ``torch.Tensor`` / ``np.ndarray``. Nothing is ever pickled: an object the
encoder does not know raises ``TypeError``.

Encoders and decoders keep per-message state: use one instance per thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

Buffer = bytes | bytearray | memoryview

_EXT_TORCH = 1
_EXT_NUMPY = 2

INLINE_THRESHOLD_BYTES = 256
"""Arrays smaller than this travel inside the body; larger ones get their own frame."""


class MsgpackEncoder:
    def __init__(self, inline_threshold: int = INLINE_THRESHOLD_BYTES) -> None:
        self.inline_threshold = inline_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._header_encoder = msgspec.msgpack.Encoder()
        self._aux: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Frames for ``obj``: the body, then one raw buffer per large array.

        The buffers are views of the arrays' memory; they stay valid while the frames are alive.
        """
        aux: list[Buffer] = []
        self._aux = aux
        try:
            body = self._encoder.encode(obj)
        finally:
            self._aux = None
        return [body, *aux]

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            # [numel * itemsize] bytes; a uint8 view works for every dtype, bfloat16 included.
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            dtype = str(tensor.dtype).removeprefix("torch.")
            return self._ext(_EXT_TORCH, dtype, tuple(tensor.shape), raw)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("numpy arrays of Python objects cannot be sent (no pickling).")
            array = np.ascontiguousarray(obj)
            return self._ext(
                _EXT_NUMPY, array.dtype.str, array.shape, array.reshape(-1).view(np.uint8)
            )
        raise TypeError(
            f"Cannot send an object of type {type(obj).__name__} to/from the engine "
            "core: only msgspec-encodable types, tensors and numpy arrays travel."
        )

    def _ext(
        self, code: int, dtype: str, shape: tuple[int, ...], raw: np.ndarray
    ) -> msgspec.msgpack.Ext:
        assert self._aux is not None, "enc_hook runs only inside encode()"
        if raw.nbytes < self.inline_threshold:
            data: bytes | int = raw.tobytes()
        else:
            data = len(self._aux) + 1  # frame index: frame 0 is the body
            self._aux.append(raw.data)
        return msgspec.msgpack.Ext(code, self._header_encoder.encode((dtype, shape, data)))


class MsgpackDecoder:
    """Decodes frames into ``type`` (a msgspec-supported type; ``Any`` for untyped payloads)."""

    def __init__(self, type: Any = Any) -> None:  # noqa: A002 - msgspec's own parameter name
        self._decoder = msgspec.msgpack.Decoder(
            type, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )
        self._header_decoder = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], bytes | int])
        self._frames: Sequence[Buffer] | None = None

    def decode(self, frames: Sequence[Buffer]) -> Any:
        """Decode one message. Large arrays alias the frames' memory (no copy)."""
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = None

    def _ext_hook(self, code: int, payload: memoryview) -> Any:
        if code not in (_EXT_TORCH, _EXT_NUMPY):
            raise msgspec.DecodeError(f"Unknown msgpack extension code {code}.")
        dtype, shape, data = self._header_decoder.decode(payload)
        if isinstance(data, int):
            assert self._frames is not None
            buffer: Buffer = self._frames[data]
            if memoryview(buffer).readonly:  # frames received as bytes (copy=True)
                buffer = bytearray(buffer)
        else:
            buffer = bytearray(data)  # writable, so the array may be modified in place
        if code == _EXT_NUMPY:
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        torch_dtype = getattr(torch, dtype)
        if not memoryview(buffer).nbytes:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).view(shape)

    @staticmethod
    def _dec_hook(expected: type, obj: Any) -> Any:
        # Arrays were already rebuilt by _ext_hook; only check they are what the field declares.
        if isinstance(expected, type) and isinstance(obj, expected):
            return obj
        raise msgspec.ValidationError(f"Expected {expected.__name__}, got {type(obj).__name__}.")
