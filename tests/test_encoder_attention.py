"""The towers' packed encoder attention (``omniserve.attention.encoder``).

torch's varlen flash attention runs only on CUDA; on the CPU a reference with its contract
stands in for it (per-segment SDPA from the bounds it is given), so what is checked here is
ours: the towers take their packed branch, get int32 device bounds with their longest lengths
as host ints, and give what SDPA's per-segment path gives. On a GPU the kernel itself is checked
against SDPA (``test_packed_encoder_attention_on_gpu_matches_sdpa``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from omniserve.attention import encoder
from omniserve.attention.encoder import (
    FLASH_VARLEN,
    pack_towers,
    segment_bounds,
    segmented_sdpa,
    set_encoder_attention,
    varlen_unavailable,
)
from omniserve.config import MultiModalConfig
from omniserve.engine.arg_utils import EngineArgs
from omniserve.worker.encoder_runner import to_device
from tests.test_encoder_inputs import META, _features, _on_meta
from tests.test_models_mm import AUDIO_ARCH, VL_ARCHS, encode, load_ours
from tests.test_models_omni import QWEN2_5, QWEN3

PACKED_ARCHS = [*VL_ARCHS, QWEN2_5, QWEN3]


class ReferenceVarlen:
    """``varlen_attn``'s contract on the CPU: q/k/v ``[tokens, heads, head_dim]``, int32
    ``cu_seq_*`` bounds, host-int longest lengths; records the segments of each call."""

    def __init__(self) -> None:
        self.segments: list[list[int]] = []

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
        cu_k: torch.Tensor, max_q: int, max_k: int, **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        assert not kwargs  # the towers' scale is the default: torch 2.10's signature serves
        assert cu_q.dtype == cu_k.dtype == torch.int32
        assert isinstance(max_q, int) and isinstance(max_k, int)
        if q.device == META:  # no values to check
            self.segments.append([max_q])
            return torch.empty_like(q)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert torch.equal(cu_q, cu_k) and max_q == max_k == max(lengths, default=0)
        self.segments.append(lengths)
        return segmented_sdpa(q, k, v, lengths)


@pytest.fixture
def reference_varlen(monkeypatch: pytest.MonkeyPatch) -> ReferenceVarlen:
    reference = ReferenceVarlen()
    monkeypatch.setattr(encoder, "varlen_attn", reference)
    return reference


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_towers_match_their_sdpa_path(
    arch: str, tiny_checkpoint: Callable[..., Path], reference_varlen: ReferenceVarlen
) -> None:
    """Images, video, audio and a video with its track: one packed call per attention layer,
    the same embeddings as the towers' per-segment SDPA (fp32)."""
    model_dir = tiny_checkpoint(arch)
    features = _features(arch, model_dir)
    model = load_ours(model_dir)
    expected = encode(model, features)
    assert not reference_varlen.segments
    pack_towers(model)
    got = encode(model, features)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)
    assert reference_varlen.segments
    assert any(len(segments) > 1 for segments in reference_varlen.segments)


@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_towers_read_nothing_back(
    arch: str, tiny_checkpoint: Callable[..., Path], reference_varlen: ReferenceVarlen
) -> None:
    """On the meta device (see ``test_encoder_inputs``): the packed path's bounds and longest
    lengths come from the host, so no device value is read."""
    model_dir = tiny_checkpoint(arch)
    features = _features(arch, model_dir)
    model = _on_meta(model_dir)
    pack_towers(model)
    for modality in sorted({f.modality for f in features}):
        items = [f for f in features if f.modality == modality]
        with torch.no_grad():
            embeds = model.get_multimodal_embeddings(
                modality, to_device([f.data for f in items], META)
            )
        assert [e.shape[0] for e in embeds] == [f.mm_position.num_embeds for f in items]
    assert reference_varlen.segments


def test_segment_bounds_follow_the_towers_attention() -> None:
    tower = torch.nn.Module()
    tower.config = type("Config", (), {"_attn_implementation": "sdpa"})()
    cu, windows = torch.tensor([0, 4, 10]), torch.tensor([0, 2, 4, 7, 10])
    assert segment_bounds(tower, cu_seqlens=cu) == ({"cu_seqlens": cu}, {})
    tower.config._attn_implementation = FLASH_VARLEN
    host, uploaded = segment_bounds(tower, cu_seqlens=cu, cu_window_seqlens=windows)
    assert host == {"max_seqlen": 6, "max_window_seqlen": 3}
    assert {k: (v.dtype, v.tolist()) for k, v in uploaded.items()} == {
        "cu_seqlens": (torch.int32, [0, 4, 10]),
        "cu_window_seqlens": (torch.int32, [0, 2, 4, 7, 10]),
    }


def test_selection(tiny_checkpoint: Callable[..., Path]) -> None:
    """auto keeps SDPA off CUDA; FLASH_ATTN where it cannot run is an error saying why; a model
    without packed towers has nothing to set."""
    model = _on_meta(tiny_checkpoint(QWEN2_5))
    cpu = torch.device("cpu")

    def implementations() -> set[Any]:
        return {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")
                and m is not model}  # fmt: skip

    assert set_encoder_attention(model, "auto", cpu, torch.bfloat16) == "TORCH_SDPA"
    assert set_encoder_attention(model, "TORCH_SDPA", cpu, torch.bfloat16) == "TORCH_SDPA"
    assert FLASH_VARLEN not in implementations()
    with pytest.raises(ValueError, match="FLASH_ATTN cannot run here: it needs a CUDA device"):
        set_encoder_attention(model, "FLASH_ATTN", cpu, torch.bfloat16)
    assert set_encoder_attention(_on_meta(tiny_checkpoint(AUDIO_ARCH)), "auto", cpu,
                                 torch.bfloat16) == ""  # fmt: skip
    cuda = torch.device("cuda", 0)
    assert "bf16 or fp16, not float32" in (varlen_unavailable(cuda, torch.float32, 64) or "")
    with pytest.raises(ValueError, match="mm_encoder_attn_backend must be one of"):
        MultiModalConfig(mm_encoder_attn_backend="xformers")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--mm-encoder-attn-backend", "FLASH_ATTN"])
    args.model = "unused"
    assert EngineArgs.from_cli_args(args).mm_encoder_attn_backend == "FLASH_ATTN"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", PACKED_ARCHS)
def test_packed_encoder_attention_on_gpu_matches_sdpa(
    arch: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    """On CUDA in bf16 the towers take torch's varlen flash attention by default and give what
    their per-segment SDPA gives, within bf16's rounding."""
    model_dir = tiny_checkpoint(arch)
    features = _features(arch, model_dir)
    device = torch.device("cuda")
    model = load_ours(model_dir).to(device, torch.bfloat16)
    expected = encode(model, [_on(f, device) for f in features])
    assert set_encoder_attention(model, "auto", device, torch.bfloat16) == "FLASH_ATTN"
    got = encode(model, [_on(f, device) for f in features])
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have.float(), want.float(), atol=5e-2, rtol=5e-2)


def _on(feature: Any, device: torch.device) -> Any:
    """The feature with its item's tensors on ``device``, as the encoder runner hands them."""
    (item,) = to_device([feature.data], device)
    return msgspec.structs.replace(feature, data=item)
