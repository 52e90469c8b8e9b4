"""What a model that speaks offers (its voices, sample rate, talker defaults), read from a full
omni checkpoint's config.json (and, for Qwen2.5-Omni, its voice file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SpeechConfig:
    """What a model that speaks (a full omni checkpoint with its talker and vocoder) offers, read
    from its config.json; the front end validates requests against it."""

    voices: tuple[str, ...]
    """The checkpoint's speakers, as its config names them; requests match them
    case-insensitively."""
    default_voice: str
    sample_rate: int
    talker_defaults: dict[str, float | int] = field(default_factory=dict)
    """The reference's talker sampling defaults (``SpeechParams`` field names)."""
    im_start_token_id: int = -1
    user_token_id: int = -1
    assistant_token_id: int = -1
    """The ChatML ids the talker's prompt is cut by (user turns, the assistant's reply)."""
    user_turns_only: bool = True
    """The talker's prompt keeps the user turns (Qwen3-Omni, cut by the ids above), or the
    whole prompt before the reply (Qwen2.5-Omni: the reply is what is generated)."""
    assistant_prompt_len: int = 0
    """Talker prompt positions after those taken from the thinker's prompt."""
    reads_hidden: str = "multimodal"
    """Where the talker reads the thinker's hidden states: "multimodal" (prompt positions of
    media, Qwen3-Omni) or "all" (every prompt and reply position, Qwen2.5-Omni)."""
    talker_max_len: int = 0
    """The talker's longest sequence (prompt + frames)."""

    def resolve_voice(self, voice: str | None) -> str:
        """The checkpoint's name of ``voice`` (None: the default); ValueError listing the voices."""
        if voice is None:
            return self.default_voice
        for name in self.voices:
            if name.lower() == voice.lower():
                return name
        raise ValueError(
            f"Unknown voice {voice!r}; this model's voices are {', '.join(self.voices)}."
        )


# Architectures whose speech stages (talker + vocoder) omniserve runs -> how to read their voices
# (each reader takes config.json and the checkpoint's directory).
def _qwen3_omni_speech(hf_config: dict, model_dir: str) -> SpeechConfig:
    del model_dir  # its voices are in config.json
    talker = hf_config.get("talker_config") or {}
    voices = tuple(talker.get("speaker_id") or {})
    if not voices:
        raise ValueError("config.json: talker_config.speaker_id names no voices.")
    return SpeechConfig(
        voices=voices,
        default_voice="ethan" if "ethan" in voices else voices[0],  # the reference's default
        sample_rate=24000,
        # Qwen3OmniMoeForConditionalGeneration.generate's talker defaults.
        talker_defaults={
            "temperature": 0.9,
            "top_k": 50,
            "top_p": 1.0,
            "repetition_penalty": 1.05,
            "max_tokens": 4096,
        },
        im_start_token_id=hf_config["im_start_token_id"],
        user_token_id=hf_config["user_token_id"],
        assistant_token_id=hf_config["assistant_token_id"],
        assistant_prompt_len=9,
        talker_max_len=int((talker.get("text_config") or {}).get("max_position_embeddings", 32768)),
    )


def _qwen2_5_omni_speech(hf_config: dict, model_dir: str) -> SpeechConfig:
    """Qwen2.5-Omni keeps its voices in ``spk_dict.pt`` (name -> text bos id, DiT conditioning,
    reference mel), as transformers' ``from_pretrained`` reads them."""
    import torch

    path = Path(model_dir) / "spk_dict.pt"
    if not path.is_file():
        raise ValueError(f"{path} is missing: a Qwen2.5-Omni checkpoint keeps its voices there.")
    voices = tuple(torch.load(path, weights_only=True))
    if not voices:
        raise ValueError(f"{path} names no voices.")
    talker = hf_config.get("talker_config") or {}
    return SpeechConfig(
        voices=voices,
        default_voice="Chelsie" if "Chelsie" in voices else voices[0],  # the reference's default
        sample_rate=24000,
        # Qwen2_5OmniForConditionalGeneration.generate's talker defaults.
        talker_defaults={
            "temperature": 0.9,
            "top_k": 40,
            "top_p": 0.8,
            "repetition_penalty": 1.05,
            "max_tokens": 4096,
        },
        user_turns_only=False,
        assistant_prompt_len=2,  # the voice's text bos, then the first reply token
        reads_hidden="all",
        talker_max_len=int(talker.get("max_position_embeddings", 32768)),
    )


_SPEAKING_ARCHITECTURES = {
    "Qwen3OmniMoeForConditionalGeneration": _qwen3_omni_speech,
    "Qwen2_5OmniForConditionalGeneration": _qwen2_5_omni_speech,
}


def speech_of(
    hf_config: dict, architecture: str, disabled: bool, model_dir: str
) -> tuple[SpeechConfig | None, str]:
    """``(speech, why not)``: what the checkpoint can say, or why it says nothing."""
    has_speech_half = "talker_config" in hf_config and hf_config.get("enable_audio_output", True)
    if not has_speech_half:
        return None, (
            f"this model ({architecture}) has no talker and vocoder (a text or "
            "thinker-only checkpoint), so it cannot speak; serve a full omni checkpoint "
            "for audio output"
        )
    if disabled:
        return None, "audio output is disabled on this server (--disable-audio-output)"
    reader = _SPEAKING_ARCHITECTURES.get(architecture)
    if reader is None:
        return None, f"speech output of {architecture} is not served yet (text only)"
    return reader(hf_config, model_dir), ""
