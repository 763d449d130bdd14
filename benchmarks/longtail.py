"""Asynchronous GRPO on a long-tail workload: colocated sync, colocated async and separate
placement, with and without in-flight weight updates, one configuration after another.

The workload (the same model, data and reward in every configuration): the demo's 0.85M Llama
(examples/demo.yaml) from its seeded random init, 2-digit addition prompts, 16 prompts x G=8 a
step, temperature 1, and a reward for *length*: each prompt asks for a completion of
L = 4 x (1 + d) tokens, d the last digit of the sum (the answer's first character, the answers
being written least-significant digit first), so the targets spread 4-40 tokens (10x) and a
batch always holds a few completions four to ten times longer than most (`target_length`).
A completion within 20% of its target scores 1 (it counts as correct in held-out accuracy),
one further off scores max(0, 1 - |n - L| / L). The random init stops at EOS at random (lengths
roughly geometric up to rollout.max_tokens = 48), so the lengths are long-tailed from the first
step and the policy learns to move them toward the targets.

Each configuration is one real run, `python -m megagrpo train --nproc 2` (torchrun, 2 ranks:
colocated = 2 training ranks, DP 2, each with its own vLLM engine; separate = 1 training rank +
1 rollout rank), for --steps GRPO steps; its metrics.jsonl gives the figures, the first step
(engine warm-up, first compiles) left out of the per-step means:

  colocated-sync          rollout.max_staleness=0: sample, then train, on both ranks
  colocated-k1            k=1: the next batch drawn on a side thread while the step trains
  colocated-k1-inflight   k=1 with rollout.inflight_updates: new weights enter the running draw
  separate-k{1,2,4}       rollout.placement=separate, 1 training + 1 rollout rank, k = 1, 2, 4
  separate-k{1,2,4}-inflight   the same with rollout.inflight_updates: the rollout rank loads
                          each sync between decode steps of the draw that is running

A configuration the config check refuses is recorded as a row that says why, without a launch.

Per configuration (a JSON line in --out): wall seconds of the launch; per step (means over the
steps kept) the step time (the sum of the trainer's phases), the phases (rollout = the trainer's
wait for its batch, score, update, weight sync...), generated and trained tokens/s (completion
tokens of the step over its time; trained = less the samples dropped as stale), the trainer's
and the engines' idle seconds (`trainer_idle_s`, `rollout_idle_s`: docs/metrics.md), queue depth,
mean/max version lag, samples dropped as stale; the reward curve against the trainer's cumulative
step time; with --eval, held-out accuracy at the end: the final checkpoint exported to HF
(`megagrpo convert`) and decoded greedily by transformers on --eval-prompts held-out prompts.

    .venv/bin/python benchmarks/longtail.py [--steps 12] [--configs a,b,...] [--seeds 0]
        [--eval] [--out benchmarks/results/longtail_<cpu>_cpu.jsonl]
    .venv/bin/python benchmarks/longtail.py --smoke          # 2 steps, 2 configurations
    .venv/bin/python benchmarks/longtail.py --table [JSONL]  # docs/performance.md's tables

`--table` prints the measured table and a projection for 8 and 16 GPUs from the measured phase
times of the colocated sync run (`projection`: the model is stated in its docstring).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared benchmark helpers
from _common import run_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NPROC = 2
BATCH, GROUP, MAX_TOKENS = 16, 8, 48
WORKLOAD = [f"data.batch_size={BATCH}", f"algo.group_size={GROUP}",
            f"rollout.max_tokens={MAX_TOKENS}", "rollout.max_model_len=64",
            "rollout.temperature=1.0", "algo.beta=0", "reference.sync_every_steps=0",
            "algo.num_minibatches=1", "optim.lr=5.0e-4", "optim.lr_schedule=constant",
            "optim.warmup_steps=0", "cold_start.steps=0", "eval.every=0",
            "reward.terms=[{name: 'benchmarks.longtail:target_length', correctness: true}]",
            "arithmetic.num_train=4096", "compute.kernel_impl=torch", "log.tensorboard=false",
            "log.progress=false", "checkpoint.every=0", "run.resume=false",
            "run.overwrite=true"]
SEPARATE = ["rollout.placement=separate", "rollout.rollout_ranks=1"]
INFLIGHT = ["rollout.inflight_updates=true"]
CONFIGS: dict[str, list[str]] = {
    "colocated-sync": ["rollout.max_staleness=0"],
    "colocated-k1": ["rollout.max_staleness=1"],
    "colocated-k1-inflight": ["rollout.max_staleness=1", *INFLIGHT],
    **{f"separate-k{k}": [*SEPARATE, f"rollout.max_staleness={k}"] for k in (1, 2, 4)},
    **{f"separate-k{k}-inflight": [*SEPARATE, f"rollout.max_staleness={k}", *INFLIGHT]
       for k in (1, 2, 4)},
}
SMOKE_CONFIGS = ("colocated-sync", "separate-k1-inflight")
PHASES = ("time_rollout", "time_rollout_wait", "time_score", "time_update",
          "time_weight_sync", "time_reference")


# ---------------------------------------------------------------------- the reward
def target_tokens(answer: str) -> int:
    """L = 4 x (1 + d), d the answer's first digit (the sum's last: answers are reversed)."""
    return 4 * (1 + int(answer.strip()[0]))


def target_length(completion: str, answer: str) -> float:
    """1 within 20% of the target length (one character is one token of the task's
    tokenizer), else max(0, 1 - |n - L| / L)."""
    n, want = len(completion), target_tokens(answer)
    off = abs(n - want) / want
    return 1.0 if off <= 0.2 else max(0.0, 1.0 - off)


# ---------------------------------------------------------------------- one run
def cpu_name() -> str:
    """megagrpo.runtime.machine.cpu_name, imported here (the launcher starts without torch)."""
    from megagrpo.runtime.machine import cpu_name as name

    return name()


def cpu_tag(name: str) -> str:
    """'epyc', 'xeon' or 'other': the results file's name part."""
    low = name.lower()
    return next((t for t in ("epyc", "xeon") if t in low), "other")


