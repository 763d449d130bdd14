"""A rank's runtime, below everything else: process start-up and the megatron-core CPU shim, random
streams, child processes, the run directory, the console, metrics, the stall watchdog, this
machine's arithmetic.

Modules: console, cpu_compat, distributed, machine, metrics, names, procs, rng, run_dir, watchdog.
"""
