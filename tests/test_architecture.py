"""The package's structure as the design states it (docs/architecture.md), measured from the
source by scripts/structure.py: no import cycle at all, counting imports inside functions and
under `if TYPE_CHECKING`, none between subpackages, and a Trainer that receives its parts
(nothing set on it from outside trainer.py). And the structure script's own arithmetic on a
planted package."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import structure  # noqa: E402


def test_no_import_cycle_and_nothing_set_on_the_trainer_from_outside():
    f = structure.figures()
    assert f["module_cycles"] == [], f["module_cycles"]
    assert f["package_cycles"] == [], f["package_cycles"]
    assert f["trainer_set_from_outside"] == [], f["trainer_set_from_outside"]


def _layers() -> dict[str, int]:
    """{package or top-level module: its row} of docs/architecture.md's layer table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | what it holds |"):].split("\n\n")[0]
    rows = [line for line in table.splitlines()[2:] if line.strip().startswith("|")]
    return {name.strip().strip("`/"): i for i, row in enumerate(rows)
            for name in row.split("|")[1].split(",")}


def test_imports_follow_the_documented_layers():
    """Every package and top-level module has a row in docs/architecture.md's layer table, and
    each imports only from its own row or rows above it (the table is the design; an import
    that goes upwards, say model/ -> train/, fails here even before it closes a cycle)."""
    layers = _layers()
    f = structure.figures()
    names = {m.split(".", 1)[1] for m in f["top_level_modules"] + f["subpackages"]}
    assert names - {"__main__"} <= set(layers), sorted(names - {"__main__"} - set(layers))
    upward = sorted(f"{a} -> {b}" for a, deps in f["package_graph"].items() if "." in a
                    for b in deps if "." in b
                    if layers[b.split(".", 1)[1]] > layers.get(a.split(".", 1)[1], 99))
    assert upward == [], upward


def test_top_level_is_small():
    """The subsystems are folders: at most ten modules directly in megagrpo/."""
    assert len(structure.figures()["top_level_modules"]) <= 10


def test_every_package_is_installed():
    """setuptools finds the packages (none listed by hand): each folder with an __init__.py."""
    from setuptools import find_packages

    found = set(find_packages(str(ROOT), include=["megagrpo*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "megagrpo").rglob("__init__.py")}
    assert folders <= found, folders - found


def test_structure_counts_a_planted_package(tmp_path):
    """A cycle hidden in a function and one under TYPE_CHECKING are both found; a module
    importing its own package is not a cycle; `tr.x = ...` outside the trainer is counted."""
    pkg = tmp_path / "megagrpo"
    (pkg / "sub").mkdir(parents=True)
    for f, text in {
        "__init__.py": "",
        "a.py": "def f():\n    from megagrpo import b\n",
        "b.py": "from megagrpo.a import f\n",
        "c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from megagrpo.sub.d import x\n"),
        "sub/__init__.py": "from megagrpo.sub.d import x\n",
        "sub/d.py": "from megagrpo import sub\nimport megagrpo.c\nx = 1\n",
        "trainer.py": "",
        "run.py": "def g(tr):\n    tr.watchdog = 1\n    return tr.cfg.rollout\n",
    }.items():
        (pkg / f).write_text(text)
    mods = structure.modules(pkg)
    graph = structure.imports(mods)
    assert structure.cycles(graph) == [["megagrpo.a", "megagrpo.b"],
                                       ["megagrpo.c", "megagrpo.sub.d"]]
    assert structure.cycles({p: d for p, d in structure.package_graph(graph).items()
                             if "." in p}) == [["megagrpo.a", "megagrpo.b"],
                                               ["megagrpo.c", "megagrpo.sub"]]
    assert structure.outside_sets(mods) == ["megagrpo.run:2 tr.watchdog"]
    assert structure.tr_paths(pkg / "run.py") == ["tr.cfg.rollout", "tr.watchdog"]


def test_structure_script_prints_the_figures():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py")],
                         capture_output=True, text=True, check=True).stdout
    assert "module import cycles (every import counted): 0" in out
    assert "subpackages:" in out and "top-level modules in megagrpo/:" in out
