"""The config reference (docs/config.md), generated from the config dataclasses.

Each field's description is the string literal that follows it in the class body (read with
`ast`, since Python keeps no runtime trace of it); a section's intro is its class docstring.

    python -m megagrpo.config.docs                         # print the reference
    python -m megagrpo.config.docs --write docs/config.md  # replace the block between the markers
    python -m megagrpo.config.docs --check docs/config.md  # exit 1 when that block is stale
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing
from pathlib import Path

from megagrpo.config.data import RewardSourceConfig, RewardTermConfig
from megagrpo.config.train import TrainConfig

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
# Dataclasses held in lists: documented as `section.field[].sub` rows after their section.
NESTED = {("reward", "terms"): RewardTermConfig, ("reward", "sources"): RewardSourceConfig}


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One row of the reference."""

    key: str
    """Dotted name as written in a recipe or override (`algo.beta`)."""
    type: str
    """The annotation as written in the source."""
    default: str
    """The default, formatted as a YAML/JSON value ('required' when there is none)."""
    doc: str
    """The field's docstring ('' when missing)."""


def field_docstrings(cls: type) -> tuple[str, dict[str, tuple[str, str]]]:
    """(class docstring, {field: (annotation source, docstring)}) read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    out: dict[str, tuple[str, str]] = {}
    body = node.body
    for stmt, nxt in zip(body, [*body[1:], None]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            doc = ""
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                doc = " ".join(nxt.value.value.split())
            out[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return " ".join((ast.get_docstring(node) or "").split()), out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return json.dumps(value)


def section_fields(cls: type, prefix: str) -> list[FieldDoc]:
    """Rows for every field of `cls`, keys prefixed with `prefix` (e.g. 'algo.')."""
    _, docs = field_docstrings(cls)
    rows = []
    for f in dataclasses.fields(cls):
        annotation, doc = docs.get(f.name, (str(f.type), ""))
        rows.append(FieldDoc(key=prefix + f.name, type=annotation, default=_default(f), doc=doc))
    return rows


def sections() -> list[tuple[str, type, list[FieldDoc]]]:
    """(section name, its dataclass, rows) in TrainConfig's order, nested list items included."""
    hints = typing.get_type_hints(TrainConfig)
    out = []
    for f in dataclasses.fields(TrainConfig):
        cls = hints[f.name]
        rows = section_fields(cls, f"{f.name}.")
        for (section, name), item_cls in NESTED.items():
            if section == f.name:
                rows += section_fields(item_cls, f"{section}.{name}[].")
        out.append((f.name, cls, rows))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The Markdown reference (without the markers)."""
    lines = [("Generated from `megagrpo/config/*.py` by `python -m megagrpo.config.docs --write "
             "docs/config.md`; do not edit by hand. Every key can be set in a recipe or "
             "overridden on the command line as `section.key=value` (values parsed as YAML).")]
    for name, cls, rows in sections():
        intro, _ = field_docstrings(cls)
        lines += ["", f"## `{name}`", "", intro, "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        lines += [f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.doc)} |"
                  for r in rows]
    return "\n".join(lines) + "\n"


def splice(text: str, block: str) -> str:
    """`text` with the part between the START and END markers replaced by `block`."""
    if START not in text or END not in text or text.index(START) > text.index(END):
        raise ValueError(f"markers {START} ... {END} not found (in that order)")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megagrpo.config.docs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", help="update the marked block in place")
    group.add_argument("--check", metavar="FILE", help="exit 1 when the marked block is stale")
    args = ap.parse_args(argv)
    block = render()
    if not (args.write or args.check):
        print(block, end="")
        return 0
    path = Path(args.write or args.check)
    text = path.read_text()
    updated = splice(text, block)
    if args.check:
        if updated != text:
            print(f"{path}: config reference is stale; run python -m megagrpo.config.docs "
                  f"--write {path}", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
