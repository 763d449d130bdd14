"""Checkpoints: `CheckpointManager` (save / newest intact / load) over the run's Stateful
parts, and the file formats beneath it.

What a checkpoint of step N holds (`out_dir/checkpoints/step_N/`, layout in `megagrpo.run_dir`):
policy/, reference/ and optimizer/ (dist-checkpoints), rng/rank*.safetensors and
rollout/rank*.safetensors (per rank, no pickle: every random stream; the async batch drawn for
the next step), trainer_state.json (`Trainer.state_dict()`: counters, loader position,
reference schedule; plus the layout and the metrics history length), and last the manifest
that marks it complete.

Models and optimizer: megatron-core's `dist_checkpointing` format, resharding on load (save at
one TP x PP x DP, load at another), the model config beside them. The optimizer state is
megatron's model-space format (`save_optimizer`), for the plain and the distributed optimizer.
What is per rank (RNG streams, the async batch's samples) carries over only to the same layout;
at another one the run continues from the same data position, not bitwise, and says so. Writes
are atomic: everything goes to `DIR.tmp` and is renamed into place only when every rank has
finished, so a crash mid-save never damages the last good checkpoint. Loading reads torch DCP's
`.metadata`, a pickle: only load model checkpoints you trust (HF safetensors directories are the
format for downloads).

Per-rank state (optimizer, RNG streams): `save_tree` / `load_tree` write a nested structure of
tensors and plain values as one safetensors file (tensors) whose metadata holds the structure as
JSON. Nothing is pickled, so loading a crafted file cannot run code.

Writes that fail for lack of space raise `OSError(ENOSPC)` saying "no space left on device" and
where, whatever layer (DCP, torch's C++ writer) saw the failure first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from megagrpo.config.model import ModelConfig
from megagrpo.cpu_compat import megatron_scope
from megagrpo.export import save_tokenizer
from megagrpo.metrics import history_size, rewind_history
from megagrpo.model import unwrap
from megagrpo.optim import use_fused_adam
from megagrpo.rng import RankRng
from megagrpo.run_dir import (
    MANIFEST,
    MODEL_JSON,
    TRAINER_STATE,
    checkpoint_root,
    manifest_bytes,
    newest_intact,
    step_dirs,
    step_of,
    write_manifest,
)

if TYPE_CHECKING:
    from megagrpo.trainer import Trainer

log = logging.getLogger("megagrpo")
# megatron-core is imported where it is used: the launcher's preflight and `plan` read model
# configs through this module and must not pay megatron's ~7 s import.


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=dist.group.WORLD)


@megatron_scope()
def save_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike, model: ModelConfig,
               *, extra: dict | None = None) -> None:
    """Collective: every rank saves its shards of `gpt` into `ckpt_dir` (atomically)."""
    from megatron.core import dist_checkpointing

    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    on_every_rank(lambda: _fresh_dir(tmp) if _rank() == 0 else None, tmp)
    with disk_errors(tmp):  # DCP gathers the ranks' failures: every rank raises together
        dist_checkpointing.save(unwrap(gpt).sharded_state_dict(), str(tmp))
    _barrier()
    on_every_rank(lambda: _publish(tmp, final, model, extra) if _rank() == 0 else None, tmp)


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _publish(tmp: Path, final: Path, model: ModelConfig, extra: dict | None) -> None:
    meta = {"model": dataclasses.asdict(model), **(extra or {})}
    (tmp / MODEL_JSON).write_text(json.dumps(meta, indent=1))
    _swap_in(tmp, final)


def read_model_config(ckpt_dir: str | os.PathLike) -> tuple[ModelConfig, dict]:
    path = Path(ckpt_dir) / MODEL_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a megagrpo model checkpoint")
    meta = json.loads(path.read_text())
    return ModelConfig(**meta.pop("model")), meta


@megatron_scope()
def load_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Collective: loads a checkpoint saved at any TP/PP into this rank's shards of `gpt`."""
    from megatron.core import dist_checkpointing

    inner = unwrap(gpt)
    state = dist_checkpointing.load(inner.sharded_state_dict(), str(ckpt_dir))
    inner.load_state_dict(state, strict=False)


# Optimizer state as megatron's model-space dist-checkpoint: each parameter's Adam moments (and
# fp32 master copy) are saved as tensors shaped like the parameter and keyed by its name, so
# the checkpoint reshards on load like the model does (any TP x PP x DP), for the plain and the
# distributed optimizer alike ('fully_reshardable' gathers the distributed optimizer's shards
# over DP to save and each rank slices its own on load).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                    "chained_optim_avoid_prefix": True}


def _optimizer_sharded(gpt: torch.nn.Module, optimizer, *, is_loading: bool) -> dict:
    model_sd = unwrap(gpt).sharded_state_dict()
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                        metadata=dict(OPTIMIZER_FORMAT))


