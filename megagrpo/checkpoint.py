"""Checkpoints: `CheckpointManager` (save / newest intact / load) over the run's `states`, a
mapping of named Stateful parts, and the file formats beneath it.

Each part says how it is kept (`megagrpo.run.checkpoint_states` builds the run's mapping):
- resharded (`ModelState`, `OptimizerState`): megatron ShardedTensors in a dist-checkpoint
  folder `<name>/`, loadable at another TP x PP x DP: policy/, reference/, optimizer/;
- per rank (`PerRank`): one pickle-free safetensors file per rank, `<name>/rank<R>.safetensors`,
  restored only at the same layout: rng/ (every random stream), rollout/ (the async batch drawn
  for the next step);
- replicated (`Replicated`): JSON, the same on every rank: trainer_state.json holds
  `Trainer.state_dict()` (counters, loader position, reference schedule) plus the manager's
  own keys (the layout, the metrics history's length);
- shared (`Shared`, resharded too): a part that rarely changes, a LoRA run's frozen base
  (`megagrpo.lora.checkpoint`), in a folder of its own beside the checkpoints,
  `checkpoints/<name>_<version>/`, written only when its version moved (after a merge) and
  named by each checkpoint's manifest (`refs`); a kept checkpoint keeps the folder it names;
and last the manifest that marks the checkpoint complete (layout in `megagrpo.runtime.run_dir`).

Models and optimizer: megatron-core's `dist_checkpointing` format, resharding on load (save at
one TP x PP x DP, load at another), the model config beside them. The optimizer state is
megatron's model-space format (`save_optimizer`), for the plain and the distributed optimizer.
At another layout the run continues from the same data position, not bitwise, and says so.
Writes are atomic: everything goes to `DIR.tmp` and is renamed into place only when every rank
has finished, so a crash mid-save never damages the last good checkpoint. Loading reads torch
DCP's `.metadata`, a pickle: only load model checkpoints you trust (HF safetensors directories
are the format for downloads).

Per-rank state (RNG streams, the async batch): `save_tree` / `load_tree` write a nested
structure of tensors and plain values as one safetensors file (tensors) whose metadata holds
the structure as JSON. Nothing is pickled, so loading a crafted file cannot run code.

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.hf.export import save_tokenizer
from megagrpo.model.gpt import unwrap
from megagrpo.model.optim import use_fused_adam
from megagrpo.runtime.cpu_compat import megatron_scope
from megagrpo.runtime.metrics import history_size, rewind_history
from megagrpo.runtime.procs import watched_checkpoint_queue
from megagrpo.runtime.run_dir import (
    MANIFEST,
    MODEL_JSON,
    TRAINER_STATE,
    checkpoint_root,
    manifest_bytes,
    newest_intact,
    prune_shared,
    refs_of,
    step_dirs,
    step_of,
    write_manifest,
)
from megagrpo.runtime.writers import WriterDied, watch_writers

log = logging.getLogger("megagrpo")
# megatron-core is imported where it is used: the launcher's preflight and `plan` read model
# configs through this module and must not pay megatron's ~7 s import.


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=dist.group.WORLD)


# ---------------------------------------------------------------------- resharded parts
class ModelState:
    """A megatron model's weights (the policy, the reference) as a resharded part: its sharded
    state dict goes into a dist-checkpoint folder that loads at any TP x PP, beside it the
    ModelConfig (megagrpo_model.json, with `extra`) and, when given, the tokenizer (so that
    `convert --to-hf` exports it)."""

    reshards: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, config: ModelConfig | None, *,
                 tokenizer=None, extra: dict | None = None, if_missing: str | None = None,
                 select: Callable[[str], bool] | None = None):
        self.model, self.config, self.tokenizer, self.extra = model, config, tokenizer, extra
        self.if_missing = if_missing
        """None: a checkpoint must hold it; '': skipped quietly when absent; else the warning's
        last words when absent."""
        self.select = select
        """None: every tensor of the model; else which keys of its sharded state dict (a LoRA
        policy saves its adapters and its frozen base as two parts)."""

    def state_dict(self) -> dict:
        """megatron ShardedTensors of this rank's shards (those `select` keeps)."""
        sd = unwrap(self.model).sharded_state_dict()
        return sd if self.select is None else {k: v for k, v in sd.items() if self.select(k)}

    def load_template(self) -> dict:
        return self.state_dict()

    def load_state_dict(self, state: dict) -> None:
        unwrap(self.model).load_state_dict(state, strict=False)

    def meta(self) -> dict:
        """What megagrpo_model.json holds: the config and `extra`."""
        return {"model": dataclasses.asdict(self.config), **(self.extra or {})}

    def write_beside(self, folder: Path) -> None:
        """Rank 0, before the folder is published: the config (and the tokenizer)."""
        (folder / MODEL_JSON).write_text(json.dumps(self.meta(), indent=1))
        if self.tokenizer is not None:
            save_tokenizer(folder, self.tokenizer)


