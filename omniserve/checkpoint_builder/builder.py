"""Build tiny Hugging Face checkpoints offline, deterministically and atomically."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniserve import envs
from omniserve.checkpoint_builder.specs import ARCH_SPECS, ArchSpec
from omniserve.checkpoint_builder.tokenizer import build_hf_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

BUILDER_VERSION = 1
"""Bump when the output of a build changes, so cached checkpoints are rebuilt."""

BUILD_INFO_FILE = "omniserve_build.json"
"""Written last inside a checkpoint: what was built, from which inputs (its `key`)."""

_VOCAB_MULTIPLE = 64
_ONE_D_NOISE_STD = 0.1


def build_tiny_checkpoint(
    architecture: str,
    out_dir: str | Path | None = None,
    *,
    size: str = "tiny",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write (or reuse) a complete random-weight HF checkpoint directory and return its path.

    `overrides` are config kwargs merged over the size's defaults. Without `out_dir` the checkpoint
    lives under `envs.cache_dir()/checkpoints`, named by its inputs, and is reused when present.
    The directory appears atomically (built next to its target, then renamed), so concurrent
    builders such as pytest-xdist workers never see half a checkpoint.
    """
    spec = _spec(architecture)
    overrides = dict(overrides or {})
    spec.config_kwargs_for(size)  # validate `size` before touching the disk
    key = _build_key(spec, size, seed, overrides)
    if out_dir is None:
        target = envs.cache_dir() / "checkpoints" / f"{architecture}-{size}-s{seed}-{key}"
    else:
        target = Path(out_dir)
    if _is_built(target, key):
        return target
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty and holds no matching checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(spec, tmp_dir, size=size, seed=seed, overrides=overrides)
        _write_build_info(tmp_dir, architecture, size, seed, overrides, key)
        _publish(tmp_dir, target, key)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


def _spec(architecture: str) -> ArchSpec:
    try:
        return ARCH_SPECS[architecture]
    except KeyError:
        raise ValueError(
            f"no tiny checkpoint recipe for {architecture!r}; supported: {sorted(ARCH_SPECS)}"
        ) from None


def _build_key(spec: ArchSpec, size: str, seed: int, overrides: dict[str, Any]) -> str:
    """Hash of everything that changes the bytes written.

    The spec's repr covers table edits (template, special tokens, shapes); transformers' version
    covers its init and layout; BUILDER_VERSION covers this package's code and corpus.
    """
    import transformers

    payload = json.dumps(
        [BUILDER_VERSION, transformers.__version__, repr(spec), size, seed, overrides],
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _is_built(path: Path, key: str) -> bool:
    try:
        return json.loads((path / BUILD_INFO_FILE).read_text())["key"] == key
    except (OSError, ValueError, KeyError):
        return False


def _publish(tmp_dir: Path, target: Path, key: str) -> None:
    """Rename into place; losing the race to an identical build is success."""
    # mkdtemp makes a private (0700) dir; a shared cache must be readable by other users.
    tmp_dir.chmod(0o755)
    for file in tmp_dir.iterdir():
        file.chmod(0o644)
    try:
        os.rename(tmp_dir, target)  # replaces `target` only if it is an empty directory
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _is_built(target, key):
            raise


def _write_build_info(
    path: Path, architecture: str, size: str, seed: int, overrides: dict[str, Any], key: str
) -> None:
    info = {
        "builder_version": BUILDER_VERSION,
        "architecture": architecture,
        "size": size,
        "seed": seed,
        "overrides": overrides,
        "key": key,
    }
    (path / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True, default=repr))


def _write_checkpoint(
    spec: ArchSpec, path: Path, *, size: str, seed: int, overrides: dict[str, Any]
) -> None:
    import torch

    kwargs = {**spec.config_kwargs_for(size), **overrides}
    tokenizer = build_hf_tokenizer(spec.tokenizer, kwargs["max_position_embeddings"])
    config = _make_config(spec, tokenizer, kwargs)
    # fork_rng: building must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _make_model(spec, config, num_tokens=len(tokenizer))
    model.generation_config = _make_generation_config(spec, tokenizer, config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _make_config(
    spec: ArchSpec, tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]
) -> PreTrainedConfig:
    import transformers

    family = spec.tokenizer
    kwargs = dict(kwargs)
    # Pad the vocabulary like real checkpoints do (their rows are zeroed in _zero_padding_rows).
    min_vocab = -(-len(tokenizer) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    vocab_size = kwargs.pop("vocab_size", min_vocab)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")
    token_id = tokenizer.convert_tokens_to_ids
    ids = {
        "bos_token_id": token_id(family.bos_token) if family.bos_token else None,
        "eos_token_id": token_id(family.eos_token),
        "pad_token_id": token_id(family.pad_token) if family.pad_token else None,
    }
    config_cls = getattr(transformers, spec.config_class)
    return config_cls(architectures=[spec.architecture], vocab_size=vocab_size, **{**ids, **kwargs})


def _make_model(spec: ArchSpec, config: PreTrainedConfig, num_tokens: int) -> PreTrainedModel:
    """Random weights drawn from the current (seeded) RNG, cast to the config's dtype."""
    import transformers

    model = getattr(transformers, spec.architecture)(config)
    _perturb_one_d_params(model)
    _zero_padding_rows(model, num_tokens)
    return model.to(config.dtype)


def _make_generation_config(
    spec: ArchSpec, tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig
) -> GenerationConfig:
    """Token ids only, as in real checkpoints' eos list; no sampling defaults, so greedy it is."""
    import transformers

    eos_ids = tokenizer.convert_tokens_to_ids(list(spec.tokenizer.generation_eos_tokens))
    return transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    )


def _perturb_one_d_params(model: torch.nn.Module) -> None:
    """Add noise to norm scales and biases, which transformers initialises to ones and zeros.

    Constant norms/biases would let a loader that drops or swaps them still match transformers;
    randomised ones make every weight in the checkpoint observable in the outputs.
    """
    import torch

    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, dtype=param.dtype) * _ONE_D_NOISE_STD)


def _zero_padding_rows(model: PreTrainedModel, num_tokens: int) -> None:
    """Zero the embedding and lm_head rows of ids the tokenizer does not have.

    Random rows there would win greedy decoding ~1.6% of steps and emit undecodable ids; zero rows
    give logit 0, far below the top logits (std ~3), as untrained rows do in real checkpoints.
    """
    import torch

    with torch.no_grad():
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            if module is not None:
                module.weight[num_tokens:] = 0  # [vocab_size - num_tokens, hidden_size]
