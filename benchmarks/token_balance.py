"""Token imbalance over DP replicas before and after `megagrpo.train.balance` on long-tailed
lengths.

    .venv/bin/python benchmarks/token_balance.py [--seqs 512] [--dp 2,4,8] [--seeds 20]
        [--mu 7] [--sigma 1.2] [--cap 32768] [--out benchmarks/results/token_balance.jsonl]

Sequence lengths are lognormal(mu, sigma) tokens, capped at `cap` (a long tail like reasoning
traces'); each replica's rollout holds a contiguous 1/dp of them (its own prompts), which is the
layout without balancing. One JSON line per dp: `token_imbalance` (max / mean tokens per
replica, the logged metric) before and after the LPT partition, mean and worst over seeds, and
the max / min replica work ratio after."""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    from benchmarks._harness import emit
    from megagrpo.train.balance import imbalance, lpt_partition

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--dp", default="2,4,8")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--mu", type=float, default=7.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for k in map(int, a.dp.split(",")):
        before, after, spread = [], [], []
        for seed in range(a.seeds):
            rng = random.Random(seed)
            w = [min(a.cap, int(rng.lognormvariate(a.mu, a.sigma)) + 1) for _ in range(a.seqs)]
            own = [sum(w[d * a.seqs // k:(d + 1) * a.seqs // k]) for d in range(k)]
            loads = [sum(w[i] for i in b) for b in lpt_partition(w, k)]
            before.append(imbalance(own))
            after.append(imbalance(loads))
            spread.append(max(loads) / max(min(loads), 1))
        emit({"dp": k, "seqs": a.seqs, "mu": a.mu, "sigma": a.sigma, "cap": a.cap,
              "imbalance_before_mean": round(sum(before) / len(before), 4),
              "imbalance_before_max": round(max(before), 4),
              "imbalance_after_mean": round(sum(after) / len(after), 5),
              "imbalance_after_max": round(max(after), 5),
              "max_over_min_after": round(max(spread), 5)}, a.out)


if __name__ == "__main__":
    main()
