"""Speech output of the full Qwen3-Omni-MoE checkpoint against transformers' ``generate`` (fp32,
greedy thinker and talker): the spoken waveform, frame count and text for text, image, audio,
video, audio-in-video and mixed prompts, a multi-turn conversation with a system turn, both
voices; the vocoder's exact streaming; batches mixing text-only and audio requests; and the
errors a request gets when the model cannot speak.

Waveforms: transformers' own code2wav differs from itself by up to 1.6e-5 between a prefix
decode and the full decode (fp32 convolutions over other lengths), and a change of codes moves
this checkpoint's waveform by ~74% of its spread; so ``WAVE_ATOL`` = 1e-4 separates equal codes
from unequal ones with a wide margin on both sides.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoProcessor
from transformers import Qwen3OmniMoeForConditionalGeneration as HFQwen3Omni

from model_zoo.qwen3_omni_moe_speech import Code2WavStream
from omniserve import LLM, SamplingParams
from omniserve.cpu.linear import WidenedLinear
from omniserve.sampling_params import RequestOutputKind
from tests.test_fidelity_omni import _engine_prompt, _hf_inputs, _media, _text

pytestmark = pytest.mark.slow  # talker and code2wav against transformers

ARCH = "Qwen3OmniMoeForConditionalGeneration"
WAVE_ATOL = 1e-4
THINKER_TOKENS, TALKER_TOKENS = 10, 30
# (media kinds, voice, system turn): every modality, both voices, a conversation with a system turn.
# Not here: a video with its audio track. transformers' generate does not pass
# use_audio_in_video on to its talker, whose positions then treat the interleaved track as if it
# were separate; omniserve's talker takes the thinker's (audio-in-video) positions.
CASES = [
    ([], "ethan", False),
    ([], "chelsie", False),
    (["image"], "ethan", False),
    (["audio"], "chelsie", False),
    (["video"], "ethan", False),
    (["image", "audio"], "ethan", False),
    ([], "ethan", True),
]


def _speech_params(voice: str, **changes: Any) -> SamplingParams:
    values = {
        "temperature": 0.0,
        "max_tokens": THINKER_TOKENS,
        "output_modalities": ["text", "audio"],
        "speech": {"voice": voice, "temperature": 0.0, "max_tokens": TALKER_TOKENS},
    }
    return SamplingParams(**{**values, **changes})


def _with_system(text: str) -> str:
    return (
        "<|im_start|>system\nYou speak.<|im_end|>\n"
        "<|im_start|>user\nEarlier question<|im_end|>\n"
        "<|im_start|>assistant\nEarlier answer<|im_end|>\n" + text
    )


def _reference(
    model_dir: str, cases: list[tuple[list[str], str, bool]]
) -> tuple[list[dict[str, Any]], list[tuple[list[int], np.ndarray]]]:
    """The engine's prompts for ``cases`` and transformers' fp32 answers (tokens, wave)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = HFQwen3Omni.from_pretrained(model_dir, dtype=torch.float32).eval()
    # transformers 5.2x: the talker's position code reads an audio config it was not given.
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    prompts, reference = [], []
    with torch.inference_mode():
        for seed, (kinds, voice, system) in enumerate(cases):
            items, text = _media(kinds, seed), _text(processor, kinds)
            if system:
                text = _with_system(text)
            inputs = _hf_inputs(processor, text, items)
            sequences, wave = model.generate(
                **inputs,
                speaker=voice,
                thinker_max_new_tokens=THINKER_TOKENS,
                thinker_do_sample=False,
                talker_do_sample=False,
                thinker_eos_token_id=model.config.im_end_token_id,
                talker_max_new_tokens=TALKER_TOKENS,
            )
            generated = sequences[0, inputs["input_ids"].shape[1] :].tolist()
            reference.append((generated, wave.reshape(-1).numpy()))
            prompts.append(_engine_prompt(text, items))
    return prompts, reference


@pytest.fixture(scope="module")
def speech_case(tiny_checkpoint):
    model_dir = str(tiny_checkpoint(ARCH))
    prompts, reference = _reference(model_dir, CASES)
    llm = LLM(model_dir, dtype="float32", max_model_len=2048, kv_cache_memory=32 << 20)
    return llm, prompts, reference


def _assert_speaks_like(output: Any, reference: tuple[list[int], np.ndarray]) -> None:
    tokens, wave = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    assert completion.audio is not None and completion.audio.shape == wave.shape
    assert completion.num_audio_tokens == (len(wave) + 555) // 1920
    np.testing.assert_allclose(completion.audio, wave, rtol=0, atol=WAVE_ATOL)