# Optimizer state as megatron's model-space dist-checkpoint: each parameter's Adam moments (and
# fp32 master copy) are saved as tensors shaped like the parameter and keyed by its name, so
# the checkpoint reshards on load like the model does (any TP x PP x DP), for the plain and the
# distributed optimizer alike ('fully_reshardable' gathers the distributed optimizer's shards
# over DP to save and each rank slices its own on load).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                    "chained_optim_avoid_prefix": True}


class Optimized(Protocol):
    """What holds the policy and its optimizer (`Trainer`: the cold start replaces the
    optimizer, so the part reads the current one when it saves or loads)."""

    policy: torch.nn.Module | list
    optimizer: object


@dataclass
class _Pair:
    policy: torch.nn.Module | list
    optimizer: object


class OptimizerState:
    """megatron's optimizer over the policy as a resharded part (model-space format, plain and
    distributed optimizer alike). Loads after the policy: the distributed optimizer's fp32
    master copy is read from the checkpoint, the plain one's from the model."""

    reshards: ClassVar[bool] = True
    if_missing = "Adam moments restart"

    def __init__(self, owner: Optimized):
        self.owner = owner

    def _sharded(self, *, is_loading: bool) -> dict:
        model_sd = unwrap(self.owner.policy).sharded_state_dict()
        return self.owner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                       metadata=dict(OPTIMIZER_FORMAT))

    def state_dict(self) -> dict:
        return self._sharded(is_loading=False)

    def load_template(self) -> dict:
        for inner in _inner_optimizers(self.owner.optimizer):
            if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
                # the state tensors must exist before megatron builds the load state dict; the
                # dummy step with zero grads is overwritten by the load (weights included)
                inner._init_optimizer_states_with_dummy_values()
        return self._sharded(is_loading=True)

    def load_state_dict(self, state: dict | list) -> None:
        inners = _inner_optimizers(self.owner.optimizer)
        states = state if isinstance(state, list) else [state] if len(inners) == 1 else \
            [v for _, v in sorted(state.items())]
        with torch.no_grad():
            for inner, part in zip(inners, states, strict=True):
                if "param_state" in part:
                    _load_distributed(inner, part)
                else:
                    inner.load_state_dict(part)
        use_fused_adam(self.owner.optimizer)  # the loaded param groups carry the saved flags

    def write_beside(self, folder: Path) -> None:
        """Nothing beside the shards."""


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


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


@megatron_scope()
def save_sharded(part: Sharded, folder: str | os.PathLike) -> None:
    """Collective: every rank saves its shards of `part` into `folder` (atomically: a temp
    folder renamed into place once every rank has written)."""
    from megatron.core import dist_checkpointing

    final = Path(folder)
    tmp = final.with_name(final.name + ".tmp")
    on_every_rank(partial(_fresh_dir, tmp) if _rank() == 0 else _nothing, tmp)
    watched_checkpoint_queue()  # megatron's own queue server would outlive a killed rank
    with disk_errors(tmp):  # DCP gathers the ranks' failures: every rank raises together
        # megatron's own sync save, but with the wait for its writer processes made finite
        request = dist_checkpointing.save(part.state_dict(), str(tmp), async_sharded_save=True)
        watch_writers(request, tmp).execute_sync()
    _barrier()
    on_every_rank(partial(_publish, part, tmp, final) if _rank() == 0 else _nothing, tmp)


