"""The supervised cold start before GRPO (DeepSeek-R1's, on the built-in arithmetic task):
NLL of the completion tokens of (prompt, answer) pairs, then a fresh optimizer and a reference
equal to the cold-started policy."""
from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo.batch import sft_batch
from megagrpo.data import encode_prompt
from megagrpo.losses import sft_loss
from megagrpo.optim import build_optimizer, optimizer_step, set_lr, zero_grad
from megagrpo.reference import sync_reference
from megagrpo.tasks.arithmetic import sft_examples

if TYPE_CHECKING:
    from megagrpo.metrics import MetricsLogger
    from megagrpo.trainer import Trainer

PairsFn = Callable[..., list[tuple[str, str]]]
"""(n, seed=...) -> n (prompt, completion) pairs."""


def supervised_steps(tr: Trainer, pairs_fn: PairsFn, steps: int, *, start: int = 0,
                     total: int | None = None) -> list[float]:
    """SFT steps `start` .. `start + steps - 1` (of `total`) on this rank's share of
    cold_start.batch_size pairs each; the global NLL per completion token of every step."""
    total = total or start + steps
    c, dp = tr.cfg.cold_start, tr.ranks.dp
    P, tok = tr.passes, tr.tokenizer
    losses = []
    for s in range(start, start + steps):
        if tr.watchdog is not None:  # each SFT step is a phase of its own
            tr.watchdog.set_phase(f"cold_start {s + 1}/{total}", tr.step_idx)
        pairs = pairs_fn(c.batch_size // dp,
                         seed=tr.cfg.run.seed * 100_003 + s * dp + tr.ranks.dp_rank)
        prompts = [encode_prompt(tok, p) for p, _ in pairs]
        comps = [tok.encode(x) + [tr.tokens.eos_id] for _, x in pairs]
        m = min(tr.cfg.compute.micro_batch_size, len(pairs))
        batch = sft_batch(prompts, comps, pad_id=tr.tokens.pad_id, multiple=m)
        plan = P.plan(batch, m)
        ctx = P.loss_context(scale=len(plan) * dp, counts=P.counts(batch, len(plan)),
                             inplace_backward=tr.cfg.compute.inplace_backward)
        ctx.temperature = 1.0
        set_lr(tr.optimizer, c.lr)
        zero_grad(tr.policy, tr.optimizer)
        out = P.run(tr.policy, partial(sft_loss, ctx), plan, batch.ids.shape[1], m)
        optimizer_step(tr.policy, tr.optimizer)
        mine = tr.ranks.tp_rank == 0
        v = torch.tensor([sum(float(o["nll_sum"]) for o in out) if mine else 0.0,
                          sum(float(o["tokens"]) for o in out) if mine else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(v, group=tr.groups.world)
        losses.append(float(v[0] / max(v[1], 1)))
        if tr.ranks.rank == 0 and tr.cfg.log.progress and (s + 1) % 50 == 0:
            print(f"cold start {s + 1:4d}/{total} | nll={losses[-1]:.3f}", flush=True)
    return losses


def cold_start(tr: Trainer, logger: MetricsLogger) -> dict:
    """The run's cold start on the arithmetic task; its summary fields. GRPO then starts from
    the cold-started weights with fresh Adam moments (the SFT gradients' second moments are far
    larger than policy-gradient ones and would damp the RL updates for hundreds of steps at
    beta2 = 0.999), and the reference is the cold-started model (DeepSeekMath)."""
    cfg, t, c = tr.cfg, time.perf_counter(), tr.cfg.cold_start
    pairs = partial(sft_examples, cfg=cfg.arithmetic)
    check = c.target_accuracy > 0 and bool(tr.task.eval)
    losses: list[float] = []
    accuracy = None
    while len(losses) < c.steps:  # in chunks of check_every when it stops at an accuracy
        n = min(c.check_every if check else c.steps, c.steps - len(losses))
        losses += supervised_steps(tr, pairs, n, start=len(losses), total=c.steps)
        if check:
            tr.sync_weights()
            accuracy = tr.evaluate(tr.task.eval)
            if tr.ranks.rank == 0 and cfg.log.progress:
                print(f"cold start {len(losses):4d}/{c.steps} | held-out {accuracy:.3f} "
                      f"(stops at {c.target_accuracy:g})", flush=True)
            if accuracy >= c.target_accuracy:
                break
    for i in range(0, len(losses), max(1, len(losses) // 20)):
        logger.log({"sft_step": i + 1, "sft_loss": losses[i]})
    tr.optimizer = build_optimizer(tr.policy, cfg.optim)
    tr.sync_weights()
    if tr.reference is not None:
        sync_reference(tr.reference.model, tr.policy, 1.0)
    out = {"sft_steps": len(losses), "sft_final_loss": losses[-1] if losses else None,
           "sft_seconds": time.perf_counter() - t}
    if accuracy is not None:
        out["sft_eval_accuracy"] = accuracy
    return out
