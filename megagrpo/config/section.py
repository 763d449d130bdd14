"""What every config dataclass shares: it can be frozen once the checks before compute passed.

The sections are plain keyword-only dataclasses while a recipe is loaded, overridden and checked
(`load_config`, `TrainConfig.validate`, `megagrpo.preflight`); `megagrpo.run.train` then calls
`freeze`, after which assigning to any field of any section raises `FrozenConfigError` naming the
dotted key. A run therefore uses exactly the settings that were checked: no component can change
one half-way (the lists and mappings inside a section, e.g. rollout.stop, are not deep-frozen).
"""
from __future__ import annotations

import dataclasses


class FrozenConfigError(dataclasses.FrozenInstanceError):
    """Assignment to a frozen config section (an AttributeError)."""


class Section:
    """Base class of the config dataclasses: refuses assignment once `freeze` has run on it."""

    def __setattr__(self, name: str, value: object) -> None:
        where = self.__dict__.get("_frozen_at")
        if where is not None:
            raise FrozenConfigError(
                f"{where}{name}: the config is frozen once the checks before the run passed; "
                f"set it in the recipe or as an override ({where}{name}=...), or build a new "
                "section with dataclasses.replace")
        object.__setattr__(self, name, value)


def freeze(cfg: Section, where: str = ""):
    """Makes `cfg` and every section inside it (list items included) refuse assignment; returns
    `cfg`. `where` is the dotted prefix the errors name ('' for the whole config)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, Section):
                index = f"[{i}]" if isinstance(value, list) else ""
                freeze(item, f"{where}{f.name}{index}.")
    object.__setattr__(cfg, "_frozen_at", where)
    return cfg


def is_frozen(cfg: Section) -> bool:
    return cfg.__dict__.get("_frozen_at") is not None
