"""Import a plugin's classes and check that they fulfil omniserve's model interface.

The checks are static (no checkpoint): every hook the engine calls exists and is implemented,
so a plugin fails at ``register-model`` with the list of what is missing instead of deep inside
a running engine. ``check.py`` validates behaviour on a real checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniserve.registry import ModelEntry, import_target

# The engine's calls into every model (worker, model runner) ...
MODEL_HOOKS = ("forward", "compute_logits", "load_weights", "get_input_embeddings")
# ... and into a multimodal one (encoder runner, chat renderer).
MULTIMODAL_MODEL_HOOKS = ("get_multimodal_embeddings", "get_placeholder_str")
MROPE_HOOKS = ("get_mrope_input_positions",)


class PluginError(ValueError):
    """A plugin cannot be imported or does not fulfil the interface (one-line message)."""


@dataclass(frozen=True)
class PluginClasses:
    """A validated plugin: its model class and, for a multimodal model, its processor classes."""

    model_cls: type
    factories: Any | None
    """``ProcessorFactories`` (info, dummy inputs, processor), or None for a text-only model."""
    modalities: tuple[str, ...] | None
    """Input modalities besides text (None: the processing info needs a checkpoint to say)."""


def add_to_sys_path(path: str | None) -> str | None:
    """Put ``--path`` on ``sys.path`` (absolute, in front, once); return the absolute path."""
    if path is None:
        return None
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise PluginError(f"--path {path!r} is not a directory")
    if str(resolved) not in sys.path:
        sys.path.insert(0, str(resolved))
    return str(resolved)


def import_plugin_class(target: str, what: str) -> type:
    """Import "package.module:Class" with an error that says what went wrong and where."""
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise PluginError(f"{what} {target!r} must look like 'package.module:Class'")
    try:
        return import_target(target)
    except ModuleNotFoundError as exc:
        raise PluginError(
            f"cannot import {what} {target!r}: {exc} (is its directory on sys.path? pass --path)"
        ) from exc
    except AttributeError as exc:
        raise PluginError(f"cannot import {what} {target!r}: {exc}") from exc
    except Exception as exc:  # the plugin's own module raised while importing
        raise PluginError(f"cannot import {what} {target!r}: {type(exc).__name__}: {exc}") from exc


def validate_plugin(model: str, processor: str | None = None) -> PluginClasses:
    """Import the classes and check every hook; PluginError names all that is missing."""
    from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

    model_cls = import_plugin_class(model, "model")
    problems: list[str] = []
    if processor is not None:
        processor_cls = import_plugin_class(processor, "processor")
        problems += companion_problems(processor_cls)
        factories = None if problems else MULTIMODAL_REGISTRY.factories_of_processor(processor_cls)
        has_processor = True
    else:
        factories = MULTIMODAL_REGISTRY.factories_of_model(model_cls)
        has_processor = factories is not None
    problems += model_problems(model_cls, has_processor=has_processor)
    if factories is not None:
        problems += processor_problems(factories)
    if problems:
        raise PluginError("; ".join(problems))
    return PluginClasses(model_cls, factories, supported_modalities(factories))


def model_problems(model_cls: type, *, has_processor: bool) -> list[str]:
    """What keeps ``model_cls`` from running in the engine."""
    import torch

    name = model_cls.__name__
    if not issubclass(model_cls, torch.nn.Module):
        return [f"model {name} is not a torch.nn.Module"]
    multimodal = bool(getattr(model_cls, "supports_multimodal", False))
    hooks = list(MODEL_HOOKS)
    if multimodal or has_processor:
        hooks += MULTIMODAL_MODEL_HOOKS
    if getattr(model_cls, "uses_mrope", False):
        hooks += MROPE_HOOKS
    problems = []
    missing = [hook for hook in hooks if not callable(getattr(model_cls, hook, None))]
    if missing:
        problems.append(f"model {name} is missing {', '.join(missing)}")
    problems += _abstract(model_cls, "model")
    if multimodal and not has_processor:
        problems.append(
            f"model {name} is multimodal but has no processor (pass --processor, or decorate "
            "it with @MULTIMODAL_REGISTRY.register_processor)"
        )
    if has_processor and not multimodal:
        problems.append(
            f"model {name} has a processor but not supports_multimodal = True, so the engine "
            "would never run its encoders"
        )
    return problems


def companion_problems(processor_cls: type) -> list[str]:
    """A processor registered on its own must name its info and dummy-inputs classes."""
    from omniserve.multimodal.processing import BaseDummyInputsBuilder, BaseProcessingInfo

    problems = []
    for attr, base in (
        ("info_cls", BaseProcessingInfo),
        ("dummy_inputs_cls", BaseDummyInputsBuilder),
    ):
        value = getattr(processor_cls, attr, None)
        if not (isinstance(value, type) and issubclass(value, base)):
            problems.append(
                f"processor {processor_cls.__name__} has no {attr} (a {base.__name__} subclass)"
            )
    return problems


def processor_problems(factories: Any) -> list[str]:
    """Each of the processor, its info and its dummy builder subclasses the right base and
    implements every abstract hook (field config, prompt updates, limits, dummy data ...)."""
    from omniserve.multimodal.processing import (
        BaseDummyInputsBuilder,
        BaseMultiModalProcessor,
        BaseProcessingInfo,
    )

    problems = []
    for cls, base, role in (
        (factories.processor, BaseMultiModalProcessor, "processor"),
        (factories.info, BaseProcessingInfo, "processing info"),
        (factories.dummy_inputs, BaseDummyInputsBuilder, "dummy-inputs builder"),
    ):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            problems.append(f"{role} {cls!r} is not a {base.__name__} subclass")
        else:
            problems += _abstract(cls, role)
    return problems


def _abstract(cls: type, role: str) -> list[str]:
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if not missing:
        return []
    return [f"{role} {cls.__name__} does not implement {', '.join(missing)}"]


def supported_modalities(factories: Any | None) -> tuple[str, ...] | None:
    """The modalities the processing info declares; () for text-only, None if it needs the
    checkpoint to answer (its ``get_supported_mm_limits`` reads the context)."""
    if factories is None:
        return ()
    try:
        limits = factories.info(None).get_supported_mm_limits()
    except Exception:  # a limit that depends on the checkpoint's config
        return None
    return tuple(limits)


def entry_modalities(entry: ModelEntry) -> str:
    """What ``omniserve models`` prints: declared modalities, else found by importing."""
    modalities = entry.modalities
    if modalities is None:
        try:
            modalities = validate_plugin(entry.target, entry.processor).modalities
        except PluginError as exc:
            return f"? ({exc})"
    if modalities is None:
        return "? (decided by the checkpoint)"
    return ", ".join(("text", *modalities))
