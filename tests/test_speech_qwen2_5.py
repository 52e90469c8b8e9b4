"""Speech output of the full Qwen2.5-Omni checkpoint against transformers' ``generate`` (fp32,
greedy thinker and talker, the DiT's noise from the same seed on both sides): the talker's codes,
the waveform and the text for text, image, audio, video, audio-in-video and mixed prompts, a
conversation with a system turn, both voices, alone and batched with a text-only request; the
stop strings; the OpenAI API on top (the talker's logits: test_speech_layers.py).

Waveforms: token2wav is transformers' own module on both sides, so equal codes and noise give
equal samples up to fp32 reordering; ``WAVE_ATOL`` = 1e-4 is far below the change one different
code makes (tens of percent of the spread on this checkpoint).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
from transformers import AutoProcessor
from transformers import Qwen2_5OmniForConditionalGeneration as HFQwen2_5Omni

from omniserve import LLM, SamplingParams
from omniserve.entrypoints.openai.audio_encoding import pcm16
from tests.server_utils import MODEL, launch_server
from tests.test_fidelity_omni import _engine_prompt, _hf_inputs, _media, _text

pytestmark = pytest.mark.slow  # talker and token2wav against transformers

ARCH = "Qwen2_5OmniForConditionalGeneration"
WAVE_ATOL = 1e-4
THINKER_TOKENS, TALKER_TOKENS = 10, 30
CASES = [
    ([], "Ethan", False),
    ([], "Chelsie", False),
    (["image"], "Ethan", False),
    (["audio"], "Chelsie", False),
    (["video"], "Ethan", False),
    (["av"], "Chelsie", False),
    (["image", "audio"], "Ethan", False),
    ([], "Ethan", True),
]


def _speech_params(voice: str, seed: int, **changes: Any) -> SamplingParams:
    values = {
        "temperature": 0.0,
        "max_tokens": THINKER_TOKENS,
        "output_modalities": ["text", "audio"],
        "speech": {"voice": voice, "temperature": 0.0, "max_tokens": TALKER_TOKENS, "seed": seed},
    }
    return SamplingParams(**{**values, **changes})


def _with_system(text: str) -> str:
    return (
        "<|im_start|>system\nYou speak.<|im_end|>\n"
        "<|im_start|>user\nEarlier question<|im_end|>\n"
        "<|im_start|>assistant\nEarlier answer<|im_end|>\n" + text
    )


def _reference(
    model: Any, processor: Any, text: str, items: list[tuple[str, Any]], voice: str, seed: int
) -> tuple[list[int], list[int], np.ndarray]:
    """``(text tokens, talker codes, waveform)`` from transformers' generate."""
    inputs = _hf_inputs(processor, text, items)
    talker = model.config.talker_config
    codes: list[int] = []
    generate = model.talker.generate

    def talker_generate(*args: Any, **kwargs: Any) -> torch.Tensor:
        # transformers 5.2x passes the thinker's pixel values on to its talker, which cannot
        # take them (the talker reads only their grids).
        kwargs.pop("pixel_values", None)
        kwargs.pop("pixel_values_videos", None)
        out = generate(*args, **kwargs)
        codes.extend(out[0, kwargs["input_ids"].shape[1] :].tolist())
        return out

    model.talker.generate = talker_generate
    torch.manual_seed(seed)  # the DiT's starting noise
    try:
        sequences, wave = model.generate(
            **inputs,
            speaker=voice,
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_TOKENS,
            # the reference hard-codes the 7B's end-of-speech ids
            talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
        )
    finally:
        model.talker.generate = generate
    ends = {talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id}
    spoken = next((i for i, c in enumerate(codes) if c in ends), len(codes))
    generated = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return generated, codes[:spoken], wave.reshape(-1).numpy()


