"""One whole GRPO step of megagrpo's trainer on the demo config, per phase, at 1 and 2 ranks.

    .venv/bin/python benchmarks/grpo_step.py [--nprocs 1,2] [--warmup 2] [--steps 5]
        [--threads N] [--set KEY=VALUE ...] [--out benchmarks/results/grpo_step_cpu.jsonl]
        [--compare TRL_JSONL]

The fixed config is examples/demo.yaml (Llama, hidden 128, 4 layers, 4 heads x 32, vocab 19,
2-digit addition; G=8, 32 prompts per step, max_tokens 6, beta 0.02) with no cold start and no
evaluation; reference.sync_every_steps=1 so every measured step pays one in-place reference
re-initialisation (the demo does it every 10th step). Each nproc runs under
`python -m torch.distributed.run` (DP over the ranks, one in-process vLLM engine per rank);
rank 0 prints one JSON line with the means over the measured steps:
  time_<phase>_s      rollout, advantage, score, update, weight_sync, reference_sync (the
                      trainer's own PhaseTimer; rollout_wait is 0 without async rollouts)
  step_s              wall time of Trainer.step()
  gen_tokens_per_s    completion tokens sampled (all ranks) / step_s
  trained_tokens_per_s prompt + completion tokens (non-pad, all ranks) through the policy's
                      forward + backward / step_s
  loss_tokens_per_s   completion tokens that carry the loss / step_s
  cpu_s_per_step      process CPU seconds per step, summed over ranks (all threads; less
                      disturbed than wall time when other processes share the cores)
--compare reads the TRL baseline's JSON lines (benchmarks/trl_grpo_baseline.py) and adds
`vs_trl_gen_tokens_per_s`: megagrpo gen tokens/s divided by the best TRL line's (the TRL
setting most favourable to TRL), and the same ratio per CPU second.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.yaml"
PHASES = ("rollout", "advantage", "score", "update", "weight_sync", "reference_sync")
OVERRIDES = ["run.sft_steps=0", "run.eval_every=0", "run.resume=false", "run.tensorboard=false",
             "run.progress=false", "reference.sync_every_steps=1"]


def _count_update(tr, counts: list, batch, skip: bool = False):
    """Trainer.update, recording the tokens of the batch it trains on (this rank)."""
    import torch

    rows = batch.seq_valid.bool()
    nonpad = (batch.ids[rows] != tr.pad_id).sum()
    counts.append(torch.tensor([float(nonpad), float(batch.mask[rows].sum()), float(rows.sum())],
                               dtype=torch.float64))
    return type(tr).update(tr, batch, skip=skip)


def worker(warmup: int, steps: int, out_dir: str, sets: list[str]) -> None:
    """Runs on every rank under torchrun; rank 0 prints `RESULT {json}`."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from megagrpo.config.train import load_config
    from megagrpo.run import setup

    cfg = load_config(str(DEMO), OVERRIDES + list(sets) + [f"run.out_dir={out_dir}"])
    t0 = time.perf_counter()
    tr = setup(cfg)
    tr.sync_weights()
    setup_s = time.perf_counter() - t0
    counts: list = []
    tr.update = partial(_count_update, tr, counts)
    rows = []
    for i in range(warmup + steps):
        counts.clear()
        t, c = time.perf_counter(), time.process_time()
        m = tr.step()
        m["step_s"] = time.perf_counter() - t
        cpu = time.process_time() - c
        nonpad, loss, seqs = torch.stack(counts).sum(0).tolist()
        # completion_len is this replica's mean: times its sequences, summed over replicas
        tok = torch.tensor([nonpad, loss, cpu, m["completion_len"] * seqs], dtype=torch.float64)
        dist.all_reduce(tok)
        tok[[0, 1, 3]] /= tr.mp_size  # every rank of a replica counted the replica's batch
        m["trained_tokens"], m["loss_tokens"], m["cpu_s"], m["gen_tokens"] = tok.tolist()
        if i >= warmup:
            rows.append(m)
    if tr.rank == 0:
        mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]
                if isinstance(rows[0][k], (int, float)) and not isinstance(rows[0][k], bool)}
        step = mean["step_s"]
        rec = dict(system="megagrpo", nproc=dist.get_world_size(), tp=cfg.parallel.tp,
                   dp=tr.dp, batch_prompts=cfg.data.batch_size, group_size=cfg.algo.group_size,
                   max_tokens=cfg.rollout.max_tokens, overrides=list(sets), warmup=warmup,
                   steps=steps,
                   setup_s=round(setup_s, 2),
                   **{f"time_{p}_s": round(mean.get(f"time_{p}", 0.0), 4) for p in PHASES},
                   step_s=round(step, 4), cpu_s_per_step=round(mean["cpu_s"], 4),
                   gen_tokens_per_step=round(mean["gen_tokens"], 1),
                   gen_tokens_per_s=round(mean["gen_tokens"] / step, 1),
                   gen_tokens_per_cpu_s=round(mean["gen_tokens"] / mean["cpu_s"], 1),
                   trained_tokens_per_s=round(mean["trained_tokens"] / step, 1),
                   loss_tokens_per_s=round(mean["loss_tokens"] / step, 1),
                   reward_mean=round(mean.get("reward_mean", float("nan")), 4),
                   threads=torch.get_num_threads(), cpus=os.cpu_count(),
                   loadavg_1m=round(os.getloadavg()[0], 2))
        print("RESULT " + json.dumps(rec), flush=True)
    dist.barrier()
    os._exit(0)  # skip vLLM's shutdown hooks (they tear down the process group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, warmup: int, steps: int, threads: int = 0, sets: list[str] = ()) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"grpo_step_{nproc}_")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, "--worker",
           "--warmup", str(warmup), "--steps", str(steps), "--out-dir", out_dir,
           *(a for kv in sets for a in ("--set", kv))]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    found = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"nproc={nproc} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(found[-1])


def compare(records: list[dict], trl_path: str) -> list[dict]:
    """Adds megagrpo gen tokens/s over the best TRL line's (wall and per CPU second)."""
    trl = [json.loads(ln) for ln in Path(trl_path).read_text().splitlines() if ln.strip()]
    best = max(trl, key=lambda r: r["gen_tokens_per_s"])
    best_cpu = max(r["gen_tokens_per_cpu_s"] for r in trl)
    for r in records:
        r["trl_gen_tokens_per_s"] = best["gen_tokens_per_s"]
        r["trl_threads"] = best["threads"]
        r["vs_trl_gen_tokens_per_s"] = round(r["gen_tokens_per_s"] / best["gen_tokens_per_s"], 2)
        r["vs_trl_gen_tokens_per_cpu_s"] = round(r["gen_tokens_per_cpu_s"] / best_cpu, 2)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/grpo_step_cpu.jsonl")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS per rank (default: torchrun's, all cores for 1 rank)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override on top of the demo (repeatable; give the TRL "
                         "baseline the same)")
    ap.add_argument("--compare", default="", help="TRL baseline JSONL to compare against")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.warmup, args.steps, args.out_dir, args.set)
        return
    records = [launch(int(n), args.warmup, args.steps, args.threads, args.set)
               for n in args.nprocs.split(",")]
    if args.compare:
        records = compare(records, args.compare)
    lines = [json.dumps(r) for r in records]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
