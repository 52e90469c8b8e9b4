"""How embedding requests pool (vLLM's ``--pooler-config``), with the checkpoint's own
sentence-transformers pipeline (``modules.json``: its Pooling module's mode, its Dense
projections, its Normalize) as the default, as vLLM reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""LAST: the prompt's last position's final hidden state (what decoder-based embedding models
are trained for); MEAN: the mean over every prompt position; CLS: the first position's."""
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
"""sentence-transformers' Pooling flags that map to a pooling type."""
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_DENSE = "sentence_transformers.models.Dense"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")
"""The torch.nn activations a Dense module may name (``activation_function``, by class)."""


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module, applied to the pooled vector before normalising:
    ``activation(x @ weight.T + bias)``, its weights in its folder (``linear.weight``,
    ``linear.bias``; loaded by the worker)."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """One of ``DENSE_ACTIVATIONS``."""


@dataclass(frozen=True)
class PoolerConfig:
    """The model's default pooling; a request's own ``PoolingParams`` fields win."""

    pooling_type: str = "LAST"
    """One of ``POOLING_TYPES``."""
    normalize: bool = True
    """Scale embeddings to unit L2 norm."""
    dense: tuple[DenseModule, ...] = ()
    """The checkpoint's Dense projections of the pooled vector, in order (classification
    requests skip them, as they are the embedding pipeline's)."""

    def embedding_size(self, hidden_size: int) -> int:
        """The width of an embedding: the last projection's, else the hidden states'."""
        return self.dense[-1].out_features if self.dense else hidden_size

    @classmethod
    def resolve(cls, model: str | Path, values: dict[str, Any] | None) -> PoolerConfig:
        """``values`` (``--pooler-config``: ``pooling_type``, ``normalize``) over the
        checkpoint's sentence-transformers settings, over LAST with normalisation."""
        values = dict(values or {})
        if unknown := sorted(set(values) - {"pooling_type", "normalize"}):
            raise ValueError(f"--pooler-config: unknown key {unknown[0]!r} (pooling_type, "
                             "normalize).")  # fmt: skip
        kind = values.get("pooling_type")
        if kind is not None:
            kind = str(kind).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(
                    f"--pooler-config: pooling_type {kind!r} is not supported; it is one of "
                    f"{', '.join(POOLING_TYPES)}."
                )
        normalize = values.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(
                f"--pooler-config: normalize must be true or false, not {normalize!r}."
            )
        path = Path(model).expanduser()
        modules = _modules(path)
        checkpoint = (
            _sentence_transformers_defaults(path, modules, need_type=kind is None)
            if kind is None or normalize is None
            else {}
        )
        return cls(
            kind or checkpoint.get("pooling_type", "LAST"),
            normalize if normalize is not None else checkpoint.get("normalize", True),
            _dense_modules(path, modules),
        )


def _modules(model: Path) -> list[dict[str, Any]]:
    """The checkpoint's sentence-transformers module list (empty when it has none), checked:
    a module omniserve does not run, or modules in an order it does not run them in, is
    refused at start-up rather than embeddings silently computed another way."""
    modules_file = model / "modules.json"
    if not modules_file.is_file():
        return []
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(m["type"]) for m in modules]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"{modules_file} is not a sentence-transformers module list: {exc}"
        ) from None
    known = (_ST_TRANSFORMER, _ST_POOLING, _ST_DENSE, _ST_NORMALIZE)
    if extra := [t for t in types if t not in known]:
        raise ValueError(
            f"{modules_file} lists sentence-transformers modules omniserve does not run "
            f"({', '.join(extra)}); it runs {', '.join(t.rpartition('.')[2] for t in known)} "
            "(a copy of the checkpoint without modules.json serves the bare pooled states)."
        )
    order = [known.index(t) for t in types]
    if order != sorted(order) or types.count(_ST_POOLING) > 1 or types.count(_ST_NORMALIZE) > 1:
        raise ValueError(
            f"{modules_file} runs its modules in the order {' -> '.join(types)}; omniserve runs "
            "Transformer -> Pooling -> Dense (any number) -> Normalize."
        )
    return modules


def _dense_modules(model: Path, modules: list[dict[str, Any]]) -> tuple[DenseModule, ...]:
    """The pipeline's Dense modules, each folder's ``config.json`` read and checked."""
    dense: list[DenseModule] = []
    for module in (m for m in modules if m["type"] == _ST_DENSE):
        folder = model / str(module.get("path", ""))
        try:
            config = json.loads((folder / "config.json").read_text())
            features = int(config["in_features"]), int(config["out_features"])
            bias = bool(config.get("bias", True))
            named = str(config.get("activation_function", "torch.nn.modules.linear.Identity"))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"Cannot read the Dense module config in {folder}: {exc}") from None
        activation = named.rpartition(".")[2]
        if not named.startswith("torch.") or activation not in DENSE_ACTIVATIONS:
            raise ValueError(
                f"{folder}/config.json: activation_function {named!r} is not one "
                f"omniserve runs (torch.nn's {', '.join(DENSE_ACTIVATIONS)})."
            )
        if dense and dense[-1].out_features != features[0]:
            raise ValueError(
                f"{folder} takes {features[0]} features but the Dense module before it "
                f"gives {dense[-1].out_features}."
            )
        dense.append(DenseModule(str(folder.resolve()), *features, bias, activation))
    return tuple(dense)


def _sentence_transformers_defaults(
    model: Path, modules: list[dict[str, Any]], need_type: bool
) -> dict[str, Any]:
    """``pooling_type`` and ``normalize`` as the checkpoint's pipeline (``modules``) sets them
    (nothing when it has none). A pooling mode omniserve does not run is refused when the type
    is not given otherwise, rather than embeddings silently pooled another way."""
    if not modules:
        return {}
    found: dict[str, Any] = {"normalize": any(m["type"] == _ST_NORMALIZE for m in modules)}
    pooling = next((m for m in modules if m["type"] == _ST_POOLING), None)
    if pooling is None:
        return found
    pooling_file = model / str(pooling.get("path", "")) / "config.json"
    try:
        flags = json.loads(pooling_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"Cannot read the checkpoint's pooling config {pooling_file}: {exc}"
        ) from None
    given = sorted(k for k, v in flags.items() if k.startswith("pooling_mode_") and v)
    if len(given) == 1 and given[0] in _ST_MODES:
        found["pooling_type"] = _ST_MODES[given[0]]
    elif need_type:
        raise ValueError(
            f"{pooling_file} pools by {' + '.join(given) or 'no mode'}; omniserve pools by one "
            f"of {', '.join(POOLING_TYPES)}: choose one with --pooler-config "
            """'{"pooling_type": "LAST"}'."""
        )
    return found
