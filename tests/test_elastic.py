"""A training node lost: two loopback "nodes" (examples/launch_multinode.sh twice, one rank
each: DP=2) under torchrun's elastic agent (MIN_NODES=1 MAX_RESTARTS=1, c10d rendezvous on
127.0.0.1). Once step 2's checkpoint is complete the node that does not host the rendezvous
store is SIGKILLed, agent and rank (as a machine that dies); the other node's rank fails in its
next collective, its agent restarts it, the rendezvous goes on with the one node left, and the
same command resumes the DP=2 checkpoint at DP=1 (resharded) and finishes the run.

Measured against the uninterrupted DP=2 run (the prompt-sequence guarantee): every step trains
the same global batch of prompts in the same order (the DP=2 ranks' halves joined = the DP=1
rank's whole batch), no prompt is lost or trained twice, and the data position at the end is
the same. Not bitwise (another layout: fresh per-rank random streams, other reductions).

Heavy (~3-4 min on 2 cores: two runs and torchrun's ~30 s wait for the lost node); the default
suite covers torchrun restarts at the same layout in tests/test_resume.py."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._fault_hooks import PROMPT_LOG_ENV
from tests.support.launch import free_port, worker_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import resume_stress as stress  # noqa: E402 - the stress script shares its harness

STEPS, GROUP = 6, 4  # a checkpoint every 2 steps (stress.tiny_overrides); algo.group_size 4
# the prompts each rank scores are logged by the test reward source (tests/_fault_hooks.py)
OVERRIDES = ("reward.source=tests._fault_hooks:PromptLog",)

pytestmark = pytest.mark.heavy


def listening_pid(port: int, pids: list[int]) -> int | None:
    """Which of `pids` listens on TCP `port` (the rendezvous store's host), read from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f[9])
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return pid
            except OSError:
                continue
    return None


def start_node(rank: int, out: Path, log: Path, port: int, job: str,
               prompts: Path) -> subprocess.Popen:
    env = worker_env(NNODES="2", MIN_NODES="1", MAX_RESTARTS="1", NODE_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GPUS_PER_NODE="1",
                     RDZV_ID=job, PYTHON=sys.executable, **{PROMPT_LOG_ENV: str(prompts)})
    env.pop("TRITON_INTERPRET", None)
    recipe = out.parent / "recipe.yaml"
    recipe.write_text("run: {steps: %d}\n" % STEPS)
    with log.open("ab") as f:
        return subprocess.Popen(
            ["bash", str(ROOT / "examples" / "launch_multinode.sh"), str(recipe),
             *stress.tiny_overrides(out, STEPS), *OVERRIDES],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def trained(prompts: Path, attempt: int, ranks: int) -> list[list[str]]:
    """The global batches one attempt scored, in order: each call's prompts of ranks 0 ..
    ranks-1 joined (DP slices are contiguous). Held-out evaluations (one greedy sample per
    prompt) are left out: a training batch holds each prompt G times in a row."""
    per_rank = []
    for r in range(ranks):
        calls = [json.loads(x) for x in
                 (prompts / f"attempt{attempt}.rank{r}.jsonl").read_text().splitlines()]
        per_rank.append([c for c in calls if len(c) % GROUP == 0 and all(
            len(set(c[i:i + GROUP])) == 1 for i in range(0, len(c), GROUP))])
    assert len({len(c) for c in per_rank}) == 1, [len(c) for c in per_rank]
    return [sum(batch, []) for batch in zip(*per_rank)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    ref, run = work / "uninterrupted", work / "node_lost"
    (work / "ref_prompts").mkdir()
    (work / "prompts").mkdir()
    ref_proc = stress.launch(ref, STEPS, work / "uninterrupted.log", *OVERRIDES,
                             env={PROMPT_LOG_ENV: str(work / "ref_prompts")})
    port, job = free_port(), f"elastic-{os.getpid()}"
    nodes = [start_node(n, run, work / f"node{n}.log", port, job, work / "prompts")
             for n in range(2)]
    try:
        stress.wait_for_step(nodes[0], run, 2, checkpoint=True)
        host = listening_pid(port, [nodes[0].pid, nodes[1].pid])
        lost = nodes[1] if host == nodes[0].pid else nodes[0]
        stress.kill_tree(lost)  # the node dies: its agent and its rank at once
        kept = nodes[0] if lost is nodes[1] else nodes[1]
        stress.finish(kept, work / f"node{nodes.index(kept)}.log", timeout=900)
        stress.finish(ref_proc, work / "uninterrupted.log")
    finally:
        for p in (*nodes, ref_proc):
            if p.poll() is None:
                stress.kill_tree(p)
    time.sleep(1)  # let the kernel reap what the agents stopped
    return {"ref": ref, "run": run, "work": work, "kept": nodes.index(kept)}


def test_a_lost_node_restarts_at_dp1_from_the_dp2_checkpoint(runs):
    run, log = runs["run"], (runs["work"] / f"node{runs['kept']}.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["dp"], summary["restarts"]) == (STEPS, 1, 1), summary
    marks = stress.restarts(run)
    assert len(marks) == 1 and marks[0]["resumed_from_step"] >= 2, marks
    assert "resume at another layout (saved at tp=1 x pp=1 x dp=2" in log, log[-4000:]
    assert "now tp=1 x pp=1 x dp=1" in log
    assert "torchrun restart 1 of at most 1" in log
    steps = [r["step"] for r in stress.history(run) if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 1))
    assert stress.leftovers(str(run)) == [] and stress.leftovers(str(runs["ref"])) == []


def test_the_prompt_sequence_is_the_uninterrupted_runs(runs):
    """Steps 1 .. C (C: the checkpoint resumed) from the first attempt at DP=2, the rest from
    the restart at DP=1: the same global batches, in order, as the uninterrupted DP=2 run."""
    work, run = runs["work"], runs["run"]
    resumed = stress.restarts(run)[0]["resumed_from_step"]
    reference = trained(work / "ref_prompts", 0, 2)
    assert len(reference) == STEPS
    before = trained(work / "prompts", 0, 2)[:resumed]
    after = trained(work / "prompts", 1, 1)
    assert before + after == reference
    assert len({p for batch in reference for p in batch}) == sum(len(b) for b in reference) \
        // GROUP  # every prompt once: none trained twice
    end_ref, end = stress.trainer_state(runs["ref"]), stress.trainer_state(run)
    assert end["loader"] == end_ref["loader"] and end["step"] == end_ref["step"] == STEPS
