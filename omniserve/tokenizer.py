"""Loading a checkpoint's tokenizer and its end-of-sequence ids, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def get_tokenizer(path: str) -> Any:
    """The checkpoint's fast tokenizer, from local files only (transformers' tokenizers are
    imported here: the engine core's process, which seldom needs one, starts without them)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot load a tokenizer from {path!r}: {exc}") from exc


def get_eos_token_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config.json's eos ids, else the tokenizer's."""
    ids: list[int] = []
    gen_config = Path(model_dir) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
