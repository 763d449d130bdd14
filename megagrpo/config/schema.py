"""Typed loading of config dataclasses from the nested dicts YAML gives.

Every value is checked against its field's annotation before any dataclass is built: `int`,
`float` (finite only), `bool`, `str`, `list[X]`, `dict`, nested sections (dataclasses),
`X | None` and `Literal[...]`. Errors name the dotted field, the value and what would be valid,
so a recipe typo fails in the launcher, not after vLLM has started.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any

from megagrpo.config.run import MOVED_RUN_KEYS

# Keys that used to exist, and where their meaning lives now: a recipe that still sets one gets
# told, instead of the setting being silently ignored.
REMOVED_KEYS: dict[str, str] = {
    "rollout.n": "the group size G (completions per prompt) is algo.group_size: set "
                 "algo.group_size instead (rollout.n was documented as G but never used)",
    **{f"run.{old}": f"run's 32 settings were split by concern: it is {new} now (in a recipe, "
                     f"under '{new.split('.')[0]}:')" for old, new in MOVED_RUN_KEYS.items()},
}


def build_dataclass(cls: type, data: Any, where: str) -> Any:
    """Dataclass `cls` from the mapping `data`; `where` is the dotted prefix ('run.', or '' for
    the top level). Unknown, removed and missing keys and ill-typed values raise ValueError."""
    section = where.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ValueError(
            f"{section}={show(data)}: expected a mapping of {cls.__name__} settings "
            f"(key: value lines under '{section}:'), got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}{key}"
        if name in REMOVED_KEYS:
            raise ValueError(f"{name} is no longer a setting: {REMOVED_KEYS[name]}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {where}{close[0]}?" if close else ""
            raise ValueError(f"unknown config key {name!r}; valid keys: {sorted(fields)}{hint}")
        kwargs[key] = coerce(value, hints[key], name)
    missing = [n for n, f in fields.items() if n not in kwargs and _required(f)]
    if missing:
        raise ValueError(f"{where}{missing[0]} is missing: {section} needs "
                         f"{', '.join(where + m for m in missing)}")
    return cls(**kwargs)


def check_instance(obj: Any, where: str = "") -> None:
    """The same type rules for a config built in Python rather than loaded (a NaN learning rate
    or a string where a list is meant passes every range check): raise ValueError naming the
    first ill-typed field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            check_instance(value, name + ".")
        elif isinstance(value, list) and value and all(map(dataclasses.is_dataclass, value)):
            for i, item in enumerate(value):
                check_instance(item, f"{name}[{i}].")
        else:
            coerce(value, hints[f.name], name)


def coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` checked against the annotation `hint` and converted where YAML 1.1 is ambiguous
    ('1e-3' is read as a string, '5' as an int where a float is meant)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), name)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"{name}={show(value)}: use one of {allowed}")
        return value
    if value is None and hint is not Any:
        raise ValueError(f"{name}=null: expected {describe(hint)} (null is not allowed here)")
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, name + ".")
    if origin is list or hint is list:
        return _coerce_list(value, (typing.get_args(hint) or (Any,))[0], name)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}={show(value)}: expected a mapping ({{key: value, ...}}), "
                             f"got {_type_name(value)}")
        return value
    return _coerce_scalar(value, hint, name)


def _coerce_scalar(value: Any, hint: Any, name: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={show(value)}: expected true or false")
        return value
    if hint is int:
        return _to_int(value, name)
    if hint is float:
        return _to_float(value, name)
    if hint is str:
        if not isinstance(value, (str, os.PathLike)):  # a Path, from Python callers
            raise ValueError(f"{name}={show(value)}: expected a string, got {_type_name(value)} "
                             "(quote it in YAML: '...')")
        return value
    return value  # Any or an annotation this loader has no rule for


def _to_int(value: Any, name: str) -> int:
    """Ints as they are, strings of an integer; bools and fractional numbers are errors (8.5
    steps cannot be meant, and YAML reads `true` as a bool, not 1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name}={show(value)}: expected an integer, got {_type_name(value)}")


def _to_float(value: Any, name: str) -> float:
    """Finite numbers only: a NaN or infinite learning rate, temperature or coefficient passes
    every `<`/`>` range check (all comparisons with NaN are false) and poisons the run."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name}={show(value)}: expected a number, got {_type_name(value)}")
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{name}={show(value)}: expected a number") from None
    if not math.isfinite(out):
        raise ValueError(f"{name}={show(value)}: expected a finite number (not NaN or infinity)")
    return out


def _coerce_list(value: Any, item: Any, name: str) -> list:
    if not isinstance(value, list):
        hint = (f" (a bare string would be split into characters: write [{value!r}])"
                if isinstance(value, str) else "")
        raise ValueError(f"{name}={show(value)}: expected {describe(list[item])}, got "
                         f"{_type_name(value)}{hint}")
    return [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]


def _coerce_union(value: Any, arms: tuple, name: str) -> Any:
    if value is None and type(None) in arms:
        return None
    choices = [a for a in arms if a is not type(None)]
    for arm in choices:
        try:
            return coerce(value, arm, name)
        except ValueError:
            continue
    nullable = " or null" if type(None) in arms else ""
    raise ValueError(f"{name}={show(value)}: expected "
                     f"{' or '.join(describe(a) for a in choices)}{nullable}")


def show(value: Any) -> str:
    """A value as the user wrote it in YAML (null, true/false), else its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def describe(hint: Any) -> str:
    """What a value of annotation `hint` looks like, for error messages."""
    origin = typing.get_origin(hint)
    if origin is list:
        args = typing.get_args(hint)
        return f"a list of {_plural(args[0])}" if args else "a list"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} settings"
    return {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string", dict: "a mapping"}.get(hint, str(hint))


def _plural(hint: Any) -> str:
    if dataclasses.is_dataclass(hint):
        return f"mappings ({hint.__name__})"
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        hint, str(hint))


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _type_name(value: Any) -> str:
    return {type(None): "null", dict: "a mapping", list: "a list", str: "a string",
            bool: "a boolean", int: "an integer", float: "a float"}.get(
                type(value), type(value).__name__)
