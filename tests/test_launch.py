"""tests.support.launch.run_ranks, the launcher of the multi-rank tests: each rank gets the
variables torchrun would give it, output comes back, and the first rank to fail ends the others
(as torchrun's agent does) instead of leaving them waiting in a collective."""
import json
import os
import subprocess

import pytest

from tests.support.launch import job_output, run_jobs, run_ranks

WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[2], f"pid{rank}"), "w").write(str(os.getpid()))
# one write of one line (the ranks share the pipe; print's pieces are separate writes when
# stdout is unbuffered, PYTHONUNBUFFERED, and interleave with the other ranks')
os.write(1, " ".join(["rank", str(rank), "of", os.environ["WORLD_SIZE"], "local",
                      os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"],
                      os.environ["MASTER_ADDR"], sys.argv[1]]).encode() + b"\\n")
if sys.argv[1] == "fail" and rank == 1:
    while len([f for f in os.listdir(sys.argv[2]) if f.startswith("pid")]) < 3:
        time.sleep(0.05)  # the others are up
    sys.exit(3)
while sys.argv[1] != "ok":  # a rank a failed peer would leave waiting in a collective
    time.sleep(1)
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "w.py"
    path.write_text(WORKER)
    return path


def _alive(tmp_path, nproc):
    """The ranks among 0..nproc-1 still running."""
    alive = []
    for r in range(nproc):
        try:
            os.kill(int((tmp_path / f"pid{r}").read_text()), 0)
            alive.append(r)
        except (ProcessLookupError, FileNotFoundError):  # gone, or killed before it wrote
            pass
    return alive


def test_every_rank_runs_with_torchruns_variables(worker, tmp_path):
    out = run_ranks(worker, 3, "ok", str(tmp_path))
    for r in range(3):
        assert f"rank {r} of 3 local {r} 3 127.0.0.1 ok" in out, out


def test_a_failed_rank_ends_the_others(worker, tmp_path):
    # the others never end on their own: waiting for them would reach the timeout instead
    with pytest.raises(RuntimeError, match=r"3 ranks of .*w\.py failed \(rank 1 rc=3\)"):
        run_ranks(worker, 3, "fail", str(tmp_path), timeout=300)
    assert _alive(tmp_path, 3) == []


def test_a_timeout_kills_every_rank(worker, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(worker, 2, "hang", str(tmp_path), timeout=3)
    assert _alive(tmp_path, 2) == []


JOB = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print("job", sys.argv[2], "rank", dist.get_rank(), flush=True)
with open(os.path.join(sys.argv[1], f"{sys.argv[2]}.rank{dist.get_rank()}"), "w") as f:
    json.dump({"pid": os.getpid(), "sum": t.item(), "argv": sys.argv[1:]}, f)
dist.destroy_process_group()
if sys.argv[2] == "fail":
    sys.exit(5)
"""


def test_jobs_run_in_turn_in_the_same_ranks(tmp_path):
    """run_jobs: each job sees its own arguments, makes its own process group and writes its
    own output, and the second runs in the same processes as the first (one start of the
    ranks for both)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_jobs([([script, tmp_path, "a"], tmp_path / "a.log"),
              ([script, tmp_path, "b", "x"], tmp_path / "b.log")], 2)
    for job in "ab":
        assert job_output(tmp_path / f"{job}.log", 2) == f"job {job} rank 0\njob {job} rank 1\n"
    for rank in range(2):
        a, b = (json.loads((tmp_path / f"{job}.rank{rank}").read_text()) for job in "ab")
        assert a["sum"] == b["sum"] == 1.0
        assert a["argv"] == [str(tmp_path), "a"] and b["argv"] == [str(tmp_path), "b", "x"]
        assert a["pid"] == b["pid"]


def test_a_failed_job_is_named_with_its_output(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    with pytest.raises(RuntimeError, match=r"(?s)rc=5.*last job started.*fail\.log.*job fail"):
        run_jobs([([script, tmp_path, "a"], tmp_path / "a.log"),
                  ([script, tmp_path, "fail"], tmp_path / "fail.log")], 2)
