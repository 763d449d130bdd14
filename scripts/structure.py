"""The package's structure in figures, from its own source (nothing is imported or run):

- modules at the top level of megagrpo/ and its subpackages (found, not listed);
- import cycles between modules, counting every import: module level, inside functions and
  under `if TYPE_CHECKING` (a cycle hidden by either is still a cycle of the design);
- cycles between subpackages (the top-level modules each count as a package of their own);
- attributes of a Trainer set from outside trainer.py (`tr.x = ...`) and the distinct `tr.`
  paths run.py reaches.

    python scripts/structure.py           # the figures
    python scripts/structure.py --json    # the same, machine-readable

tests/test_architecture.py asserts the figures the design promises (no cycle at all).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megagrpo"


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """{dotted name: file} of every module of the package."""
    out = {}
    for f in sorted(pkg.rglob("*.py")):
        parts = f.relative_to(pkg.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _resolve(name: str, level: int, here: str, is_pkg: bool) -> str:
    if not level:
        return name
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its body}."""
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        is_pkg = f.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, is_pkg)
                subs = [f"{base}.{a.name}" for a in node.names]
                # `from pkg import module` imports the module; `from module import name` it
                targets = [t for t in subs if t in mods] or [base]
            for t in targets:
                while t and t not in mods:  # `from pkg import module` or a name in a module
                    t = t.rpartition(".")[0]
                # a module's own parent packages are not an edge of the design (Python runs
                # them first for any import of the module)
                if t and t != name and t.startswith("megagrpo") and not name.startswith(t + "."):
                    deps.add(t)
        graph[name] = deps
    # `from megagrpo.x import y` also names the package megagrpo.x's parents: drop the
    # root package (its __init__ imports nothing of the tree's)
    for deps in graph.values():
        deps.discard("megagrpo")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def package_of(module: str) -> str:
    """megagrpo.sync.transports.x -> megagrpo.sync; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        p = package_of(m)
        out.setdefault(p, set()).update(package_of(d) for d in deps if package_of(d) != p)
    return out


def outside_sets(mods: dict[str, Path], owner: str = "megagrpo.train.trainer") -> list[str]:
    """`tr.attr = ...` / `trainer.attr = ...` assignments in the package outside `owner`."""
    found = []
    for name, f in mods.items():
        if name == owner:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if (isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name)
                                and el.value.id in ("tr", "trainer")):
                            found.append(f"{name}:{node.lineno} {el.value.id}.{el.attr}")
    return found


def tr_paths(f: Path) -> list[str]:
    """Distinct `tr.a.b` attribute paths a module reaches."""
    paths = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "tr":
                paths.add("tr." + ".".join(reversed(chain)))
    # keep the longest paths only (tr.cfg.rollout covers tr.cfg)
    return sorted(p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths))


def figures() -> dict:
    mods = modules()
    graph = imports(mods)
    top = sorted(m for m, f in mods.items() if m.count(".") == 1 and f.name != "__init__.py")
    subs = sorted(m for m, f in mods.items() if m.count(".") == 1 and f.name == "__init__.py")
    pkg = package_graph(graph)
    return {"top_level_modules": top, "subpackages": subs, "package_graph": pkg,
            "module_cycles": cycles(graph),
            "package_cycles": cycles({p: d for p, d in pkg.items() if "." in p}),
            "trainer_set_from_outside": outside_sets(mods),
            "run_tr_paths": tr_paths(PKG / "run.py") if (PKG / "run.py").exists() else [],
            "trainer_lines": (len((PKG / "train" / "trainer.py").read_text().splitlines())
                              if (PKG / "train" / "trainer.py").exists() else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    f = figures()
    if ap.parse_args().json:
        print(json.dumps(f, indent=1))
        return
    print(f"top-level modules in megagrpo/: {len(f['top_level_modules'])} "
          f"({', '.join(m.split('.')[-1] for m in f['top_level_modules'])})")
    print(f"subpackages: {len(f['subpackages'])} "
          f"({', '.join(m.split('.')[-1] for m in f['subpackages'])})")
    print(f"module import cycles (every import counted): {len(f['module_cycles'])}")
    for c in f["module_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"cycles between packages: {len(f['package_cycles'])}")
    for c in f["package_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"Trainer attributes set outside trainer.py: {len(f['trainer_set_from_outside'])}")
    for s in f["trainer_set_from_outside"]:
        print("  " + s)
    print(f"distinct tr. paths in run.py: {len(f['run_tr_paths'])}; "
          f"trainer.py lines: {f['trainer_lines']}")


if __name__ == "__main__":
    main()