@megatron_scope()
def load_sharded(part: Sharded, folder: str | os.PathLike) -> None:
    """Collective: loads a folder saved at any layout into this rank's shards of `part`."""
    from megatron.core import dist_checkpointing

    part.load_state_dict(dist_checkpointing.load(part.load_template(), str(folder)))


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _publish(part: Sharded, tmp: Path, final: Path) -> None:
    part.write_beside(tmp)
    _swap_in(tmp, final)


def save_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike, model: ModelConfig,
               *, extra: dict | None = None) -> None:
    """Collective: every rank saves its shards of `gpt` into `ckpt_dir` (atomically)."""
    save_sharded(ModelState(gpt, model, extra=extra), ckpt_dir)


def load_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Collective: loads a checkpoint saved at any TP/PP into this rank's shards of `gpt`. A
    LoRA run's policy holds the adapters alone and names the folder of its base (written by
    an earlier checkpoint of the run): the base is read from there (`base_folder`)."""
    link = base_folder(ckpt_dir)
    if link is None:
        load_sharded(ModelState(gpt, None), ckpt_dir)
        return
    base, holds = link
    load_sharded(ModelState(gpt, None, select=lambda k: holds not in k), base)
    load_sharded(ModelState(gpt, None, select=lambda k: holds in k), ckpt_dir)


LEGACY_HOLDS = ".lora_"
"""What a linked folder's keys hold where its metadata predates "holds" (LoRA runs wrote the
first linked folders: their adapters' keys)."""


def base_folder(policy_dir: str | os.PathLike) -> tuple[Path, str] | None:
    """A model folder that holds part of a model (a LoRA run's adapters) names, in its
    megagrpo_model.json, the folder of the rest ("base", relative to it) and what names the keys
    it holds itself ("holds"): (that folder, the mark), or None where the folder holds the
    whole model. Raises FileNotFoundError naming it when it is not there (a step folder copied
    without it)."""
    path = Path(policy_dir) / MODEL_JSON
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if not (rel := meta.get("base")):
        return None
    base = Path(policy_dir) / rel
    if not (base / MODEL_JSON).exists():
        raise FileNotFoundError(
            f"{policy_dir} holds part of a model (a LoRA run's adapters); the rest, its base "
            f"weights, is in {rel} (= {base.resolve()}), written by an earlier checkpoint of the "
            "run, and that folder is missing: copy it beside the step folder (checkpoints/ "
            "keeps both)")
    return base, meta.get("holds", LEGACY_HOLDS)


def read_model_config(ckpt_dir: str | os.PathLike) -> tuple[ModelConfig, dict]:
    path = Path(ckpt_dir) / MODEL_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a megagrpo model checkpoint")
    meta = json.loads(path.read_text())
    return ModelConfig(**meta.pop("model")), meta


def save_optimizer(gpt: torch.nn.Module, optimizer, ckpt_dir: str | os.PathLike) -> None:
    """Collective: the optimizer state of `gpt` into `ckpt_dir` (atomically), reshardable."""
    save_sharded(OptimizerState(_Pair(gpt, optimizer)), ckpt_dir)


