"""serial_utils: engine messages with tensors and numpy arrays survive the wire, zero-copy."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from omniserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from omniserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from omniserve.sampling_params import RequestOutputKind, SamplingParams


class _MultiModalRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """An engine request carrying multimodal tensors, as EngineCoreRequest will."""

    request: EngineCoreRequest
    pixel_values: torch.Tensor
    mm_kwargs: dict[str, Any]
    features: np.ndarray | None = None


def _roundtrip(obj: Any, type_: Any, **encoder_kwargs: Any) -> tuple[Any, list[Any]]:
    frames = MsgpackEncoder(**encoder_kwargs).encode(obj)
    # What the receiving side gets: copies of each frame (writable, like zmq frames).
    received = [bytearray(frame) for frame in frames]
    return MsgpackDecoder(type_).decode(received), frames


def _request() -> EngineCoreRequest:
    params = SamplingParams(
        temperature=0.0, max_tokens=7, stop=["x"], seed=3, output_kind=RequestOutputKind.DELTA
    )
    return EngineCoreRequest(
        "req-0", [1, 2, 3], params, eos_token_id=2, arrival_time=12.5, max_tokens=7
    )


def test_engine_core_request_roundtrip() -> None:
    decoded, frames = _roundtrip(_request(), EngineCoreRequest)
    assert decoded == _request()
    assert decoded.sampling_params.output_kind is RequestOutputKind.DELTA
    assert len(frames) == 1  # no arrays: just the body


def test_engine_core_outputs_roundtrip() -> None:
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "a", [5, 6], new_logprobs=LogprobsLists([[5, 1]], [[-0.1, -2.0]], [1])
            ),
            EngineCoreOutput(
                "b", [], finish_reason=FinishReason.LENGTH, stop_reason=9, num_cached_tokens=16
            ),
        ],
        timestamp=3.0,
        scheduler_stats={"num_running": 2.0},
    )
    decoded, _ = _roundtrip(outputs, EngineCoreOutputs)
    assert decoded == outputs
    assert decoded.outputs[1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensors_and_arrays_roundtrip(dtype: torch.dtype) -> None:
    pixel_values = torch.arange(3 * 64 * 4).reshape(3, 64, 4).to(dtype)  # large: own frame
    grid = torch.tensor([[1, 2, 2]])  # small: inlined
    transposed = torch.arange(400, dtype=torch.float32).reshape(20, 20).t()  # non-contiguous
    features = np.linspace(0, 1, 300, dtype=np.float32).reshape(3, 100)
    message = _MultiModalRequest(
        _request(),
        pixel_values,
        {
            "image_grid_thw": grid,
            "t": transposed,
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
            "audio": np.arange(5, dtype=">i2"),
            "n": [1, "x"],
        },
        features,
    )
    decoded, frames = _roundtrip(message, _MultiModalRequest)
    assert len(frames) == 4  # body + pixel_values + transposed + features
    assert decoded.request == message.request
    assert decoded.pixel_values.dtype == dtype
    assert torch.equal(decoded.pixel_values, pixel_values)
    kwargs = decoded.mm_kwargs
    assert torch.equal(kwargs["image_grid_thw"], grid)
    assert torch.equal(kwargs["t"], transposed)
    assert kwargs["scalar"].shape == () and kwargs["scalar"].item() == 2.5
    assert kwargs["empty"].shape == (0, 4)
    assert kwargs["audio"].dtype == np.dtype(">i2")
    np.testing.assert_array_equal(kwargs["audio"], np.arange(5))
    assert kwargs["n"] == [1, "x"]
    np.testing.assert_array_equal(decoded.features, features)


def test_large_arrays_are_zero_copy_both_ways() -> None:
    tensor = torch.randn(64, 64)
    frames = MsgpackEncoder().encode({"x": tensor})
    assert len(frames) == 2
    # The frame is a view of the tensor's memory, not a copy.
    assert np.frombuffer(frames[1], dtype=np.float32).ctypes.data == tensor.data_ptr()
    received = [bytearray(frames[0]), bytearray(frames[1])]
    decoded = MsgpackDecoder().decode(received)["x"]
    assert decoded.data_ptr() == np.frombuffer(received[1], dtype=np.uint8).ctypes.data
    decoded += 1  # writable
    assert torch.allclose(decoded, tensor + 1)


def test_inline_threshold() -> None:
    tensor = torch.ones(100)  # 400 bytes
    assert len(MsgpackEncoder(inline_threshold=1024).encode(tensor)) == 1
    assert len(MsgpackEncoder(inline_threshold=0).encode(tensor)) == 2


def test_over_zmq_frames() -> None:
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://serial-test")
        push = ctx.socket(zmq.PUSH)
        push.connect("inproc://serial-test")
        tensor = torch.randn(128, 33)
        push.send_multipart(MsgpackEncoder().encode([tensor, "tail"]), copy=False)
        frames = pull.recv_multipart(copy=False)
        decoded = MsgpackDecoder().decode([frame.buffer for frame in frames])
        assert torch.equal(decoded[0], tensor) and decoded[1] == "tail"
        push.close(linger=0)
        pull.close(linger=0)
    finally:
        ctx.term()


def test_unknown_objects_are_refused_not_pickled() -> None:
    with pytest.raises(TypeError, match="Cannot send"):
        MsgpackEncoder().encode({"x": object()})
    with pytest.raises(TypeError, match="no pickling"):
        MsgpackEncoder().encode(np.array([object()]))


def test_typed_field_rejects_wrong_array_kind() -> None:
    message = [msgspec.to_builtins(_request()), np.zeros(3), {}]  # array_like struct layout
    frames = MsgpackEncoder().encode(message)
    with pytest.raises(msgspec.ValidationError, match="Expected Tensor"):
        MsgpackDecoder(_MultiModalRequest).decode(frames)
