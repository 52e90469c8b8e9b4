"""A dataclass's fields checked against their annotations, for the settings and parameters
users build by hand (``SamplingParams(...)``, ``LLM(**engine_args)``): a wrong type is an error
naming the field at construction, not a failure deep in the engine."""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
import operator
import os
import types
import typing
from collections.abc import Callable
from typing import Any


class ParamTypeError(TypeError, ValueError):
    """A parameter of the wrong type. Also a ``ValueError``, as every other refused parameter
    is, so the callers that report those (the server's 400s) report it too."""


def check_types(params: object, prefix: str = "") -> None:
    """Raise ``ParamTypeError`` naming the first field of the dataclass ``params`` whose value
    is not of its annotated type (a bool is no integer; an integer is a number). Values of the
    right kind in another form take the annotated one, as vLLM's lax configs do: numpy numbers
    become Python's, a tuple a list, a path a string, an enum's value the enum."""
    quick = _quick_checks(type(params))  # type: ignore[arg-type]  # classes hash
    for name, hint in field_types(type(params)).items():
        value = getattr(params, name)
        if quick[name](value):  # the usual case, decided without walking the hint
            continue
        taken = _conform(value, hint)
        if taken is _REFUSED:
            raise ParamTypeError(f"{prefix}{name} must be {_describe(hint)}, got {value!r}.")
        if taken is not value:
            object.__setattr__(params, name, taken)  # frozen dataclasses too


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field name -> its annotation, evaluated (once per class)."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


_FIELD_TYPES: dict[type, dict[str, Any]] = {}
_REFUSED = object()


@functools.cache
def _quick_checks(cls: type) -> dict[str, Callable[[Any], bool]]:
    """Per field, a test that takes a value as it is when its type (and its items' types, in a
    list or dict) are exactly the hint's: the common case, without walking the hint."""
    return {name: _quick(hint) for name, hint in field_types(cls).items()}


def _quick(hint: Any) -> Callable[[Any], bool]:
    arms = _arms(hint)
    scalars = frozenset(_scalars(hint))
    lists = [frozenset(_scalars(typing.get_args(arm)[0])) for arm in arms
             if typing.get_origin(arm) is list]  # fmt: skip
    dicts = [tuple(frozenset(_scalars(a)) for a in typing.get_args(arm)) for arm in arms
             if typing.get_origin(arm) is dict]  # fmt: skip

    def check(value: Any) -> bool:
        kind = type(value)
        if kind in scalars:
            return True
        if kind is list:
            return any(all(type(v) in items for v in value) for items in lists)
        if kind is dict:
            return any(all(type(k) in keys and type(v) in values for k, v in value.items())
                       for keys, values in dicts)  # fmt: skip
        return False

    return check


def _arms(hint: Any) -> tuple[Any, ...]:
    """A union's members, or the hint itself."""
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    return typing.get_args(hint) if union else (hint,)


def _scalars(hint: Any) -> set[type]:
    """The classes a value of ``hint`` may be as it is (an int for a float too), containers
    aside."""
    if len(arms := _arms(hint)) > 1:
        return set().union(*map(_scalars, arms))
    if hint is Any or not isinstance(hint, type) or typing.get_origin(hint) is not None:
        return set()
    return {float, int} if hint is float else {hint}


def _conform(value: Any, hint: Any) -> Any:
    """``value`` in the annotated type's form, or ``_REFUSED``."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for arm in args:
            taken = _conform(value, arm)
            if taken is not _REFUSED:
                return taken
        return _REFUSED
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            return _REFUSED
        kinds = args if origin is tuple else (args[0],) * len(value)
        if len(kinds) != len(value):
            return _REFUSED
        items = [_conform(item, kind) for item, kind in zip(value, kinds, strict=True)]
        if any(item is _REFUSED for item in items):
            return _REFUSED
        same = isinstance(value, origin) and all(map(operator.is_, items, value))
        return value if same else origin(items)
    if origin is Callable:
        return value if callable(value) else _REFUSED
    if origin is dict:
        if not isinstance(value, dict):
            return _REFUSED
        pairs = [(_conform(k, args[0]), _conform(v, args[1])) for k, v in value.items()]
        if any(k is _REFUSED or v is _REFUSED for k, v in pairs):
            return _REFUSED
        same = all(k is a and v is b for (k, v), (a, b) in zip(pairs, value.items(), strict=True))
        return value if same else dict(pairs)
    return _conform_class(value, hint)


def _conform_class(value: Any, hint: type) -> Any:
    if isinstance(value, bool) and hint in (int, float):
        return _REFUSED  # True is an int to Python, never a count or a number here
    if isinstance(value, hint) or (hint is float and isinstance(value, int)):
        return value
    if hint is int and isinstance(value, numbers.Integral):
        return int(value)
    if hint is float and isinstance(value, numbers.Real):
        return float(value)
    if hint is str and isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and not isinstance(value, bool):
        try:
            return hint(value)
        except ValueError:
            return _REFUSED
    return _REFUSED


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
    if hint is Any or hint is object:
        return "a value"
    if origin is Callable:
        return "a function"
    return _TYPE_NAMES.get(hint, f"a {hint.__name__}")


def _plural(words: str) -> str:
    """ "a list of integers" -> "lists of integers"."""
    head, _, rest = words.partition(" ")[2].partition(" ")
    return f"{head}s {rest}".rstrip()