def load_optimizer(gpt: torch.nn.Module, optimizer, ckpt_dir: str | os.PathLike) -> None:
    """Collective: loads optimizer state saved at any layout into this rank's optimizer.
    `gpt` must already hold the checkpoint's weights (the distributed optimizer's fp32 master
    copy is read from the checkpoint, the plain one's from the model)."""
    load_sharded(OptimizerState(_Pair(gpt, optimizer)), ckpt_dir)


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
class Stateful(Protocol):
    """What a checkpoint is made of: an object that gives and takes its state."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Sharded(Stateful, Protocol):
    """A resharded part (`ModelState`, `OptimizerState`): `state_dict()` holds megatron
    ShardedTensors, saved as one dist-checkpoint folder `<name>/` that loads at any layout."""

    reshards: ClassVar[bool]
    if_missing: str | None

    def load_template(self) -> dict: ...

    def write_beside(self, folder: Path) -> None: ...


@dataclass
class PerRank:
    """A part held per rank (random streams, the async batch drawn ahead): one pickle-free
    safetensors file per rank, `<name>/rank<R>.safetensors`, restored only at the layout it
    was saved at."""

    part: Stateful
    what: str
    """What it holds, for the console (e.g. 'the random streams')."""
    restore: bool = True
    """False: saved, but not put back by this run (e.g. the async batch when run.async_rollout
    is off now)."""
    reshards: ClassVar[bool] = False


@dataclass
class Replicated:
    """JSON-able state that is the same on every rank (counters, data position, schedules):
    rank 0 writes it into trainer_state.json, keys at the top level, and every rank reads it.
    Loaded after the per-rank parts (it may depend on what they restored)."""

    part: Stateful
    reshards: ClassVar[bool] = True


class Shared(Sharded, Protocol):
    """A resharded part that rarely changes (a LoRA run's frozen base:
    `megagrpo.lora.checkpoint.BaseWeights`), kept beside the checkpoints in
    `checkpoints/<name>_<version:06d>/` (a dist-checkpoint with its own manifest), written only
    when `version()` names a folder other than `written`, the one the manager last wrote or
    loaded; each checkpoint's manifest names the folder it uses."""

    shared: ClassVar[bool]
    written: str | None
    """The folder (name under checkpoints/) that holds the part's current state, or None."""
    inside: str
    """Where checkpoints written before the part was shared held it (a folder of theirs)."""

    def version(self) -> int: ...


def _is_shared(part: object) -> bool:
    return bool(getattr(part, "shared", False))


Part = Sharded | PerRank | Replicated | Shared


