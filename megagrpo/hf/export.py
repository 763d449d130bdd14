"""What makes a megatron -> HF export complete: the tokenizer and its special ids.

A megagrpo model checkpoint (`--to-megatron`, or `policy/` of a training checkpoint) keeps a
snapshot of the tokenizer it was trained with in `<ckpt>/tokenizer/`: the HF tokenizer files
(with the chat template) or the sentencepiece model as `tokenizer.model`, plus
`megagrpo_tokenizer.json` with the bos/eos/pad ids the run used (eos is the id the rollouts
stopped on). `finish_hf_export` puts them into the exported folder: the ids into config.json,
a `generation_config.json` (so `generate` stops at EOS) and the tokenizer files.

`resolve_megatron_dir` lets `convert --from-megatron` take a model checkpoint, a training
checkpoint's step directory (`out_dir/checkpoints/step_N`) or a whole run directory (its newest
intact checkpoint).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from megagrpo.data import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from megagrpo.runtime.run_dir import MODEL_JSON, checkpoint_root, newest_intact, verify

log = logging.getLogger("megagrpo")

TOKENIZER_DIR = "tokenizer"
IDS_FILE = "megagrpo_tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "chat_template.json")
"""A vision-language folder's image (and video) processor files beside the tokenizer's: the
snapshot keeps them, the export returns them (transformers' `AutoProcessor` and vLLM read
`preprocessor_config.json` to turn images into patches)."""
_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def resolve_megatron_dir(path: str | os.PathLike) -> Path:
    """The model checkpoint that `path` names: itself, the `policy/` of a training checkpoint's
    step directory, or the newest intact checkpoint's `policy/` of a run directory. Raises
    FileNotFoundError / ValueError saying what was found instead."""
    p = Path(path).expanduser()
    if (p / MODEL_JSON).exists():
        return p
    if (p / "policy" / MODEL_JSON).exists():
        broken = verify(p)
        if broken is not None and (p / "manifest.json").exists():
            raise ValueError(f"--from-megatron {path}: this checkpoint is damaged ({broken})")
        return p / "policy"
    if checkpoint_root(p).is_dir():
        ckpt, bad = newest_intact(checkpoint_root(p))
        if ckpt is None:
            why = "; ".join(f"{c.name}: {r}" for c, r in bad) or "no step_* directories"
            raise ValueError(f"--from-megatron {path}: a run directory without an intact "
                             f"checkpoint ({why})")
        log.info("--from-megatron %s: newest intact checkpoint %s", path, ckpt.name)
        return ckpt / "policy"
    raise FileNotFoundError(
        f"--from-megatron {path}: not a megagrpo checkpoint (no {MODEL_JSON} in it or in its "
        "policy/ folder, and no checkpoints/ folder): give a `convert --to-megatron` output, a "
        "training checkpoint out_dir/checkpoints/step_N, or a run's out_dir")


def has_hf_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether an HF folder holds tokenizer files (an exported model may have weights only)."""
    return any((Path(folder) / f).exists() for f in _HF_TOKENIZER_FILES)


def special_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """{bos,eos,pad}_token_id of the tokenizer as megagrpo uses it (pad falls back to eos)."""
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id}