@pytest.fixture(scope="module")
def speech_case(tiny_checkpoint):
    model_dir = str(tiny_checkpoint(ARCH))
    processor = AutoProcessor.from_pretrained(model_dir)
    model = HFQwen2_5Omni.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, reference = [], []
    with torch.inference_mode():
        for seed, (kinds, voice, system) in enumerate(CASES):
            items, text = _media(kinds, seed), _text(processor, kinds)
            if system:
                text = _with_system(text)
            reference.append(_reference(model, processor, text, items, voice, seed))
            prompts.append(_engine_prompt(text, items))
    llm = LLM(model_dir, dtype="float32", max_model_len=2048, kv_cache_memory=32 << 20)
    return llm, prompts, reference


def _assert_speaks_like(output: Any, reference: tuple[list[int], list[int], np.ndarray]) -> None:
    tokens, codes, wave = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    assert completion.num_audio_tokens == len(codes)
    assert completion.audio is not None and completion.audio.shape == wave.shape
    np.testing.assert_allclose(completion.audio, wave, rtol=0, atol=WAVE_ATOL)


def test_reference_speaks_visibly(speech_case):
    """The cases are worth comparing: every answer speaks, and the waveforms differ."""
    _, _, reference = speech_case
    assert all(len(codes) >= 5 for _, codes, _ in reference)
    assert all(np.std(wave) > 1e-2 for _, _, wave in reference)
    assert np.abs(reference[0][2][:1000] - reference[2][2][:1000]).max() > 1e-2


def test_speech_matches_transformers_alone_and_batched(speech_case):
    llm, prompts, reference = speech_case
    params = [_speech_params(voice, seed) for seed, (_, voice, _) in enumerate(CASES)]
    for prompt, p, ref in zip(prompts, params, reference, strict=True):
        _assert_speaks_like(llm.generate(prompt, p, use_tqdm=False)[0], ref)
    text_only = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS)
    batch = llm.generate([*prompts, prompts[0]], [*params, text_only], use_tqdm=False)
    for output, ref in zip(batch[:-1], reference, strict=True):
        _assert_speaks_like(output, ref)
    assert batch[-1].outputs[0].audio is None
    assert batch[-1].outputs[0].token_ids == reference[0][0]


