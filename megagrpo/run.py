"""Builds a run from its config and drives the trainer: set-up, resume, cold start, the GRPO
loop, evaluation, checkpoints, summary. `train(cfg)` is what `python -m megagrpo train` calls on
every rank (this module imports megatron-core and vLLM: the launcher imports it only then)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from megagrpo.checkpoint import (
    CheckpointManager,
    OptimizerState,
    Part,
    PerRank,
    Replicated,
    layout_of,
    load_model,
)
from megagrpo.config.compile import run_work
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.section import freeze
from megagrpo.config.train import TrainConfig
from megagrpo.data import PromptLoader
from megagrpo.engine import VLLMEngine
from megagrpo.engine.process import EngineProcess
from megagrpo.hf import hf_config_dict, load_hf_weights
from megagrpo.model.compile import (
    FirstStepLine,
    compile_for_run,
    compile_reference,
    compiled_layers,
)
from megagrpo.model.gpt import attention_impl_name, build_model, layer_spec_name, sequence_packing
from megagrpo.model.optim import build_optimizer, wrap_ddp
from megagrpo.preflight import Preflight, preflight
from megagrpo.reward import RewardContext, build_rewards
from megagrpo.rollout.collect import ImagePrompts, RolloutCollector
from megagrpo.rollout.placement import RemoteEngine, split_world, streams_weights, training_world
from megagrpo.rollout.separate_source import InFlightState, SeparateSource
from megagrpo.rollout.serve import serve
from megagrpo.runtime import rng
from megagrpo.runtime.console import PREFLIGHT_SHOWN_ENV, attach_log_file, summary_table, what_runs
from megagrpo.runtime.distributed import init_distributed, torchrun_env, training_layout
from megagrpo.runtime.metrics import MetricsLogger, plot_curves, read_jsonl
from megagrpo.runtime.procs import follow_parent
from megagrpo.runtime.rng import RankRng
from megagrpo.runtime.run_dir import check_out_dir, restarts_own_run, this_attempt
from megagrpo.runtime.watchdog import Watchdog, describe_previous_attempt, start_watchdog
from megagrpo.sync import build_weight_sync
from megagrpo.train.cold_start import cold_start
from megagrpo.train.eval_target import EvalTarget
from megagrpo.train.offpolicy import StalenessPolicy, start_line
from megagrpo.train.trainer import BadStepsError, TokenIds, Trainer
from megagrpo.train.tuning import build_tuning

log = logging.getLogger("megagrpo")


def setup(cfg: TrainConfig, checked: Preflight | None = None, *, frozen: bool = False,
          engine: VLLMEngine | None = None, watchdog: Watchdog | None = None) -> Trainer:
    """Validates everything (unless the launcher's `checked` preflight, in this very process,
    already did), then starts distributed, models, optimizer, engine and data. `frozen`: the
    config refuses changes from then on (`train`; tests and benchmarks that adjust settings
    between steps leave it off). The architecture is the preflight's (run.init's checkpoint's
    when it has one), passed on as `Trainer.model_cfg`; cfg.model stays as the recipe gave it.
    `engine`: a running vLLM engine of this rank to sample with (a test that rebuilds the
    trainer at another layout in the same processes; vLLM cannot start twice); None: one is
    started here. `watchdog`: the run's stall watchdog (`train` starts it first)."""
    rank, world, _ = torchrun_env()
    # the launcher ran these checks too; here they also cover a plain `torchrun` start, and
    # the run is built from what they loaded (prompts, tokenizer, architecture)
    fresh = checked is None
    shows = rank == 0 and fresh and not os.environ.get(PREFLIGHT_SHOWN_ENV)
    checked = preflight(cfg, world, warn=shows) if fresh else checked
    # parallel.sequence_parallel decided for this model (None: auto), before anything reads it
    cfg.parallel.sequence_parallel = checked.parallel.sequence_parallel
    if checked.model.is_vlm:  # unset means "where it runs": neither carries images yet
        cfg.compute.pack_sequences = cfg.compute.pack_sequences or False
        cfg.compute.balance_tokens = cfg.compute.balance_tokens or False
    if frozen:
        freeze(cfg)
    task, model_cfg = checked.task, checked.model
    if shows:
        log.info("%s", checked.summary())
        for w in checked.warnings:
            log.warning("warning: %s", w)
    rng.seed_process(cfg.run.seed)
    place = (split_world(cfg, rank, world, model_cfg) if cfg.rollout.placement == "separate"
             else None)
    info = init_distributed(cfg.parallel, model_cfg, seed=cfg.run.seed)
    log_file = attach_log_file(cfg.run.out_dir, rank)  # out_dir is ready once all ranks met
    packed = sequence_packing(cfg.compute, cfg.parallel)
    if rank == 0:
        log.info("%s; full log: %s", what_runs(layer_spec_name(cfg.parallel),
                                               cfg.compute.kernel_impl,
                                               attention_impl_name(cfg.parallel), packed,
                                               cfg.parallel.cp),
                 log_file)
    if rank == 0:
        log.info("sequence parallelism: %s (%s); activation recomputation (update pass): %s",
                 "on" if cfg.parallel.sequence_parallel else "off",
                 checked.sequence_parallel_why, cfg.compute.recompute
                 + (f" ({cfg.compute.recompute_num_layers} layer chunks)"
                    if cfg.compute.recompute == "full" else ""))
    gpt = build_model(model_cfg, cfg.parallel, seed=cfg.run.seed,
                      recompute=(cfg.compute.recompute, cfg.compute.recompute_num_layers))
    _load_init(gpt, cfg.run.init, model_cfg, cfg.parallel, info)
    tuning = build_tuning(cfg.lora)
    tuning.prepare(gpt, model_cfg, cfg.rollout.tensor_parallel_size, seed=cfg.run.seed,
                   loud=rank == 0)
    compiled = compile_for_run(cfg, model_cfg, gpt, loud=rank == 0,
                               work=run_work(cfg, info.dp, checked.mean_train_prompt))
    policy = wrap_ddp(gpt, cfg.optim)
    optimizer = build_optimizer(policy, cfg.optim)
    reference = None if cfg.algo.beta == 0 else tuning.reference(policy, model_cfg, cfg)
    compile_reference(reference, compiled)
    layout = RolloutLayout(rank=rank, world_size=world, engine_tp=cfg.rollout.tensor_parallel_size,
                           train_tp=cfg.parallel.tp, train_pp=cfg.parallel.pp,
                           train_cp=cfg.parallel.cp)
    if rank == 0:
        log.info("%s", place.describe(cfg, info.dp) if place else layout.describe())
        if line := start_line(cfg):
            log.info("%s", line)
    tok = task.tokenizer
    if engine is None and place is None:
        engine = _start_engine(cfg, model_cfg, tok, layout)
    rng.seed_rank(cfg.run.seed, rank)  # vLLM reseeded the global streams
    ranks, groups = training_layout(cfg.parallel, model_cfg, info)
    tokens = TokenIds(pad_id=tok.pad_id, eos_id=tok.eos_id, stop_ids=(tok.eos_id, *task.stop_ids))
    loader = PromptLoader(task.train, cfg.data.batch_size, info.dp_rank, info.dp,
                          seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    if place is not None:
        rollouts = SeparateSource(cfg=cfg, place=place, loader=loader, tokenizer=tok,
                                  ranks=ranks, groups=groups, engine=RemoteEngine(
                                      place=place, loader=loader,
                                      sends=streams_weights(cfg.parallel),
                                      bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
                                      dtype=model_cfg.dtype,
                                      # the rollout ranks' engines serve the adapters?
                                      max_lora_rank=tuning.engine_lora_rank(
                                          cfg.rollout.tensor_parallel_size, model_cfg)))
    else:
        context = RewardContext(engine=engine, tokenizer=tok, stop_ids=tokens.stop_ids,
                                engine_tp=layout.engine_tp,
                                max_model_len=cfg.rollout.max_model_len)
        rewards = build_rewards(cfg.reward, cfg.agent.reward_join, context)
        rollouts = RolloutCollector(cfg=cfg, engine=engine, loader=loader, tokenizer=tok,
                                    rewards=rewards, layout=layout, ranks=ranks, groups=groups,
                                    stop_ids=tokens.stop_ids,
                                    vision=(ImagePrompts.build(model_cfg, cfg.data.tokenizer)
                                            if model_cfg.is_vlm else None))
    weight_sync = build_weight_sync(cfg.sync, cfg.rollout, cfg.lora, model=model_cfg,
                                    parallel=cfg.parallel, engine=rollouts.engine,
                                    shard_to_shard=layout.shard_to_shard,
                                    folder=_engine_dir(cfg, rank))
    tr = Trainer(cfg, model_cfg=model_cfg, policy=policy, optimizer=optimizer,
                 reference=reference, rollouts=rollouts, task=task, ranks=ranks, groups=groups,
                 tokens=tokens, staleness=StalenessPolicy.from_config(cfg), watchdog=watchdog,
                 eval_target=EvalTarget(cfg.eval.target_accuracy), weight_sync=weight_sync)
    return tr


def _load_init(gpt, init: str, model: ModelConfig, parallel: ParallelConfig, info) -> None:
    """run.init's weights into this rank's shards (an HF or a megagrpo checkpoint)."""
    if init == "random":
        return
    if (Path(init) / "config.json").exists():
        load_hf_weights(gpt, init, model, parallel, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    else:
        load_model(gpt, init)


def _start_engine(cfg: TrainConfig, model: ModelConfig, tokenizer,
                  layout: RolloutLayout, rank: int | None = None) -> VLLMEngine:
    """vLLM in this process, on an HF config of `model` written for this rank (weights come
    from the policy by `sync_weights`, not from disk). The ranks of one engine share its seed,
    rollout.seed + the engine's index: they must sample the same tokens (and rollout rank j's
    engine samples as colocated engine j would). `rank`: the global rank whose folder it uses
    (default `layout.rank`; a rollout rank's layout counts the rollout ranks only)."""
    d = _engine_dir(cfg, layout.rank if rank is None else rank)
    d.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(model)
    hf.update(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
              pad_token_id=tokenizer.pad_id)
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    if model.is_vlm:  # vLLM's multimodal processor reads the tokenizer and image processor
        tokenizer.tok.save_pretrained(str(d))
        shutil.copy(Path(cfg.data.tokenizer).expanduser() / "preprocessor_config.json", d)
    if cfg.rollout.stop:  # vLLM matches stop strings in text it detokenizes itself
        save = getattr(getattr(tokenizer, "tok", None), "save_pretrained", None)
        if save is None:
            raise ValueError(f"rollout.stop={list(cfg.rollout.stop)} needs a Hugging Face "
                             "tokenizer (data.tokenizer an HF folder): vLLM matches stop strings "
                             "in its own detokenized text; end turns with token ids instead, "
                             "or drop rollout.stop")
        save(str(d))
    r = dataclasses.replace(cfg.rollout,
                            seed=cfg.rollout.seed + layout.engine,
                            dtype=model.dtype)
    lora_rank = build_tuning(cfg.lora).engine_lora_rank(cfg.rollout.tensor_parallel_size, model)
    build = functools.partial(VLLMEngine, r, d, dtype=model.dtype,
                              capture_routing=cfg.algo.routing_replay, max_lora_rank=lora_rank)
    if cfg.rollout.engine_failure == "continue":  # a failed engine leaves its rank standing
        engine = EngineProcess(build, cfg.parallel.collective_timeout_s,
                               rank=layout.rank if rank is None else rank)
        (d / "engine.pid").write_text(str(engine.pid))
        log.info("rollout rank %d: vLLM engine in child process %d (rollout.engine_failure="
                 "continue)", layout.rank if rank is None else rank, engine.pid)
        return engine
    return build()


def _engine_dir(cfg: TrainConfig, rank: int) -> Path:
    """This rank's engine folder (its config.json; the weight sync's files)."""
    return Path(cfg.run.out_dir) / "engine" / f"rank{rank}"


def checkpoint_states(tr: Trainer) -> dict[str, Part]:
    """What a checkpoint of the run holds, by its name on disk, in the order it is written and
    read (the policy before the optimizer, whose load needs the weights)."""
    states: dict[str, Part] = build_tuning(tr.cfg.lora).model_parts(tr)
    states["optimizer"] = OptimizerState(tr)  # the cold start replaces tr.optimizer
    states["rng"] = PerRank(RankRng(tr.engine), what="the per-rank random streams")
    states["rollout"] = PerRank(tr.rollouts, what="the async batch drawn for the next step",
                                restore=tr.cfg.staleness > 0)
    if isinstance(tr.rollouts, SeparateSource):  # the rollout ranks' queue and streams
        states["rollout_ranks"] = PerRank(InFlightState(tr.rollouts, tr),
                                          what="the rollout ranks' queued batches and streams")
    states["train_state"] = Replicated(tr)
    if tr.eval_target is not None:  # a Trainer built by `setup` has one
        states["eval_target"] = Replicated(tr.eval_target)
    # the weight sync's own parts: an adapter refit's merge not yet sent (bitwise resume)
    states.update({name: Replicated(part)
                   for name, part in tr.weight_sync.checkpoint_parts().items()})
    return states


def checkpoints(tr: Trainer, watchdog: Watchdog | None = None) -> CheckpointManager:
    """The run's checkpoint manager over `checkpoint_states(tr)` (run.out_dir,
    checkpoint.keep_last; per-rank parts restored at this layout only)."""
    cfg = tr.cfg
    layout = layout_of(cfg.parallel, tr.ranks.dp, cfg.rollout.tensor_parallel_size)
    return CheckpointManager(cfg.run.out_dir, cfg.checkpoint.keep_last, checkpoint_states(tr),
                             layout=layout, watchdog=watchdog)


# ---------------------------------------------------------------------- the run
def train(cfg: TrainConfig, checked: Preflight | None = None) -> dict:
    """The whole run on this rank. Returns the summary (identical on every rank). `checked`:
    the preflight the single-process launcher already ran (not run again)."""
    rank, world, _ = torchrun_env()
    watchdog = start_watchdog(cfg.watchdog, rank, world)  # a frozen rank or stall ends the run
    try:
        if rank >= (training_world(cfg.rollout, world) or world):
            return serve_rollouts(cfg, watchdog, checked)
        return _train(cfg, watchdog, checked)
    finally:
        watchdog.stop()


def serve_rollouts(cfg: TrainConfig, watchdog: Watchdog, checked: Preflight | None) -> dict:
    """A rollout rank of separate placement (`megagrpo.rollout.placement`): its own engine, sampling
    for the trainer until it says stop. Returns what it did."""
    follow_parent()
    watchdog.role = "rollout"  # a frozen rollout rank is named as one by the rank watching it
    rank, world, _ = torchrun_env()
    checked = checked or preflight(cfg, world, warn=False)
    freeze(cfg)
    task, model_cfg = checked.task, checked.model
    rng.seed_process(cfg.run.seed)
    place = split_world(cfg, rank, world, model_cfg)
    attach_log_file(cfg.run.out_dir, rank)
    tok = task.tokenizer
    k = cfg.rollout.tensor_parallel_size  # engines of k consecutive rollout ranks
    layout = RolloutLayout(rank=place.rollout_index, world_size=place.rollout_ranks,
                           engine_tp=k, train_tp=k, train_pp=1)
    engine = _start_engine(cfg, model_cfg, tok, layout, rank=rank)
    loader = PromptLoader(task.train, cfg.data.batch_size, 0, 1, seed=cfg.data.seed,
                          shuffle=cfg.data.shuffle)
    stop_ids = (tok.eos_id, *task.stop_ids)
    context = RewardContext(engine=engine, tokenizer=tok, stop_ids=stop_ids, engine_tp=k,
                            max_model_len=cfg.rollout.max_model_len)
    collector = RolloutCollector(cfg=cfg, engine=engine, loader=loader, tokenizer=tok,
                                 rewards=build_rewards(cfg.reward, cfg.agent.reward_join, context),
                                 layout=layout, stop_ids=stop_ids)
    done = serve(cfg, place, collector, watchdog, held_out=task.eval)
    log.info("rollout rank %d: %d batches sampled over %d weight syncs, %d held-out "
             "evaluations; weight bytes received %d", rank, done["batches"], done["syncs"],
             done["evaluations"], done["weight_bytes_received"])
    engine.close()
    return done


def _train(cfg: TrainConfig, watchdog: Watchdog, checked: Preflight | None) -> dict:
    t0 = time.perf_counter()
    follow_parent()  # under torchrun: a killed agent takes this rank down with it
    said = check_out_dir(cfg.run)  # an earlier run in out_dir: refused, resumed or cleared
    tr = setup(cfg, checked, frozen=True, watchdog=watchdog)
    if said and tr.ranks.rank == 0:
        log.warning("%s", said)
        if this_attempt().number:  # which rank of the attempt before was killed, and where
            log.warning("%s", describe_previous_attempt(torchrun_env()[1]))
    ckpts = checkpoints(tr, watchdog)
    resolved = dataclasses.replace(cfg, model=tr.model_cfg)  # the architecture that runs
    logger = MetricsLogger(cfg.run.out_dir, enabled=tr.ranks.rank == 0,
                           tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                           config=dataclasses.asdict(resolved), progress=cfg.log.progress,
                           total_steps=cfg.run.steps)
    attempt = this_attempt()  # a torchrun restart of this job resumes whatever run.resume says
    resume = cfg.run.resume or restarts_own_run(cfg.run.out_dir, attempt)
    ckpt = ckpts.latest() if resume else None
    restored = ckpts.load(ckpt) if ckpt is not None else {}  # per-rank states put back
    if attempt.number:  # the history shows where torchrun restarted the job
        logger.log({"step": tr.step_idx, "restart": attempt.number,
                    "resumed_from_step": tr.step_idx if ckpt is not None else None})
    # a resumed run's weight sync and evaluation are work the run it continues never did: they
    # leave the streams the checkpoint restored (once, by the manager) as they found them
    remote = tr.engine if isinstance(tr.engine, RemoteEngine) else None
    if remote is not None:  # separate placement: its last batch on-policy; no batch drawn
        remote.batches = max(cfg.run.steps - tr.step_idx, 0)  # before a cold start's end
        remote.held = ckpt is None and cfg.cold_start.steps > 0
    with rng.kept(tr.engine) if "rng" in restored else contextlib.nullcontext():
        tr.sync_weights()
        summary = _evaluate_before(tr, logger, resumed=ckpt is not None)
    if remote is not None:
        remote.release()
    syncs_before = tr.reference.state.syncs if tr.reference else 0
    target, lead = tr.eval_target, tr.ranks.rank == 0
    if lead and target.target > 0 and not (cfg.eval.every and tr.task.eval):
        log.info("eval.target_accuracy=%g is not checked during GRPO: %s; all run.steps=%d run",
                 target.target, "eval.every=0 runs no periodic evaluation" if tr.task.eval
                 else "the task has no held-out prompts", cfg.run.steps)
    if target.reached and lead:
        log.info("resume: held-out accuracy %.3f reached eval.target_accuracy=%g after GRPO step "
                 "%d: no step left to run", target.accuracy, target.target, target.reached_step)
    compile_line = FirstStepLine(compiled_layers(tr.policy), loud=tr.ranks.rank == 0)
    while tr.step_idx < cfg.run.steps and not target.reached:
        try:
            m = tr.step()
            compile_line.after_step()
        except BadStepsError as e:
            logger.log(e.metrics)
            logger.close()
            stop_on_bad_steps(tr, ckpts, e)
        if tr.task.eval and cfg.eval.every and tr.step_idx % cfg.eval.every == 0 \
                and tr.step_idx < cfg.run.steps:
            m["eval_accuracy"] = tr.evaluate(tr.task.eval)
            if target.check(tr.step_idx, m["eval_accuracy"], announce=lead, cap=cfg.run.steps):
                m["eval_target_step"] = tr.step_idx
        logger.log(m)
        if cfg.checkpoint.every and tr.step_idx % cfg.checkpoint.every == 0:
            where = ckpts.save(tr.step_idx)
            if tr.step_idx < cfg.run.steps and isinstance(tr.rollouts, SeparateSource) \
                    and tr.rollouts.ends_attempt(attempt):
                end_attempt(tr, logger, where)
    if cfg.checkpoint.at_end and (not cfg.checkpoint.every
                                  or tr.step_idx % cfg.checkpoint.every):
        ckpts.save(tr.step_idx)
    tr.rollouts.join()
    if tr.task.eval and target.reached_step == tr.step_idx:  # stopped there: its evaluation
        summary["eval_accuracy_after"] = target.accuracy
    elif tr.task.eval:
        after = summary["eval_accuracy_after"] = tr.evaluate(tr.task.eval)
        record = {"step": tr.step_idx, "eval_accuracy": after}
        if target.check(tr.step_idx, after, announce=lead):  # reached at the last step
            record["eval_target_step"] = tr.step_idx
        logger.log(record)
    summary.update(target.summary())
    syncs = tr.reference.state.syncs if tr.reference else 0
    summary.update(steps=tr.step_idx, reference_syncs=syncs,
                   reference_syncs_this_run=syncs - syncs_before,
                   restarts=attempt.number,
                   wall_seconds=time.perf_counter() - t0, world_size=dist.get_world_size(),
                   tp=cfg.parallel.tp, pp=cfg.parallel.pp, cp=cfg.parallel.cp, dp=tr.ranks.dp)
    if cfg.rollout.placement == "separate":  # world_size counts the training ranks
        summary["rollout_ranks"] = cfg.rollout.rollout_ranks
    if tr.ranks.rank == 0:
        _write_summary(cfg, summary)
    logger.close()
    dist.barrier(group=tr.groups.world)
    tr.engine.close()  # before torch.distributed goes: vLLM's shutdown destroys its groups
    return summary


def _evaluate_before(tr: Trainer, logger: MetricsLogger, resumed: bool) -> dict:
    """A fresh run: held-out accuracy of the initial weights, the cold start, and accuracy
    before GRPO; a resumed run: accuracy before its next step. The summary's fields."""
    cfg, evals, summary = tr.cfg, tr.task.eval, {}
    if evals and tr.ranks.rank == 0:
        log.info("held-out evaluation: %d prompts, greedy, <= %d new tokens", len(evals),
                 cfg.eval.max_tokens)
    if not resumed:
        if evals:
            summary["eval_accuracy_init"] = tr.evaluate(evals)
        if cfg.cold_start.steps:
            summary.update(cold_start(tr, logger, cfg.cold_start, cfg.arithmetic,
                                      held_out=evals, seed=cfg.run.seed,
                                      progress=cfg.log.progress and tr.ranks.rank == 0,
                                      train=None if cfg.data.task == "arithmetic"
                                      else tr.task.train))
    if evals:
        # greedy and the same weights unless a cold start ran: no second pass over the eval set
        fresh = resumed or "sft_steps" in summary
        summary["eval_accuracy_before"] = (tr.evaluate(evals) if fresh
                                           else summary["eval_accuracy_init"])
        if not resumed:  # a resumed run's history already holds this step's evaluation
            logger.log({"step": tr.step_idx, "eval_accuracy": summary["eval_accuracy_before"]})
    return summary


def end_attempt(tr: Trainer, logger: MetricsLogger, where: Path) -> NoReturn:
    """rollout.engine_failure=continue, a rollout rank out: the checkpoint `where` is written,
    so this torchrun attempt ends (every training rank exits non-zero) and torchrun's
    --max-restarts starts the job again with every rollout rank, resuming from it."""
    if tr.ranks.rank == 0:
        log.warning("rollout.engine_failure=continue: checkpoint %s written with %d of %d "
                    "rollout ranks; ending this attempt so that torchrun restarts the job "
                    "with all of them (it resumes from this checkpoint)", where,
                    tr.cfg.rollout.rollout_ranks - len(tr.rollouts.channel.outs),
                    tr.cfg.rollout.rollout_ranks)
    tr.watchdog.set_phase("ended for a restart with every rollout rank", tr.step_idx)
    logger.close()
    dist.barrier(group=tr.groups.world)
    raise SystemExit(f"megagrpo: attempt ended at step {tr.step_idx} for a restart with every "
                     f"rollout rank (rollout.engine_failure=continue); checkpoint: {where}")


def stop_on_bad_steps(tr: Trainer, ckpts: CheckpointManager, err: BadStepsError) -> NoReturn:
    """Ends the run after run.max_bad_steps skipped steps: saves a checkpoint (the weights are
    the last good step's, as bad steps apply no update), closes the engine and exits non-zero
    on every rank with the reason."""
    tr.rollouts.join()
    where = ckpts.save(tr.step_idx)
    if tr.ranks.rank == 0:
        log.error("stopping: %s; checkpoint saved to %s", err, where)
    dist.barrier(group=tr.groups.world)
    tr.engine.close()
    raise SystemExit(f"megagrpo stopped at step {tr.step_idx}: {err}. Checkpoint: {where}")


def _write_summary(cfg: TrainConfig, summary: dict) -> None:
    out = Path(cfg.run.out_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    records = read_jsonl(out / "metrics.jsonl")
    try:
        plot_curves(records, out / "curves.png")
    except Exception as e:  # plotting must never cost a finished run
        log.warning("curves.png not written: %s", e)
    print("\n" + summary_table(summary, out), flush=True)

