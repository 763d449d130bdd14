"""In-flight weight updates (rollout.inflight_updates): new weights enter a running generation.

With async rollouts (rollout.max_staleness = k >= 1) the engine draws the next batches on a
side thread while the trainer updates. Without in-flight updates that draw finishes on the
weights it started with and the trainer refits vLLM after it (`Trainer.sync_weights`). With
them, the trainer posts its refit tensors to a one-deep slot (`InflightUpdates.post`, on the
main thread: the gather's collectives never leave it) and the generating thread, which runs
vLLM's engine step by step itself (`InflightUpdates.run`, instead of `LLM.generate`), loads
them between two decode steps. Running requests are not dropped or restarted: their KV cache
is kept, so the tokens sampled after the update attend to keys and values that earlier
weights computed (PipelineRL and open-instruct accept the same). vLLM's log-probs of those
tokens are of exactly that mixed computation: the behaviour policy that sampled them, which
is what the decoupled correction needs (`megagrpo.train.offpolicy`).

Per-token versions: after every load the engine's weight label is set to the policy version
(vLLM 0.32's `set_weight_version`); vLLM labels every step's output with it and hands each
finished completion its spans (`CompletionOutput.weight_versions`), from which
`token_versions` gives `Completion.token_versions` (one int per completion token,
non-decreasing). `Completion.version` is then the oldest of them (`megagrpo.rollout.stream.stamp`).

Limits: one engine rank (vLLM TP > 1 would need every rank of an engine to load at the same
decode step); the prefix cache cannot be reset while requests hold blocks, so it is reset when
the generation ends (a request admitted after the update while others run may reuse a cached
prompt prefix of the older weights: the same kept-KV approximation).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megagrpo.engine.types import Completion, WeightSyncStats


@dataclass
class _Posted:
    pairs: list[tuple[str, torch.Tensor]]
    """(hf_name, tensor) pairs of a whole refit, materialised by the poster."""
    version: int


class InflightUpdates:
    """The slot between the trainer (posts a refit) and the generating thread (loads it between
    decode steps), and the step loop that generates with it. One per engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Posted | None = None
        self.version = -1
        """The policy version the engine's weights hold (-1: none labelled yet)."""
        self.generating = False
        """A `run` is in progress (on some thread)."""
        self.midway = 0
        """Updates loaded between decode steps of a running generation since the last
        `take_counts` (the trainer's per-step metric)."""
        self.last_stats: WeightSyncStats | None = None
        """What the last load moved."""
        self.on_step: Callable[[int], None] | None = None
        """Called on the generating thread after each decode step with the step count (tests
        post from it, so that an update lands at a chosen step)."""

    # -- the slot -------------------------------------------------------------------------
    def post(self, pairs: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """Hands a whole refit (full-shape HF tensors, as `VLLMEngine.update_weights` takes)
        for policy `version` to the generating thread; a newer post replaces one not yet
        loaded. The poster must not edit the tensors until `apply_pending` ran."""
        with self._lock:
            self._pending = _Posted(list(pairs), version)

    @property
    def pending_version(self) -> int | None:
        """The version posted and not loaded yet (None: nothing pending)."""
        with self._lock:
            return None if self._pending is None else self._pending.version

    def apply_pending(self, engine, *, midway: bool = False
                      ) -> WeightSyncStats | None:
        """Loads the posted refit, if any (None: nothing was pending), and labels the engine's
        weights with its version. `midway`: requests are running, whose KV cache is kept (the
        prefix cache is reset when the generation ends, `run`)."""
        with self._lock:
            posted, self._pending = self._pending, None
        if posted is None:
            return None
        stats = engine.update_weights(posted.pairs, reset_prefix_cache=not midway)
        self.label(engine, posted.version)
        self.midway += int(midway)
        self.last_stats = stats
        return stats

    def label(self, engine, version: int) -> None:
        """Records that the engine holds policy `version`; vLLM stamps it on every token sampled
        from now on."""
        self.version = version
        engine.llm.llm_engine.set_weight_version(str(version))

    def _load_between_steps(self, engine, ids: list[str], steps: int
                            ) -> WeightSyncStats | None:
        """`apply_pending` inside `run`; a load that fails aborts the draw's requests (none is
        left running in the engine) and raises, naming the version and the step."""
        version = self.pending_version
        try:
            return self.apply_pending(engine, midway=steps > 0)
        except Exception as e:
            engine.llm.llm_engine.abort_request(list(ids), internal=True)
            raise RuntimeError(_abort_message(version, steps, len(ids), e)) from e

    def take_midway(self) -> int:
        """The count of updates loaded mid-generation since the last call, reset to 0."""
        n, self.midway = self.midway, 0
        return n

    # -- the step loop --------------------------------------------------------------------
    def run(self, engine, prompts: list[dict], params, lora_request=None) -> list:
        """Generates `prompts` (vLLM prompt dicts) with `params` (SamplingParams) by stepping
        vLLM's engine, loading a posted update before any step. Returns vLLM's finished
        RequestOutputs in request order (as `LLM.generate`)."""
        llm = engine.llm
        core = llm.llm_engine
        if getattr(core.engine_core, "engine_core", None) is not None:
            queue = getattr(core.engine_core.engine_core, "batch_queue", None)
            if queue is not None:  # a batch could be executing while the weights change
                raise RuntimeError("rollout.inflight_updates needs vLLM's synchronous scheduler "
                                   "(no batch queue / async scheduling)")
        ids = llm.enqueue(prompts, params, lora_request=lora_request, use_tqdm=False)
        outputs, steps, loaded = [], 0, False
        self.generating = True
        try:
            while core.has_unfinished_requests():
                stats = self._load_between_steps(engine, ids, steps)
                loaded = loaded or (stats is not None and steps > 0)
                outputs += [out for out in core.step() if out.finished]
                steps += 1
                if self.on_step is not None:
                    self.on_step(steps)
        finally:
            self.generating = False
        if loaded:  # the reset the mid-generation loads could not do (blocks were in use)
            llm.reset_prefix_cache()
        return sorted(outputs, key=lambda o: int(o.request_id))


def _abort_message(version: int | None, steps: int, n: int, error: BaseException) -> str:
    return (f"rollout.inflight_updates: loading the weights of policy version {version} before "
            f"decode step {steps + 1} failed ({type(error).__name__}: {error}); the draw's {n} "
            "requests were aborted and the engine's weights may be partly updated, so the run "
            "stops here: resume from the last checkpoint")


def token_versions(output) -> list[int]:
    """One policy version per token of a finished vLLM CompletionOutput, from its weight-version
    spans ([] when vLLM reported none; an unlabelled span, vLLM's 'default', is -1)."""
    spans = getattr(output, "weight_versions", None) or []
    out: list[int] = []
    for span in spans:
        version = int(span.version) if str(span.version).lstrip("-").isdigit() else -1
        out += [version] * (span.end - span.start)
    return out


def attach_token_versions(outputs: list, done: list[Completion]) -> None:
    """Sets `token_versions` on the completions `done` built from `outputs` (prompt-major, the
    samples of each output sorted by index, as `VLLMEngine.generate` builds them)."""
    flat = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    for comp, c in zip(done, flat):
        versions = token_versions(c)
        if len(versions) != len(comp.token_ids):
            raise RuntimeError(f"vLLM reported {len(versions)} token versions for a completion "
                               f"of {len(comp.token_ids)} tokens")
        comp.token_versions = versions


__all__ = ["InflightUpdates", "attach_token_versions", "token_versions"]
