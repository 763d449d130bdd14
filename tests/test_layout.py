"""The repository's layout holds without the editable install: `megagrpo.kernels` is the tracked
link `megagrpo/kernels -> ../kernels`, so a plain clone imports it (and import-graph tools see the
edges), and kernels/ imports nothing but torch, triton and the standard library."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what kernels/ may import besides its own modules (relative imports)
KERNEL_DEPS = {"torch", "triton"}

_PLAIN_IMPORT = """
import sys
# drop the editable install's finder: resolve from the clone's files alone
sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                 and "editable" not in getattr(f, "__name__", "").lower()]
sys.path.insert(0, sys.argv[1])
import megagrpo.kernels as k
print(k.__file__)
print(k.vocab_parallel_logprob.__module__)
"""


def test_kernels_resolve_from_a_plain_clone(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    mode = subprocess.run(["git", "ls-files", "-s", "megagrpo/kernels"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.split()
    assert mode and mode[0] == "120000", "megagrpo/kernels must be a tracked link to ../kernels"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", _PLAIN_IMPORT, str(clone)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    path, module = out.stdout.split()
    assert Path(path).resolve() == (clone / "kernels" / "__init__.py").resolve()
    assert module == "megagrpo.kernels.logprob"


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_kernels_import_only_torch_and_triton():
    for path in sorted((ROOT / "kernels").glob("*.py")):
        foreign = {n for n in _top_level_imports(path)
                   if n not in KERNEL_DEPS and n not in sys.stdlib_module_names
                   and n != "__future__"}
        assert not foreign, f"{path.name} imports {sorted(foreign)}"


def test_ruff_clean_with_the_kernels_banned_imports():
    """kernels/ruff.toml bans megagrpo/megatron/vllm/transformers imports there (TID251)."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "megagrpo", "kernels", "tests",
                          "benchmarks", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]
    probe = "from megagrpo.config import AlgoConfig\n\nprint(AlgoConfig)\n"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--stdin-filename",
                          "kernels/_probe.py", "-"], cwd=ROOT, input=probe,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "TID251" in out.stdout, out.stdout
