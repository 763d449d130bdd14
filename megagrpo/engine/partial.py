"""Partial rollouts (rollout.partial_rollouts): a generation paused at a weight update and
continued with the new weights.

A draw on the async thread (rollout.max_staleness = k >= 1) runs vLLM's engine step by step
(`run_partial`, instead of `LLM.generate`). When the trainer is about to update the weights it
sets the pause signal; between two decode steps the loop takes every unfinished trajectory out
of the engine (its requests aborted, their KV blocks freed) with its exact state so far: token
ids, vLLM's log-probs and, per token, the policy version that sampled it. The weights are then
updated as in any async run (no request is running). A later call continues each trajectory as
a request whose prompt is the original prompt followed by the tokens sampled so far, with the
remaining token budget: vLLM computes the prefix's keys and values again, with the new weights,
so every token's log-prob is the one the policy of its recorded version gives it after exactly
that prefix (no KV cache of older weights is mixed in, unlike rollout.inflight_updates).

Every sample of a group is its own request (n = 1: the samples diverge and pause at different
lengths); a group's requests share the prompt's cached blocks through vLLM's prefix cache.

The cap (rollout.partial_max_updates = c): a trajectory whose oldest token is already c
versions behind the weights the engine holds is not paused at the signal but generated to its
end by those weights before the call returns (the step waits for it), so no trajectory spans
more than c updates.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from megagrpo.engine.types import Completion, SamplingSettings


@dataclass
class PartialResult:
    """What one `run_partial` call leaves: the trajectories that ended and those paused."""

    finished: list[Completion]
    paused: list[Completion]
    tokens: int
    """Tokens this call sampled (over every trajectory)."""
    recomputed: int
    """Prefix tokens whose keys and values were computed again (continued trajectories)."""


def start_trajectories(prompt_indices: list[int], n: int) -> list[Completion]:
    """`n` empty trajectories per prompt index (no token sampled yet), prompt-major."""
    return [Completion(prompt_index=p, sample_index=j, token_ids=[], logprobs=[],
                       finish_reason="", token_versions=[])
            for p in prompt_indices for j in range(n)]


def first_version(traj: Completion, version: int) -> int:
    """The version of a trajectory's oldest token (`version` when it has none yet)."""
    return traj.token_versions[0] if traj.token_versions else version


Oldest = Callable[[Completion, int], int]
"""(trajectory, the engine's version) -> the version of its oldest token: what the cap reads
(`first_version`; a multi-turn turn reads its whole trajectory's, megagrpo.agent.runner)."""


def run_partial(engine, prompts: list[list[int]], trajs: list[Completion],
                sampling: SamplingSettings, *, version: int,
                pause: threading.Event | None = None, max_updates: int = 0,
                lora_request=None, on_step: Callable[[int], None] | None = None,
                limits: list[int] | None = None, oldest: Oldest = first_version
                ) -> PartialResult:
    """Generates (or continues) `trajs` (`prompt_index` indexes `prompts`) on `engine` (a
    VLLMEngine holding policy `version`) until each ends, or until `pause` is set: then the
    trajectories whose oldest token (`oldest`) is fewer than `max_updates` versions behind
    `version` are taken out (paused, their state so far kept), the others generated to their
    end. The new tokens are appended to each trajectory in place, stamped `version`; an ended
    one gets its finish_reason. `limits`: per trajectory its own max_tokens (default
    sampling.max_tokens for all). vLLM's synchronous scheduler only (one step at a time).
    `on_step` is called after each decode step with the step count (tests hold a draw there
    until the pause)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm
    core = llm.llm_engine
    if not trajs:
        return PartialResult([], [], 0, 0)
    if pause is not None and pause.is_set():  # paused already: only the capped ones run
        held = [t for t in trajs if version - oldest(t, version) < max_updates]
        kept = {id(t) for t in held}
        run = [(t, m) for t, m in zip(trajs, limits or [sampling.max_tokens] * len(trajs))
               if id(t) not in kept]
        rest = run_partial(engine, prompts, [t for t, _ in run], sampling, version=version,
                           lora_request=lora_request, limits=[m for _, m in run])
        return PartialResult(rest.finished, held, rest.tokens, rest.recomputed)
    detok = core.tokenizer is not None
    prefix = sum(len(t.token_ids) for t in trajs)
    by_id: dict[str, Completion] = {}
    to_internal: dict[str, str] = {}
    for t, most in zip(trajs, limits or [sampling.max_tokens] * len(trajs), strict=True):
        left = most - len(t.token_ids)
        if left < 1:
            raise ValueError(f"run_partial: trajectory ({t.prompt_index}, {t.sample_index}) "
                             f"already holds {len(t.token_ids)} tokens of max_tokens={most}")
        # DELTA outputs every step (LLM.generate asks for the final one only): the state of a
        # request at any step is what its outputs added up to
        params = SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=left, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids) or None, detokenize=detok,
            output_kind=RequestOutputKind.DELTA)
        rid = str(next(llm.request_counter))  # LLM's own counter: no clash with its requests
        prompt = {"prompt_token_ids": list(prompts[t.prompt_index]) + t.token_ids}
        # outputs carry `rid`; an abort with internal=True takes the id add_request returns
        to_internal[rid] = core.add_request(rid, prompt, params, lora_request=lora_request)
        by_id[rid] = t
    ids = list(by_id)
    ended: set[str] = set()
    paused: set[str] = set()
    stopped = False
    tokens = steps = 0
    while core.has_unfinished_requests():
        if pause is not None and not stopped and pause.is_set():
            stopped = True
            paused = {i for i in ids if i not in ended
                      and version - oldest(by_id[i], version) < max_updates}
            if paused:
                core.abort_request([to_internal[i] for i in ids if i in paused], internal=True)
            continue
        for out in core.step():
            t = by_id.get(out.request_id)
            if t is None or out.request_id in paused:
                continue
            new = out.outputs[0]
            got = list(new.token_ids)
            t.token_ids += got
            t.logprobs += [lp[tok].logprob for tok, lp in zip(got, new.logprobs or [])]
            t.token_versions += [version] * len(got)
            tokens += len(got)
            if out.finished:
                ended.add(out.request_id)
                t.finish_reason = new.finish_reason or "length"
                # the whole text, as one detokenization of every token gives it
                t.text = (core.tokenizer.decode(t.token_ids, skip_special_tokens=True)
                          if detok else "")
        steps += 1
        if on_step is not None:
            on_step(steps)
    for t in by_id.values():
        if len(t.logprobs) != len(t.token_ids):
            raise RuntimeError(f"vLLM returned {len(t.logprobs)} log-probs for "
                               f"{len(t.token_ids)} tokens")
    return PartialResult([by_id[i] for i in ids if i in ended],
                         [by_id[i] for i in ids if i not in ended], tokens, prefix)


__all__ = ["Oldest", "PartialResult", "first_version", "run_partial", "start_trajectories"]
