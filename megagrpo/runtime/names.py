"""User code named in a recipe as 'module:attribute' (reward terms, environments, tools)."""
from __future__ import annotations

import importlib


def import_object(spec: str, where: str) -> object:
    """The object 'package.module:attr' names (attr may be dotted: 'Class.method').

    The module is imported like any Python module: it must be on every rank's import path (the
    launch directory or a folder on PYTHONPATH). Each failure is a ValueError starting with
    `where` (e.g. "reward 'my_mod:score'" or "agent.environment='my_mod:Env'")."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{where}: name it as 'module:attribute'")
    try:
        target = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(import_failure(where, module_name, str(e))) from e
    except Exception as e:  # a syntax error or a failing top-level statement in user code
        raise ValueError(f"{where}: importing {module_name!r} raised "
                         f"{type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{where}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def import_failure(where: str, module_name: str, error: str) -> str:
    """The message of a module that cannot be imported: where, which, why and the fix."""
    path = module_name.replace(".", "/")
    return (f"{where}: cannot import module {module_name!r} ({error}); it must be importable by "
            "every rank: run from its folder or put that folder on PYTHONPATH (e.g. "
            f"PYTHONPATH=/path/to/dir for /path/to/dir/{path}.py)")
