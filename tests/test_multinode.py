"""Multi-node for real: examples/launch_multinode.sh started twice on this machine as two torchrun
"nodes" of 2 ranks (--nnodes 2, c10d rendezvous on 127.0.0.1), training TP=2 inside a node, DP=2
across the nodes, vLLM engines of rollout.tensor_parallel_size=2 (one per node, fed shard to
shard). A few GRPO steps through `python -m megagrpo train`, the command users run. Separate
placement across two nodes (a training node and a rollout node): tests/test_placement.py's
`megagrpo train` run."""
import json
import math
from pathlib import Path

import pytest

from tests.support.launch import run_loopback_nodes

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """\
model: {vocab_size: 19, hidden_size: 64, ffn_hidden_size: 128, num_layers: 2,
        num_attention_heads: 4, num_query_groups: 2, head_dim: 32,
        max_position_embeddings: 64}
parallel: {tp: 2, pp: 1, make_vocab_size_divisible_by: 16}
optim: {lr: 1.0e-3}
rollout: {tensor_parallel_size: 2, max_tokens: 6, max_model_len: 64}
algo: {group_size: 4, beta: 0.0}
data: {batch_size: 4}
arithmetic: {num_train: 64, num_eval: 4, tokenizer_dir: TOK}
reward: {terms: [{name: "tests._rewards:length_reward"}]}
run: {steps: 3, out_dir: OUT}
compute: {micro_batch_size: 8, kernel_impl: torch}
log: {progress: false, tensorboard: false}
checkpoint: {every: 0, at_end: false}
eval: {every: 0}
cold_start: {steps: 0}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.replace("TOK", str(work / "tok")).replace("OUT", str(work / "run")))
    run_loopback_nodes(recipe, (2, 2))
    return work / "run"


def test_two_loopback_nodes_train_with_vllm_tp2(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["tp"], summary["pp"], summary["dp"]) == (4, 2, 1, 2)
    assert summary["steps"] == 3
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # each node's engine samples what its replica's policy computes (fp32)
        assert m["logp_gap_vllm_mean"] < 1e-4, m
        # finite (NaN and inf fail); on-policy (mu=1, one minibatch: ratio 1), beta=0, "grpo"
        # per-sequence mean: the loss is -mean(A) over group-centred advantages, 0 up to rounding
        assert math.isfinite(m["loss"]) and abs(m["loss"]) < 1e-5, m  # measured <= 1e-7
        assert m["sync_received_bytes"] >= 0
    # TP = k = 2, PP = 1: the shard-to-shard feed moves only the vocab tensors across TP
    assert steps[0]["sync_received_bytes"] < steps[0]["sync_bytes"] / 4

