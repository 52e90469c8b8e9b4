"""Video token pruning (``--video-pruning-rate``): the kept counts and rows against a direct
transcription of the rule, and whole runs against transformers given the same kept tokens: HF's
vision tower encodes the video, the test picks the kept rows its own way, drops the other pads
from HF's prompt and positions (``get_rope_index`` on the whole video) and runs HF's decoder on
the rest; greedy tokens identical and logprobs close (fp32), chunked through the video, and
again from the prefix and encoder caches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache

from omniserve import LLM, SamplingParams
from omniserve.multimodal.pruning import VideoPruning, frame_quotas, retained_tokens
from omniserve.plugin_tools.reference import hf_processor_text
from tests.hf_reference import ReferenceOutput, assert_matches_reference

MAX_TOKENS = 8
RATE = 0.6


def _reference_kept(embeds: torch.Tensor, frames: int, rate: float, per_frame: bool) -> list[int]:
    """The kept rows, written out: each token's ``1 - cos`` to the same token a frame group
    before (the first group counts as 255: always kept), the largest kept, ties to the earlier;
    per frame group, each later group keeps its own share of the rest."""
    per = embeds.shape[0] // frames
    x = embeds.float().reshape(frames, per, -1)
    score = torch.full((frames, per), 255.0)
    score[1:] = 1 - torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)
    total = max(per, int(per * frames * (1 - rate)))
    if not per_frame:
        order = sorted(range(frames * per), key=lambda i: (-float(score.flatten()[i]), i))
        return sorted(order[:total])
    kept = list(range(per))
    rest, later = total - per, frames - 1
    for t in range(1, frames):
        share = rest // later + (t - 1 < rest % later)
        order = sorted(range(per), key=lambda i: (-float(score[t, i]), i))
        kept += sorted(t * per + i for i in order[:share])
    return kept


def test_counts_and_rows():
    assert retained_tokens(6, 4, 0.6) == 9 and retained_tokens(6, 4, 0.9) == 6
    assert retained_tokens(6, 4, 0.0) == 24 and retained_tokens(6, 1, 0.5) == 6
    assert frame_quotas(6, 4, 0.6) == [6, 1, 1, 1] and frame_quotas(6, 4, 0.4) == [6, 3, 3, 2]
    assert frame_quotas(6, 1, 0.5) == [6] and sum(frame_quotas(10, 7, 0.37)) == retained_tokens(
        10, 7, 0.37
    )
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(4 * 6, 5, generator=gen)
    embeds[12:18] = embeds[6:12]  # a still frame group: nothing of it differs from the one before
    for rate in (0.0, 0.3, 0.6, 0.95):
        for per_frame in (False, True):
            pruning = VideoPruning(4, 6, rate, per_frame)
            kept = pruning.kept_rows(embeds)
            assert kept.tolist() == _reference_kept(embeds, 4, rate, per_frame)
            assert len(kept) == pruning.num_kept
            assert len(pruning.provisional_rows()) == pruning.num_kept
    whole = VideoPruning(4, 6, 0.6, per_frame=False).kept_rows(embeds).tolist()
    assert not set(whole) & set(range(12, 18))  # the still group loses every token
    # Only the leading columns are compared where rows carry more after them.
    noisy = torch.cat([embeds, torch.randn(24, 3, generator=gen)], dim=1)
    assert VideoPruning(4, 6, 0.6, False, compared_width=5).kept_rows(noisy).tolist() == whole
    with pytest.raises(ValueError, match="got 23 encoder rows"):
        VideoPruning(4, 6, 0.6, False).kept_rows(embeds[:23])


def _video() -> np.ndarray:
    """Eight frames of noise whose last four are one still frame: the later groups change
    little, so pruning has a choice to make."""
    frames = np.random.default_rng(7).integers(0, 256, (8, 64, 96, 3), dtype=np.uint8)
    frames[4:] = frames[4]
    frames[5, :20] = 255 - frames[5, :20]  # a change within the still part
    return frames


def _joined(rows: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """HF's per-video rows (a tuple on some versions) as one tensor."""
    return torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows


