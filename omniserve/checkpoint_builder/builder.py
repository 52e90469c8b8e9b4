"""Build tiny Hugging Face checkpoints offline, deterministically and atomically."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniserve import envs
from omniserve.checkpoint_builder.processors import build_hf_processor
from omniserve.checkpoint_builder.specs import ArchSpec, MultiModalSpec, SpeechSpec
from omniserve.checkpoint_builder.speech import (
    init_fused_experts,
    speech_submodels,
    tune_speech_weights,
    write_speakers,
)
from omniserve.checkpoint_builder.table import ARCH_SPECS
from omniserve.checkpoint_builder.tokenizer import build_hf_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

BUILDER_VERSION = 6
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
    """
    spec = _spec(architecture)
    overrides = dict(overrides or {})
    spec.config_kwargs_for(size)  # validate `size` before touching the disk
    key = build_key(repr(spec), size, seed, overrides)
    if out_dir is None:
        target = envs.cache_dir() / "checkpoints" / f"{architecture}-{size}-s{seed}-{key}"
    else:
        target = Path(out_dir)
    info = {"architecture": architecture, "size": size, "seed": seed, "overrides": overrides}
    return build_once(
        target,
        key,
        info,
        lambda path: _write_checkpoint(spec, path, size=size, seed=seed, overrides=overrides),
    )


