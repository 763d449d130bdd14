"""Imported by Python at the start of every process the test session starts (tests/conftest.py
puts this folder on PYTHONPATH; MEGAGRPO_TEST_FAST_EXIT=0 turns it off): at exit, after every
other atexit handler (this one is registered first, so it runs last), the objects still alive
are frozen out of the cyclic garbage collector, so the interpreter's final collections skip
the millions of objects that importing torch, megatron-core and vLLM made: 1-1.5 s of CPU per
process (a rank, a torchrun agent, a CLI launcher), measured on 2 cores, with dozens of such
processes per test file. Module teardown still frees by reference count (files are closed and
flushed); cyclic garbage is left to the OS, as os._exit would leave it, and stderr is closed
first, so the binding libraries' "leaked instances" reports about it (triton's nanobind types)
are not printed. Test code only: nothing under megagrpo/ imports it."""
import atexit
import gc
import os
import sys


def _freeze_at_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or detached stream: nothing to flush
            pass
    gc.freeze()
    try:  # what follows on fd 2 is teardown noise about the frozen objects
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


if os.environ.get("MEGAGRPO_TEST_FAST_EXIT", "1") != "0":
    atexit.register(_freeze_at_exit)
