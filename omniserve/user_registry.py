"""The user's registry file: models recorded by ``omniserve register-model``.

``$OMNISERVE_CONFIG_DIR/models.json`` (by default ``~/.config/omniserve/models.json``)::

    {"version": 1,
     "models": {"MyVLForConditionalGeneration": {
         "model": "my_vl.model:MyVLForConditionalGeneration",
         "processor": null, "path": "/home/me/src/my_vl", "modalities": ["image"]}}}

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a failed or
interrupted command leaves the previous file intact and readers never see half a file. This
module stays free of torch and of model imports: ``load_plugins`` reads it in every process.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from omniserve import envs
from omniserve.registry import USER_FILE_SOURCE, ModelEntry

FILE_NAME = "models.json"
FORMAT_VERSION = 1


class UserRegistryError(ValueError):
    """The registry file cannot be read or written; the message names the file."""


@dataclass(frozen=True)
class UserModel:
    """One recorded architecture."""

    model: str
    """"package.module:Class" of the model."""
    processor: str | None = None
    """"package.module:Class" of its multimodal processor, if given at registration."""
    path: str | None = None
    """A directory put on ``sys.path`` before importing (``--path``), absolute."""
    modalities: tuple[str, ...] | None = None
    """Input modalities besides text, as found at registration (None: not known)."""

    def to_entry(self, architecture: str) -> ModelEntry:
        return ModelEntry(
            architecture, self.model, USER_FILE_SOURCE, self.processor, self.modalities
        )


def registry_file() -> Path:
    return envs.config_dir() / FILE_NAME


def read_user_registry(path: Path | None = None) -> dict[str, UserModel]:
    """Every recorded model (empty if the file does not exist yet)."""
    path = path or registry_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UserRegistryError(f"cannot read the model registry {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserRegistryError(
            f"the model registry {path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
            "fix or delete it"
        ) from exc
    return _parse(data, path)


def _parse(data: object, path: Path) -> dict[str, UserModel]:
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise UserRegistryError(f"the model registry {path} has no 'models' object")
    if data.get("version") != FORMAT_VERSION:
        raise UserRegistryError(
            f"the model registry {path} has version {data.get('version')!r}; this omniserve "
            f"reads version {FORMAT_VERSION}"
        )
    models: dict[str, UserModel] = {}
    for architecture, fields in data["models"].items():
        if not isinstance(fields, dict) or not isinstance(fields.get("model"), str):
            raise UserRegistryError(
                f"the model registry {path}: entry {architecture!r} has no 'model' string"
            )
        for key in ("processor", "path"):
            if not isinstance(fields.get(key), str | None):
                raise UserRegistryError(
                    f"the model registry {path}: entry {architecture!r} has a non-string {key!r}"
                )
        try:
            models[architecture] = UserModel(
                model=fields["model"],
                processor=fields.get("processor"),
                path=fields.get("path"),
                modalities=_modalities(fields.get("modalities")),
            )
        except TypeError as exc:
            raise UserRegistryError(
                f"the model registry {path}: entry {architecture!r} is malformed: {exc}"
            ) from exc
    return models


def _modalities(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        raise TypeError(f"'modalities' must be a list of strings, got {value!r}")
    return tuple(value)


def write_user_registry(models: dict[str, UserModel], path: Path | None = None) -> Path:
    """Replace the file's content atomically; return its path."""
    path = path or registry_file()
    payload = {
        "version": FORMAT_VERSION,
        "models": {
            arch: {**asdict(model), "modalities": _modalities(model.modalities)}
            for arch, model in sorted(models.items())
        },
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UserRegistryError(f"cannot write the model registry {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        Path(tmp_name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise UserRegistryError(
                f"cannot write the model registry {path}: {exc.strerror}"
            ) from exc
        raise
    return path