def _hf_pruned(model_dir: str, text: str, video: np.ndarray, per_frame: bool) -> ReferenceOutput:
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    core = model.model
    inputs = processor(
        text=[hf_processor_text(processor, text)], videos=[video], return_tensors="pt"
    )
    rope = {k: inputs[k] for k in ("second_per_grid_ts",) if k in inputs}  # (Qwen2.5-VL's)
    with torch.inference_mode():
        features = core.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        embeds = _joined(features.pooler_output)
        deepstack = getattr(features, "deepstack_features", None)  # [level][video] (Qwen3-VL)
        positions, _ = core.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            video_grid_thw=inputs["video_grid_thw"],
            attention_mask=inputs["attention_mask"],
            **rope,
        )
        frames = int(inputs["video_grid_thw"][0, 0])
        kept = torch.tensor(_reference_kept(embeds, frames, RATE, per_frame))
        ids = inputs["input_ids"][0]
        pads = torch.nonzero(ids == processor.video_token_id).squeeze(1)
        keep = torch.ones(len(ids), dtype=torch.bool)
        keep[pads[~torch.isin(torch.arange(len(pads)), kept)]] = False
        ids, step_positions = ids[keep], positions[:, :, keep]
        is_video = ids == processor.video_token_id
        step_embeds = core.get_input_embeddings()(ids[None]).clone()
        step_embeds[0, is_video] = embeds[kept]
        extra = {}
        if deepstack is not None:
            extra = {
                "visual_pos_masks": is_video[None],
                "deepstack_visual_embeds": [_joined(level)[kept] for level in deepstack],
            }
        cache, tokens, logprobs = DynamicCache(config=model.config), [], []
        next_position = int(positions.max()) + 1  # after the whole video, pruned or not
        for _ in range(MAX_TOKENS):
            hidden = core.language_model(
                inputs_embeds=step_embeds,
                position_ids=step_positions,
                past_key_values=cache,
                use_cache=True,
                **extra,
            )
            scores = torch.log_softmax(model.lm_head(hidden.last_hidden_state[0, -1]).float(), -1)
            token = int(scores.argmax())
            tokens.append(token)
            logprobs.append(scores)
            step_embeds = core.get_input_embeddings()(torch.tensor([[token]]))
            step_positions = torch.full((3, 1, 1), next_position)
            next_position += 1
            extra = {}
    return ReferenceOutput(tokens, logprobs)


