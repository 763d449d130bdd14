"""Test-wide settings. TRITON_INTERPRET must be set before anything imports triton (Triton
reads it when @triton.jit decorates), so it is set here, at the very top of the session.
Subprocess launches (torchrun, multiprocessing) inherit it."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
