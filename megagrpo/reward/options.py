"""A reward source's own options (`reward.options`, or `reward.sources[i].options`) read into
the source's small options dataclass: unknown keys, missing required keys and wrong types are
errors naming the field (`reward.options.url`), raised in the preflight before any compute."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, TypeVar

from megagrpo.config.schema import coerce

T = TypeVar("T")

WHERE = "reward.options"
"""The dotted prefix a single source's option errors name."""


def parse_options(cls: type[T], options: dict, where: str = WHERE) -> T:
    """`cls(**options)`, each value checked against its annotation; then `cls.check(where)`
    when the class defines it. Raises ValueError naming `where.key`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in options:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{where}.{key}: unknown option{hint}; this source takes "
                             f"{sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in options
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}.{missing[0]} is required: set it in the recipe")
    values: dict[str, Any] = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in options.items()}
    out = cls(**values)
    check = getattr(out, "check", None)
    if check is not None:
        check(where)
    return out