PER_FRAME = {
    "Qwen2VLForConditionalGeneration": False,
    "Qwen2_5_VLForConditionalGeneration": False,
    "Qwen3VLForConditionalGeneration": True,
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # (5.23 has no `cache`)
@pytest.mark.parametrize("arch", list(PER_FRAME))
def test_matches_hf_on_the_kept_tokens(arch, tiny_checkpoint):
    model_dir = str(tiny_checkpoint(arch))
    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What changes?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    video = _video()
    reference = _hf_pruned(model_dir, text, video, PER_FRAME[arch])
    # A 16-token budget cuts through the video: its later windows run after it was encoded.
    llm = LLM(model_dir, dtype="float32", video_pruning_rate=RATE, max_num_batched_tokens=16)
    prompt = {"prompt": text, "multi_modal_data": {"video": [video]}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    first = llm.generate([prompt], params, use_tqdm=False)
    assert_matches_reference(first, [reference], atol=2e-4)
    unpruned = processor(text=[hf_processor_text(processor, text)], videos=[video])
    merge = processor.video_processor.merge_size
    t, h, w = (int(n) for n in unpruned["video_grid_thw"][0])
    pads = first[0].prompt_token_ids.count(processor.video_token_id)
    assert pads == retained_tokens(h * w // merge**2, t, RATE) < t * h * w // merge**2
    # Again: from the prefix cache (the video's blocks) and the encoder cache, same result.
    again = llm.generate([prompt], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert again[0].num_cached_tokens > 0


def test_refused_where_videos_are_not_pruned(tiny_checkpoint):
    with pytest.raises(ValueError, match="--video-pruning-rate: Qwen2Audio.*does not prune"):
        LLM(str(tiny_checkpoint("Qwen2AudioForConditionalGeneration")), video_pruning_rate=0.5)
    with pytest.raises(ValueError, match="--video-pruning-rate: this model takes no video"):
        LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), video_pruning_rate=0.5)
    with pytest.raises(ValueError, match=r"video_pruning_rate must be in \[0, 1\)"):
        LLM(str(tiny_checkpoint("Qwen2VLForConditionalGeneration")), video_pruning_rate=1.0)


def test_flag(tiny_checkpoint):
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.entrypoints.cli import build_parser

    model = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--model", model, "--video-pruning-rate", "0.75"])
    parsed.check_flags(parser, parsed)
    config = EngineArgs.from_cli_args(parsed).create_config()
    assert config.multimodal_config.video_pruning_rate == 0.75
    assert EngineArgs(model=model).create_config().multimodal_config.video_pruning_rate == 0


def _omni_video() -> tuple[np.ndarray, np.ndarray]:
    """Eight 64 x 64 frames of noise and a 3 s soundtrack. (No still part here: each frame group
    keeps its share, and among a still group's equally unchanged tokens which are kept is a tie
    that sums in another order may break otherwise than transformers'.)"""
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    return frames, rng.standard_normal(16000 * 3).astype(np.float32)


def _hf_omni_pruned(arch: str, model_dir: str, kind: str) -> tuple[dict, ReferenceOutput]:
    """The engine's prompt and transformers' thinker on the kept tokens: its towers encode the
    video (and soundtrack), its ``get_rope_index`` places the whole item, the pads of the dropped
    video tokens leave the prompt and its positions, its decoder runs the rest."""
    from tests.test_fidelity_omni import THINKERS, _engine_prompt, _hf_inputs, _text

    processor = AutoProcessor.from_pretrained(model_dir)
    model = THINKERS[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
    core, tok = model.model, processor.tokenizer
    frames, track = _omni_video()
    items = [(kind, (frames, track if kind == "av" else None))]
    text = _text(processor, [kind])
    inputs = _hf_inputs(processor, text, items)
    video_id, audio_id = tok.convert_tokens_to_ids([tok.video_token, tok.audio_token])
    with torch.inference_mode():
        ids = inputs["input_ids"][0]
        embeds = core.get_input_embeddings()(ids[None]).clone()
        lengths = None
        if "input_features" in inputs:
            mask = inputs["feature_attention_mask"]
            audio = core.get_audio_features(inputs["input_features"], mask, return_dict=True)
            embeds[0, ids == audio_id] = audio.last_hidden_state
            lengths = mask.sum(1)
        features = core.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                           return_dict=True)  # fmt: skip
        video = _joined(features.pooler_output)
        deepstack = getattr(features, "deepstack_features", None)
        embeds[0, ids == video_id] = video
        positions, _ = core.get_rope_index(
            inputs["input_ids"], video_grid_thw=inputs["video_grid_thw"],
            attention_mask=inputs["attention_mask"], use_audio_in_video=kind == "av",
            audio_seqlens=lengths, second_per_grids=inputs.get("video_second_per_grid"),
        )  # fmt: skip
        frames_t = int(inputs["video_grid_thw"][0, 0])
        hidden = model.config.get_text_config().hidden_size
        kept = torch.tensor(_reference_kept(video[:, :hidden], frames_t, RATE, per_frame=True))
        pads = torch.nonzero(ids == video_id).squeeze(1)
        keep = torch.ones(len(ids), dtype=torch.bool)
        keep[pads[~torch.isin(torch.arange(len(pads)), kept)]] = False
        ids, step_embeds, step_positions = ids[keep], embeds[:, keep], positions[:, :, keep]
        extra = {}
        if deepstack is not None:
            levels = [_joined(level)[kept] for level in deepstack]
            extra = {"visual_pos_masks": (ids == video_id)[None], "deepstack_visual_embeds": levels}
        cache, tokens, logprobs = DynamicCache(config=model.config.get_text_config()), [], []
        next_position = positions.max() + 1  # after the whole video, pruned or not
        for _ in range(MAX_TOKENS):
            out = core.language_model(
                inputs_embeds=step_embeds, position_ids=step_positions, past_key_values=cache,
                use_cache=True, **extra,
            )  # fmt: skip
            scores = torch.log_softmax(model.lm_head(out.last_hidden_state[0, -1]).float(), -1)
            tokens.append(int(scores.argmax()))
            logprobs.append(scores)
            step_embeds = core.get_input_embeddings()(torch.tensor([[tokens[-1]]]))
            step_positions = next_position.expand(3, 1, 1)
            next_position = next_position + 1
            extra = {}
    return _engine_prompt(text, items), ReferenceOutput(tokens, logprobs)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize(
    "arch",
    ["Qwen2_5OmniThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration"],
)
def test_omni_thinkers_match_hf_on_the_kept_tokens(arch, tiny_checkpoint):
    """A video alone, and one with its soundtrack (``use_audio_in_video``: each frame group keeps
    its share, the soundtrack's tokens keep their places among them), chunked through the item."""
    model_dir = str(tiny_checkpoint(arch))
    cases = [_hf_omni_pruned(arch, model_dir, kind) for kind in ("video", "av")]
    llm = LLM(model_dir, dtype="float32", video_pruning_rate=RATE, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    outputs = llm.generate([prompt for prompt, _ in cases], params, use_tqdm=False)
    assert_matches_reference(outputs, [reference for _, reference in cases], atol=2e-4)
