"""A checkpoint under another architecture name: how a plugin runs on its base family's weights.

The engine picks the model class from config.json's ``architectures``, so a plugin architecture
(``MyVLForConditionalGeneration``) runs on a checkpoint of the family it starts from
(``Qwen2VLForConditionalGeneration``) when that entry names the plugin. ``--check`` makes a
temporary view (symlinks to every file, a rewritten config.json); ``omniserve make-tiny
--as-architecture`` writes a copy to keep.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


def checkpoint_architecture(checkpoint: str | Path) -> str:
    """``architectures[0]`` of a checkpoint's config.json, or a precise error."""
    config_file = Path(checkpoint).expanduser() / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: not a Hugging Face checkpoint dir")
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{config_file} is not a JSON object: {exc}") from exc
    if not architectures:
        raise ValueError(f"{config_file} names no 'architectures'")
    return str(architectures[0])


def write_checkpoint_as(
    source: str | Path, architecture: str, out_dir: str | Path, *, link: bool
) -> Path:
    """Write ``source`` into ``out_dir`` (new or empty) with config.json naming
    ``architecture``; other files are symlinked (``link``) or copied."""
    source, out = Path(source).expanduser().resolve(), Path(out_dir).expanduser()
    config = json.loads((source / CONFIG_FILE).read_text())
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name == CONFIG_FILE:
            continue
        target = out / item.name
        if link:
            target.symlink_to(item, target_is_directory=item.is_dir())
        elif item.is_dir():
            shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)
    config["architectures"] = [architecture]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def tiny_checkpoint_as(
    base_architecture: str, architecture: str, out_dir: str | Path | None = None, **build: Any
) -> Path:
    """A tiny checkpoint of ``base_architecture``'s family whose config.json names
    ``architecture``: at ``out_dir``, or cached next to the family's tiny checkpoint."""
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    source = build_tiny_checkpoint(base_architecture, **build)
    if out_dir is not None:
        return write_checkpoint_as(source, architecture, out_dir, link=False)
    out = source.parent / f"{source.name}-as-{architecture}"
    if out.is_dir() and checkpoint_architecture(out) == architecture:
        return out
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=source.parent))
    try:
        write_checkpoint_as(source, architecture, staging, link=False)
        staging.rename(out)  # atomic: a concurrent builder never sees half a checkpoint
    except OSError:
        if not (out.is_dir() and checkpoint_architecture(out) == architecture):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
