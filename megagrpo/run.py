"""Builds a run from its config and drives the trainer: set-up, resume, cold start, the GRPO
loop, evaluation, checkpoints, summary. `train(cfg)` is what `python -m megagrpo train` calls on
every rank."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.config.train import TrainConfig
from megagrpo.distributed import init_distributed, torchrun_env
from megagrpo.metrics import MetricsLogger, plot_curves, read_jsonl
from megagrpo.trainer import Trainer

log = logging.getLogger("megagrpo")


def resolve_model_config(cfg: TrainConfig, tokenizer_vocab: int | None):
    """The architecture: from run.init's checkpoint when it has one, else cfg.model (whose vocab
    must hold the tokenizer's)."""
    from megagrpo.checkpoint import MODEL_JSON, read_model_config
    from megagrpo.hf import model_config_from_hf

    init = cfg.run.init
    if init != "random":
        p = Path(init)
        if (p / "config.json").exists():
            return model_config_from_hf(p, dtype=cfg.model.dtype)
        if (p / MODEL_JSON).exists():
            return read_model_config(p)[0]
        raise ValueError(f"run.init={init!r} is neither 'random', an HF checkpoint directory "
                         "(config.json) nor a megagrpo checkpoint")
    if tokenizer_vocab is not None and cfg.model.vocab_size < tokenizer_vocab:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                         f"tokenizer's vocabulary ({tokenizer_vocab}); set model.vocab_size >= "
                         f"{tokenizer_vocab}")
    return cfg.model


def setup(cfg: TrainConfig) -> Trainer:
    """Validates everything, then starts distributed, models, optimizer, engine and data."""
    from megagrpo.data import PromptLoader
    from megagrpo.model import build_model, layer_spec_name
    from megagrpo.optim import build_optimizer, wrap_ddp
    from megagrpo.reference import Reference
    from megagrpo.rewards import RewardFn
    from megagrpo.tasks import build_task

    rank, world, _ = torchrun_env()
    task = build_task(cfg.data, cfg.arithmetic)
    model_cfg = resolve_model_config(cfg, task.tokenizer.vocab_size)
    cfg.model = model_cfg
    cfg.validate(world)
    if cfg.run.init != "random" and (Path(cfg.run.init) / "config.json").exists():
        from megagrpo.hf import check_hf_checkpoint

        check_hf_checkpoint(cfg.run.init, model_cfg)  # before any process group exists
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    info = init_distributed(cfg.parallel, model_cfg, seed=cfg.run.seed)
    if rank == 0:
        log.info("layer spec: %s; kernels: %s", layer_spec_name(cfg.parallel), cfg.run.kernel_impl)
    gpt = build_model(model_cfg, cfg.parallel, seed=cfg.run.seed)
    _load_init(gpt, cfg, model_cfg, info)
    policy = wrap_ddp(gpt, cfg.optim)
    optimizer = build_optimizer(policy, cfg.optim)
    reference = (Reference(policy, model_cfg, cfg.parallel, cfg.reference, seed=cfg.run.seed)
                 if cfg.algo.beta > 0 else None)
    engine = _start_engine(cfg, model_cfg, task.tokenizer, rank)
    # vLLM reseeds the global RNG: put megatron's tracker and torch's back on the run's seed
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed + rank)
    loader = PromptLoader(task.train, cfg.data.batch_size, info.dp_rank, info.dp,
                          seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    Vp = cfg.parallel.padded_vocab_size(model_cfg.vocab_size)
    v_local = Vp // cfg.parallel.tp
    valid_local = max(0, min(v_local, model_cfg.vocab_size - info.tp_rank * v_local))
    per_step = cfg.algo.mu * cfg.run.num_minibatches
    parts = dict(
        model_cfg=model_cfg, policy=policy, optimizer=optimizer, reference=reference,
        engine=engine, loader=loader, task=task, tokenizer=task.tokenizer,
        reward_fn=RewardFn(cfg.reward), rank=rank, dp=info.dp, dp_rank=info.dp_rank,
        tp_rank=info.tp_rank, tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), mp_group=ps.get_model_parallel_group(),
        mp_size=cfg.parallel.tp * cfg.parallel.pp, pp=cfg.parallel.pp,
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        mp_rank=dist.get_rank(group=ps.get_model_parallel_group()),
        valid_local_vocab=valid_local, pad_id=task.tokenizer.pad_id,
        eos_id=task.tokenizer.eos_id, stop_ids=(task.tokenizer.eos_id,),
        opt_steps=0, total_opt_steps=max(1, cfg.run.steps * per_step),
    )
    return Trainer(cfg, parts)


def _load_init(gpt, cfg: TrainConfig, model_cfg, info) -> None:
    from megagrpo.checkpoint import load_model
    from megagrpo.hf import load_hf_weights

    init = cfg.run.init
    if init == "random":
        return
    if (Path(init) / "config.json").exists():
        load_hf_weights(gpt, init, model_cfg, cfg.parallel, tp_rank=info.tp_rank,
                        pp_rank=info.pp_rank)
    else:
        load_model(gpt, init)


