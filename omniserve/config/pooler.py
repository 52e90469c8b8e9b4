"""How embedding requests pool (vLLM's ``--pooler-config``), with the checkpoint's own
sentence-transformers pipeline (``modules.json`` and its Pooling module's config) as the default,
as vLLM reads it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""LAST: the prompt's last position's final hidden state (what decoder-based embedding models
are trained for); MEAN: the mean over every prompt position; CLS: the first position's."""
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
"""sentence-transformers' Pooling flags that map to a pooling type."""
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_IGNORED = ("sentence_transformers.models.Transformer", _ST_POOLING, _ST_NORMALIZE)


@dataclass(frozen=True)
class PoolerConfig:
    """The model's default pooling; a request's own ``PoolingParams`` fields win."""

    pooling_type: str = "LAST"
    """One of ``POOLING_TYPES``."""
    normalize: bool = True
    """Scale embeddings to unit L2 norm."""

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
        checkpoint = (
            _sentence_transformers_defaults(Path(model).expanduser(), need_type=kind is None)
            if kind is None or normalize is None
            else {}
        )
        return cls(
            kind or checkpoint.get("pooling_type", "LAST"),
            normalize if normalize is not None else checkpoint.get("normalize", True),
        )


def _sentence_transformers_defaults(model: Path, need_type: bool) -> dict[str, Any]:
    """``pooling_type`` and ``normalize`` as the checkpoint's ``modules.json`` pipeline sets
    them (nothing when it has none). A pooling mode omniserve does not run is refused when the
    type is not given otherwise, rather than embeddings silently pooled another way."""
    modules_file = model / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(m["type"]) for m in modules]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(
            f"{modules_file} is not a sentence-transformers module list: {exc}"
        ) from None
    found: dict[str, Any] = {"normalize": _ST_NORMALIZE in types}
    if extra := [t for t in types if t not in _ST_IGNORED]:
        logger.warning(
            "%s lists sentence-transformers modules omniserve does not apply (%s): embeddings "
            "are the pooled hidden states without them.", modules_file, ", ".join(extra)
        )  # fmt: skip
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