def refusal(config: str) -> str:
    """'' when the configuration passes the config check, else the check's message (the
    workload itself must pass: an error there raises)."""
    from megagrpo.config.train import load_config

    recipe = str(ROOT / "examples" / "demo.yaml")
    load_config(recipe, WORKLOAD).validate()
    try:
        load_config(recipe, [*WORKLOAD, *CONFIGS[config]]).validate()
    except ValueError as e:
        return str(e)
    return ""


def train(out_dir: Path, config: str, steps: int, seed: int, nproc: int) -> float:
    """Runs one configuration; returns its wall seconds. Raises with the log's tail on failure."""
    return run_train(["--config", "examples/demo.yaml", *WORKLOAD, *CONFIGS[config],
                      f"run.steps={steps}", f"run.seed={seed}", f"run.out_dir={out_dir}",
                      "checkpoint.at_end=true"], nproc=nproc, name=config, timeout=1800)


def summarize(records: list[dict], dp: int, skip: int = 1) -> dict:
    """Per-step means of a run's step records (the first `skip` left out) and its reward curve
    against the trainer's cumulative step time (every step). `dp`: training replicas (the
    records' sample counts are per replica)."""
    steps = [r for r in records if "reward_mean" in r]
    kept = steps[skip:]
    if not kept:
        raise ValueError(f"no step records after the first {skip}")

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in kept)

    wall = [sum(v for k, v in r.items() if k.startswith("time_")) for r in steps]
    step_s = statistics.fmean(wall[skip:])
    gen = [r["tokens_per_s"] * w for r, w in zip(steps, wall)]  # completion tokens of the step
    n = BATCH * GROUP
    trained = [g * (1.0 - r.get("stale_dropped", 0.0) * dp / n)
               for g, r in zip(gen, steps)]
    clock, curve = 0.0, []
    for r, w in zip(steps, wall):
        clock += w
        curve.append([round(clock, 2), round(r["reward_mean"], 4)])
    return {"steps_kept": len(kept), "step_s": step_s,
            "gen_tokens_per_s": sum(gen[skip:]) / sum(wall[skip:]),
            "trained_tokens_per_s": sum(trained[skip:]) / sum(wall[skip:]),
            "completion_len": mean("completion_len"),
            "phases": {k: mean(k) for k in PHASES if any(k in r for r in kept)},
            "trainer_idle_s": mean("trainer_idle_s"), "rollout_idle_s": mean("rollout_idle_s"),
            "queue_depth": mean("rollout_queue_depth"), "lag_mean": mean("staleness_mean"),
            "lag_max": max(float(r.get("staleness_max", 0.0)) for r in kept),
            "stale_dropped": sum(float(r.get("stale_dropped", 0.0)) for r in kept),
            "token_lag_mean": mean("token_lag_mean"),
            "inflight_midway": mean("inflight_midway"),
            "reward_first": steps[0]["reward_mean"],
            "reward_last3": statistics.fmean(r["reward_mean"] for r in steps[-3:]),
            "reward_curve": curve}


