"""A dataclass's fields checked against their annotations, for the settings and parameters
users build by hand (``SamplingParams(...)``, ``LLM(**engine_args)``): a wrong type is an error
naming the field at construction, not a failure deep in the engine."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class ParamTypeError(TypeError, ValueError):
    """A parameter of the wrong type. Also a ``ValueError``, as every other refused parameter
    is, so the callers that report those (the server's 400s) report it too."""


def check_types(params: object, prefix: str = "") -> None:
    """Raise ``ParamTypeError`` naming the first field of the dataclass ``params`` whose value
    is not of its annotated type (a bool is no integer; an integer is a number)."""
    for name, hint in field_types(type(params)).items():
        value = getattr(params, name)
        if not _conforms(value, hint):
            raise ParamTypeError(f"{prefix}{name} must be {_describe(hint)}, got {value!r}.")


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field name -> its annotation, evaluated (once per class)."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _conforms(value: object, hint: Any) -> bool:
    if hint is Any:
        return True
    if isinstance(hint, type):  # a class: bool, str, an enum, a params dataclass, ...
        if hint is int or hint is float:
            return isinstance(value, int | hint) and not isinstance(value, bool)
        return isinstance(value, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(item, args[0]) for item in value)
    if origin is tuple:
        return (
            isinstance(value, tuple)
            and len(value) == len(args)
            and all(map(_conforms, value, args))
        )
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    return isinstance(value, hint)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               dict: "a dict", type(None): "None"}  # fmt: skip


def _describe(hint: Any) -> str:
    """``hint`` in words ("a list of integers or None")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        *others, last = map(_describe, args)
        return f"{', '.join(others)} or {last}"
    if origin is list:
        return f"a list of {_plural(_describe(args[0]))}"
    if origin is dict:
        return f"a dict of {_plural(_describe(args[0]))} to {_plural(_describe(args[1]))}"
    if origin is tuple:
        return f"a tuple ({', '.join(map(_describe, args))})"
    if hint is Any:
        return "anything"
    return _TYPE_NAMES.get(hint, f"a {hint.__name__}")


def _plural(words: str) -> str:
    """ "a list of integers" -> "lists of integers"."""
    head, _, rest = words.partition(" ")[2].partition(" ")
    return f"{head}s {rest}".rstrip()