def test_prefix_cache_does_not_skip_what_the_talker_reads(speech_case):
    """A speaking request whose prompt is cached (the text-only run above cached it) still
    computes it: the talker reads the thinker's hidden state at every prompt position."""
    llm, prompts, reference = speech_case
    llm.generate(prompts[7], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    _assert_speaks_like(
        llm.generate(prompts[7], _speech_params("Ethan", 7), use_tqdm=False)[0], reference[7]
    )


def test_voices_and_refusals(speech_case):
    llm, prompts, _ = speech_case
    with pytest.raises(ValueError, match="Unknown voice 'alloy'.*Chelsie, Ethan"):
        llm.generate(prompts[0], _speech_params("alloy", 0), use_tqdm=False)
    # The voice is matched case-insensitively and each request keeps its own.
    a, b = llm.generate(
        [prompts[0], prompts[0]],
        [_speech_params("ethan", 0), _speech_params("CHELSIE", 0)],
        use_tqdm=False,
    )
    assert np.abs(a.outputs[0].audio - b.outputs[0].audio).max() > 1e-2


def test_served_through_the_api(speech_case, tmp_path_factory):
    """The OpenAI API on the Qwen2.5-Omni checkpoint: the voices from spk_dict.pt, a chat answer
    as a WAV and as one streamed PCM16 chunk equal to the offline waveform, and
    ``/v1/audio/speech`` speaking its input."""
    llm, _, _ = speech_case
    model = llm.llm_engine.config.model_config.model
    question = [{"role": "user", "content": "Hello there, say something"}]
    seeded = {"speech": {"temperature": 0.0, "max_tokens": TALKER_TOKENS, "seed": 3}}
    (offline,) = llm.chat(question, _speech_params("Chelsie", 3, max_tokens=8))
    offline = offline.outputs[0]
    with launch_server(
        Path(model),
        tmp_path_factory.mktemp("qwen2_5_speaking"),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "16MiB",
    ) as server:
        client = server.client()
        assert client.get("/audio/voices", cast_to=object) == {
            "voices": ["Chelsie", "Ethan"],
            "default_voice": "Chelsie",
        }
        ask = {
            "model": MODEL,
            "messages": question,
            "max_tokens": 8,
            "temperature": 0.0,
            "modalities": ["text", "audio"],
            "extra_body": seeded,
        }
        answer = client.chat.completions.create(**ask, audio={"voice": "chelsie", "format": "wav"})
        audio = answer.choices[0].message.audio
        assert audio.transcript == offline.text
        samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="float32")
        assert rate == 24000
        np.testing.assert_allclose(samples, offline.audio, rtol=0, atol=1 / 32767)
        assert answer.usage.completion_tokens_details.audio_tokens == offline.num_audio_tokens
        pieces = [
            base64.b64decode(chunk.choices[0].delta.audio.data)
            for chunk in client.chat.completions.create(
                **ask, audio={"voice": "chelsie", "format": "pcm16"}, stream=True
            )
            if chunk.choices
            and getattr(chunk.choices[0].delta, "audio", None)
            and chunk.choices[0].delta.audio.data
        ]
        assert len(pieces) == 1 and pieces[0] == pcm16(offline.audio)
        # A stop string through the server's engine process: the same text and speech as
        # offline, streamed (the front end must not cut the speech short when it sees it).
        stop = offline.text[3:5]
        (stopped,) = llm.chat(question, _speech_params("Chelsie", 3, max_tokens=8, stop=[stop]))
        stopped = stopped.outputs[0]
        text, pcm = "", b""
        for chunk in client.chat.completions.create(
            **ask, audio={"voice": "chelsie", "format": "pcm16"}, stream=True, stop=[stop]
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                audio = getattr(choice.delta, "audio", None)
                pcm += base64.b64decode(audio.data or "") if audio else b""
        assert text == stopped.text == offline.text[: offline.text.index(stop)]
        assert pcm == pcm16(stopped.audio) and not np.allclose(stopped.audio, offline.audio)
        speech = client.audio.speech.create(
            model=MODEL,
            voice="ethan",
            input="Good morning",
            response_format="wav",
            extra_body=seeded,
        )
        spoken, _ = soundfile.read(io.BytesIO(speech.content), dtype="float32")
        assert len(spoken) >= 5 * 480 and np.std(spoken) > 1e-2


def test_stop_string_ends_text_and_speech_as_transformers(speech_case):
    """A stop string with audio output: the text ends before it, and the talker speaks the
    tokens before the one that completed it, as transformers' generate with the same stop
    string (its talker never speaks the thinker's last token)."""
    llm, prompts, reference = speech_case
    tokenizer = llm.get_tokenizer()
    tokens = reference[0][0]
    full = tokenizer.decode(tokens)
    prefix = tokenizer.decode(tokens[:5])
    stop = full[len(prefix) : len(prefix) + 2]
    assert stop and stop not in prefix
    model_dir = llm.llm_engine.config.model_config.model
    processor = AutoProcessor.from_pretrained(model_dir)
    model = HFQwen2_5Omni.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = _text(processor, [])
    inputs = _hf_inputs(processor, text, [])
    talker = model.config.talker_config
    torch.manual_seed(0)
    with torch.inference_mode():
        sequences, wave = model.generate(
            **inputs,
            speaker="Ethan",
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            thinker_stop_strings=[stop],
            thinker_tokenizer=processor.tokenizer,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_TOKENS,
            talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
        )
    generated = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(generated) < len(tokens)  # the stop string ended it
    (output,) = llm.generate(prompts[0], _speech_params("Ethan", 0, stop=[stop]), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == generated
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full[: full.index(stop)]
    np.testing.assert_allclose(completion.audio, wave.reshape(-1).numpy(), rtol=0, atol=WAVE_ATOL)
