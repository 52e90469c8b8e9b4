"""Encoders of modalities turned off are never loaded (vLLM's ``--limit-mm-per-prompt`` 0 for a
modality, ``--language-model-only`` for all): the model holds no parameter of them, their
checkpoint tensors are skipped, the rest answers token for token as the whole model, and a
request with such media is a clear 400-class error naming the modality."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omniserve import LLM, SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from omniserve.entrypoints.cli import build_parser
from omniserve.multimodal.errors import MultiModalInputError
from tests.test_api_multimodal import IMAGE
from tests.test_mm_embeds import TONE, _llm

QWEN2_5 = "Qwen2_5OmniThinkerForConditionalGeneration"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
AUDIO_PROMPT = "<|audio_bos|><|AUDIO|><|audio_eos|>What is it?"
IMAGE_PROMPT = "<|vision_bos|><|IMAGE|><|vision_eos|>What is it?"


def _worker(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.worker


def _answers(llm: LLM, prompts: list[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_omni_thinker_without_vision_loads_no_vision_tower(tiny_checkpoint: Any, caplog) -> None:
    path = tiny_checkpoint(QWEN2_5)
    audio = {"prompt": AUDIO_PROMPT, "multi_modal_data": {"audio": TONE}}
    whole = _llm(path)
    want = _answers(whole, ["Hello there", audio])
    whole_bytes = _worker(whole).weight_bytes
    visual = _worker(whole).model_runner.model.visual
    vision_bytes = sum(t.nbytes for t in {*visual.parameters(), *visual.buffers()})
    whole.llm_engine.shutdown()

    with caplog.at_level("INFO"):
        llm = _llm(path, limit_mm_per_prompt={"image": 0, "video": 0})
    worker = _worker(llm)
    model = worker.model_runner.model
    assert model.visual is None and model.audio_tower is not None
    assert not any(name.startswith("visual.") for name, _ in model.named_parameters())
    assert worker.weight_bytes == whole_bytes - vision_bytes
    assert "Not loading visual: image, video turned off (--limit-mm-per-prompt 0" in caplog.text
    assert "checkpoint tensors of visual: their modalities are turned off" in caplog.text
    assert _answers(llm, ["Hello there", audio]) == want
    image = {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": IMAGE}}
    with pytest.raises(MultiModalInputError, match="this server takes no image input"):
        llm.generate(image, GREEDY, use_tqdm=False)
    assert _answers(llm, ["Hello there"]) == want[:1]  # the engine serves on
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", [QWEN2_5, "Qwen3OmniMoeThinkerForConditionalGeneration",
                                  "Qwen2VLForConditionalGeneration",
                                  "Qwen2AudioForConditionalGeneration"])  # fmt: skip
def test_language_model_only_loads_the_decoder_alone(tiny_checkpoint: Any, arch: str) -> None:
    path = tiny_checkpoint(arch)
    whole = _llm(path)
    want = _answers(whole, ["Hello there"])
    whole.llm_engine.shutdown()
    llm = _llm(path, language_model_only=True)
    model = _worker(llm).model_runner.model
    towers = type(model).tower_modalities
    assert towers and all(getattr(model, name) is None for name in towers)
    assert all(name.startswith(("model.", "lm_head.")) for name, _ in model.named_parameters())
    assert _answers(llm, ["Hello there"]) == want
    llm.llm_engine.shutdown()


def test_a_video_soundtrack_needs_audio_on(tiny_checkpoint: Any) -> None:
    """Audio-in-video reads the track with the audio encoder: with audio off it is refused
    (the video alone, without use_audio_in_video, still runs)."""
    llm = _llm(tiny_checkpoint(QWEN2_5), limit_mm_per_prompt={"audio": 0})
    assert _worker(llm).model_runner.model.audio_tower is None
    frames = np.zeros((4, 56, 56, 3), dtype=np.uint8)
    prompt = "<|vision_bos|><|VIDEO|><|vision_eos|>What is it?"
    for media, needle in (
        (
            {"video": [(frames, TONE)]},
            "use_audio_in_video needs the audio encoder for the videos' soundtracks",
        ),
        ({"video": frames, "audio": TONE}, "this server takes no audio input"),
    ):
        with pytest.raises(MultiModalInputError, match=needle):
            llm.generate({"prompt": prompt, "multi_modal_data": media,
                          "mm_processor_kwargs": {"use_audio_in_video": True}}, GREEDY,
                         use_tqdm=False)  # fmt: skip
    (answer,) = _answers(llm, [{"prompt": prompt, "multi_modal_data": {"video": frames}}])
    assert len(answer) == GREEDY.max_tokens
    llm.llm_engine.shutdown()


def test_language_model_only_settings(tiny_checkpoint: Any) -> None:
    model = str(tiny_checkpoint(QWEN2_5))
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--model", model, "--language-model-only"])
    parsed.check_flags(parser, parsed)
    config = EngineArgs.from_cli_args(parsed).create_config()
    assert config.multimodal_config.limit_mm_per_prompt == {"image": 0, "video": 0, "audio": 0}
    assert config.multimodal_config.modalities_off() == {"image", "video", "audio"}
    with pytest.raises(ValueError, match="--language-model-only turns every modality off"):
        EngineArgs(model=model, language_model_only=True,
                   limit_mm_per_prompt={"image": 1, "audio": 0}).create_config()  # fmt: skip