def build_once(target: Path, key: str, info: dict[str, Any], write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` and publish its directory at `target`, unless `key` is built there.

    The directory appears atomically (built next to its target, then renamed), so concurrent
    builders such as pytest-xdist workers never see half a checkpoint. `info` and `key` go to
    BUILD_INFO_FILE, written last.
    """
    if _is_built(target, key):
        return target
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty and holds no matching checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp_dir)
        info = {"builder_version": BUILDER_VERSION, **info, "key": key}
        (tmp_dir / BUILD_INFO_FILE).write_text(
            json.dumps(info, indent=2, sort_keys=True, default=repr)
        )
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


def build_key(*inputs: Any) -> str:
    """Hash of everything that changes the bytes written, given as `inputs`.

    A spec's repr covers table edits (template, special tokens, shapes); transformers' version
    covers its init and layout; BUILDER_VERSION covers this package's code and corpus.
    """
    import transformers

    payload = json.dumps(
        [BUILDER_VERSION, transformers.__version__, *inputs], sort_keys=True, default=repr
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


def _write_checkpoint(
    spec: ArchSpec, path: Path, *, size: str, seed: int, overrides: dict[str, Any]
) -> None:
    import torch

    config, tokenizer = make_config_and_tokenizer(spec, size, overrides)
    # fork_rng: building must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _make_model(spec, config, num_tokens=len(tokenizer))
    model.generation_config = make_generation_config(spec, tokenizer, config)
    model.save_pretrained(path)
    if spec.speech is not None and spec.speech.speakers:
        write_speakers(path, spec.speech, config, num_tokens=len(tokenizer), seed=seed)
    save_tokenizer_or_processor(spec, path, tokenizer, config)


def make_config_and_tokenizer(
    spec: ArchSpec, size: str, overrides: dict[str, Any]
) -> tuple[PreTrainedConfig, PreTrainedTokenizerBase]:
    """The model config (`overrides` merged over the size's defaults) and the trained tokenizer,
    whose special-token ids the config refers to."""
    kwargs, tower_overrides = _split_overrides(spec, size, overrides)
    tokenizer = build_hf_tokenizer(spec.tokenizer, kwargs["max_position_embeddings"])
    config = _make_config(spec, tokenizer, kwargs, size=size, tower_overrides=tower_overrides)
    return config, tokenizer


def save_tokenizer_or_processor(
    spec: ArchSpec, path: Path, tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig
) -> None:
    """The tokenizer, or for multimodal rows the processor, which saves the tokenizer, its media
    components and the chat template."""
    if spec.multimodal is None:
        tokenizer.save_pretrained(path)
    else:
        media_config = config.thinker_config if spec.speech else config
        build_hf_processor(spec.multimodal.processor, tokenizer, media_config).save_pretrained(path)


def _split_overrides(
    spec: ArchSpec, size: str, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config kwargs with overrides, per-tower overrides): tower keys name a sub-config dict."""
    towers = {**(spec.multimodal.towers if spec.multimodal else {})}
    towers.update(spec.speech.submodels if spec.speech else {})
    tower_overrides = {name: dict(value) for name, value in overrides.items() if name in towers}
    text_overrides = {key: value for key, value in overrides.items() if key not in towers}
    return {**spec.config_kwargs_for(size), **text_overrides}, tower_overrides


def _make_config(
    spec: ArchSpec,
    tokenizer: PreTrainedTokenizerBase,
    kwargs: dict[str, Any],
    *,
    size: str,
    tower_overrides: dict[str, dict[str, Any]],
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
    if spec.speech is not None:
        return _speech_config(spec, tokenizer, kwargs, size=size, tower_overrides=tower_overrides)
    text_kwargs = {"vocab_size": vocab_size, **ids, **kwargs}
    if spec.multimodal is None:
        return config_cls(architectures=[spec.architecture], **text_kwargs)
    outer = _multimodal_kwargs(spec.multimodal, tokenizer, text_kwargs, size, tower_overrides)
    return config_cls(architectures=[spec.architecture], **outer)


def _multimodal_kwargs(
    mm: MultiModalSpec,
    tokenizer: PreTrainedTokenizerBase,
    text_kwargs: dict[str, Any],
    size: str,
    tower_overrides: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Outer-config kwargs: nested text config, tower sub-configs and placeholder token ids."""
    outer = {key: text_kwargs.pop(key) for key in list(text_kwargs) if key in mm.outer_kwargs}
    outer = {**mm.outer_kwargs, **outer}
    if mm.text_model_type is not None:
        text_kwargs["model_type"] = mm.text_model_type
    if mm.mrope_section is not None:
        head_dim = text_kwargs.get("head_dim")
        head_dim = head_dim or text_kwargs["hidden_size"] // text_kwargs["num_attention_heads"]
        rope = dict(text_kwargs["rope_parameters"])  # an overridden split is kept as given
        rope.setdefault("mrope_section", scale_mrope_section(mm.mrope_section, head_dim))
        text_kwargs["rope_parameters"] = rope
    outer.update({key: text_kwargs[text_key] for key, text_key in mm.outer_text_links.items()})
    outer["text_config"] = text_kwargs
    outer["dtype"] = text_kwargs["dtype"]
    for name, tower in mm.towers.items():
        tower_kwargs = {**mm.tower_kwargs_for(name, size), **tower_overrides.get(name, {})}
        for key, text_key in tower.text_links.items():
            tower_kwargs[key] = text_kwargs[text_key]
        outer[name] = tower_kwargs
    for key, token in mm.token_ids.items():
        outer[key] = _token_id(tokenizer, token)
    return outer


def _speech_config(
    spec: ArchSpec,
    tokenizer: PreTrainedTokenizerBase,
    kwargs: dict[str, Any],
    *,
    size: str,
    tower_overrides: dict[str, dict[str, Any]],
) -> PreTrainedConfig:
    """A full omni config: the thinker row's config plus the talker / vocoder sub-configs."""
    import transformers

    speech: SpeechSpec = spec.speech  # type: ignore[assignment]
    thinker_spec = ARCH_SPECS[speech.thinker_architecture]
    thinker_overrides = {k: v for k, v in tower_overrides.items() if k not in speech.submodels}
    thinker = _make_config(
        thinker_spec, tokenizer, kwargs, size=size, tower_overrides=thinker_overrides
    )
    outer = speech_submodels(speech, size, thinker, tower_overrides)
    for key, token in speech.token_ids.items():
        outer[key] = _token_id(tokenizer, token)
    config_cls = getattr(transformers, spec.config_class)
    return config_cls(
        architectures=[spec.architecture], thinker_config=thinker, dtype=thinker.dtype, **outer
    )


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a special token, or of the first piece of a word our small BPE splits.

    Role ids such as user_token_id are single tokens in the real vocabulary ("user" is 872); here
    "user" splits, and its first piece still tells the roles apart after <|im_start|>.
    """
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None:
        token_id = tokenizer.encode(token, add_special_tokens=False)[0]
    return token_id


def scale_mrope_section(real_section: tuple[int, ...], head_dim: int) -> list[int]:
    """Shrink a real M-RoPE split (which sums to 64 = 128 / 2) so it sums to head_dim / 2.

    Rounded per axis with the remainder given to the last axis, e.g. (16, 24, 24) -> [2, 3, 3]
    for head_dim 16 and [8, 12, 12] for head_dim 64.
    """
    if head_dim % 2:
        raise ValueError(f"M-RoPE needs an even head_dim, got {head_dim}")
    half, real_half = head_dim // 2, sum(real_section)
    section = [max(1, round(n * half / real_half)) for n in real_section[:-1]]
    section.append(half - sum(section))
    if section[-1] < 1:
        raise ValueError(f"head_dim {head_dim} is too small for {len(real_section)} M-RoPE axes")
    return section


def _make_model(spec: ArchSpec, config: PreTrainedConfig, num_tokens: int) -> PreTrainedModel:
    """Random weights drawn from the current (seeded) RNG, cast to the config's dtype.

    A full omni model's thinker is drawn first, exactly as its thinker row draws it, so a full
    checkpoint's "thinker.*" weights equal the thinker checkpoint's for the same seed.
    """
    import transformers

    thinker = None
    if spec.speech is not None:
        thinker_spec = ARCH_SPECS[spec.speech.thinker_architecture]
        thinker = _make_model(thinker_spec, config.thinker_config, num_tokens)
    model = getattr(transformers, spec.architecture)(config)
    if thinker is not None:
        init_fused_experts(model)
    _perturb_one_d_params(model)
    if thinker is not None:
        tune_speech_weights(model)
    if thinker is not None:
        model.thinker.load_state_dict(thinker.state_dict())
    else:
        _zero_padding_rows(model, num_tokens)
    return model.to(config.dtype)


def make_generation_config(
    spec: ArchSpec, tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig
) -> GenerationConfig:
    """Token ids only, as in real checkpoints' eos list; no sampling defaults, so greedy it is."""
    import transformers

    eos_ids = tokenizer.convert_tokens_to_ids(list(spec.tokenizer.generation_eos_tokens))
    text_config = config.get_text_config()
    return transformers.GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=text_config.pad_token_id,
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