def test_speech_matches_transformers_alone_and_batched(speech_case):
    llm, prompts, reference = speech_case
    params = [_speech_params(voice) for _, voice, _ in CASES]
    for prompt, p, ref in zip(prompts, params, reference, strict=True):
        _assert_speaks_like(llm.generate(prompt, p, use_tqdm=False)[0], ref)
    # All together in one batch, with a text-only request among them: the same answers, and
    # the text-only request gets no audio.
    text_only = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS)
    batch = llm.generate([*prompts, prompts[0]], [*params, text_only], use_tqdm=False)
    for output, ref in zip(batch[:-1], reference, strict=True):
        _assert_speaks_like(output, ref)
    assert batch[-1].outputs[0].audio is None
    assert batch[-1].outputs[0].token_ids == reference[0][0]


def test_bf16_checkpoint_speaks_like_transformers_in_fp32(bf16_checkpoint):
    """A bf16 checkpoint computed in fp32: the thinker's and talker's linear and embedding
    weights stay bf16, widened in the kernels (``cpu.backend.keep_bf16_weights``), and the text
    and the wave are transformers' fp32 ones on the same checkpoint."""
    model_dir = bf16_checkpoint(ARCH)
    prompts, reference = _reference(model_dir, [CASES[0], CASES[2]])
    llm = LLM(model_dir, dtype="float32", max_model_len=2048, kv_cache_memory=32 << 20)
    outputs = llm.generate(prompts, [_speech_params("ethan")] * 2, use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        _assert_speaks_like(output, expected)
    kernels = llm.llm_engine.engine_core.call_utility("get_model_info")["layer_kernels"]
    if WidenedLinear.available():
        assert "linear: C bf16 weights, fp32 activations" in kernels


def test_voices_speak_differently(speech_case):
    """The same prompt in two voices: the voice reaches the talker, so the speech differs."""
    _, _, reference = speech_case
    assert CASES[0][0] == CASES[1][0] == [] and CASES[0][1] != CASES[1][1]
    ethan, chelsie = reference[0][1], reference[1][1]
    n = min(len(ethan), len(chelsie))
    assert np.abs(ethan[:n] - chelsie[:n]).max() > 0.1


def test_streamed_audio_equals_the_whole(speech_case):
    llm, prompts, reference = speech_case
    ethan = reference[0][1]
    # DELTA outputs carry only new samples; their concatenation is the whole answer.
    engine = llm.llm_engine
    engine.add_request(
        "delta", prompts[0], _speech_params("ethan", output_kind=RequestOutputKind.DELTA)
    )
    pieces, finished = [], False
    while not finished:
        for output in engine.step():
            if output.outputs[0].audio is not None:
                pieces.append(output.outputs[0].audio)
            finished = output.finished
    assert len([p for p in pieces if len(p)]) >= 2  # a first short chunk, then the rest
    np.testing.assert_allclose(np.concatenate(pieces), ethan, rtol=0, atol=WAVE_ATOL)


def test_code2wav_streams_exactly_for_any_chunk_schedule(speech_case):
    """The incremental vocoder equals one pass over all frames (to fp32 noise: transformers'
    own prefix decode differs from its full decode by ~2e-5), in the same number of samples,
    whatever the chunks; a shorter convolution context than the layers' reach is visibly off."""
    llm = speech_case[0]
    model = HFQwen3Omni.from_pretrained(
        llm.llm_engine.config.model_config.model, dtype=torch.float32
    ).eval()
    code2wav = model.code2wav
    codes = torch.randint(0, 64, (4, 170), generator=torch.Generator().manual_seed(1))

    def streamed(stream: Code2WavStream, schedule: list[int]) -> np.ndarray:
        state, pieces, done = stream.new_state(), [], 0
        for size in schedule:
            (piece,) = stream.decode([(state, codes[:, done : done + size])])
            pieces.append(piece)
            done += size
        assert done == codes.shape[1]
        return np.concatenate(pieces)

    with torch.no_grad():
        whole = code2wav(codes[None])[0, 0].numpy()
        stream = Code2WavStream(code2wav)
        assert stream.shortfall == 555  # n frames decode to n * 1920 - 555 samples
        for schedule in ([4, 25, 25, 25, 25, 25, 25, 16], [1, 2, 3, 50, 114], [170]):
            out = streamed(stream, schedule)
            assert out.shape == whole.shape
            np.testing.assert_allclose(out, whole, rtol=0, atol=WAVE_ATOL)
        short = streamed(Code2WavStream(code2wav, conv_context=4), [4, 25, 25, 25, 25, 25, 25, 16])
        assert np.abs(short - whole).max() > 100 * WAVE_ATOL
        # transformers' chunked decode drops the shortfall at every chunk boundary.
        assert (
            code2wav.chunked_decode(codes[None], chunk_size=25, left_context_size=25).shape[-1]
            == whole.shape[0] - 6 * 555
        )


def test_requests_that_cannot_speak_are_refused(tiny_checkpoint, speech_case):
    llm, prompts, _ = speech_case
    with pytest.raises(ValueError, match="Unknown voice 'alloy'.*chelsie, ethan"):
        llm.generate(prompts[0], _speech_params("alloy"), use_tqdm=False)
    with pytest.raises(ValueError, match="assistant"):
        llm.generate({"prompt": "no chat template here"}, _speech_params("ethan"), use_tqdm=False)
    thinker = LLM(
        str(tiny_checkpoint("Qwen3OmniMoeThinkerForConditionalGeneration")),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=8 << 20,
    )
    with pytest.raises(ValueError, match="no talker and vocoder"):
        thinker.generate(prompts[0], _speech_params("ethan"), use_tqdm=False)
    with pytest.raises(ValueError, match="--async-scheduling does not support speech output"):
        LLM(
            llm.llm_engine.config.model_config.model,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=8 << 20,
            async_scheduling=True,
        )
    silent = LLM(  # without its talker, the thinker runs under async scheduling
        llm.llm_engine.config.model_config.model,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=8 << 20,
        disable_audio_output=True,
        async_scheduling=True,
    )
    with pytest.raises(ValueError, match="--disable-audio-output"):
        silent.generate(prompts[0], _speech_params("ethan"), use_tqdm=False)
    text = silent.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS))
    assert text[0].outputs[0].audio is None and text[0].outputs[0].token_ids


