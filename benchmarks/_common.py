"""What the benchmark scripts share besides timing (_harness) and workloads (_workloads): their
command line's common parts, reading the JSON lines they write, and markdown tables."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The script's argument parser, described by the first line of its docstring `doc`."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0])


def records(path: str | Path) -> list[dict]:
    """The JSON objects of a results file, one per non-blank line, in file order; a clear error
    naming a line that is not JSON."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}, line {i}: not JSON ({e.msg}); every line must be one "
                             "record a benchmark wrote") from None
    return out


def write_lines(path: str | Path, lines: Sequence[str]) -> None:
    """Writes a run's result lines to `path` (replacing it), making its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def run_train(args: Sequence[str], *, nproc: int, name: str, timeout: int) -> float:
    """Runs `megagrpo train --nproc NPROC ARGS` from the repository root (one thread per rank,
    this checkout first on the path, Triton's interpreter off); returns its wall seconds.
    Raises with the log's tail, naming the run `name`, on failure."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "megagrpo", "train", "--nproc", str(nproc), *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{(p.stdout + p.stderr)[-4000:]}")
    return time.monotonic() - t0


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the `header` cells, the separator line, then one line per row of cells
    (each cell printed with `str`; a row has as many cells as the header)."""
    lines = [_row(header), "|" + "---|" * len(header)]
    for cells in rows:
        if len(cells) != len(header):
            raise ValueError(f"a table row has {len(cells)} cells, the header {len(header)}: "
                             f"{cells}")
        lines.append(_row(cells))
    return "\n".join(lines)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def print_table(args: argparse.Namespace, **tables: Callable[[str], str]) -> bool:
    """If one of the table flags named by `tables` (argument name -> the function that makes
    that table from a results file) was given, print its table and return True: the script
    then stops; False when none was given."""
    for flag, make in tables.items():
        path = getattr(args, flag)
        if path:
            print(make(path))
            return True
    return False
