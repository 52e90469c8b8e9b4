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


def tokenizer_refusal(what: str) -> str:
    """Why ``what`` is refused by an engine started without a tokenizer."""
    return (f"{what} needs the tokenizer, which this engine does not load (skip_tokenizer_init, "
            "--skip-tokenizer-init): give prompts as token ids.")  # fmt: skip


def get_eos_token_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config.json's eos ids, then the tokenizer's
    (None: no tokenizer loaded; then config.json's, if generation_config.json has none)."""
    ids = _eos_ids(Path(model_dir) / "generation_config.json")
    if tokenizer is None:
        return ids or _eos_ids(Path(model_dir) / "config.json")
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _eos_ids(file: Path) -> list[int]:
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
