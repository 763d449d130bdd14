"""Partial rollouts inside tests/_trainer_worker.py's launch (TP=2 x PP=2 trainer, one vLLM
engine per rank, k = 2): called by the worker after the in-flight check, checked by
tests/test_trainer.py.

Turns rollout.partial_rollouts on for `steps` steps with no cap (k = 2), then `capped` steps
at rollout.partial_max_updates = 1. A draw on the side thread while a batch is queued is held
at its third decode step until the trainer's join sets the pause, so the weight update lands
mid-generation (rollout.max_tokens 9), and a queued batch's continuation is running at the
next pause (the cap's case). The trainer's weights are kept per version (this rank's shards); for
every batch drawn with partial rollouts that a step trained, every token's vLLM log-prob is
compared with the sharded trainer's log-prob of that token under the weights of the version
the token is stamped with (the same packed batch, scored with those weights loaded)."""
from __future__ import annotations

import dataclasses
import threading
import time

import torch


def _params(module) -> dict[str, torch.Tensor]:
    from megagrpo.model.gpt import unwrap

    return {n: p.detach().clone() for n, p in unwrap(module).named_parameters()}


def _load(module, params: dict[str, torch.Tensor]) -> None:
    from megagrpo.model.gpt import unwrap

    with torch.no_grad():
        for n, p in unwrap(module).named_parameters():
            p.copy_(params[n])


def _versions_batch(tr, ro):
    """The batch `tr.build_batch` packs from `ro`, with each token's version where its vLLM
    log-prob goes (the same rows and positions)."""
    comps = [dataclasses.replace(c, logprobs=[float(v) for v in c.token_versions])
             for c in ro.completions]
    return tr.build_batch(dataclasses.replace(ro, completions=comps))[0].rollout_logp.long()


def _gaps(tr, ro, snapshots: dict[int, dict]) -> dict:
    """Max |vLLM - trainer| over the tokens stamped with each version (last stage's TP rank 0
    holds the log-probs; None elsewhere), and the same against the *final* version's weights
    for every token (what stamping every token with the newest version would claim)."""
    batch = tr.build_batch(ro)[0]
    versions = _versions_batch(tr, ro)
    now = _params(tr.policy)
    present = sorted({int(x) for x in versions[batch.mask].tolist()})
    logps = {}
    for v in present:  # every rank runs the same passes (TP / PP collectives)
        _load(tr.policy, snapshots[v])
        logps[v] = tr.passes.logprobs(tr.policy, batch)
    _load(tr.policy, now)
    if logps[present[-1]] is None or tr.ranks.tp_rank != 0:
        return {}
    per_version = {v: float((lp - batch.rollout_logp)[batch.mask & (versions == v)].abs().max())
                   for v, lp in logps.items()}
    final = float((logps[present[-1]] - batch.rollout_logp)[batch.mask].abs().max())
    return {"per_version": per_version, "as_final": final}


def partial_check(tr, steps: int = 4, capped: int = 4) -> dict:
    """Partial rollouts for `steps` steps (cap k = 2), then `capped` steps at cap 1. Returns
    per trained partial batch: [cap, the most updates one trajectory spans, trajectories
    spanning >= 1 update, token lags (min, max), per-version max gaps, gap if every token were
    the final version's]; and whether the queue's batches were whole at the end."""
    r = tr.cfg.rollout
    saved = (r.max_tokens, r.partial_rollouts, r.partial_max_updates)
    r.max_tokens, r.partial_rollouts = 9, True
    snapshots: dict[int, dict] = {}
    trained: list[tuple[int, int, object]] = []
    collector = tr.rollouts
    plain_next = collector.next

    def recording_next(version: int):
        ro = plain_next(version)
        trained.append((r.partial_max_updates, tr.version, ro))
        return ro

    def hold(step: int) -> None:
        # a draw on the side thread with a batch already queued (a continuation, or the second
        # batch of a window) waits at its third decode step for the pause; the first batch of
        # an empty queue runs free. So every other window continues a batch across the
        # update: paused again without a cap, finished at the pause at cap 1.
        if step == 3 and collector.queue and \
                threading.current_thread() is not threading.main_thread():
            deadline = time.monotonic() + 120
            while not collector.pause.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)

    collector.next = recording_next
    tr.engine.partial_on_step = hold
    try:
        for cap, n in ((0, steps), (1, capped)):
            r.partial_max_updates = cap
            for _ in range(n):
                snapshots[tr.version] = _params(tr.policy)
                tr.step()
        collector.join()  # pauses the last draw
    finally:
        tr.engine.partial_on_step = None
        del collector.next
    snapshots[tr.version] = _params(tr.policy)
    rows = []
    for cap, version, ro in trained:
        if "partial_recomputed_tokens" not in ro.metrics:
            continue  # drawn before partial rollouts were on
        spans = [max(c.token_versions) - min(c.token_versions) for c in ro.completions]
        lags = [version - v for c in ro.completions for v in c.token_versions]
        gaps = _gaps(tr, ro, snapshots)
        rows.append([cap, max(spans), sum(s > 0 for s in spans), min(lags), max(lags),
                     gaps.get("per_version"), gaps.get("as_final")])
    for drawn in collector.queue:  # later checks train on whole batches, as before
        if drawn.unfinished:
            collector.advance(drawn, tr.engine_version)
    r.max_tokens, r.partial_rollouts, r.partial_max_updates = saved
    return {"batches": rows, "queue_whole": all(not d.unfinished for d in collector.queue)}