def _start_engine(cfg: TrainConfig, model_cfg, tokenizer, rank: int):
    """vLLM in this process, on an HF config written for this rank (weights come from the
    policy by `sync_weights`, not from disk)."""
    from megagrpo.hf import hf_config_dict
    from megagrpo.rollout import VLLMEngine

    d = Path(cfg.run.out_dir) / "engine" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(model_cfg)
    hf.update(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
              pad_token_id=tokenizer.pad_id)
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    r = dataclasses.replace(cfg.rollout, seed=cfg.rollout.seed + rank, n=cfg.algo.group_size,
                            dtype=model_cfg.dtype)
    return VLLMEngine(r, d, dtype=model_cfg.dtype)


# ---------------------------------------------------------------------- checkpoints
def _ckpt_root(cfg: TrainConfig) -> Path:
    return Path(cfg.run.out_dir) / "checkpoints"


def save_checkpoint(tr: Trainer) -> None:
    """Policy + reference (dist-checkpoint, reshardable), optimizer (per rank) and trainer
    state, written to a temp dir and renamed into place; older ones beyond keep_last removed."""
    from megagrpo.checkpoint import save_model

    root = _ckpt_root(tr.cfg)
    final = root / f"step_{tr.step_idx:06d}"
    save_model(tr.policy, final / "policy", tr.model_cfg)
    if tr.reference is not None:
        save_model(tr.reference.model, final / "reference", tr.model_cfg)
    opt_dir = final / "optimizer"
    if tr.rank == 0:
        opt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if not tr.cfg.optim.distributed_optimizer:
        torch.save(tr.optimizer.state_dict(), opt_dir / f"rank{dist.get_rank():05d}.pt")
    state = {"step": tr.step_idx, "version": tr.version, "opt_steps": tr.opt_steps,
             "loader": tr.loader.state_dict(),
             "reference": dataclasses.asdict(tr.reference.state) if tr.reference else None,
             "world_size": dist.get_world_size()}
    dist.barrier()
    if tr.rank == 0:
        tmp = final / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, final / "trainer_state.json")  # marks the checkpoint complete
        done = sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").exists())
        for old in done[: -tr.cfg.run.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def latest_checkpoint(cfg: TrainConfig) -> Path | None:
    done = sorted(p for p in _ckpt_root(cfg).glob("step_*") if (p / "trainer_state.json").exists())
    return done[-1] if done else None


def resume(tr: Trainer, ckpt: Path) -> None:
    from megagrpo.checkpoint import load_model
    from megagrpo.reference import ReferenceState

    state = json.loads((ckpt / "trainer_state.json").read_text())
    load_model(tr.policy, ckpt / "policy")
    if tr.reference is not None and (ckpt / "reference").exists():
        load_model(tr.reference.model, ckpt / "reference")
        tr.reference.state = ReferenceState(**state["reference"])
    opt = ckpt / "optimizer" / f"rank{dist.get_rank():05d}.pt"
    if opt.exists() and state["world_size"] == dist.get_world_size():
        tr.optimizer.load_state_dict(torch.load(opt, weights_only=False))
    elif tr.rank == 0:
        log.info("resume: optimizer state not restored (saved with world size %d or with the "
                 "distributed optimizer); Adam moments restart", state["world_size"])
    tr.loader.load_state_dict(state["loader"])
    tr.step_idx, tr.version, tr.opt_steps = state["step"], state["version"], state["opt_steps"]
    if tr.rank == 0:
        log.info("resumed from %s at step %d", ckpt, tr.step_idx)


# ---------------------------------------------------------------------- the run
def train(cfg: TrainConfig) -> dict:
    """The whole run on this rank. Returns the summary (identical on every rank)."""
    t0 = time.perf_counter()
    tr = setup(cfg)
    logger = MetricsLogger(cfg.run.out_dir, enabled=tr.rank == 0, tensorboard=cfg.run.tensorboard,
                           wandb=cfg.run.wandb, config=dataclasses.asdict(cfg),
                           progress=cfg.run.progress)
    ckpt = latest_checkpoint(cfg) if cfg.run.resume else None
    summary: dict = {}
    if ckpt is not None:
        resume(tr, ckpt)
    tr.sync_weights()
    evals = tr.task.eval
    if ckpt is None:
        if evals:
            summary["eval_accuracy_init"] = tr.evaluate(evals)
        if cfg.run.sft_steps and cfg.data.task == "arithmetic":
            summary.update(_cold_start(tr, cfg, logger))
    if evals:
        summary["eval_accuracy_before"] = tr.evaluate(evals)
        logger.log({"step": tr.step_idx, "eval_accuracy": summary["eval_accuracy_before"]})
    syncs = 0
    while tr.step_idx < cfg.run.steps:
        m = tr.step()
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
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
