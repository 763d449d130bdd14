"""In-flight weight updates inside tests/_trainer_worker.py's launch (TP=2 x PP=2 trainer, one
vLLM engine per rank, k = 2): called by the worker, checked by tests/test_trainer.py."""
from __future__ import annotations

import threading
import time


def inflight_check(tr, greedy_check, steps: int = 3) -> dict:
    """Turns in-flight updates on for `steps` steps at rollout.max_staleness = 2. The draw
    thread holds at decode step 3 until the trainer's post arrives (it is gathered on the main
    thread after the update), so the weights enter every draw mid-generation; returns per step
    [inflight_midway, token_lag_mean, inflight_mixed_samples, staleness_max, stale_dropped,
    engine version == trainer version], the per-token versions of the queued batches (lengths,
    monotone, version = oldest) and the greedy vLLM-vs-megatron check afterwards."""
    from megagrpo.engine.inflight import InflightUpdates
    from megagrpo.sync import WeightSync
    from megagrpo.sync.transports.inflight import Inflight

    slot = InflightUpdates()
    tr.engine.inflight = slot
    slot.label(tr.engine, tr.engine_version)
    before = tr.weight_sync
    tr.weight_sync = WeightSync(before.source, Inflight(tr.engine, slot), before.transforms)
    tr.weight_sync.version = before.version
    tr.cfg.rollout.inflight_updates = True
    armed = threading.Event()

    def hold(step: int) -> None:
        if step == 3 and armed.is_set() and threading.current_thread() is not \
                threading.main_thread():
            armed.clear()
            deadline = time.monotonic() + 120
            while slot.pending_version is None and time.monotonic() < deadline:
                time.sleep(0.002)

    slot.on_step = hold
    rows = []
    for _ in range(steps):
        armed.set()
        m = tr.step()
        rows.append([m["inflight_midway"], m["token_lag_mean"], m["inflight_mixed_samples"],
                     m["staleness_max"], m["stale_dropped"],
                     slot.version == tr.version == tr.engine_version])
    slot.on_step = None
    queued = [c for d in tr.rollouts.queue for c in d.completions]
    tokens_ok = all(c.token_versions is not None and len(c.token_versions) == len(c.token_ids)
                    and c.token_versions == sorted(c.token_versions)
                    and c.version == min(c.token_versions) for c in queued)
    mixed = sum(len(set(c.token_versions or ())) > 1 for c in queued)
    out = {"steps": rows, "queued": len(queued), "queued_tokens_ok": tokens_ok,
           "queued_mixed": mixed, "greedy_after": greedy_check(tr)}
    tr.engine.inflight = None
    before.version, tr.weight_sync = tr.weight_sync.version, before
    tr.cfg.rollout.inflight_updates = False
    return out
