"""Run on local ranks by tests.support.launch.run_jobs: several worker scripts one after another
in the same rank processes, each run as `__main__` with its own arguments (the workers of the
test modules that share one launch, tests/conftest.py). Each worker starts and ends the
default process group itself, as it does alone; the ranks' start (the interpreter, importing
torch, megatron-core and transformers) is paid once for all of them. Each job rendezvous on
a port of its own; its output (file descriptors 1 and 2) goes to LOG.rankR, so each test
reads its own worker's lines.

    python tests/_jobs_worker.py '[{"argv": ["tests/_moe_worker.py", "--work", "W"],
                                    "log": "W/output", "port": 29517}, ...]'
"""
import json
import os
import runpy
import sys


def to_file(path: str) -> None:
    """Points this process's stdout and stderr (the descriptors, so C code's output too) at
    `path`."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    rank = os.environ["RANK"]
    launch_out = os.fdopen(os.dup(1), "w")  # the launch's own output: which job runs
    for job in json.loads(sys.argv[1]):
        print(f"== job: {' '.join(job['argv'])} (output: {job['log']}.rank{rank})",
              file=launch_out, flush=True)
        to_file(f"{job['log']}.rank{rank}")
        # a port of its own: a rank done with the job before could otherwise join the store
        # that rank 0 still serves for it, which is gone once rank 0 ends that job
        os.environ["MASTER_PORT"] = str(job["port"])
        sys.argv = list(job["argv"])
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
