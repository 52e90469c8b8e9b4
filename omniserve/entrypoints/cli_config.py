"""vLLM's ``--config FILE``: a command's flags from a YAML file, read before the command line,
whose own flags win (argparse keeps a flag's last value)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIG_COMMANDS = ("serve", "run-batch")


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``--config FILE``'s settings in front of its flags: ``max-num-seqs: 64``
    (or ``max_num_seqs``), ``true`` for a switch (``false``: its ``--no-`` form where it has
    one), a list for a flag of several values, a mapping as JSON; ``model:`` is the positional
    model when the command line gives none. ValueError naming the file when it is unreadable."""
    spot = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")),
                None)  # fmt: skip
    if spot is None or not argv or argv[0] not in CONFIG_COMMANDS:
        return argv
    given = argv[spot]
    if given == "--config":
        if spot + 1 >= len(argv):
            raise ValueError("--config needs a YAML file.")
        path, rest = argv[spot + 1], argv[:spot] + argv[spot + 2 :]
    else:
        path, rest = given.split("=", 1)[1], argv[:spot] + argv[spot + 1 :]
    settings = _read(path)
    known = {o for action in _actions(parser, argv[0]) for o in action.option_strings}
    tokens: list[str] = []
    model = settings.pop("model", None)
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            tokens.append(flag)
        elif value is False:
            if f"--no-{flag[2:]}" in known:
                tokens.append(f"--no-{flag[2:]}")
        elif value is None:
            continue
        elif isinstance(value, list):
            tokens += [flag, *map(str, value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        else:
            tokens += [flag, str(value)]
    command, *others = rest
    if model is not None and (not others or others[0].startswith("-")):
        tokens = [str(model), *tokens] if command == "serve" else [*tokens, "--model", str(model)]
    return [command, *tokens, *others]


def _read(path: str) -> dict:
    import yaml

    file = Path(path).expanduser()
    try:
        settings = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: not a YAML mapping of flags to values.")
    return settings


def _actions(parser: argparse.ArgumentParser, command: str) -> list[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return list(action.choices[command]._actions)
    return []
