"""A media step never reads the device back.

On a GPU, every read of a device value (``tolist``, ``nonzero``, a boolean mask index, a
pageable copy) waits for all the work queued before it: for a media step, the encoders' work so
far, and under async scheduling the step in flight. Encoders get their items' tensors on the
device (``EncoderItem``) and read their metadata (grids, lengths, masks, token orders) from the
items' host copies, and the merge into the token embeddings is sized by the embeddings.

Checked on the CPU with the meta device standing in for the GPU: a meta tensor has no values, so
any read of one fails, as does any op that meets a host tensor with a meta one (what a metadata
tensor left on the host would do on a GPU). Every family's encoders run so, for every modality
and for a video with its audio track; on a GPU, a media step runs under
``set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoProcessor

import model_zoo
from omniserve import LLM, SamplingParams
from omniserve.multimodal.inputs import EncoderItem, MultiModalFeatureSpec
from omniserve.registry import ModelRegistry
from omniserve.worker.encoder_runner import to_device
from tests.test_fidelity_omni import _engine_prompt, _media, _text
from tests.test_models_mm import (
    AUDIO_ARCH,
    AUDIO_PROMPT,
    VL_ARCHS,
    VL_PROMPT,
    _rng_media,
    audio_features,
    vision_features,
    vl_inputs,
)
from tests.test_models_omni import QWEN2_5, QWEN3, Omni
from tests.utils import steps_never_synchronizing

META = torch.device("meta")


def _features(arch: str, model_dir: Path) -> list[MultiModalFeatureSpec]:
    """Every modality the family takes, from its own HF processor (tiny media)."""
    config = AutoConfig.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    if arch in VL_ARCHS:
        return vision_features(vl_inputs(processor, VL_PROMPT), config)
    if arch == AUDIO_ARCH:
        inputs = processor(text=[AUDIO_PROMPT], audio=_rng_media(0)["audio"], return_tensors="pt")
        return audio_features(dict(inputs), config)
    omni = Omni(arch, model_dir)
    return omni.features(omni.inputs(["image", "av", "audio", "video"]))


def _on_meta(model_dir: Path) -> torch.nn.Module:
    """The family's model without weights, on the meta device."""
    config = AutoConfig.from_pretrained(model_dir)
    model_zoo.register()
    with META:
        return ModelRegistry.resolve_model_cls(config.architectures[0])(config).eval()


@pytest.mark.parametrize("arch", [*VL_ARCHS, AUDIO_ARCH, QWEN2_5, QWEN3])
def test_encoders_read_their_metadata_from_the_host(
    arch: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    model_dir = tiny_checkpoint(arch)
    features = _features(arch, model_dir)
    model = _on_meta(model_dir)
    hidden = model.config.get_text_config().hidden_size
    for modality in sorted({f.modality for f in features}):
        items = [f for f in features if f.modality == modality]
        with torch.no_grad():
            embeds = model.get_multimodal_embeddings(
                modality, to_device([f.data for f in items], META)
            )
        assert [(e.device, e.shape[0]) for e in embeds] == [
            (META, f.mm_position.num_embeds) for f in items
        ]
        assert all(e.shape[1] >= hidden for e in embeds)  # Qwen3's rows carry DeepStack levels
    # The merge into the token embeddings (DeepStack rows too) is sized by the embeddings.
    num_tokens, num_mm = 40, 7
    is_mm = torch.zeros(num_tokens, dtype=torch.bool)
    is_mm[[3, 4, 5, 20, 21, 30, 39]] = True
    width = embeds[0].shape[1]
    with torch.no_grad():
        merged = model.get_input_embeddings(
            torch.zeros(num_tokens, dtype=torch.long, device=META),
            torch.empty(num_mm, width, device=META),
            is_mm.to(META),
        )
    assert merged.device == META and merged.shape == (num_tokens, hidden)


def test_the_meta_device_catches_a_read() -> None:
    """The check above has teeth: what the encoders did before (a mask index, a device read of
    the lengths) fails on the meta device."""
    features = torch.empty(8, 20, device=META)
    mask = torch.ones(20, dtype=torch.bool, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        features[:, mask]
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.tensor([20, 12], device=META).tolist()
    with pytest.raises(RuntimeError, match="device"):
        torch.lt(torch.arange(4, device=META), torch.tensor([[2], [3]]))  # a length on the host


def test_items_reach_the_device_with_their_host_data() -> None:
    host = {"pixel_values": torch.randn(6, 4).bfloat16(), "image_grid_thw": torch.tensor([1, 2, 3]),
            "note": "kept"}  # fmt: skip
    (item,) = to_device([host], META)
    assert isinstance(item, EncoderItem) and item.host is host
    assert item["pixel_values"].device == META and item["pixel_values"].dtype == torch.bfloat16
    assert item["image_grid_thw"].device == META and item["note"] == "kept"
    with pytest.raises(RuntimeError, match="carries no data"):
        to_device([host, None], META)


@pytest.mark.gpu
def test_media_steps_on_gpu_never_synchronize(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill with an image, a video with its track and an audio clip, encoded and merged,
    then its decode steps: nothing on the way reads the device back."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint(QWEN2_5))
    processor = AutoProcessor.from_pretrained(model_dir)
    kinds = ["image", "av", "audio"]
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=1024, async_scheduling=True)
    llm.generate([_engine_prompt(_text(processor, kinds), _media(kinds, 1))],
                 SamplingParams(max_tokens=2))  # compiles the kernels  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("media", _engine_prompt(_text(processor, kinds), _media(kinds, 2)),
                       SamplingParams(temperature=0.0, max_tokens=6))  # fmt: skip
    steps_never_synchronizing(engine, 4)


def test_split_encoding_when_ranks_outnumber_items(monkeypatch) -> None:
    """--mm-encoder-tp-mode data with 4 ranks and 2 items, seen from rank 3, which encodes
    none: it still joins the collectives with the right shapes and gets both items' outputs
    (the collectives stubbed as the other ranks would answer)."""
    from types import SimpleNamespace

    from omniserve.worker import encoder_runner

    outputs = [torch.full((3, 4), 1.0), torch.full((2, 4), 2.0)]  # rank 0's and rank 1's item
    monkeypatch.setattr(encoder_runner, "get_tp_size", lambda: 4)
    monkeypatch.setattr(encoder_runner, "get_tp_rank", lambda: 3)
    monkeypatch.setattr(encoder_runner, "tp_all_reduce", lambda width: width + 2 * 4)

    def all_gather(padded: torch.Tensor, dim: int) -> torch.Tensor:
        assert padded.shape == (3, 4) and not padded.any()  # this rank's share: nothing
        parts = [torch.zeros(3, 4) for _ in range(4)]
        parts[0][:3], parts[1][:2] = outputs
        return torch.cat(parts, dim=dim)

    monkeypatch.setattr(encoder_runner, "tp_all_gather", all_gather)

    class Model(torch.nn.Module):
        def get_multimodal_embeddings(self, modality: str, items: list) -> list:
            raise AssertionError("rank 3 encodes nothing")

    runner = encoder_runner.EncoderRunner(Model(), torch.device("cpu"), split_items=True)
    features = [SimpleNamespace(mm_position=SimpleNamespace(num_embeds=n)) for n in (3, 2)]
    got = runner._encode_split("image", features, [{}, {}], torch.float32)  # type: ignore[arg-type]
    assert [torch.equal(g, o) for g, o in zip(got, outputs, strict=True)] == [True, True]
