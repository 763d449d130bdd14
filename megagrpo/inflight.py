"""The trainer's side of in-flight weight updates (rollout.inflight_updates; the engine's side
and the semantics: `megagrpo.engine.inflight`).

After its optimizer step the trainer gathers the refit tensors on the main thread (the TP
gathers and PP broadcasts are collectives; they never run on the generating thread) and posts
them to the engine's slot (`post_refit`); the draw running on the async thread loads them
between two decode steps. `Trainer.step` then joins the draw as before; if it had already
ended (or none ran: k batches were queued), `finish_refit` loads the posted weights on the main
thread, so the engine always holds the trainer's version once a step ends.

Which tokens are stale: a token is stale when the version that sampled it
(`Completion.token_versions`) is below the trainer's. The decoupled correction and the
rollout.max_staleness bound act per sample, by its OLDEST token (`Completion.version`): a
sample with any stale token is weighted by the truncated importance weight on every token
(on the tokens the trainer's own version sampled that weight is min(exp(old - vLLM), cap),
the vLLM-vs-trainer mismatch alone: the right weight for them too), and one whose oldest
token is more than k versions old is dropped or down-weighted whole.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megagrpo.engine.feed import _pairs
from megagrpo.reshard import ReshardStats, iter_hf_weights, iter_vllm_slices

if TYPE_CHECKING:
    from megagrpo.trainer import Trainer


def post_refit(tr: Trainer) -> dict | None:
    """Gathers the policy's weights as the engine takes them (shard to shard, or full HF
    tensors) and posts them for policy `tr.version`; returns the gather's metrics, or None when
    the engine already holds this version (no update applied: `sync_weights` refits as usual).
    The posted tensors may be live parameters (PP = 1): nothing edits them before the draw is
    joined and `finish_refit` ran."""
    if tr.version == tr.engine_version:
        return None
    if tr.adapter_refit is not None:
        raise RuntimeError("rollout.inflight_updates posts merged weights; the adapter-only "
                           "refit is not supported with it (set lora.refit=merged)")
    stats = ReshardStats()
    feed = iter_vllm_slices if tr.rollouts.layout.shard_to_shard else iter_hf_weights
    pairs = list(_pairs(feed(tr.policy, tr.model_cfg, tr.cfg.parallel,
                             bucket_bytes=tr.cfg.rollout.sync_bucket_mb << 20, stats=stats)))
    tr.inflight.post(pairs, tr.version)
    return {"sync_bytes": stats.bytes, "sync_received_bytes": stats.received_bytes,
            "sync_gather_s": stats.gather_s}


def finish_refit(engine, posted: dict) -> dict:
    """After the join: loads the posted weights if the draw did not (it had ended); the step's
    sync metrics: the gather's, vLLM's load time, and inflight_midway (1: the weights entered
    a running generation, 0: loaded after it)."""
    slot = engine.inflight
    stats = slot.apply_pending(engine) or slot.last_stats
    return dict(posted, sync_load_s=stats.seconds if stats is not None else 0.0,
                inflight_midway=float(slot.take_midway()))


__all__ = ["finish_refit", "post_refit"]