@megatron_scope()
def save_optimizer(gpt: torch.nn.Module, optimizer, ckpt_dir: str | os.PathLike) -> None:
    """Collective: the optimizer state of `gpt` into `ckpt_dir` (atomically), reshardable."""
    from megatron.core import dist_checkpointing

    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    on_every_rank(lambda: _fresh_dir(tmp) if _rank() == 0 else None, tmp)
    with disk_errors(tmp):
        dist_checkpointing.save(_optimizer_sharded(gpt, optimizer, is_loading=False), str(tmp))
    _barrier()
    on_every_rank(lambda: _swap_in(tmp, final) if _rank() == 0 else None, tmp)


@megatron_scope()
def load_optimizer(gpt: torch.nn.Module, optimizer, ckpt_dir: str | os.PathLike) -> None:
    """Collective: loads optimizer state saved at any layout into this rank's optimizer.
    `gpt` must already hold the checkpoint's weights (the distributed optimizer's fp32 master
    copy is read from the checkpoint, the plain one's from the model)."""
    from megatron.core import dist_checkpointing

    inners = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for inner in inners:
        if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
            # the state tensors must exist before megatron builds the load state dict; the
            # dummy step with zero grads is overwritten by the load (weights included)
            inner._init_optimizer_states_with_dummy_values()
    sharded = _optimizer_sharded(gpt, optimizer, is_loading=True)
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    states = state if isinstance(state, list) else [state] if len(inners) == 1 else \
        [v for _, v in sorted(state.items())]
    with torch.no_grad():
        for inner, part in zip(inners, states, strict=True):
            if "param_state" in part:
                _load_distributed(inner, part)
            else:
                inner.load_state_dict(part)
    use_fused_adam(optimizer)  # a checkpoint written before the switch saved the loop's flags


def _load_distributed(inner, part: dict) -> None:
    """megatron's DistributedOptimizer.load_state_dict, in its two halves. With torch's Adam
    (no Apex/TE: every CPU run) the second half fails on the per-parameter 'step' megatron
    itself put into the state ('step' is not among the loaded tensors), and the first half
    gives every parameter the same 'step' tensor, which torch's Adam then increments once per
    parameter: so the steps are set aside around the tensors' load and given back one tensor
    per parameter."""
    param_state = part.pop("param_state")
    kind = part.pop("param_state_sharding_type")
    if kind != OPTIMIZER_FORMAT["distrib_optim_sharding_type"]:
        raise ValueError(f"optimizer checkpoint in megatron's {kind!r} format; megagrpo writes "
                         f"and reads {OPTIMIZER_FORMAT['distrib_optim_sharding_type']!r}")
    inner.load_state_dict(part)
    steps = {p: s.pop("step") for p, s in inner.optimizer.state.items() if "step" in s}
    inner.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():
        inner.optimizer.state[p]["step"] = step.detach().clone()


def _swap_in(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- failures of a write
_NEARLY_FULL = 64 << 20  # bytes: a write that failed with less than this free ran out of space


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """exc, its causes and contexts, and the per-rank failures a DCP CheckpointException holds."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for f in failures.values():
                f = f[0] if isinstance(f, tuple) and f else f
                if isinstance(f, BaseException):
                    todo.append(f)


def _free_bytes(path: Path) -> tuple[Path, int]:
    """(nearest existing ancestor of path, its filesystem's free bytes)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p, shutil.disk_usage(p).free


def no_space_error(exc: BaseException, path: str | os.PathLike) -> OSError | None:
    """An OSError(ENOSPC) naming `path` when `exc` is (or wraps) a write that ran out of space,
    else None. The layers below rarely say so: torch's C++ writer reports "unexpected pos" or
    "basic_ios::clear", and DCP hands ranks other than the coordinator an empty
    CheckpointException. So: an ENOSPC anywhere in the chain, or a failure while the
    filesystem of `path` is (almost) full."""
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(exc))
    where, free = _free_bytes(Path(path))
    if not (enospc or free < _NEARLY_FULL):
        return None
    total = shutil.disk_usage(where).total
    return OSError(errno.ENOSPC, (
        f"no space left on device while writing {path} ({free >> 20} MiB free of "
        f"{total >> 20} MiB on the filesystem of {where}): free space, lower checkpoint.keep_last "
        "or point run.out_dir at a larger disk; the checkpoints written before are intact"))


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raises a failed write as `no_space_error` when that is what it was."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        err = no_space_error(e, path)
        if err is None:
            raise
        raise err from e


def on_every_rank(fn: Callable[[], object], path: str | os.PathLike) -> None:
    """Collective: runs this rank's part of a write, then agrees on the outcome, so that a rank
    that fails (e.g. out of disk) does not leave the others waiting in the next collective:
    every rank raises, the failing one with its own (translated) error."""
    err: BaseException | None = None
    try:
        with disk_errors(path):
            fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised below
        err = e
    failed = torch.tensor([0.0 if err is None else 1.0])
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    if err is not None:
        raise err
    if failed.item():
        raise RuntimeError(f"writing {path} failed on another rank (its error says why)")


# ---------------------------------------------------------------------- pickle-free state
_TREE_KEY = "megagrpo_tree"


def _encode(obj, tensors: dict[str, torch.Tensor], where: str):
    """JSON-able structure of `obj`; tensors go to `tensors` and are referenced by key."""
    if isinstance(obj, torch.Tensor):
        key = next((k for k, t in tensors.items() if t.data_ptr() == obj.data_ptr()
                    and t.shape == obj.shape and obj.device.type == "cpu"), None)
        if key is None:  # safetensors refuses two keys on one storage: store a repeat once
            key = str(len(tensors))
            tensors[key] = obj.detach().cpu().contiguous()
        return {"t": key}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}.{k}")]
                      for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"u": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"save_tree: {where} is a {type(obj).__name__}; only tensors, dicts, "
                    "lists, tuples, numbers, strings and None are saved")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "t" in obj:
        return tensors[obj["t"]]
    if "u" in obj:
        return tuple(_decode(v, tensors) for v in obj["u"])
    return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["d"]}


