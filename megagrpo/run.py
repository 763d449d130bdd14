"""Builds a run from its config and drives the trainer: set-up, resume, cold start, the GRPO
loop, evaluation, checkpoints, summary. `train(cfg)` is what `python -m megagrpo train` calls on
every rank."""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from megagrpo.checkpoint import (
    capture_rng,
    load_model,
    load_tree,
    on_every_rank,
    restore_rng,
    save_model,
    save_tree,
)
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import TrainConfig
from megagrpo.console import attach_log_file, summary_table, what_runs
from megagrpo.distributed import init_distributed, torchrun_env
from megagrpo.export import save_tokenizer
from megagrpo.metrics import (
    MetricsLogger,
    history_size,
    plot_curves,
    read_jsonl,
    rewind_history,
)
from megagrpo.procs import follow_parent
from megagrpo.run_dir import (
    MANIFEST,
    TRAINER_STATE,
    check_out_dir,
    checkpoint_root,
    manifest_bytes,
    newest_intact,
    step_dirs,
    step_of,
    write_manifest,
)
from megagrpo.trainer import BadStepsError, TokenIds, Trainer, TrainerGroups, TrainerRanks
from megagrpo.watchdog import Watchdog, start_watchdog

if TYPE_CHECKING:
    from megagrpo.preflight import Preflight

log = logging.getLogger("megagrpo")


