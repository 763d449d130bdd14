"""The run directory (`run.out_dir`) and what makes a checkpoint in it trustworthy. Standard
library only, so the launcher can check out_dir before any process group or engine starts.

Layout:
  out_dir/.megagrpo-run                  marks a directory megagrpo may clear (run.overwrite)
  out_dir/metrics.jsonl, summary.json, curves.png, tb/, engine/rank*/config.json
  out_dir/checkpoints/step_000006/       policy/, reference/, optimizer/ (dist-checkpoints),
      rng/rank*.safetensors, rollout/rank*.safetensors, trainer_state.json, manifest.json
  out_dir/checkpoints/base_000001/       a LoRA run's frozen base after its first merge
      (a dist-checkpoint with its own manifest.json), shared by the checkpoints that name it

A checkpoint is complete when its manifest.json exists (written last, atomically). The manifest
lists every file of the checkpoint with its size, and a sha256 for the small ones (JSON and
dist-checkpoint metadata), so a truncated shard, a missing file or a damaged metadata file is
found before anything is loaded, and the run falls back to the newest intact checkpoint. A
manifest may also name shared folders beside the checkpoints (`refs`, part name -> folder
relative to the checkpoint, e.g. {"base": "../base_000001"}): the checkpoint is intact only when
they are, by their own manifests; `prune_shared` removes the shared folders no checkpoint names.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

MODEL_JSON = "megagrpo_model.json"  # beside a model checkpoint's shards: its ModelConfig
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RUN_MARKER = ".megagrpo-run"
_HASH_LIMIT = 1 << 20  # files up to 1 MiB also get a sha256 (metadata); shards get their size
_RUN_FILES = ("metrics.jsonl", "checkpoints", "summary.json", "engine")
JOB_ENV = "MEGAGRPO_JOB_ID"  # set by the launcher: one id for every attempt of its torchrun job


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir).expanduser() / "checkpoints"


def step_of(ckpt: Path) -> int:
    """The step number of a `step_000006` directory."""
    return int(ckpt.name.split("_", 1)[1])


def step_dirs(root: Path) -> list[Path]:
    """Every `step_<N>` directory under root (complete or not), oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=step_of)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt: Path, refs: dict[str, str] | None = None) -> dict:
    """Lists every file of `ckpt` (relative path -> size, sha256 when small) in manifest.json,
    written atomically: from then on the checkpoint counts as complete. `refs`: the shared
    folders it uses (part name -> folder relative to `ckpt`). Returns the manifest."""
    files = {}
    for p in _files(ckpt):
        size = p.stat().st_size
        entry: dict = {"size": size}
        if size <= _HASH_LIMIT:
            entry["sha256"] = _sha256(p)
        files[str(p.relative_to(ckpt))] = entry
    manifest = {"format": 1, "files": files, "bytes": sum(e["size"] for e in files.values())}
    if refs:
        manifest["refs"] = dict(refs)
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=0))
    os.replace(tmp, ckpt / MANIFEST)
    return manifest


def verify(ckpt: Path) -> str | None:
    """None when `ckpt` is complete and matches its manifest, and so do the shared folders it
    names (`refs`), else what is wrong with it."""
    path = ckpt / MANIFEST
    if not path.exists():
        return ("no manifest.json: the save did not finish (or an older megagrpo, whose "
                "pickled optimizer files are not loaded, wrote it)")
    try:
        manifest = json.loads(path.read_text())
        files, refs = manifest["files"], manifest.get("refs", {})
    except (ValueError, KeyError, TypeError) as e:
        return f"manifest.json unreadable ({e})"
    reason = _check_files(ckpt, files)
    if reason is not None:
        return reason
    if TRAINER_STATE not in files:
        return f"{TRAINER_STATE} not in the manifest"
    try:
        json.loads((ckpt / TRAINER_STATE).read_text())
    except ValueError as e:
        return f"{TRAINER_STATE} is not valid JSON ({e})"
    for name, rel in refs.items():
        reason = verify_shared(ckpt / rel)
        if reason is not None:
            return f"the {name} it names, {rel}: {reason}"
    return None


