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
import re
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


STOP_IDS = (3, *range(4, 19, 2))
"""The multi-turn checks' turn ends on the arithmetic tokenizer (about half the ids)."""


def digits_layout(tok, c, prompt_b: int, max_tokens: int) -> list[bool] | None:
    """The model / environment split of a Digits trajectory (tests/_agent_env.py) rebuilt from
    its ids alone: a turn is ids up to the first stop id (at most `max_tokens`), answered after
    turns 1 and 2 by exactly encode('<turn>=<b mod 10> '). Per id True = the model's; None when
    the ids do not parse so (an answer missing or wrong)."""
    ids, at, out = c.token_ids, 0, []
    for turn in range(3):
        end = at
        while end < len(ids) and end - at < max_tokens and ids[end] not in STOP_IDS:
            end += 1
        stopped = end < len(ids) and end - at < max_tokens  # ids[end] ends the turn
        end += stopped
        out += [True] * (end - at)
        at = end
        if not stopped or turn == 2 or at == len(ids):
            break
        answer = tok.encode(f"{turn}={prompt_b % 10} ")
        if ids[at:at + len(answer)] != answer:
            return None
        out += [False] * len(answer)
        at += len(answer)
    return out if at == len(ids) else None


def agent_partial_check(tr, steps: int = 4) -> dict:
    """Multi-turn partial rollouts at k = 1 (tests._agent_env:DigitsSaved, 3 turns, stop ids end
    about half the turns' ids): a draw on the side thread is held at its third decode step
    until the trainer's join sets the pause, so the update lands in the middle of the draw
    (some trajectories mid-turn, some between turns). Per trained batch: trajectories paused
    mid-turn / between turns (the batch metrics), trajectories whose tokens span an update,
    every model token's vLLM-vs-trainer gap per stamped version, the gap if every token were
    the trainer's version, whether the loss mask is exactly the model's ids (rebuilt from the
    ids and the environment's rule), the loss."""
    from megagrpo.agent.runner import TrajectoryRunner, environment_factory

    t0 = time.perf_counter()
    cfg, c = tr.cfg, tr.rollouts
    saved = (cfg.agent.environment, cfg.agent.max_turns, c.stop_ids, cfg.rollout.max_tokens,
             cfg.rollout.max_staleness, cfg.run.async_rollout, cfg.rollout.partial_rollouts,
             cfg.rollout.partial_max_updates)
    cfg.agent.environment, cfg.agent.max_turns = "tests._agent_env:DigitsSaved", 3
    cfg.rollout.max_staleness, cfg.run.async_rollout = 1, False
    cfg.rollout.partial_rollouts, cfg.rollout.partial_max_updates = True, 0
    cfg.rollout.max_tokens = 6
    c.runner = TrajectoryRunner(engine=tr.engine, tokenizer=tr.tokenizer, agent=cfg.agent,
                                factory=environment_factory(cfg.agent, tr.tokenizer),
                                max_model_len=cfg.rollout.max_model_len)
    c.stop_ids = STOP_IDS
    c.join()
    c.queue = []  # the single-turn batches drawn ahead before: not this check's
    tr.sync_weights()
    snapshots: dict[int, dict] = {}
    trained: list = []
    plain_next = c.next

    def recording_next(version: int):
        ro = plain_next(version)
        trained.append((tr.version, ro))
        return ro

    def hold(step: int) -> None:  # the side thread's draw waits for the pause at step 3
        if step == 3 and threading.current_thread() is not threading.main_thread():
            deadline = time.monotonic() + 120
            while not c.pause.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)

    c.next = recording_next
    tr.engine.partial_on_step = hold
    losses = []
    try:
        for _ in range(steps):
            snapshots[tr.version] = _params(tr.policy)
            losses.append(tr.step()["loss"])
        c.join()
        resume = _resume_paused(c, tr.engine_version, tr.tokenizer)
    finally:
        tr.engine.partial_on_step = None
        del c.next
        (cfg.agent.environment, cfg.agent.max_turns, c.stop_ids, cfg.rollout.max_tokens,
         cfg.rollout.max_staleness, cfg.run.async_rollout, cfg.rollout.partial_rollouts,
         cfg.rollout.partial_max_updates) = saved
        c.runner, c.queue = None, []
    rows = []
    for version, ro in trained:
        if "partial_turns_mid" not in ro.metrics:
            continue  # drawn on the main thread at the first step: no pause in it
        batch = tr.build_batch(ro)[0]
        mask = batch.real(batch.mask)
        exact = True
        for i, comp in enumerate(ro.completions):
            L, n = len(ro.prompts[comp.prompt_index]), len(comp.token_ids)
            want = digits_layout(tr.tokenizer, comp,
                                 _record_b(tr.tokenizer, ro.prompts[comp.prompt_index]), 6)
            exact &= want is not None and mask[i, L - 1:L - 1 + n].tolist() == want \
                and comp.loss_mask == want
        spans = sum(len({v for v in comp.token_versions if v >= 0}) > 1
                    for comp in ro.completions)
        gaps = _gaps(tr, ro, snapshots)
        rows.append([version, ro.metrics["partial_turns_mid"],
                     ro.metrics["partial_turns_between"], spans, exact,
                     gaps.get("per_version"), gaps.get("as_final")])
    return {"batches": rows, "losses": losses, "resume": resume,
            "seconds": time.perf_counter() - t0}


def _resume_paused(c, version: int, tok) -> list:
    """The collector's checkpoint state with the last draw paused (live environments in it)
    saved through torch.save and loaded again: [paused trajectories, of them with sampled
    tokens and an environment that saves no state, restarted on load (partial_restarted),
    trajectories whole after the restored batch is advanced, expected, continued where they
    were (their environment's state saved), of those the ones whose ids survived the load,
    trajectories ended by an environment error, whole ones whose mask is exactly Digits']."""
    import io

    from megagrpo.rollout.collect import Drawn

    paused = [len(d.unfinished) for d in c.queue]
    kept = {(id(d), t.prompt_index, t.sample_index): list(t.ids) for d in c.queue
            for t in d.unfinished if c.runner.saved(t).get("trajectory")}
    lost = sum(bool(t.ids or (t.turn is not None and t.turn.token_ids))
               for d in c.queue for t in d.unfinished
               if (id(d), t.prompt_index, t.sample_index) not in kept)
    ids_before = sorted(kept.values())
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    c.load_state_dict(torch.load(buf, weights_only=False))
    assert all(isinstance(d, Drawn) for d in c.queue)
    restarted = sum(d.metrics.get("partial_restarted", 0.0) for d in c.queue)
    ids_after = sorted(list(t.ids) for d in c.queue for t in d.unfinished if t.started)
    for d in c.queue:
        c.advance(d, version)
    whole = sum(len(d.completions) for d in c.queue if not d.unfinished)
    comps = [(d, x) for d in c.queue for x in d.completions]
    errors = sum(x.truncation == "env_error" for _, x in comps)
    exact = sum(digits_layout(tok, x, _record_b(tok, d.prompts[x.prompt_index]), 6)
                == x.loss_mask for d, x in comps)
    return [sum(paused), lost, restarted, whole, sum(len(d.completions) for d in c.queue),
            len(kept), ids_after == ids_before, errors, exact]


def _record_b(tok, prompt: list[int]) -> int:
    """The arithmetic prompt's second operand ('12+7=' -> 7: the Digits answer's source)."""
    return int(re.search(r"\d+[-+*](\d+)=", tok.decode(prompt)).group(1))
