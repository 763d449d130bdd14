"""Makes the registry's torchvision 0.28.0 importable beside torch 2.13.0+cpu (run by
scripts/setup_venv.sh after installing it; idempotent).

Why: the registry serves one Linux x86_64 build of torchvision 0.28.0, a CUDA 13.0 one
(`torchvision.version.__version__` '0.28.0+cu130'): its `torchvision/_C.so` needs
`libtorch_cuda.so` and `libc10_cuda.so`, which the CPU torch build does not have, so the
C++ ops (nms, roi_align, deform_conv2d, ...) do not load. torchvision is written to import
without them (`extension._has_ops()` False, each op then raising "Couldn't load custom C++
ops" when called), except for two fake-tensor registrations in `_meta_registrations.py` that
are not guarded: `torch.library.register_fake("torchvision::nms")` (and `qnms`) raises
"operator torchvision::nms does not exist", so `import torchvision` fails, and with it
`import transformers` paths that use it and vLLM's Qwen2-VL / Qwen2.5-VL model code.

What: those two registrations get the guard the other nine already have (registered only when
the ops loaded). Nothing else changes: the image transforms (pure torch) work, the C++ ops stay
absent and raise torchvision's own error if called (megagrpo calls none). The registry has no
torchvision source distribution to build the ops against this torch (docs/vlm.md).

Refuses (exit 1, saying why) a torchvision other than 0.28.0, or a file whose text is not the
one this patch was written for; checks in a fresh interpreter that `import torchvision` works.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

VERSION = "0.28.0"
OPS = ("nms", "qnms")


def _unguarded(op: str) -> str:
    return f'@torch.library.register_fake("torchvision::{op}")\n'


def _guarded(op: str) -> str:
    return (f'@(torch.library.register_fake("torchvision::{op}") '
            f'if torchvision.extension._has_ops() else (lambda fn: fn))\n')


def patch(text: str) -> str:
    """The patched text of `_meta_registrations.py` (unchanged if already patched)."""
    for op in OPS:
        if text.count(_guarded(op)) == 1 and _unguarded(op) not in text:
            continue
        if text.count(_unguarded(op)) != 1:
            raise SystemExit(f"[patch_torchvision] _meta_registrations.py has no single "
                             f"register_fake of torchvision::{op}: not the torchvision "
                             f"{VERSION} this patch was written for")
        text = text.replace(_unguarded(op), _guarded(op))
    return text


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("[patch_torchvision] torchvision is not installed", file=sys.stderr)
        return 1
    root = Path(spec.origin).parent
    version = (root / "version.py").read_text()
    if f"__version__ = '{VERSION}" not in version:
        print(f"[patch_torchvision] torchvision is not {VERSION} ({root / 'version.py'}): "
              f"install torchvision=={VERSION}, the build for torch 2.13.0", file=sys.stderr)
        return 1
    meta = root / "_meta_registrations.py"
    old = meta.read_text()
    new = patch(old)
    if new != old:
        meta.write_text(new)
        print(f"[patch_torchvision] guarded the nms/qnms fake registrations in {meta}")
    probe = ("import torchvision, torch\n"
             "from torchvision.transforms.v2 import functional as F\n"
             "assert F.resize(torch.zeros(3, 4, 4), [2, 2]).shape == (3, 2, 2)\n"
             "print(torchvision.__version__, 'C++ ops:', torchvision.extension._has_ops())\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if run.returncode:
        print(f"[patch_torchvision] import torchvision still fails:\n{run.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    print(f"[patch_torchvision] torchvision {run.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
