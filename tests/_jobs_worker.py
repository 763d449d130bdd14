"""Run on local ranks by tests.support.launch.run_jobs: several worker scripts one after
another in the same rank processes, each run as `__main__` with its own arguments (the workers
of the test modules that share one launch, tests/conftest.py). Each worker starts and ends the
default process group itself, as it does alone; the ranks' start (the interpreter, importing
torch, megatron-core and transformers) is paid once for all of them.

    python tests/_jobs_worker.py '[["tests/_moe_worker.py", "--work", "W1"], [...]]'
"""
import json
import runpy
import sys


def main() -> None:
    for argv in json.loads(sys.argv[1]):
        print(f"== job: {' '.join(argv)}", flush=True)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
