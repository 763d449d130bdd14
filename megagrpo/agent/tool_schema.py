"""JSON schemas of tool functions from their type hints and docstrings (the format
`tokenizer.apply_chat_template(tools=...)` renders).

Standard library only, and importable by file path: the sandbox child
(megagrpo.agent.sandbox_child) loads this file to derive a user tool's schema inside the
sandbox, where the user's module is imported; the rank derives the built-ins' schemas with the
same code.
"""
from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable

FIELD = "agent.tools"


def function_schema(fn: Callable[..., object], spec: str) -> tuple[str, dict]:
    """(description, parameters schema) of `fn`; ValueError naming agent.tools and `spec` when a
    parameter has no (supported) type hint, takes *args/**kwargs, or the docstring is missing."""
    doc = inspect.getdoc(fn) or ""
    description = " ".join(doc.split("\n\n")[0].split())
    if not description:
        raise ValueError(f"{FIELD}: tool {spec!r} ({fn.__name__}) has no docstring; its first "
                         "paragraph is the description the model reads")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - an annotation naming something undefined
        raise ValueError(f"{FIELD}: tool {spec!r}: cannot resolve its type hints ({e})") from e
    arg_docs = _arg_docs(doc)
    properties: dict[str, dict] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"{FIELD}: tool {spec!r} ({fn.__name__}) takes {p}; a tool takes "
                             "named parameters only (the model passes a JSON object)")
        if p.name not in hints:
            raise ValueError(f"{FIELD}: tool {spec!r} ({fn.__name__}): parameter {p.name!r} has "
                             "no type hint; every parameter needs one (int, float, str, bool, "
                             "list[...], dict, Literal[...], Optional[...]) for the JSON schema")
        schema = json_type(hints[p.name], f"{spec} parameter {p.name!r}")
        if p.name in arg_docs:
            schema["description"] = arg_docs[p.name]
        properties[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    return description, {"type": "object", "properties": properties, "required": required}


_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def json_type(hint: object, where: str) -> dict:
    """JSON schema of a type hint (a fresh dict)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is list or origin is list:
        return {"type": "array", **({"items": json_type(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin is typing.Literal and args and len({type(a) for a in args}) == 1 \
            and type(args[0]) in _SCALARS:
        return {"type": _SCALARS[type(args[0])], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1 and len(args) == 2:
            inner = json_type(kept[0], where)
            return {**inner, "type": [inner["type"], "null"]}
    raise ValueError(f"{FIELD}: {where}: type hint {hint!r} has no JSON schema here; use int, "
                     "float, str, bool, list[...], dict, Literal[...] or Optional[...]")


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` section."""
    found: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc,
                        re.MULTILINE)
    if section:
        for m in re.finditer(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section.group(1),
                             re.MULTILINE):
            found[m.group(1)] = m.group(2).strip()
    return found