def setup(cfg: TrainConfig, checked: Preflight | None = None) -> Trainer:
    """Validates everything (unless the launcher's `checked` preflight, in this very process,
    already did), then starts distributed, models, optimizer, engine and data."""
    from megagrpo.data import PromptLoader
    from megagrpo.model import attention_impl_name, build_model, layer_spec_name, sequence_packing
    from megagrpo.optim import build_optimizer, wrap_ddp
    from megagrpo.preflight import preflight
    from megagrpo.reference import Reference
    from megagrpo.rewards import RewardFn

    rank, world, _ = torchrun_env()
    # the launcher ran these checks too; here they also cover a plain `torchrun` start, and
    # the run is built from what they loaded (prompts, tokenizer, architecture)
    fresh = checked is None
    checked = preflight(cfg, world) if fresh else checked
    task, model_cfg = checked.task, checked.model
    cfg.model = model_cfg
    if rank == 0 and fresh:
        log.info("%s", checked.summary())
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    info = init_distributed(cfg.parallel, model_cfg, seed=cfg.run.seed)
    log_file = attach_log_file(cfg.run.out_dir, rank)  # out_dir is ready once all ranks met
    if rank == 0:
        log.info("%s; full log: %s", what_runs(layer_spec_name(cfg.parallel), cfg.run.kernel_impl,
                                               attention_impl_name(cfg.parallel),
                                               sequence_packing(cfg.run, cfg.parallel)), log_file)
    gpt = build_model(model_cfg, cfg.parallel, seed=cfg.run.seed)
    _load_init(gpt, cfg, model_cfg, info)
    policy = wrap_ddp(gpt, cfg.optim)
    optimizer = build_optimizer(policy, cfg.optim)
    reference = (Reference(policy, model_cfg, cfg.parallel, cfg.reference, seed=cfg.run.seed)
                 if cfg.algo.beta > 0 else None)
    layout = RolloutLayout(rank=rank, world_size=world, engine_tp=cfg.rollout.tensor_parallel_size,
                           train_tp=cfg.parallel.tp, train_pp=cfg.parallel.pp)
    if rank == 0:
        log.info("%s", layout.describe())
    engine = _start_engine(cfg, model_cfg, task.tokenizer, layout)
    # vLLM reseeds the global RNG: put megatron's tracker and torch's back on the run's seed
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed + rank)
    loader = PromptLoader(task.train, cfg.data.batch_size, info.dp_rank, info.dp,
                          seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    per_step = cfg.algo.mu * cfg.run.num_minibatches
    tok = task.tokenizer
    return Trainer(
        cfg, model_cfg=model_cfg, policy=policy, optimizer=optimizer, reference=reference,
        engine=engine, loader=loader, task=task, reward_fn=RewardFn(cfg.reward), layout=layout,
        ranks=_trainer_ranks(cfg, model_cfg, info), groups=TrainerGroups(
            tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(), mp=ps.get_model_parallel_group()),
        tokens=TokenIds(pad_id=tok.pad_id, eos_id=tok.eos_id, stop_ids=(tok.eos_id,)),
        total_opt_steps=max(1, cfg.run.steps * per_step))


def _trainer_ranks(cfg: TrainConfig, model_cfg, info) -> TrainerRanks:
    """This rank's place in the training layout, from megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    v_local = cfg.parallel.padded_vocab_size(model_cfg.vocab_size) // cfg.parallel.tp
    return TrainerRanks(
        rank=info.rank, dp=info.dp, dp_rank=info.dp_rank, tp_rank=info.tp_rank,
        pp=cfg.parallel.pp, pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        mp_rank=dist.get_rank(group=ps.get_model_parallel_group()),
        mp_size=cfg.parallel.tp * cfg.parallel.pp,
        valid_local_vocab=max(0, min(v_local, model_cfg.vocab_size - info.tp_rank * v_local)))


def _load_init(gpt, cfg: TrainConfig, model_cfg, info) -> None:
    from megagrpo.hf import load_hf_weights

    init = cfg.run.init
    if init == "random":
        return
    if (Path(init) / "config.json").exists():
        load_hf_weights(gpt, init, model_cfg, cfg.parallel, tp_rank=info.tp_rank,
                        pp_rank=info.pp_rank)
    else:
        load_model(gpt, init)


def _start_engine(cfg: TrainConfig, model_cfg, tokenizer, layout: RolloutLayout):
    """vLLM in this process, on an HF config written for this rank (weights come from the
    policy by `sync_weights`, not from disk). The ranks of one engine share its seed: they
    must sample the same tokens."""
    rank = layout.rank
    from megagrpo.hf import hf_config_dict
    from megagrpo.rollout import VLLMEngine

    d = Path(cfg.run.out_dir) / "engine" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(model_cfg)
    hf.update(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
              pad_token_id=tokenizer.pad_id)
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    r = dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + layout.engine,
                            dtype=model_cfg.dtype)
    return VLLMEngine(r, d, dtype=model_cfg.dtype)


# ---------------------------------------------------------------------- checkpoints
def _ckpt_root(cfg: TrainConfig) -> Path:
    return checkpoint_root(cfg.run.out_dir)


def save_checkpoint(tr: Trainer) -> None:
    """Collective. Policy + reference (dist-checkpoint, reshardable), per rank the optimizer
    and every RNG stream (safetensors, no pickle), the trainer state, and last the manifest
    that marks the checkpoint complete; complete ones beyond keep_last are then removed. Out of
    disk, every rank stops with an error that says so and where."""
    if tr.watchdog is not None:
        tr.watchdog.set_phase("checkpoint", tr.step_idx)
    root = _ckpt_root(tr.cfg)
    final = root / f"step_{tr.step_idx:06d}"
    on_every_rank(partial(_clear_for_save, root, final) if tr.rank == 0 else lambda: None,
                  final)
    save_model(tr.policy, final / "policy", tr.model_cfg)
    if tr.reference is not None:
        save_model(tr.reference.model, final / "reference", tr.model_cfg)
    on_every_rank(partial(_save_rank_state, tr, final), final)
    on_every_rank(partial(_finish_checkpoint, tr, final) if tr.rank == 0 else lambda: None,
                  final)


def _save_rank_state(tr: Trainer, final: Path) -> None:
    """This rank's optimizer state and RNG streams, as safetensors (no pickle)."""
    me = f"rank{dist.get_rank():05d}.safetensors"
    if not tr.cfg.optim.distributed_optimizer:
        save_tree(final / "optimizer" / me, tr.optimizer.state_dict())
    save_tree(final / "rng" / me, capture_rng(tr.engine))


def _clear_for_save(root: Path, final: Path) -> None:
    """Removes a leftover of the same step (a save a crash interrupted) and checks that the
    disk holds another checkpoint as large as the last one."""
    shutil.rmtree(final, ignore_errors=True)
    final.mkdir(parents=True)
    done = [p for p in step_dirs(root) if (p / MANIFEST).exists()]
    need = manifest_bytes(done[-1]) if done else 0
    free = shutil.disk_usage(final).free
    if need > free:
        raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {final}: the last "
                      f"one took {need >> 20} MiB, {free >> 20} MiB are free; free space, lower "
                      "run.keep_last or point run.out_dir at a larger disk")