def verify_shared(folder: Path) -> str | None:
    """None when a shared folder (e.g. a LoRA run's base) matches its own manifest."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except OSError:
        return "missing" if not folder.is_dir() else "no manifest.json"
    except (ValueError, KeyError, TypeError) as e:
        return f"manifest.json unreadable ({e})"
    return _check_files(folder, files)


def _check_files(folder: Path, files: dict) -> str | None:
    """What differs between `folder` and its manifest's `files`, or None."""
    for rel, entry in files.items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} missing"
        size = p.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest says {entry['size']} (truncated?)"
        if "sha256" in entry and _sha256(p) != entry["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (damaged)"
    return None


def refs_of(ckpt: Path) -> dict[str, str]:
    """The shared folders a checkpoint's manifest names (part name -> folder relative to it);
    {} without a readable manifest."""
    try:
        return dict(json.loads((ckpt / MANIFEST).read_text()).get("refs", {}))
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def prune_shared(root: Path, names: list[str]) -> list[Path]:
    """Removes every shared folder `<name>_*` under `root` (leftovers of an interrupted write
    included) that no checkpoint's manifest names; a checkpoint that is kept keeps what it
    uses. Call only between saves. Returns the removed folders."""
    used = {(ckpt / rel).name for ckpt in step_dirs(root) for rel in refs_of(ckpt).values()}
    removed = [p for n in names for p in sorted(root.glob(f"{n}_*"))
               if p.is_dir() and p.name not in used]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def newest_intact(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies, [(newer broken checkpoint, why)]), newest first."""
    broken: list[tuple[Path, str]] = []
    for ckpt in reversed(step_dirs(root)):
        reason = verify(ckpt)
        if reason is None:
            return ckpt, broken
        broken.append((ckpt, reason))
    return None, broken


def manifest_bytes(ckpt: Path) -> int:
    """Total bytes of a complete checkpoint's own files, or of a shared folder (0 when
    unknown)."""
    try:
        return int(json.loads((ckpt / MANIFEST).read_text())["bytes"])
    except (OSError, ValueError, KeyError):
        return 0


@dataclass(frozen=True)
class Attempt:
    """Which start of its torchrun job this process is. torchrun's elastic agent
    (`--max-restarts`) restarts every rank of a job with the same command after a rank or a
    node failed; the environment it sets says how many times it has."""

    number: int
    """TORCHELASTIC_RESTART_COUNT: 0 = the first start (also outside torchrun)."""
    max_restarts: int
    """TORCHELASTIC_MAX_RESTARTS: torchrun's --max-restarts (0 outside torchrun)."""
    job: str
    """What identifies the job over its restarts: MEGAGRPO_JOB_ID (the launcher sets a fresh
    one) or torchrun's run id (--rdzv-id; --standalone makes a random one); '' when neither
    tells one job from another (torchrun's default run id 'none')."""


