"""Generated tables in the docs: a table pasted between its two markers must be exactly the
one its generator prints now, rows and all (none typed in by hand, none left out)."""
from __future__ import annotations

from pathlib import Path


def table_lines(text: str) -> list[str]:
    """The markdown table lines ('|' first) of `text`."""
    return [ln for ln in text.splitlines() if ln.startswith("|")]


def between(doc: Path, start: str, end: str) -> str:
    """The text of `doc` from the line holding marker `start` to the next holding `end`."""
    text = doc.read_text()
    i = text.index(start)
    return text[i:text.index(end, i)]


def body_rows(lines: list[str]) -> list[str]:
    """Table lines without the header lines (a separator `|---` and the line above it)."""
    heads = {i for i, ln in enumerate(lines) if ln.startswith("|---")}
    return [ln for i, ln in enumerate(lines) if i not in heads and i + 1 not in heads]


def assert_generated_table(doc: Path, start: str, end: str, generated: str) -> None:
    """The table between `doc`'s markers is `generated`'s table (its body rows only where the
    generator prints no header), and it has rows."""
    want = table_lines(generated)
    assert body_rows(want), f"the generator made no rows:\n{generated}"
    got = table_lines(between(doc, start, end))
    if not any(ln.startswith("|---") for ln in want):
        got = body_rows(got)
    assert got == want, f"{doc.name} between {start!r} and {end!r} is not the generated table"