def _finish_checkpoint(tr: Trainer, final: Path) -> None:
    """Rank 0, after every rank wrote its part: trainer state, manifest, pruning."""
    state = {"step": tr.step_idx, "version": tr.version, "opt_steps": tr.opt_steps,
             "loader": tr.loader.state_dict(),
             "reference": dataclasses.asdict(tr.reference.state) if tr.reference else None,
             "world_size": dist.get_world_size(),
             "metrics_bytes": history_size(tr.cfg.run.out_dir)}
    tmp = final / (TRAINER_STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, final / TRAINER_STATE)
    save_tokenizer(final / "policy", tr.tokenizer)  # `convert --to-hf` exports it with the model
    write_manifest(final)  # from here on the checkpoint is complete
    dirs = step_dirs(final.parent)
    kept = [p for p in dirs if (p / MANIFEST).exists() and step_of(p) <= tr.step_idx]
    kept = kept[-tr.cfg.run.keep_last:]
    for old in dirs:  # older than every kept one, complete or a broken leftover
        if step_of(old) < step_of(kept[0]):
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(cfg: TrainConfig) -> Path | None:
    """Collective: the newest checkpoint that matches its manifest, the same on every rank
    (rank 0 checks and tells the others); newer broken ones are named in a warning."""
    root = _ckpt_root(cfg)
    step = torch.tensor([-1], dtype=torch.int64)
    if dist.get_rank() == 0:
        ckpt, broken = newest_intact(root)
        for path, why in broken:
            log.warning("checkpoint %s is broken and is skipped: %s", path, why)
        step[0] = step_of(ckpt) if ckpt is not None else -1
    dist.broadcast(step, src=0)
    return root / f"step_{int(step):06d}" if int(step) >= 0 else None


def resume(tr: Trainer, ckpt: Path) -> dict | None:
    """Collective: restores policy, reference, optimizer, data position, schedule counters and
    every RNG stream from `ckpt`. Returns the RNG state (None when it could not be restored):
    `train` puts it back once more right before the next step, after the evaluation and the
    weight sync that come between. Reads no pickle except dist-checkpoint metadata."""
    from megagrpo.reference import ReferenceState

    state = json.loads((ckpt / TRAINER_STATE).read_text())
    load_model(tr.policy, ckpt / "policy")
    if tr.reference is not None and (ckpt / "reference").exists():
        load_model(tr.reference.model, ckpt / "reference")
        tr.reference.state = ReferenceState(**state["reference"])
    me = f"rank{dist.get_rank():05d}.safetensors"
    same_world = state["world_size"] == dist.get_world_size()
    opt = ckpt / "optimizer" / me
    if opt.exists() and same_world:
        tr.optimizer.load_state_dict(load_tree(opt))
    elif tr.rank == 0:
        log.warning("resume: optimizer state not restored (saved with world size %d, with the "
                    "distributed optimizer, or as a pickle by an older megagrpo, which is never "
                    "loaded); Adam moments restart", state["world_size"])
    rng = load_tree(ckpt / "rng" / me) if same_world and (ckpt / "rng" / me).exists() else None
    if rng is not None:
        restore_rng(rng, tr.engine)
    elif tr.rank == 0:
        log.warning("resume: RNG streams not restored (world size changed): the run continues "
                    "but not bitwise as it would have uninterrupted")
    tr.loader.load_state_dict(state["loader"])
    tr.step_idx, tr.version, tr.opt_steps = state["step"], state["version"], state["opt_steps"]
    if tr.rank == 0:
        dropped = rewind_history(tr.cfg.run.out_dir, state.get("metrics_bytes", 1 << 62))
        log.info("resumed from %s at step %d%s", ckpt, tr.step_idx,
                 f"; dropped {dropped} metrics records written after it" if dropped else "")
    return rng


# ---------------------------------------------------------------------- the run
def train(cfg: TrainConfig, checked: Preflight | None = None) -> dict:
    """The whole run on this rank. Returns the summary (identical on every rank). `checked`:
    the preflight the single-process launcher already ran (not run again)."""
    rank, world, _ = torchrun_env()
    watchdog = start_watchdog(cfg.run, rank, world)  # a frozen rank or stalled phase ends the run
    try:
        return _train(cfg, watchdog, checked)
    finally:
        watchdog.stop()