def held_out_accuracy(run_dir: Path, prompts: int) -> float:
    """The run's final checkpoint, exported to HF, decoded greedily by transformers on
    `prompts` held-out addition prompts: the share within 20% of the target length."""
    import torch
    from transformers import AutoModelForCausalLM

    from megagrpo.config.data import ArithmeticConfig
    from megagrpo.data import encode_prompt
    from megagrpo.tasks.arithmetic import build_tokenizer, eval_examples

    hf, t0 = run_dir / "hf", time.monotonic()
    p = subprocess.run([sys.executable, "-m", "megagrpo", "convert", "--from-megatron",
                        str(run_dir), "--to-hf", str(hf)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise RuntimeError(f"convert failed:\n{(p.stdout + p.stderr)[-3000:]}")
    print(f"  export to HF: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = build_tokenizer(run_dir / "tokenizer-cache")
    cfg = ArithmeticConfig(digits=2, operators="+", reverse_answer=True, num_eval=prompts)
    by_len: dict[int, list] = {}  # prompts of one length decode as one batch (no padding)
    for e in eval_examples(cfg):
        ids = encode_prompt(tok, e.prompt)
        by_len.setdefault(len(ids), []).append((ids, e.answer))
    hits = 0
    for group in by_len.values():
        ids = torch.tensor([i for i, _ in group])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        for row, (_, answer) in zip(out[:, ids.shape[1]:].tolist(), group):
            new = row[:row.index(tok.eos_id)] if tok.eos_id in row else row
            hits += target_length(tok.decode(new), answer) >= 1.0
    return hits / prompts


def measure(config: str, steps: int, seed: int = 0, nproc: int = NPROC, evaluate: bool = False,
            eval_prompts: int = 64) -> dict:
    """One configuration's record (a refused one: its refusal, nothing launched)."""
    base = {"config": config, "steps": steps, "seed": seed, "nproc": nproc, "cpu": cpu_name(),
            "cores": os.cpu_count(), "overrides": CONFIGS[config]}
    why = refusal(config)
    if why:
        return {**base, "refused": why}
    import torch

    base["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mg-longtail-") as tmp:
        out = Path(tmp) / "run"
        wall = train(out, config, steps, seed, nproc)
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        acc = held_out_accuracy(out, eval_prompts) if evaluate else None
    return {**base, "loadavg_1m_start": round(load0, 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(wall, 1),
            **summarize(records, dp=1 if "separate" in config else nproc), "eval_accuracy": acc,
            "eval_prompts": eval_prompts if evaluate else 0}


# ---------------------------------------------------------------------- the tables
def projection(sync: dict, gpus: int, train_ranks: int, score_ratio: float = 0.0) -> dict:
    """A step on `gpus` GPUs (one engine or one training rank each) from the colocated sync
    run's phase times (2 ranks), by a stated model. g: the sync run's rollout phase (each engine
    samples its share of the batch; under a long tail its time is set by the longest
    completion's decode steps, which do not shrink with more engines, so g is taken as is);
    W = 2 x (step - g - s): the training work in rank-seconds, split evenly over the ranks that
    train; s: the weight sync, taken as is. An async step also scores its stale batch under the
    proximal policy (a forward pass the sync step skips): its work is W x (1 + score_ratio),
    score_ratio = time_score / time_update of a measured async run.
      colocated sync on N:                  g + W / N + s
      separate, T train + N - T rollout:    max(g, Wa / T) + s  (k >= 1: sampling overlaps
                                            training, but a sync waits for the running draw to
                                            end: a broadcast needs both sides)
      the same with in-flight updates:      max(g, Wa / T + s)  (the engines take the sync
                                            mid-draw, so only the trainer's side pays it)
    The tokens of a step are the same in every case, so tokens/s scale as 1 / step."""
    ph = sync["phases"]
    g = ph.get("time_rollout", 0.0) + ph.get("time_rollout_wait", 0.0)
    s = ph.get("time_weight_sync", 0.0)
    work = 2.0 * max(sync["step_s"] - g - s, 0.0)
    work_async = work * (1.0 + score_ratio)
    return {"gpus": gpus, "train_ranks": train_ranks, "g": g, "work": work, "s": s,
            "work_async": work_async, "colocated_sync_s": g + work / gpus + s,
            "separate_s": max(g, work_async / train_ranks) + s,
            "separate_inflight_s": max(g, work_async / train_ranks + s)}


def reward_windows(curve: list[list[float]], width: float, count: int) -> list[float | None]:
    """Mean reward of the steps that ended in each `width`-second window of the trainer's
    cumulative step time ([0, width), [width, 2 width), ...); None for a window with none."""
    out: list[float | None] = []
    for w in range(count):
        inside = [r for t, r in curve if w * width <= t < (w + 1) * width]
        out.append(statistics.fmean(inside) if inside else None)
    return out


def table(path: Path) -> str:
    """docs/performance.md's tables: the measured runs, then the projection."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ran = [r for r in rows if "refused" not in r]
    base = next(r for r in ran if r["config"] == "colocated-sync")
    lines = ["| configuration | seed | step s | gen tok/s | trained tok/s | vs sync | rollout s "
             "| update s | sync s | trainer idle s | rollout idle s | queue | lag mean/max | "
             "dropped | reward first -> last 3 | held-out acc |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['config']} | | refused: {r['refused'].split(':')[0]} "
                         + "| " * 13 + "|")
            continue
        ph = r["phases"]
        acc = "" if r.get("eval_accuracy") is None else f"{r['eval_accuracy']:.3f}"
        lines.append(
            f"| {r['config']} | {r['seed']} | {r['step_s']:.2f} | {r['gen_tokens_per_s']:.0f} | "
            f"{r['trained_tokens_per_s']:.0f} | "
            f"{r['gen_tokens_per_s'] / base['gen_tokens_per_s']:.2f}x | "
            f"{ph.get('time_rollout', 0) + ph.get('time_rollout_wait', 0):.2f} | "
            f"{ph.get('time_update', 0):.2f} | {ph.get('time_weight_sync', 0):.2f} | "
            f"{r['trainer_idle_s']:.2f} | {r['rollout_idle_s']:.2f} | {r['queue_depth']:.1f} | "
            f"{r['lag_mean']:.2f}/{r['lag_max']:.0f} | {r['stale_dropped']:.0f} | "
            f"{r['reward_first']:.3f} -> {r['reward_last3']:.3f} | {acc} |")
    loads = [x for r in ran for x in (r["loadavg_1m_start"], r["loadavg_1m_end"])]
    lines += ["", f"{base['cpu']}, {base['cores']} cores, {base['nproc']} ranks a run, "
              f"{base['steps']} steps; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
              "during the runs.", "",
              "| GPUs | training ranks | colocated sync step s | separate k>=1 step s | "
              "separate + in-flight step s | separate vs sync | + in-flight vs sync |",
              "|---|---|---|---|---|---|---|"]
    asy = next((r for r in ran if r["config"] == "separate-k1"), None)
    ratio = (asy["phases"].get("time_score", 0.0) / asy["phases"]["time_update"]) if asy else 0.0
    for gpus, t in ((8, 4), (8, 6), (16, 8), (16, 12)):
        p = projection(base, gpus, t, ratio)
        lines.append(f"| {gpus} | {t} | {p['colocated_sync_s']:.2f} | {p['separate_s']:.2f} | "
                     f"{p['separate_inflight_s']:.2f} | "
                     f"{p['colocated_sync_s'] / p['separate_s']:.2f}x | "
                     f"{p['colocated_sync_s'] / p['separate_inflight_s']:.2f}x |")
    width = 10.0
    count = int(max(r["reward_curve"][-1][0] for r in ran) // width) + 1
    lines += ["", "| configuration | seed | " + " | ".join(
        f"{w * width:.0f}-{(w + 1) * width:.0f} s" for w in range(count)) + " |",
        "|---|---|" + "---|" * count]
    for r in ran:
        cells = ["" if v is None else f"{v:.3f}"
                 for v in reward_windows(r["reward_curve"], width, count)]
        lines.append(f"| {r['config']} | {r['seed']} | " + " | ".join(cells) + " |")
    p = projection(base, 8, 4, ratio)
    lines += ["", f"Projection inputs (measured): g = {p['g']:.2f} s rollout, W = "
              f"{p['work']:.2f} rank-s training work, s = {p['s']:.2f} s weight sync (colocated "
              f"sync, seed {base['seed']}); proximal scoring adds {ratio:.2f} x the update "
              "(separate-k1)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seeds", default="0", help="seeds of the colocated sync baseline (the "
                    "others run seed 0): their spread is the reference for held-out accuracy")
    ap.add_argument("--nproc", type=int, default=NPROC)
    ap.add_argument("--eval", action="store_true", help="held-out accuracy of each final model")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="2 steps of 2 configurations, no eval")
    ap.add_argument("--out", default=None, help="JSONL to append to (default: "
                    "benchmarks/results/longtail_<cpu>_cpu.jsonl)")
    ap.add_argument("--table", nargs="?", const="", default=None, metavar="JSONL",
                    help="print the markdown tables of a results file and exit")
    args = ap.parse_args(argv)
    default = ROOT / "benchmarks" / "results" / f"longtail_{cpu_tag(cpu_name())}_cpu.jsonl"
    if args.table is not None:
        print(table(Path(args.table) if args.table else default))
        return
    configs = list(SMOKE_CONFIGS) if args.smoke else args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; use any of {', '.join(CONFIGS)}")
    steps = 2 if args.smoke else args.steps
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [(c, int(s)) for c in configs
            for s in (args.seeds.split(",") if c == "colocated-sync" else ["0"])]
    for i, (config, seed) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {config} seed {seed}", file=sys.stderr, flush=True)
        line = json.dumps(measure(config, steps, seed, args.nproc,
                                  evaluate=args.eval and not args.smoke,
                                  eval_prompts=args.eval_prompts))
        print(line, flush=True)
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
