"""InputPreprocessor: a prompt in any accepted form -> token ids (and, later, multimodal inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniserve.inputs.data import PromptType


@dataclass
class ProcessedInputs:
    prompt: str | None
    prompt_token_ids: list[int]


class InputPreprocessor:
    """Tokenizes text prompts; validates token-id prompts. One path for both."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def preprocess(self, prompt: PromptType) -> ProcessedInputs:
        if isinstance(prompt, str):
            return ProcessedInputs(prompt, self._tokenize(prompt))
        if not isinstance(prompt, dict):
            raise TypeError(f"A prompt must be a str or a dict, got {type(prompt).__name__}.")
        if prompt.get("multi_modal_data"):
            raise ValueError("This model takes no multimodal data (multi_modal_data was given).")
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
                raise TypeError("prompt_token_ids must be a list of ints.")
            return ProcessedInputs(prompt.get("prompt"), list(token_ids))  # type: ignore[arg-type]
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError("'prompt' must be a str.")
            return ProcessedInputs(prompt["prompt"], self._tokenize(prompt["prompt"]))
        raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)