def _train(cfg: TrainConfig, watchdog: Watchdog, checked: Preflight | None) -> dict:
    t0 = time.perf_counter()
    follow_parent()  # under torchrun: a killed agent takes this rank down with it
    check_out_dir(cfg.run)  # an earlier run in out_dir: refused, resumed or cleared
    tr = setup(cfg, checked)
    tr.watchdog = watchdog
    logger = MetricsLogger(cfg.run.out_dir, enabled=tr.rank == 0, tensorboard=cfg.run.tensorboard,
                           wandb=cfg.run.wandb, config=dataclasses.asdict(cfg),
                           progress=cfg.run.progress, total_steps=cfg.run.steps)
    ckpt = latest_checkpoint(cfg) if cfg.run.resume else None
    summary: dict = {}
    rng = resume(tr, ckpt) if ckpt is not None else None
    tr.sync_weights()
    evals = tr.task.eval
    if evals and tr.rank == 0:
        log.info("held-out evaluation: %d prompts, greedy, <= %d new tokens", len(evals),
                 cfg.run.eval_max_tokens)
    if ckpt is None:
        if evals:
            summary["eval_accuracy_init"] = tr.evaluate(evals)
        if cfg.run.sft_steps and cfg.data.task == "arithmetic":
            summary.update(_cold_start(tr, cfg, logger))
    if evals:
        # greedy and the same weights unless a cold start ran: no second pass over the eval set
        fresh = ckpt is not None or "sft_steps" in summary
        summary["eval_accuracy_before"] = (tr.evaluate(evals) if fresh
                                           else summary["eval_accuracy_init"])
        if ckpt is None:  # a resumed run's history already holds this step's evaluation
            logger.log({"step": tr.step_idx, "eval_accuracy": summary["eval_accuracy_before"]})
    if rng is not None:  # the streams as they were when the checkpoint was written
        restore_rng(rng, tr.engine)
    syncs = 0
    while tr.step_idx < cfg.run.steps:
        try:
            m = tr.step()
        except BadStepsError as e:
            logger.log(e.metrics)
            logger.close()
            stop_on_bad_steps(tr, e)
        syncs += int(bool(m.get("reference_sync")))
        if evals and cfg.run.eval_every and tr.step_idx % cfg.run.eval_every == 0 \
                and tr.step_idx < cfg.run.steps:
            m["eval_accuracy"] = tr.evaluate(evals)
        logger.log(m)
        if cfg.run.checkpoint_every and tr.step_idx % cfg.run.checkpoint_every == 0:
            save_checkpoint(tr)
    if cfg.run.checkpoint_at_end and (not cfg.run.checkpoint_every
                                      or tr.step_idx % cfg.run.checkpoint_every):
        save_checkpoint(tr)
    tr._join_async()
    if evals:
        summary["eval_accuracy_after"] = tr.evaluate(evals)
        logger.log({"step": tr.step_idx, "eval_accuracy": summary["eval_accuracy_after"]})
    summary.update(steps=tr.step_idx, reference_syncs=tr.reference.state.syncs
                   if tr.reference else 0, reference_syncs_this_run=syncs,
                   wall_seconds=time.perf_counter() - t0, world_size=dist.get_world_size(),
                   tp=cfg.parallel.tp, pp=cfg.parallel.pp, dp=tr.dp)
    if tr.rank == 0:
        _write_summary(cfg, summary)
    logger.close()
    dist.barrier()
    tr.engine.close()  # before torch.distributed goes: vLLM's shutdown destroys its groups
    return summary


def stop_on_bad_steps(tr: Trainer, err: BadStepsError) -> NoReturn:
    """Ends the run after run.max_bad_steps skipped steps: saves a checkpoint (the weights are
    the last good step's, as bad steps apply no update), closes the engine and exits non-zero
    on every rank with the reason."""
    tr._join_async()
    save_checkpoint(tr)
    where = _ckpt_root(tr.cfg) / f"step_{tr.step_idx:06d}"
    if tr.rank == 0:
        log.error("stopping: %s; checkpoint saved to %s", err, where)
    dist.barrier()
    tr.engine.close()
    raise SystemExit(f"megagrpo stopped at step {tr.step_idx}: {err}. Checkpoint: {where}")


def _cold_start(tr: Trainer, cfg: TrainConfig, logger: MetricsLogger) -> dict:
    from megagrpo.tasks.arithmetic import sft_examples

    t = time.perf_counter()
    losses = tr.cold_start(partial(_sft_pairs, cfg=cfg.arithmetic, fn=sft_examples),
                           cfg.run.sft_steps)
    for i in range(0, len(losses), max(1, len(losses) // 20)):
        logger.log({"sft_step": i + 1, "sft_loss": losses[i]})
    # GRPO starts from the cold-started weights with fresh Adam moments: the SFT gradients'
    # second moments are far larger than policy-gradient ones and would damp the RL updates
    # for hundreds of steps (beta2 = 0.999)
    from megagrpo.optim import build_optimizer

    tr.optimizer = build_optimizer(tr.policy, cfg.optim)
    tr.sync_weights()
    if tr.reference is not None:  # GRPO's reference is the cold-started model (DeepSeekMath)
        from megagrpo.reference import sync_reference

        sync_reference(tr.reference.model, tr.policy, 1.0)
    return {"sft_steps": cfg.run.sft_steps, "sft_final_loss": losses[-1] if losses else None,
            "sft_seconds": time.perf_counter() - t}


def _sft_pairs(n: int, seed: int, *, cfg, fn):
    return fn(n, seed, cfg)


def _write_summary(cfg: TrainConfig, summary: dict) -> None:
    out = Path(cfg.run.out_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    records = read_jsonl(out / "metrics.jsonl")
    try:
        plot_curves(records, out / "curves.png")
    except Exception as e:  # plotting must never cost a finished run
        log.warning("curves.png not written: %s", e)
    print("\n" + summary_table(summary, out), flush=True)