def save_tree(path: str | os.PathLike, tree) -> None:
    """Writes a nested structure of tensors and plain values to one safetensors file
    (atomically: a temp file renamed into place)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = json.dumps(_encode(tree, tensors, "state"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with disk_errors(path):
        save_file(tensors, str(tmp), metadata={_TREE_KEY: structure})
        os.replace(tmp, path)


def load_tree(path: str | os.PathLike):
    """The structure `save_tree` wrote (tensors on CPU). Reads only safetensors + JSON."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if _TREE_KEY not in meta:
            raise ValueError(f"{path} was not written by megagrpo's save_tree")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(meta[_TREE_KEY]), tensors)


# ---------------------------------------------------------------------- the manager
class CheckpointManager:
    """Saves, finds and loads the run's checkpoints in run.out_dir/checkpoints (every method is
    a collective). Writes are atomic per part and the manifest, written last, marks a
    checkpoint complete; complete ones beyond checkpoint.keep_last are then removed. Out of
    disk, every rank stops with an error that says so and where."""

    def __init__(self, out_dir: str | os.PathLike, keep_last: int, watchdog=None) -> None:
        self.root = checkpoint_root(out_dir)
        self.out_dir = str(out_dir)
        self.keep_last = keep_last
        self.watchdog = watchdog

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, tr: Trainer) -> Path:
        """Policy + reference (dist-checkpoint, reshardable), per rank the optimizer and every
        RNG stream, the trainer state, and last the manifest."""
        if self.watchdog is not None:
            self.watchdog.set_phase("checkpoint", tr.step_idx)
        final, rank0 = self.path(tr.step_idx), dist.get_rank() == 0
        on_every_rank(partial(self._clear_for_save, final) if rank0 else _nothing, final)
        save_model(tr.policy, final / "policy", tr.model_cfg)
        if tr.reference is not None:
            save_model(tr.reference.model, final / "reference", tr.model_cfg)
        save_optimizer(tr.policy, tr.optimizer, final / "optimizer")
        on_every_rank(partial(self._save_rank_state, tr, final), final)
        on_every_rank(partial(self._finish, tr, final) if rank0 else _nothing, final)
        return final

    @staticmethod
    def _save_rank_state(tr: Trainer, final: Path) -> None:
        """This rank's RNG streams and pending async batch, as safetensors (no pickle)."""
        me = _rank_file()
        save_tree(final / "rng" / me, RankRng(tr.engine).state_dict())
        save_tree(final / "rollout" / me, tr.rollouts.state_dict())

    def _clear_for_save(self, final: Path) -> None:
        """Removes a leftover of the same step (a save a crash interrupted) and checks that the
        disk holds another checkpoint as large as the last one."""
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir(parents=True)
        done = [p for p in step_dirs(self.root) if (p / MANIFEST).exists()]
        need = manifest_bytes(done[-1]) if done else 0
        free = shutil.disk_usage(final).free
        if need > free:
            raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final}: the "
                          f"last one took {need >> 20} MiB, {free >> 20} MiB are free; free "
                          "space, lower checkpoint.keep_last or point run.out_dir at a larger "
                          "disk")

    def _finish(self, tr: Trainer, final: Path) -> None:
        """Rank 0, after every rank wrote its part: trainer state, manifest, pruning."""
        state = dict(tr.state_dict(), world_size=dist.get_world_size(), layout=layout_of(tr),
                     pending_loader=tr.rollouts.pending_loader_state(),
                     metrics_bytes=history_size(self.out_dir))
        tmp = final / (TRAINER_STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, final / TRAINER_STATE)
        save_tokenizer(final / "policy", tr.tokenizer)  # `convert --to-hf` exports it too
        write_manifest(final)  # from here on the checkpoint is complete
        dirs = step_dirs(final.parent)
        kept = [p for p in dirs if (p / MANIFEST).exists() and step_of(p) <= tr.step_idx]
        kept = kept[-self.keep_last:]
        for old in dirs:  # older than every kept one, complete or a broken leftover
            if step_of(old) < step_of(kept[0]):
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest checkpoint that matches its manifest, the same on every rank (rank 0
        checks and tells the others); newer broken ones are named in a warning."""
        step = torch.tensor([-1], dtype=torch.int64)
        if dist.get_rank() == 0:
            ckpt, broken = newest_intact(self.root)
            for path, why in broken:
                log.warning("checkpoint %s is broken and is skipped: %s", path, why)
            step[0] = step_of(ckpt) if ckpt is not None else -1
        dist.broadcast(step, src=0, group=dist.group.WORLD)
        return self.path(int(step)) if int(step) >= 0 else None

    def load(self, tr: Trainer, ckpt: Path) -> dict | None:
        """Restores policy, reference, optimizer, trainer state (data position, schedule
        counters) and every RNG stream from `ckpt`. Returns the RNG state it restored (None when
        it could not be: another layout). Reads no pickle except dist-checkpoint metadata."""
        state = json.loads((ckpt / TRAINER_STATE).read_text())
        load_model(tr.policy, ckpt / "policy")
        if tr.reference is not None and (ckpt / "reference").exists():
            load_model(tr.reference.model, ckpt / "reference")
        me, rank0 = _rank_file(), dist.get_rank() == 0
        saved_layout = state.get("layout") or {"world_size": state["world_size"]}
        same = saved_layout == layout_of(tr) if "layout" in state else \
            state["world_size"] == dist.get_world_size()
        opt_dir, legacy = ckpt / "optimizer", ckpt / "optimizer" / me
        if (opt_dir / "metadata.json").exists():
            load_optimizer(tr.policy, tr.optimizer, opt_dir)
        elif legacy.exists() and same:  # per rank, by an older megagrpo
            tr.optimizer.load_state_dict(load_tree(legacy))
            use_fused_adam(tr.optimizer)
        elif rank0:
            log.warning("resume: optimizer state not restored (%s holds none this layout can "
                        "read); Adam moments restart", opt_dir)
        rng_file, rollout_file = ckpt / "rng" / me, ckpt / "rollout" / me
        rng = load_tree(rng_file) if same and rng_file.exists() else None
        if rng is not None:
            RankRng(tr.engine).load_state_dict(rng)
        keep_pending = same and tr.cfg.run.async_rollout and rollout_file.exists()
        if keep_pending:
            tr.rollouts.load_state_dict(load_tree(rollout_file))
        tr.load_state_dict(state)
        redraw = state.get("pending_loader") is not None and not keep_pending
        if redraw:  # the loader goes back to the async batch, drawn again by this run
            tr.rollouts.loader.load_state_dict(state["pending_loader"])
        if rank0 and not same:
            log.warning("resume at another layout (saved at %s, now %s): the weights and the "
                        "optimizer state are resharded; the per-rank random streams%s do not "
                        "carry over, so the run continues from the same data position but not "
                        "bitwise as it would have uninterrupted", _describe(saved_layout),
                        _describe(layout_of(tr)),
                        " and the async batch drawn for the next step" if redraw else "")
        elif rank0 and redraw:
            log.info("resume: the async batch drawn for step %d is drawn again (run.async_rollout "
                     "is off now)", tr.step_idx + 1)
        if rank0:
            dropped = rewind_history(self.out_dir, state.get("metrics_bytes", 1 << 62))
            log.info("resumed from %s at step %d%s", ckpt, tr.step_idx,
                     f"; dropped {dropped} metrics records written after it" if dropped else "")
        return rng


def layout_of(tr: Trainer) -> dict:
    """What the per-rank parts of a checkpoint depend on: world, TP, PP, DP, vLLM's TP."""
    return {"world_size": dist.get_world_size(), "tp": tr.cfg.parallel.tp,
            "pp": tr.cfg.parallel.pp, "dp": tr.ranks.dp,
            "rollout_tp": tr.cfg.rollout.tensor_parallel_size}


def _describe(layout: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items() if k != "world_size") or \
        f"world size {layout.get('world_size')}"


def _rank_file() -> str:
    return f"rank{dist.get_rank():05d}.safetensors"


def _nothing() -> None:
    """This rank's part of a write that rank 0 does alone."""
