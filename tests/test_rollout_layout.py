"""vLLM tensor parallelism inside the trainer (issue 8).

Without processes: the rollout layout's arithmetic (engines, prompt slices) and the config
validation of (training TP x PP x DP, rollout k) before anything starts.

One rank launch (tests/_rollout_layout_worker.py): 4 ranks, training TP=2 x PP=2, two vLLM
engines of tensor_parallel_size=2 (external_launcher on ranks [0, 1] and [2, 3]) fed shard to
shard. vLLM greedy equals a megatron argmax loop before and after an optimizer step, the
trainer's log-probs match vLLM's in fp32, and the bytes each rank receives are measured for the
full-tensor feed (what vLLM TP=1 engines need; the k=1 trainer itself is tests/test_trainer.py)
and for the shard-to-shard feed.
"""
import json
import os

import pytest

from megagrpo.config.layout import RolloutLayout, check_rollout_layout
from megagrpo.config.model import ModelConfig, ParallelConfig
from tests.support.launch import run_ranks_results

WORKER = os.path.join(os.path.dirname(__file__), "_rollout_layout_worker.py")


def _layouts(world: int, k: int, tp: int, pp: int) -> list[RolloutLayout]:
    return [RolloutLayout(rank=r, world_size=world, engine_tp=k, train_tp=tp, train_pp=pp)
            for r in range(world)]


