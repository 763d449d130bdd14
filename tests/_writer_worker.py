"""Run on local ranks (2 ranks, gloo, DP=2) by tests/test_resume.py: checkpoints of a real
megatron-core model through `CheckpointManager`, whose writer processes are killed where
MEGAGRPO_TEST_KILL_WRITER says (tests/_fault_hooks.py; set by the test for the launch).

Step 1 is saved whole; after a training step, step 2's policy save loses rank 0's first writer
(SIGKILL 1 s after its fork) and step 3's (at its fork); each save's error, the seconds it took
and the killed writer's pid go to the results, then the newest intact checkpoint is loaded
into the model (it must be step 1: the weights saved then). Rank 0 writes WORK/results.json.
"""
import time
from pathlib import Path

import torch

import tests._fault_hooks  # noqa: F401,I001 - its at-fork hook (megagrpo's own first)
from tests._resume_worker import build, params, train_step
from tests.support.launch import worker_args, write_results


def failed_save(mgr, step: int) -> dict:
    from megagrpo.runtime.writers import WriterDied

    t0 = time.monotonic()
    try:
        mgr.save(step)
    except WriterDied as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def main() -> None:
    from megagrpo.checkpoint import CheckpointManager, ModelState

    work = Path(worker_args().work)
    model, policy, opt = build()
    mgr = CheckpointManager(work / "run", keep_last=3, states={"policy": ModelState(policy, model)},
                            layout={"world_size": 2})
    mgr.save(1)
    saved = params(policy)
    train_step(policy, opt, 1)
    res = {"moved": any(not torch.equal(a, b) for a, b in zip(saved, params(policy)))}
    for step in (2, 3):
        res[f"step{step}"] = failed_save(mgr, step)
        killed = work / f"killed{step}"
        res[f"step{step}"]["killed"] = int(killed.read_text()) if killed.exists() else None
    latest = mgr.latest()
    res["latest"] = str(latest)
    mgr.load(latest)
    res["restored_step1"] = all(torch.equal(a, b) for a, b in zip(saved, params(policy)))
    write_results(res, work)


if __name__ == "__main__":
    main()