def test_talker_preempted_by_its_pool_still_speaks_the_same(speech_case):
    """A talker KV pool that holds the longest of 5 text-prompted speaking requests but not all
    of them: their short prompts are admitted together, their growth preempts the newest
    (recomputed from its kept inputs), every answer equals its uncontended reference, and the
    pools are empty afterwards."""
    llm, prompts, reference = speech_case
    picks = [i for i, (kinds, _, _) in enumerate(CASES) if not kinds] * 2
    model_dir = llm.llm_engine.config.model_config.model
    talker = AutoConfig.from_pretrained(model_dir).talker_config.text_config
    block_size = 16
    per_block = (
        2 * block_size * talker.num_key_value_heads * talker.head_dim * 4 * talker.num_hidden_layers
    )  # fp32 keys and values
    tokenizer = llm.get_tokenizer()
    # talker positions: the thinker's prompt and reply, then one per frame (an upper bound)
    needs = [
        len(tokenizer(prompts[i]["prompt"]).input_ids)
        + THINKER_TOKENS
        + len(reference[i][1]) // 1920
        for i in picks
    ]
    pool = -(-max(needs) // block_size) + 1
    assert pool * block_size < sum(needs)
    small = LLM(
        model_dir,
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory=32 << 20,
        block_size=block_size,
        talker_kv_cache_memory=pool * per_block,
    )
    outputs = small.generate(
        [prompts[i] for i in picks], [_speech_params(CASES[i][1]) for i in picks], use_tqdm=False
    )
    for output, i in zip(outputs, picks, strict=True):
        _assert_speaks_like(output, reference[i])
    stats = small.llm_engine.engine_core.call_utility("get_stats")
    assert stats["num_talker_preemptions"] > 0
    assert stats["talker_kv_cache_usage"] == 0 and stats["kv_cache_usage"] == 0
    assert stats["num_speaking"] == 0


def test_talker_pool_too_small_is_refused_at_admission(speech_case):
    """A request whose talker prompt and frames could never fit the talker's KV pool is refused
    when it arrives, naming the pool and the flag (not cut short, silently, mid-answer); an
    unset frame cap becomes what the pool holds; text-only requests are unaffected."""
    llm, prompts, reference = speech_case
    model_dir = llm.llm_engine.config.model_config.model
    talker = AutoConfig.from_pretrained(model_dir).talker_config.text_config
    per_block = 2 * 16 * talker.num_key_value_heads * talker.head_dim * 4 * talker.num_hidden_layers
    one_block = LLM(
        model_dir,
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory=32 << 20,
        talker_kv_cache_memory=per_block,
    )
    with pytest.raises(ValueError, match=r"KV pool holds \(16 tokens\).*--talker-kv-cache-memory"):
        one_block.generate(prompts[0], _speech_params("ethan"), use_tqdm=False)
    text = one_block.generate(
        prompts[0], SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS)
    )
    assert text[0].outputs[0].token_ids == reference[0][0]
    del one_block
    four_blocks = LLM(
        model_dir,
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory=32 << 20,
        talker_kv_cache_memory=4 * per_block,
    )
    with pytest.raises(ValueError, match="lower speech.max_tokens"):
        four_blocks.generate(
            prompts[0],
            _speech_params(
                "ethan", speech={"voice": "ethan", "temperature": 0.0, "max_tokens": 64}
            ),
            use_tqdm=False,
        )
    (capped,) = four_blocks.generate(
        prompts[0],
        _speech_params("ethan", speech={"voice": "ethan", "temperature": 0.0}),
        use_tqdm=False,
    )
    completion = capped.outputs[0]
    assert completion.token_ids == reference[0][0]
    assert 0 < completion.num_audio_tokens < 64 and completion.audio.size > 0
    stats = four_blocks.llm_engine.engine_core.call_utility("get_stats")
    assert stats["num_speaking"] == 0 and stats["talker_kv_cache_usage"] == 0