def _replica(rank: int, tp: int, pp: int, world: int) -> int:
    """Megatron's DP rank of `rank` (TP fastest, then DP, then PP), computed independently."""
    dp = world // (tp * pp)
    return (rank // tp) % dp


@pytest.mark.parametrize("world,k,tp,pp", [(4, 2, 2, 2), (4, 1, 2, 2), (4, 4, 2, 2), (8, 2, 2, 2),
                                           (8, 2, 4, 1), (8, 1, 1, 1), (2, 2, 2, 1)])
def test_engines_sample_each_replica_prompt_exactly_once(world, k, tp, pp):
    layouts = _layouts(world, k, tp, pp)
    B = 7  # not a multiple of the engine count
    for dp_rank in range(world // (tp * pp)):
        members = [lay for lay in layouts if _replica(lay.rank, tp, pp, world) == dp_rank]
        engines = {lay.engine: lay.prompt_indices(B) for lay in members}
        sampled = sorted(i for idx in engines.values() for i in idx)
        assert sampled == list(range(B))  # every prompt once, by one engine of this replica
        for lay in members:  # an engine's ranks all lie in this replica
            assert {_replica(r, tp, pp, world) for r in lay.engine_ranks()} == {dp_rank}
            assert not lay.pooled
    assert sum(lay.is_leader for lay in layouts) == world // k


@pytest.mark.parametrize("world,k,tp,pp", [(4, 2, 1, 1), (8, 4, 2, 1), (8, 4, 1, 2)])
def test_engines_spanning_replicas_sample_the_pool_exactly_once(world, k, tp, pp):
    layouts = _layouts(world, k, tp, pp)
    dp, B = world // (tp * pp), 3
    spans = {len({_replica(r, tp, pp, world) for r in lay.engine_ranks()}) for lay in layouts}
    assert max(spans) > 1 and all(lay.pooled for lay in layouts)
    engines = {lay.engine: lay.prompt_indices(dp * B) for lay in layouts}
    assert sorted(i for idx in engines.values() for i in idx) == list(range(dp * B))


def test_shard_to_shard_only_when_k_equals_training_tp():
    assert all(lay.shard_to_shard for lay in _layouts(4, 2, 2, 2))
    assert not any(lay.shard_to_shard for lay in _layouts(4, 1, 2, 2) + _layouts(4, 4, 2, 2))
    assert "2 vLLM engine(s) of 2 rank(s)" in _layouts(4, 2, 2, 2)[0].describe()


def test_invalid_layouts_are_refused_with_the_reason():
    model = ModelConfig(num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide model\."
                                         r"num_attention_heads=4"):
        check_rollout_layout(3, ParallelConfig(), model, 6)
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        check_rollout_layout(4, ParallelConfig(), model, 2)
    with pytest.raises(ValueError, match="model.num_query_groups=2: vLLM needs one"):
        check_rollout_layout(3, ParallelConfig(), ModelConfig(num_attention_heads=6,
                                                              num_query_groups=2), 6)
    check_rollout_layout(4, ParallelConfig(tp=2, pp=2), model, 4)  # DP = 1: any k | world
    check_rollout_layout(2, ParallelConfig(tp=2), model, 8)  # k | TP with DP = 4
    check_rollout_layout(2, ParallelConfig(tp=1), model, 4)  # pooled: spans two replicas


def test_trainer_config_checks_the_layout_before_anything_starts():
    from megagrpo.config.train import load_config

    cfg = load_config(None, ["rollout.tensor_parallel_size=2", "parallel.tp=1",
                             "data.batch_size=12"])
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        cfg.validate(world_size=3)
    cfg.validate(world_size=4)  # engines of 2 ranks over TP=1 x DP=4 replicas: pooled
    cfg.run.async_rollout = True
    with pytest.raises(ValueError, match="async_rollout needs rollout.tensor_parallel_size=1"):
        cfg.validate(world_size=2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("layout")
    return run_ranks_results(WORKER, 4, work, timeout=900)


def test_vllm_tp2_greedy_equals_megatron_before_and_after_a_step(results):
    for r in results:
        assert r["shard_to_shard"]
        meg0, vllm0 = r["greedy_initial"]
        meg1, vllm1 = r["greedy_after_step"]
        assert meg0 == vllm0 and meg1 == vllm1
        assert meg0 != meg1  # the step changed the policy and both engines follow it


def test_trainer_logprobs_match_vllm_tp2_in_fp32(results):
    gaps = [r["logprob_gap"] for r in results if r["logprob_gap"] is not None]
    assert len(gaps) == 1 and gaps[0] < 1e-5, gaps  # the last stage's TP rank 0
    assert results[0]["step"]["logp_gap_vllm_mean"] < 1e-5


def test_engines_sample_disjoint_prompt_slices_and_the_batch_is_whole(results):
    engines = {r["prompts"]["engine"]: r["prompts"]["mine"] for r in results}
    assert len(engines) == 2 and sorted(sum(engines.values(), [])) == [0, 1, 2, 3]
    for r in results:  # B prompts x G completions, each exactly once
        p = r["prompts"]
        assert p["num_completions"] == p["distinct"] == p["num_prompts"] * 4


def test_shard_to_shard_receives_about_half_and_no_full_model_buffer(results):
    for r in results:
        full, mine = r["feed_full"], r["feed_slices"]
        model_bytes = r["sync"]["sync_bytes"]  # every HF tensor, full shape, as vLLM gets it
        # measured: bytes that arrived through collectives, full-tensor feed vs shard to shard
        assert 0 < mine["received"] <= 0.55 * full["received"], (mine, full)
        assert r["sync"]["sync_received_bytes"] == mine["received"]  # the trainer's feed
        # one bucket buffer plus one HF tensor at a time, far from the whole model
        assert mine["peak"] <= mine["buffer"] + mine["largest"], mine
        assert mine["peak"] < model_bytes / 4, (mine, model_bytes)


def test_eval_accuracy_is_the_known_share_on_every_rank(results):
    """Two TP=2 engines split the 8 held-out prompts, 3 of whose answers are the greedy
    completions (tests/_trainer_worker.py: known_share_eval): every rank reports 3/8, the share
    the task's own check scores on the completions decoded in the worker (engine 0's slice
    holds 2 of its 4 right, engine 1's 1 of 4). One engine's slice evaluated by both or by none,
    a rank counting prompts it did not score, or an engine decoding with other weights or
    settings would change it."""
    for r in results:
        e = r["eval_accuracy"]
        assert e["expected"] == 3 / 8, e
        assert e["accuracy"] == e["reference"] == e["expected"], e


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_slices_are_what_vllm_narrows_from_the_full_hf_tensors(arch):
    """Each TP rank's slice tensors (built from its megatron shard alone) hold, in the region
    vLLM's loaders read (rows or columns [r*n, (r+1)*n) of each HF tensor), exactly the full
    HF tensor's values; the full tensors come from all shards via `unfuse_shards`."""
    import torch

    from megagrpo.hf import param_specs, unfuse_shards
    from megagrpo.sync.source import slice_pairs

    tp = 2
    model = ModelConfig(architecture=arch, num_attention_heads=8, num_query_groups=2,
                        head_dim=4, hidden_size=16, ffn_hidden_size=12, qkv_bias=arch == "qwen2")
    g = torch.Generator().manual_seed(0)
    for spec in param_specs(model, ParallelConfig(tp=tp, make_vocab_size_divisible_by=8), 0):
        if spec.kind in ("vocab", "replicated"):
            continue  # vocab is gathered whole; replicated tensors pass through
        full_meg = torch.randn(spec.full_shape, generator=g)
        shards = list(full_meg.chunk(tp, dim=spec.split_dim))  # megatron's TP split
        reference = dict(unfuse_shards(shards, spec, model))
        dim = 1 if spec.kind == "row" else 0
        for r in range(tp):
            for name, got in slice_pairs(shards[r].contiguous(), spec, model, r):
                want = reference[name]
                n = want.shape[dim] // tp
                assert got.shape == want.shape, name
                assert torch.equal(got.narrow(dim, r * n, n), want.narrow(dim, r * n, n)), name


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    """Training TP=1 x DP=4 with two vLLM TP=2 engines: each engine spans two replicas."""
    work = tmp_path_factory.mktemp("pooled")
    return run_ranks_results(WORKER, 4, work, "--pooled", timeout=900)


def test_engines_spanning_replicas_serve_each_replica_its_own_prompts(pooled):
    assert all(r["pooled"] for r in pooled) and sorted(r["dp_rank"] for r in pooled) == [0, 1, 2,
                                                                                           3]
    assert len({json.dumps(r["prompts"]["prompts"]) for r in pooled}) == 4  # 4 different batches
    for r in pooled:
        meg0, vllm0 = r["greedy_initial"]
        meg1, vllm1 = r["greedy_after_step"]
        assert meg0 == vllm0 and meg1 == vllm1 and meg0 != meg1
        p = r["prompts"]
        assert p["num_completions"] == p["distinct"] == p["num_prompts"] * 4
        # completions sit on the prompt they were sampled for: the trainer's log-probs of
        # (prompt + completion) equal vLLM's (every rank is a last stage at TP=1 x PP=1)
        assert r["logprob_gap"] is not None and r["logprob_gap"] < 1e-5
    engines = {r["prompts"]["engine"]: r["prompts"]["mine"] for r in pooled}
    assert sorted(sum(engines.values(), [])) == [0, 1, 2, 3]  # the pool of 4 replicas x 1
