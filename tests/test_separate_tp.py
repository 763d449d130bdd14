"""Rollout engines at tensor parallelism > 1 under separate placement (issue 46 item 2): the
rollout ranks form engines of rollout.tensor_parallel_size consecutive rollout ranks, each fed
shard to shard (`megagrpo.engine.shard_feed`: a training TP rank sends its own shards to the
engine ranks of its TP rank only, each of which writes just its vLLM slice; the vocab tensors
travel whole to every rollout rank).

One real-process launch through the CLI: 2 training ranks (megatron-core TP=2) + 2 rollout
ranks forming one vLLM engine of TP 2, the tiny dense model in fp32, rollout.max_staleness 1,
3 steps (the first and the last drawn fresh, k = 0, by design; the engine's two ranks take
the syncs in lockstep). Checked against independent references: vLLM's log-probs of the
fresh samples equal the trainer's to fp32 precision (a slice written at the wrong offset, or
from the wrong TP rank, fails here), and the bytes each rollout rank received equal what the
HF shapes say a TP rank's slices plus the whole (padded) vocab tensors weigh, well under the
whole model (a rollout rank that reassembles whole tensors fails here). The refusals of
rollout ranks that do not divide into engines, and of in-flight updates into such engines,
name their fields.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megagrpo.config.model import ModelConfig
from megagrpo.config.train import load_config
from megagrpo.hf import hf_shapes
from tests.support.cli import run_cli
from tests.test_placement import ARGS as SEPARATE_ARGS

STEPS = 3
ARGS = [a for a in SEPARATE_ARGS if not a.startswith(("rollout.rollout_ranks=",
                                                     "rollout.max_staleness=", "run.steps="))]
ARGS += ["parallel.tp=2", "rollout.rollout_ranks=2", "rollout.tensor_parallel_size=2",
         "rollout.max_staleness=1", f"run.steps={STEPS}"]
MODEL = ModelConfig(vocab_size=19, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                    num_attention_heads=4, num_query_groups=2, head_dim=32,
                    max_position_embeddings=64)
"""ARGS' model, as the bytes reference reads it."""
PADDED_VOCAB = 32
"""19 rounded up to parallel.make_vocab_size_divisible_by (16) x tp (2)."""


def test_rollout_ranks_must_divide_into_engines():
    base = ["rollout.placement=separate", "data.batch_size=4", "rollout.tensor_parallel_size=2"]
    load_config(None, [*base, "rollout.rollout_ranks=2"]).validate(4)  # 2 training + 1 engine
    load_config(None, [*base, "rollout.rollout_ranks=2", "rollout.max_staleness=1"]).validate(4)
    with pytest.raises(ValueError, match=r"rollout.rollout_ranks=3 do not divide into engines "
                                         r"of rollout.tensor_parallel_size=2"):
        load_config(None, [*base, "rollout.rollout_ranks=3"]).validate(5)
    # what a rollout rank decides mid-draw or from the store alone: refused at engines of TP 2
    for extra, name in ((["rollout.max_staleness=1", "rollout.inflight_updates=true"],
                         "rollout.inflight_updates=true"),
                        (["rollout.max_staleness=1", "rollout.partial_rollouts=true"],
                         "rollout.partial_rollouts=true"),
                        (["algo.dynamic_sampling=true"], "algo.dynamic_sampling=true")):
        with pytest.raises(ValueError, match=rf"{name} with rollout.tensor_parallel_size=2"):
            load_config(None, [*base, "rollout.rollout_ranks=2", *extra]).validate(4)
        load_config(None, [*base, "rollout.rollout_ranks=2", "rollout.tensor_parallel_size=1",
                           *extra]).validate(4)  # engines of TP 1 take it


def _slice_bytes(tp: int) -> int:
    """Bytes (fp32) one rollout rank of an engine of `tp` ranks needs per sync, from the HF
    shapes: every tensor split over TP (attention and MLP projections) 1/tp of it, the norms
    whole, the two vocab tensors whole at the padded vocab (they travel as every TP rank's
    megatron shard)."""
    total = 0
    for name, shape in hf_shapes(MODEL).items():
        numel = _numel(shape)
        if name.endswith("norm.weight"):
            total += numel
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            total += PADDED_VOCAB * MODEL.hidden_size
        else:
            total += numel // tp
    return 4 * total


@pytest.fixture(scope="module")
def tp2_engine_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("separate_tp2")
    p = run_cli("train", "--nproc", "4", *ARGS, f"run.out_dir={work}/run",
                f"arithmetic.tokenizer_dir={work}/tok", timeout=900)
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-6000:]
    records = [json.loads(line) for line in Path(work, "run", "metrics.jsonl").read_text()
               .splitlines()]
    logs = {int(f.stem.removeprefix("rank")): f.read_text()
            for f in Path(work, "run", "logs").glob("rank*.log")}
    return console, [r for r in records if "loss" in r], logs


def test_tp2_engine_samples_with_the_trainers_weights(tp2_engine_run):
    console, steps, _ = tp2_engine_run
    assert "rollout ranks 2-3 (1 vLLM engine(s) of TP 2, each over 2 consecutive rollout " \
           "ranks" in console
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= 1 and r["update_skipped"] == 0 for r in steps)  # k = 1
    # the first batch waits for the first sync, the launch's last is drawn at k = 0
    assert steps[0]["staleness_max"] == 0 and steps[-1]["staleness_max"] == 0
    fresh = [r["logp_gap_vllm_mean"] for r in steps if r["staleness_max"] == 0]
    print("logp_gap_vllm_mean on fresh steps:", fresh)
    # fresh samples: vLLM's log-probs are the trainer's to fp32 precision
    assert all(g < 1e-5 for g in fresh), fresh


def test_tp2_engine_ranks_receive_their_slices_only(tp2_engine_run):
    _, _, logs = tp2_engine_run
    whole = 4 * sum(_numel(s) for s in hf_shapes(MODEL).values())
    for rank in (2, 3):
        m = re.search(r"rollout rank \d+: (\d+) batches sampled over (\d+) weight syncs, "
                      r"\d+ held-out evaluations; weight bytes received (\d+)", logs[rank])
        assert m, logs[rank][-3000:]
        batches, syncs, got = map(int, m.groups())
        assert batches >= STEPS and syncs >= STEPS  # the last batch may be drawn unasked
        print(f"rank {rank}: {syncs} syncs, {got} bytes received; per sync {got // syncs} "
              f"(slices + vocab: {_slice_bytes(2)}, whole model: {whole})")
        assert got == syncs * _slice_bytes(2), (got, syncs, _slice_bytes(2), whole)
        assert got < 0.75 * syncs * whole


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