def this_attempt() -> Attempt:
    """The attempt of this process, from torchrun's environment."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = os.environ.get(JOB_ENV) or ("" if run_id in ("", "none") else f"torchrun:{run_id}")
    return Attempt(number=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                   max_restarts=int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0),
                   job=job)


def _marked_job(out: Path) -> str:
    """The job the out_dir's marker names ('' for none, or a marker of an older megagrpo)."""
    try:
        return str(json.loads((out / RUN_MARKER).read_text()).get("job", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def restarts_own_run(out_dir: str, attempt: Attempt) -> bool:
    """True when this process is a torchrun restart of the job that started the run in
    out_dir: whatever is there, this job wrote it, so it resumes from its newest intact
    checkpoint (whatever run.resume says) or, with none complete yet, starts over."""
    return attempt.number > 0 and bool(attempt.job) and \
        _marked_job(Path(out_dir).expanduser()) == attempt.job


def _is_run_dir(out: Path) -> bool:
    return (out / RUN_MARKER).exists() or any((out / f).exists() for f in _RUN_FILES)


def _clear(out: Path) -> None:
    """Empties out_dir but its marker (other ranks read the job it names meanwhile)."""
    for entry in out.iterdir():
        if entry.name == RUN_MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def prepare_out_dir(out_dir: str, *, resume: bool, overwrite: bool, rank: int = 0,
                    attempt: Attempt | None = None) -> str:
    """Before a run writes anything: refuses an out_dir that holds an earlier run unless the run
    resumes from an intact checkpoint there (run.resume) or may delete it (run.overwrite, which
    clears it on rank 0). With both set, resume wins where an intact checkpoint exists (a crashed
    run rerun with its recipe must not delete its own checkpoints), and the returned line says so
    for the console ('' otherwise). Creates out_dir and its marker. Raises ValueError naming the
    fix. Safe to call on every rank before torch.distributed starts: only rank 0 writes, and no
    rank writes into out_dir before all ranks have met in init_distributed. `attempt`: a
    torchrun restart of the job that started the run here resumes it, or starts over when no
    checkpoint is complete yet (`restarts_own_run`), and says so; the marker records the job."""
    out = Path(out_dir).expanduser()
    attempt = attempt or Attempt(number=0, max_restarts=0, job="")
    if out.exists() and not out.is_dir():
        raise ValueError(f"run.out_dir={out_dir!r} is a file, not a directory")
    held = sorted(p.name for p in out.iterdir() if p.name != RUN_MARKER) if out.exists() else []
    own = restarts_own_run(out_dir, attempt)
    resume, overwrite = (True, True) if own else (resume, overwrite)
    said = ""
    ckpt, broken = newest_intact(checkpoint_root(out)) if held and resume else (None, [])
    if own:
        which = (f"resuming from its newest intact checkpoint {ckpt}" if ckpt is not None else
                 "no checkpoint of it is complete yet: starting over")
        said = (f"torchrun restart {attempt.number} of at most {attempt.max_restarts} "
                f"(job {attempt.job}): {which}")
        overwrite = ckpt is None
    elif overwrite and ckpt is not None:
        overwrite = False
        said = (f"run.resume and run.overwrite are both true: resuming from the intact "
                f"checkpoint {ckpt} (nothing deleted); set run.resume=false to start over")
    if held and overwrite:
        if not _is_run_dir(out):
            raise ValueError(f"run.overwrite=true would delete {held[:5]} in run.out_dir="
                             f"{out_dir!r}, which is not a megagrpo run directory: choose "
                             "another run.out_dir")
        if rank == 0:
            _clear(out)
    elif held and resume:
        if ckpt is None:
            why = "; ".join(f"{p.name}: {r}" for p, r in broken) or "it has no checkpoints"
            raise ValueError(
                f"run.out_dir={out_dir!r} holds an earlier run ({', '.join(held[:5])}) but no "
                f"intact checkpoint to resume from ({why}). Set run.overwrite=true to delete it "
                "and start over, or choose another run.out_dir" + _unknown_job(attempt))
    elif held:
        raise ValueError(
            f"run.out_dir={out_dir!r} is not empty ({', '.join(held[:5])}) and run.resume=false: "
            "a new run there would mix its metrics and checkpoints with the old run's. Set "
            "run.resume=true to continue it, run.overwrite=true to delete it and start over, "
            "or choose another run.out_dir")
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / RUN_MARKER).write_text(json.dumps({"job": attempt.job}))
        except OSError as e:
            raise ValueError(f"run.out_dir={out_dir!r} cannot be created or written "
                             f"({e.strerror or e}: {e.filename or out}); choose a folder this "
                             "user may write, e.g. run.out_dir=runs/mine") from None
    return said


def _unknown_job(attempt: Attempt) -> str:
    if attempt.number == 0 or attempt.job:
        return ""
    return (f" (this is torchrun restart {attempt.number}, but nothing tells this job from "
            "another: start it with `python -m megagrpo train`, or give torchrun a --rdzv-id "
            f"unique to the job, or set {JOB_ENV}, so that a restart may start its own run over)")


def check_out_dir(run) -> str:
    """`prepare_out_dir` for a `RunConfig`, as this process's rank (RANK; 0 outside torchrun)
    and attempt."""
    return prepare_out_dir(run.out_dir, resume=run.resume, overwrite=run.overwrite,
                           rank=int(os.environ.get("RANK", "0")), attempt=this_attempt())
