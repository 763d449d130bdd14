"""benchmarks/ scripts imported by file path (benchmarks/ is not a package), for the tests of
their tables, figures and smallest runs."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support import ROOT

BENCH = ROOT / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (registered as `bench_NAME`), with benchmarks/ on sys.path
    while it loads: the scripts import their shared helpers (_common, _harness, _workloads) as
    siblings."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))