class CheckpointManager:
    """Saves, finds and loads the run's checkpoints in run.out_dir/checkpoints over `states`,
    a mapping of named Stateful parts (every method is a collective); the names are the parts'
    places on disk. A save writes the resharded parts, in the mapping's order (a model before
    its optimizer; a shared part, in its own folder, only when its version moved), then the
    per-rank ones, then trainer_state.json and last the manifest that marks the checkpoint
    complete; complete ones beyond checkpoint.keep_last are then removed, and the shared
    folders none of the rest names. A load reads them in the same order. Writes are atomic per
    part. Out of disk, every rank stops with an error that says so and where."""

    def __init__(self, out_dir: str | os.PathLike, keep_last: int, states: Mapping[str, Part],
                 *, layout: dict, watchdog=None) -> None:
        """`layout`: what the per-rank parts depend on (`layout_of`); they are restored only
        from a checkpoint saved at the same one."""
        self.root = checkpoint_root(out_dir)
        self.out_dir = str(out_dir)
        self.keep_last = keep_last
        self.states = dict(states)
        self.layout = layout
        self.watchdog = watchdog

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def _sharded(self) -> list[tuple[str, Sharded | Shared]]:
        return [(n, p) for n, p in self.states.items()
                if not isinstance(p, (PerRank, Replicated))]

    def _per_rank(self) -> list[tuple[str, PerRank]]:
        return [(n, p) for n, p in self.states.items() if isinstance(p, PerRank)]

    def _replicated(self) -> list[Replicated]:
        return [p for p in self.states.values() if isinstance(p, Replicated)]

    def save(self, step: int) -> Path:
        """Writes checkpoint `step` of every part in `states`; returns its folder. A shared
        part is written (first, into its own folder) only when its version moved."""
        if self.watchdog is not None:
            self.watchdog.set_phase("checkpoint", step)
        final, rank0 = self.path(step), _rank() == 0
        refs = {name: self._shared_folder(name, part) for name, part in self._sharded()
                if _is_shared(part)}
        fresh = [f for name, f in refs.items() if self.states[name].written != f.name]
        on_every_rank(partial(self._clear_for_save, final, fresh) if rank0 else _nothing, final)
        try:
            for name, part in self._sharded():
                if name not in refs:
                    save_sharded(part, final / name)
                elif refs[name] in fresh:
                    save_sharded(part, refs[name])  # atomic: named by no checkpoint until done
                    part.written = refs[name].name
        except WriterDied as e:
            raise WriterDied(self._incomplete(step, final, e)) from None
        on_every_rank(partial(self._save_per_rank, final), final)
        on_every_rank(partial(self._finish, step, final,
                              {n: f"../{f.name}" for n, f in refs.items()})
                      if rank0 else _nothing, final)
        return final

    def _incomplete(self, step: int, final: Path, err: WriterDied) -> str:
        """What a save a dead writer stopped says: which step, that it is incomplete, what is
        intact and how to go on."""
        done = [p for p in step_dirs(self.root) if (p / MANIFEST).exists() and p != final]
        kept = (f"the previous complete checkpoint, {done[-1]}, is intact" if done else
                "no earlier checkpoint is complete, so a rerun starts over")
        return (f"checkpoint of step {step} is incomplete: {err}. {final} has no {MANIFEST}, "
                f"so no resume takes it for a checkpoint; {kept}. Run the same command again "
                "(or run under torchrun --max-restarts N / `megagrpo train --max-restarts N`) "
                "to resume from the newest intact checkpoint")

    def _shared_folder(self, name: str, part: Shared) -> Path:
        return self.root / f"{name}_{part.version():06d}"

    def _save_per_rank(self, final: Path) -> None:
        me = _rank_file()
        for name, entry in self._per_rank():
            save_tree(final / name / me, entry.part.state_dict())

    def _clear_for_save(self, final: Path, fresh: list[Path]) -> None:
        """Removes a leftover of the same step (a save a crash interrupted) and the checkpoints
        that name a shared folder about to be rewritten (`fresh`), and checks that the disk
        holds another checkpoint as large as the last one (with the shared folders it names
        that this save writes again)."""
        shutil.rmtree(final, ignore_errors=True)
        names = {f.name for f in fresh}
        for ckpt in step_dirs(self.root):
            # a folder is rewritten only under a version the run had not reached at the
            # checkpoint it resumed from: whatever names it is left from the crashed attempt
            # (broken, or it would have been resumed from) and must not name the new contents
            if names & {(ckpt / rel).name for rel in refs_of(ckpt).values()}:
                log.warning("removing %s: it names %s, which this run writes again", ckpt,
                            ", ".join(sorted(names)))
                shutil.rmtree(ckpt, ignore_errors=True)
        final.mkdir(parents=True)
        done = [p for p in step_dirs(self.root) if (p / MANIFEST).exists()]
        need = manifest_bytes(done[-1]) if done else 0
        if done and fresh:  # and room for the shared folders once more
            need += sum(manifest_bytes(done[-1] / rel) for rel in refs_of(done[-1]).values())
        free = shutil.disk_usage(final).free
        if need > free:
            raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final}: the "
                          f"last one took {need >> 20} MiB, {free >> 20} MiB are free; free "
                          "space, lower checkpoint.keep_last or point run.out_dir at a larger "
                          "disk")

    def _finish(self, step: int, final: Path, refs: dict[str, str]) -> None:
        """Rank 0, after every rank wrote its part: trainer_state.json (the replicated parts,
        the layout, the metrics history's length), manifest (naming the shared folders the
        checkpoint uses, `refs`), pruning (a shared folder goes with the last checkpoint that
        names it)."""
        state: dict = {}
        for entry in self._replicated():
            state.update(entry.part.state_dict())
        state.update(world_size=dist.get_world_size(), layout=self.layout,
                     metrics_bytes=history_size(self.out_dir))
        tmp = final / (TRAINER_STATE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, final / TRAINER_STATE)
        write_manifest(final, refs)  # from here on the checkpoint is complete
        dirs = step_dirs(final.parent)
        kept = [p for p in dirs if (p / MANIFEST).exists() and step_of(p) <= step]
        kept = kept[-self.keep_last:]
        for old in dirs:  # older than every kept one, complete or a broken leftover
            if step_of(old) < step_of(kept[0]):
                shutil.rmtree(old, ignore_errors=True)
        prune_shared(self.root, [n for n, p in self._sharded() if _is_shared(p)])

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

    def load(self, ckpt: Path) -> dict[str, dict]:
        """Restores every part from `ckpt`: the resharded ones at any layout, the per-rank ones
        at the same layout only (the console says what did not carry over), then the
        replicated ones. Returns the per-rank states it restored, by name. Reads no pickle
        except dist-checkpoint metadata."""
        state = json.loads((ckpt / TRAINER_STATE).read_text())
        rank0 = dist.get_rank() == 0
        refs = refs_of(ckpt)
        for name, part in self._sharded():
            if not _is_shared(part):
                self._load_sharded(name, part, ckpt / name)
            elif name in refs:  # the folder an earlier checkpoint (or this one) wrote
                load_sharded(part, ckpt / refs[name])
                part.written = (ckpt / refs[name]).name
            else:  # written before the part was shared: inside the checkpoint; saved again
                load_sharded(part, ckpt / part.inside)
                part.written = None
        same = state["layout"] == self.layout
        restored = self._load_per_rank(ckpt, same)
        for entry in self._replicated():
            entry.part.load_state_dict(state)
        if rank0 and not same:
            lost = [e.what for _, e in self._per_rank() if e.restore]
            log.warning("resume at another layout (saved at %s, now %s): the weights and the "
                        "optimizer state are resharded; %s do not carry over, so the run "
                        "continues from the same data position but not bitwise as it would "
                        "have uninterrupted", _describe(state["layout"]),
                        _describe(self.layout), " and ".join(lost) or "no per-rank parts")
        if rank0:
            dropped = rewind_history(self.out_dir, state["metrics_bytes"])
            log.info("resumed from %s at step %d%s", ckpt, step_of(ckpt),
                     f"; dropped {dropped} metrics records written after it" if dropped else "")
        return restored

    @staticmethod
    def _load_sharded(name: str, part: Sharded, folder: Path) -> None:
        if (folder / "metadata.json").exists() or part.if_missing is None:
            load_sharded(part, folder)
        elif part.if_missing and dist.get_rank() == 0:
            log.warning("resume: %s state not restored (%s holds none this layout can read); "
                        "%s", name, folder, part.if_missing)

    def _load_per_rank(self, ckpt: Path, same_layout: bool) -> dict[str, dict]:
        """The per-rank parts this rank saved, at the layout they were saved at (a part that
        does not reshard means nothing on another rank of another layout)."""
        me, restored = _rank_file(), {}
        for name, entry in self._per_rank():
            path = ckpt / name / me
            if entry.restore and (same_layout or entry.reshards) and path.exists():
                restored[name] = load_tree(path)
                entry.part.load_state_dict(restored[name])
        return restored


def layout_of(parallel: ParallelConfig, dp: int, rollout_tp: int) -> dict:
    """What the per-rank parts of a checkpoint depend on: world, TP, PP, DP, vLLM's TP, and CP
    when > 1 (absent at cp = 1, as in checkpoints written before CP ran)."""
    layout = {"world_size": dist.get_world_size(), "tp": parallel.tp, "pp": parallel.pp,
              "dp": dp, "rollout_tp": rollout_tp}
    if parallel.cp > 1:
        layout["cp"] = parallel.cp
    return layout


def _describe(layout: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items() if k != "world_size") or \
        f"world size {layout.get('world_size')}"


def _rank_file() -> str:
    return f"rank{dist.get_rank():05d}.safetensors"


def _nothing() -> None:
    """This rank's part of a write that rank 0 does alone."""