def save_tokenizer(ckpt_dir: str | os.PathLike, tokenizer: Tokenizer,
                   generation_config: str | os.PathLike | None = None) -> Path:
    """Writes `<ckpt_dir>/tokenizer/`: the tokenizer's files, its special ids and, when given,
    the source's generation_config.json (kept so an export returns it). Returns the folder."""
    out = Path(ckpt_dir) / TOKENIZER_DIR
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tok.save_pretrained(str(tmp))
        kind = "hf"
        source = Path(getattr(tokenizer, "source", ""))
        for name in PROCESSOR_FILES:
            if source.is_dir() and (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        (tmp / "tokenizer.model").write_bytes(tokenizer.sp.serialized_model_proto())
        kind = "sentencepiece"
    else:
        kind = type(tokenizer).__name__  # ids only: no files this module knows how to write
    if generation_config is not None and Path(generation_config).exists():
        shutil.copyfile(generation_config, tmp / GENERATION_CONFIG)
    (tmp / IDS_FILE).write_text(json.dumps({"kind": kind, **special_ids(tokenizer)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def save_hf_source_tokenizer(ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike) -> bool:
    """`convert --from-hf`: snapshots the source folder's tokenizer (and generation config)
    into the megatron checkpoint. False when the folder has no tokenizer files."""
    if not has_hf_tokenizer(hf_dir):
        return False
    save_tokenizer(ckpt_dir, HFTokenizer(str(hf_dir)), Path(hf_dir) / GENERATION_CONFIG)
    return True


def finish_hf_export(out_dir: str | os.PathLike, ckpt_dir: str | os.PathLike,
                     tokenizer: str = "") -> str:
    """Completes an exported HF folder from the checkpoint's tokenizer snapshot, or from
    `tokenizer` (an HF folder or a .model file) when given: special ids in config.json,
    generation_config.json, tokenizer files. Returns one console line saying what was added."""
    out = Path(out_dir)
    if tokenizer:
        tmp = out / ".tokenizer-snapshot"
        src = save_tokenizer(tmp, load_tokenizer(tokenizer),
                             Path(tokenizer) / GENERATION_CONFIG if Path(tokenizer).is_dir()
                             else None)
    else:
        tmp, src = None, Path(ckpt_dir) / TOKENIZER_DIR
    if not (src / IDS_FILE).exists():
        return (f"note: {ckpt_dir} has no tokenizer snapshot (written by an older megagrpo): "
                "config.json has no bos/eos ids, so generate() will not stop at EOS; pass "
                "--tokenizer DIR|FILE.model to add them")
    ids = json.loads((src / IDS_FILE).read_text())
    copied = [f.name for f in sorted(src.iterdir())
              if f.is_file() and f.name not in (IDS_FILE, GENERATION_CONFIG)]
    for name in copied:
        shutil.copyfile(src / name, out / name)
    _set_ids(out / "config.json", ids)
    _write_generation_config(out, src / GENERATION_CONFIG, ids)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    shown = ", ".join(f"{k.split('_')[0]}={ids[k]}" for k in _SPECIAL)
    files = f"{ids['kind']} tokenizer ({len(copied)} files)" if copied else "no tokenizer files"
    processor = write_default_processor(out)
    return f"added {files}, special ids {shown}, {GENERATION_CONFIG}" + (
        f", {processor}" if processor else "")


def write_default_processor(out: str | os.PathLike) -> str | None:
    """A vision-language export (config.json's model_type qwen2_5_vl) whose snapshot held no
    image processor gets transformers' default Qwen2-VL image processor at the model's patch,
    temporal patch and merge sizes (`preprocessor_config.json`); None when none was needed.
    The snapshot's own file (copied before) wins: it holds the run's pixel limits."""
    out = Path(out)
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("model_type") != "qwen2_5_vl" or (out / PROCESSOR_FILES[0]).exists():
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    v = cfg["vision_config"]
    Qwen2VLImageProcessorPil(patch_size=v["patch_size"], temporal_patch_size=v[
        "temporal_patch_size"], merge_size=v["spatial_merge_size"]).save_pretrained(str(out))
    return f"{PROCESSOR_FILES[0]} (transformers' defaults at the model's patch sizes)"


def _set_ids(config_json: Path, ids: dict) -> None:
    """The ids at config.json's top level, and in a vision-language model's `text_config`
    too (where Qwen2.5-VL's decoder reads them)."""
    cfg = json.loads(config_json.read_text())
    for key in _SPECIAL:
        cfg[key] = ids[key]
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"][key] = ids[key]
    config_json.write_text(json.dumps(cfg, indent=1))


def _write_generation_config(out: Path, source: Path, ids: dict) -> None:
    """The source's generation config when the snapshot kept one, with the run's ids filled
    in where it has none; else a config holding just the ids (greedy by default)."""
    gen = json.loads(source.read_text()) if source.exists() else {}
    for key in _SPECIAL:
        if gen.get(key) is None:
            gen[key] = ids[key]
    gen.setdefault("transformers_version", _transformers_version())
    (out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _transformers_version() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "unknown"
