"""A rollout rank's whole run under separate placement (`megagrpo.rollout.placement`'s module
docstring says what flows where): `serve` samples batch after batch with the newest weights it
may use, takes every sync, evaluation and checkpoint request the trainer sends, and with
rollout.engine_failure=continue reports itself out when its engine fails and makes up the
shares of failed ranks (`MakeUps`)."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megagrpo.engine.process import EngineLost
from megagrpo.rollout.in_flight import send_state
from megagrpo.rollout.placement import (
    Placement,
    Sync,
    eval_digest,
    receive_posted,
    receive_weights,
)
from megagrpo.rollout.sample_channel import Part, TensorChannel, pack, unpack
from megagrpo.rollout.stream import stamp

if TYPE_CHECKING:
    from megagrpo.config.train import TrainConfig
    from megagrpo.rollout.collect import RolloutCollector

log = logging.getLogger("megagrpo")


# ---------------------------------------------------------------------- the rollout ranks
def serve(cfg: TrainConfig, place: Placement, collector: RolloutCollector, watchdog,
          held_out: list | None = None) -> dict:
    """A rollout rank's whole run: sample batch after batch with the newest weights it has
    (at least sync i - k for batch i), put each finished part in the store, and evaluate
    `held_out` (its share, greedy) whenever the trainer asks, until the trainer says stop.
    Returns what it did."""
    k, B = cfg.staleness, cfg.data.batch_size
    loader = collector.loader
    watchdog.set_phase("weight_sync", 0)  # phases name a stall, as on the training ranks
    sync, evals = _until_started(place, collector, held_out or [], watchdog)
    if sync.start is not None:
        loader.load_state_dict(sync.start)
    last = sync.batches - 1 if sync.batches is not None else None
    base = sync.index  # batch i: sync base + i - k or newer (base > 0 after a cold start)
    # groups whole: every sample of a prompt on one engine (all of whose ranks draw it)
    mine = list(range(place.engine_index, B, place.engines))
    channel = place.channel(B)
    i, ckpts, starts = 0, 0, {}  # starts: batch -> (sampler state, loader) before its draw
    if sync.restore is not None:  # a resumed launch: the checkpoint's queued parts first
        i = restore_in_flight(collector, channel, sync.restore)
    topups = 0
    makeups = MakeUps(place) if place.failover else None
    while not sync.stop:
        if makeups is not None:  # rollout.engine_failure=continue
            makeups.check_engine(collector.engine, i)
            if makeups.serve(collector, channel, starts, i, sync):
                continue
        # an engine's ranks count the same top-ups: its leader's count
        topups = _leaders(place, _topups_asked(place, topups))
        step = i - topups  # the trainer's step the next draw goes to (top-ups: part of theirs)
        # at most k syncs behind; the launch's last batch on-policy (k = 0)
        behind = sync.index < base + step - (0 if step == last else k)
        behind = behind or (makeups is not None and makeups.out)  # an out rank draws nothing
        due = (sync, evals, ckpts)  # the messages a broadcast may be on its way for
        if behind and cfg.algo.dynamic_sampling and not _agree(place, _message_due(place, *due)):
            watchdog.set_phase("weight_sync", i)  # or a top-up of this step, asked first
            if place.engine_rank == 0:  # its peers wait for the count it sends next round
                _await_topup_or_message(place, due, topups)
            continue
        if behind and makeups is not None and not _message_due(place, *due):
            watchdog.set_phase("weight_sync", i)  # polled: a make-up may be asked meanwhile
            time.sleep(0.005)
            continue
        # an engine's ranks take the same syncs at the same point (its leader decides)
        if _agree(place, behind or _message_due(place, *due)):
            watchdog.set_phase("weight_sync", i)
            got = receive_weights(place, collector.engine)
            if got.eval is not None:  # with the weights of every sync sent before it
                evals = _as_out_if_lost(makeups, collector.engine, i, functools.partial(
                    _evaluate, place, collector, got.eval, held_out or [], watchdog))
            elif got.checkpoint is not None:
                ckpts = _as_out_if_lost(makeups, collector.engine, i, functools.partial(
                    save_in_flight, place, collector, channel, got.checkpoint, starts, i,
                    topups))
            else:
                sync = got
            continue
        watchdog.set_phase("rollout", i)
        try:
            sync = _draw(place, collector, channel, sync, starts, i, mine)
        except EngineLost as e:
            if makeups is None:
                raise
            makeups.report(e, i)  # out from batch i: the trainer has its share made up
            continue
        for old in [b for b in starts if b < i - k - 4]:  # the trainer took them long ago
            del starts[old]
        i += 1
    channel.close()
    return {"batches": i, "syncs": sync.index, "sample_bytes": channel.bytes_sent,
            "evaluations": evals, "weight_bytes_received": place.received_bytes}


def _as_out_if_lost(makeups: MakeUps | None, engine, i: int, answer):
    """`answer(out=...)` for a message a rank answers whether or not its engine lives (an
    evaluation, a checkpoint's in-flight state): as an out rank once its engine was lost, also
    when the engine dies during the answer (nothing is sent before the engine's part is done).
    Without rollout.engine_failure=continue (`makeups` None) a lost engine raises."""
    if makeups is None:
        return answer(out=False)
    makeups.check_engine(engine, i)
    try:
        return answer(out=makeups.out)
    except EngineLost as e:
        makeups.report(e, i)
        return answer(out=True)


def _draw_args(collector: RolloutCollector, examples: list, mine: list[int]) -> tuple:
    """`RolloutCollector._generate`'s arguments for prompts `mine` of a batch's `examples`."""
    return ([_encode(collector.tokenizer, e.prompt) for e in examples],
            [e.answer for e in examples], mine, collector.sampling(),
            [e.record for e in examples], [e.prompt for e in examples])


def _draw(place: Placement, collector: RolloutCollector, channel: TensorChannel, sync: Sync,
          starts: dict[int, tuple], i: int, mine: list[int]) -> Sync:
    """Rollout rank: draws prompts `mine` of batch i (the loader's next), with the engine's
    weights (and, in flight or with partial rollouts, every sync announced meanwhile), and
    puts the part in the channel; `starts[i]`: the sampler's streams and the loader position
    before it. Returns the newest sync."""
    cfg, loader, t0 = collector.cfg, collector.loader, time.perf_counter()
    before = loader.state_dict()
    starts[i] = (collector.engine.rng_state(), before)
    args = _draw_args(collector, next(loader), mine)
    first = sync
    if cfg.rollout.partial_rollouts:  # paused at each announced sync, continued after it
        (comps, rewards, metrics), sync = _generate_partial(place, collector, args, sync)
    elif getattr(collector.engine, "inflight", None) is None:
        comps, rewards, metrics = collector._generate(*args)
    else:
        (comps, rewards, metrics), sync = _generate_inflight(place, collector, args, sync)
    stamp(comps, first.index)  # sync indices (per token in flight); the trainer maps them
    leads = place.engine_rank == 0  # an engine's other ranks drew the same: they send none
    channel.put(Part(batch=i, rollout=place.rollout_index, loader=before, epoch=loader.epoch,
                     draw_s=time.perf_counter() - t0, metrics=metrics if leads else {},
                     completions=comps if leads else [],
                     rewards=rewards.tolist() if leads else []))
    return sync


@dataclass
class MakeUps:
    """A rollout rank's side of rollout.engine_failure=continue: it reports itself out when its
    engine fails (`report`; the store's `out/{j}`: the first batch it did not draw), and it
    draws the shares of failed ranks that training rank 0 asks it to make up (`makeup/{m}`),
    each from the prompts of that batch, once it has drawn its own part of it."""

    place: Placement
    out: bool = False
    seen: int = 0
    """Make-up requests read from the store so far (every rank reads them all)."""
    asked: list = field(default_factory=list)
    """Requests addressed to this rank, not drawn yet: (batch, slot)."""

    def check_engine(self, engine, i: int) -> None:
        """Reports the rank out once its engine was lost outside a draw (e.g. in a sync, whose
        tensors it then drained)."""
        alive = getattr(engine, "alive", None)
        if alive is not None and not alive() and not self.out:
            self.report(engine.lost, i)

    def report(self, lost: EngineLost, i: int) -> None:
        self.out = True
        self.place.store.set(f"out/{self.place.rollout_index}", json.dumps(
            {"batch": i, "pid": lost.pid, "how": lost.how}))
        log.warning("rollout rank %d: %s at batch %d; it draws no more and keeps taking the "
                    "trainer's syncs (rollout.engine_failure=continue)", self.place.rank, lost,
                    i)

    def serve(self, collector: RolloutCollector, channel: TensorChannel,
              starts: dict[int, tuple], i: int, sync: Sync) -> bool:
        """Draws one make-up asked of this rank whose batch it has drawn (< i); whether it did.
        The make-up uses the engine's newest weights (at least as new as the batch needs) and
        is put after this rank's own part of that batch (the order the trainer receives)."""
        store, j = self.place.store, self.place.rollout_index
        while store.check([f"makeup/{self.seen}"]):
            ask = json.loads(store.get(f"makeup/{self.seen}"))
            self.seen += 1
            if ask["by"] == j:
                self.asked.append((ask["batch"], ask["slot"]))
        ready = [a for a in self.asked if a[0] < i]
        if self.out or not ready:
            return False
        b, slot = ready[0]
        self.asked.remove(ready[0])
        if b not in starts:
            raise RuntimeError(f"rollout rank {self.place.rank}: asked to make up rollout rank "
                               f"{self.place.train_world + slot}'s share of batch {b}, which it "
                               "drew too long ago")
        loader, t0 = collector.loader, time.perf_counter()
        here, before = loader.state_dict(), starts[b][1]
        loader.load_state_dict(before)
        examples = next(loader)
        loader.load_state_dict(here)
        mine = list(range(slot, collector.cfg.data.batch_size, self.place.engines))
        try:
            comps, rewards, metrics = collector._generate(*_draw_args(collector, examples, mine))
        except EngineLost as e:
            self.report(e, i)
            return True
        stamp(comps, sync.index)
        channel.put(Part(batch=b, rollout=slot, loader=before, epoch=before["epoch"],
                         draw_s=time.perf_counter() - t0, metrics=metrics, completions=comps,
                         rewards=rewards.tolist(), by=j))
        log.info("rollout rank %d: made up rollout rank %d's share of batch %d (%d prompts)",
                 self.place.rank, self.place.train_world + slot, b, len(mine))
        return True


def _agree(place: Placement, flag: bool) -> bool:
    """`flag` as the leader of this rollout rank's engine sees it (engines of one rank: as
    is). The ranks of an engine of TP > 1 run vLLM's collectives together: they must take a
    sync (or draw) at the same point, and store checks made on each rank could differ."""
    return bool(_leaders(place, int(flag)))


def _leaders(place: Placement, value: int) -> int:
    """`value` as the leader of this rollout rank's engine has it (engines of one rank: as
    is); collective over the engine's ranks."""
    if place.engine_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    place.engine_group.broadcast(t, 0).wait()
    return int(t.item())


def _topups_asked(place: Placement, known: int) -> int:
    """Rollout rank: how many dynamic-sampling top-ups the trainer has asked for so far in this
    launch (`known` of them counted before). A top-up is drawn as part of the step it tops up:
    with the weights that step's batch may be drawn with."""
    while place.store.check([f"topup/{known}"]):
        known += 1
    return known


def _await_topup_or_message(place: Placement, due: tuple, topups: int) -> None:
    """Rollout rank with dynamic sampling, behind the weights its next draw needs: polls the
    store until the trainer asks for top-up `topups` or announces its next message (`due`:
    `_message_due`'s arguments; a blocking receive would not see a top-up asked first)."""
    while not (place.store.check([f"topup/{topups}"]) or _message_due(place, *due)):
        time.sleep(0.005)


def _message_due(place: Placement, sync: Sync, evals: int, ckpts: int) -> bool:
    """Rollout rank: the trainer has announced the next sync (or the stop), evaluation
    `evals` or checkpoint `ckpts`: its broadcast over the cross group is on its way."""
    return (place.announced(sync.index + 1) or place.eval_asked(evals)
            or place.checkpoint_asked(ckpts))


def _until_started(place: Placement, collector: RolloutCollector, held_out: list, watchdog
                   ) -> tuple[Sync, int]:
    """Rollout rank, before its first batch: the cross group's messages until the one that
    starts sampling (the first sync, or after a cold start the trainer's release), loading
    every sync and serving every evaluation on the way. Returns (the newest sync, with the
    start and the batch count; the evaluations served)."""
    sync, evals = None, 0
    while True:
        got = receive_weights(place, collector.engine)
        if got.eval is not None:
            evals = _evaluate(place, collector, got.eval, held_out, watchdog)
            continue
        if got.checkpoint is not None:  # nothing drawn yet: the sampler's streams only
            send_state(place.samples, 0, {"next": 0, "loader": None, "parts": [],
                                          "rng": collector.engine.rng_state()})
            continue
        if got.release:  # the cold start's syncs are in: sample from the newest on
            got = dataclasses.replace(sync, start=got.start, batches=got.batches)
        sync = got
        if sync.start is not None or sync.stop:
            return sync, evals



def _evaluate(place: Placement, collector: RolloutCollector, ask: dict, held_out: list,
              watchdog, out: bool = False) -> int:
    """Rollout rank: its share of held-out evaluation `ask` (examples j, j + R, ...), greedy
    with the weights its engine holds; (correct, counted) into the store (a rank whose engine
    failed, `out`: (0, 0), its share not evaluated). Returns the next evaluation's index."""
    e = ask["index"]
    if out:
        place.store.set(f"eval/{e}/{place.rollout_index}", json.dumps([0, 0]))
        return e + 1
    if ask["n"] != len(held_out) or ask["digest"] != eval_digest(held_out):
        raise RuntimeError(f"separate placement: the trainer evaluates {ask['n']} held-out "
                           f"examples (digest {ask['digest']}), this rollout rank holds "
                           f"{len(held_out)} (digest {eval_digest(held_out)}): both sides must "
                           "read the same data.eval_path / arithmetic.num_eval")
    watchdog.set_phase("eval", e)
    mine = list(range(place.engine_index, len(held_out), place.engines))
    streams = collector.engine.rng_state()  # left as found: a resumed launch evaluates where
    correct = collector.count_correct(held_out, mine) if mine else 0  # the run did not
    collector.engine.set_rng_state(streams)
    counted = len(mine) if place.engine_rank == 0 else 0  # the leader reports its engine's
    place.store.set(f"eval/{e}/{place.rollout_index}", json.dumps([correct, counted]))
    return e + 1


def _generate_inflight(place: Placement, collector: RolloutCollector, args: tuple, sync: Sync
                       ) -> tuple[tuple, Sync]:
    """One batch with in-flight updates: the engine generates on a thread while this one
    receives every sync the trainer sends meanwhile (the cross group's broadcasts stay on this
    thread) and posts it; the generating thread loads the newest between decode steps, its KV
    cache kept. A sync posted after the last decode step is loaded here before returning, so the
    engine holds the newest weights between batches. Returns the draw and the newest sync (a
    stop message ends the run after this batch)."""
    engine, out, failed = collector.engine, [], []

    def draw() -> None:
        try:
            out.append(collector._generate(*args))
        except BaseException as e:  # re-raised on this thread
            failed.append(e)

    thread = threading.Thread(target=draw, name="megagrpo-inflight-draw", daemon=True)
    thread.start()
    while thread.is_alive():
        if not sync.stop and place.announced(sync.index + 1):
            sync = receive_posted(place, engine)
        else:
            thread.join(timeout=0.005)
    if failed:
        raise failed[0]
    engine.inflight.apply_pending(engine)  # arrived after the last decode step
    return out[0], sync


def _generate_partial(place: Placement, collector: RolloutCollector, args: tuple, sync: Sync
                      ) -> tuple[tuple, Sync]:
    """One batch with partial rollouts (rollout.partial_rollouts): its trajectories generated
    on a thread (`RolloutCollector.continue_partial`; multi-turn ones through the agent's
    runner, their environments on this rank) while this one watches for the trainer's next
    sync; once it is announced the draw pauses between two decode steps or two turns
    (trajectories at the cap, rollout.partial_max_updates, are generated to their end first),
    this thread loads the sync, and the paused trajectories continue with the new weights,
    their prefixes recomputed; every model token is stamped with the sync that sampled it. The
    batch is scored once whole. Returns the draw and the newest sync (a stop message: the rest
    is generated with the weights held, and the run ends after this batch)."""
    from megagrpo.rollout.collect import record_scores

    prompts, answers, mine, sampling, records, texts = args
    trajs, done, recomputed = collector.start_partial(prompts, mine, sampling.n), [], 0
    while trajs:
        pause = None if sync.stop else threading.Event()
        res = _watching(place, sync, pause, functools.partial(
            collector.continue_partial, prompts, records, trajs, sync.index, pause))
        done, trajs = done + res.finished, res.paused
        recomputed += res.recomputed
        if trajs:  # paused: the announced sync is the next message (nothing else is sent
            sync = receive_weights(place, collector.engine)  # before it while a batch waits)
    metrics = {"partial_recomputed_tokens": float(recomputed)}
    comps, pending = collector.finish_partial(done, prompts, answers, records, texts, metrics)
    rewards, scored = record_scores(comps, pending)
    return (comps, rewards, dict(scored, **metrics)), sync


def _watching(place: Placement, sync: Sync, pause: threading.Event | None, draw):
    """`draw()` on a thread of its own; `pause` set once the trainer announces the sync after
    `sync`. Returns what `draw` returned (re-raises what it raised)."""
    out, failed = [], []

    def run() -> None:
        try:
            out.append(draw())
        except BaseException as e:  # re-raised on this thread
            failed.append(e)

    thread = threading.Thread(target=run, name="megagrpo-partial-draw", daemon=True)
    thread.start()
    while thread.is_alive():
        if pause is not None and not pause.is_set() and place.announced(sync.index + 1):
            pause.set()
        thread.join(timeout=0.005)
    if failed:
        raise failed[0]
    return out[0]


def _encode(tokenizer, prompt) -> list[int]:
    from megagrpo.data import encode_prompt

    return encode_prompt(tokenizer, prompt)


# ---------------------------------------------------------------------- in-flight state
def save_in_flight(place: Placement, collector: RolloutCollector, channel: TensorChannel,
                   ask: dict, starts: dict[int, tuple], i: int, topups: int = 0,
                   out: bool = False) -> int:
    """Rollout rank, between two draws, when the trainer checkpoints (`ask`: its index, the
    batches the trainer took, the launch's batch count and sync index -> policy version):
    sends training rank 0 its in-flight state (`send_state`): the finished parts of batches
    the trainer has not taken and will (their versions made policy versions, their batch
    indices counted from the checkpoint's first untrained batch), and the sampler's streams
    and loader position before the first batch not kept (batches drawn past the launch's
    end are drawn again on resume, as the uninterrupted run draws them). Every batch drawn
    with weights older than the checkpoint's is finished by now (a sync waits for the draw
    it interrupts), so a resumed launch draws the rest with the same weights and streams as
    the uninterrupted one. A rank whose engine failed (`out`) sends only that it is out (the
    checkpoint then keeps no in-flight state). Returns the next checkpoint's index."""
    if out:
        send_state(place.samples, 0, {"next": 0, "loader": None, "rng": {}, "parts": [],
                                      "out": True})
        return ask["index"] + 1
    taken, batches = ask["taken"], ask["batches"]
    # dynamic sampling: the `topups` asked so far are draws of the launch's steps too
    end = i if batches is None else min(i, batches + topups)
    versions = {int(s): v for s, v in ask["versions"].items()}
    rng, loader = starts[end] if end < i else (collector.engine.rng_state(),
                                              collector.loader.state_dict())
    parts = [pack(_restamped(p, taken, versions)) for p in channel.unsent(taken, end)]
    send_state(place.samples, 0, {"next": end - taken, "loader": loader, "rng": rng,
                                  "parts": parts})
    return ask["index"] + 1


def _restamped(part: Part, taken: int, versions: dict[int, int]) -> Part:
    """`part` as a checkpoint keeps it: batch counted from the first untrained one, each
    completion's (and token's) sync index replaced by the policy version it carried."""
    comps = part.completions
    if not part.policy_versions:
        comps = comps.with_versions(versions)
    return dataclasses.replace(part, batch=part.batch - taken, completions=comps,
                               policy_versions=True)


def restore_in_flight(collector: RolloutCollector, channel: TensorChannel, state: dict) -> int:
    """Rollout rank, at the first sync of a resumed launch: its in-flight state from the
    checkpoint (`save_in_flight`) put back: the loader position and the sampler's streams
    of its next draw, the finished parts queued again (sent when the trainer asks). Returns
    the next batch to draw."""
    if state["loader"] is not None:
        collector.loader.load_state_dict(state["loader"])
    collector.engine.set_rng_state(state["rng"])
    for buf in state["parts"]:
        channel.put(unpack(buf))
    return state["next"]
