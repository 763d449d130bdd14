"""One whole GRPO step of megagrpo's trainer on a named workload, per phase, at 1 and 2 ranks.

    .venv/bin/python benchmarks/grpo_step.py [--workload demo|varlen|midsize|smollm2]
        [--dtype float32|bfloat16] [--nprocs 1,2] [--warmup 2] [--steps 5] [--threads N]
        [--set KEY=VALUE ...] [--out benchmarks/results/grpo_step_cpu.jsonl [--append]]
        [--compare TRL_JSONL]

The workloads (benchmarks/_workloads.py) start from the same weights as the TRL baseline
(benchmarks/trl_grpo_baseline.py) and reset the reference every step where there is one. Each
nproc runs under `python -m torch.distributed.run` (DP over the ranks, one in-process vLLM engine
per rank); rank 0 reports the means over the measured steps, one JSON line per nproc:
  time_<phase>_s      rollout, advantage, score, update, weight_sync, reference_sync (the
                      trainer's own PhaseTimer; rollout_wait is 0 without async rollouts)
  step_s              wall time of Trainer.step()
  gen_tokens_per_s    completion tokens sampled (all ranks) / step_s
  trained_tokens_per_s real (non-pad) prompt + completion tokens through the update's
                      forward + backward passes / step_s
  loss_tokens_per_s   update tokens that carry the loss / step_s
  cpu_s_per_step      process CPU seconds per step, summed over ranks (all threads; less
                      disturbed than wall time when other processes share the cores)
  padded_token_share  1 - real tokens / tokens the policy processed in the update, counted from
                      the shapes of the micro-batches reaching `tr.passes.forward`
                      (wrapped here, so trimmed or packed micro-batches count as they are: a
                      packed one's dense layers see its packed tokens only; its attention pads
                      each row to the micro-batch's longest, not counted here);
                      `padded_token_share_score` the same for the scoring passes
  floor_<phase>_s, floor_frac_<phase>  for rollout, score, update and the step: the FLOP
                      floor, useful model FLOPs of the phase (`_workloads.forward_flops`: dense
                      layers and causal attention over the real tokens, the output layer at the
                      loss positions; an update pass is 3x a forward, a scoring pass 1x; each
                      scoring pass that ran counts: old log-probs if computed, reference; a
                      rollout `_workloads.rollout_flops`: each prompt prefilled once, one
                      forward per sampled token) at `gemm_gflops`, torch.mm's best rate measured
                      by this script (before the launches and after each) at the same dtype and
                      the run's total thread count (ranks x threads per rank), and the fraction
                      of it achieved (floor / time); the step's floor is the phases' sum.
                      The rollout's floor is bandwidth-aware (benchmarks/rollout_floor.py): per
                      decode step the larger of its FLOPs at that rate and its bytes (weights
                      once + the live sequences' KV cache) at `mem_read_gbs`, the best memory
                      read bandwidth measured the same way (`machine.memory_read_gbs`);
                      `floor_rollout_flops_only_s` is the FLOP-only floor of earlier records,
                      `rollout_bandwidth_bound_steps` of `rollout_decode_steps` the decode
                      steps where the bytes bind, `rollout_profiles` each rollout's prefill
                      FLOPs and per-step [FLOPs, bytes] (to re-price the record at other rates)
  mfu_update, mfu_score  floor_frac_update, floor_frac_score under their older names
  warmup_step_s       the warm-up steps' wall times (not in the means: first-step costs such as
                      compute.compile_layers' compile land there)
  compile_s           dynamo's and inductor's own seconds on rank 0 where the layers were
                      compiled (null where not)
  cpu                 megagrpo.runtime.machine.cpu_name(): model name, family / model, capability
  model               the model's shape: hidden, ffn, layers, vocab
  eager               with --compile-ab: the eager steps' step_s and time_<phase>_s means (the
                      record's own are the compiled steps')
  completion_len_mean/_p50/_max  the sampled completion lengths over the measured steps
--compare reads the TRL baseline's JSON lines and adds `vs_trl_gen_tokens_per_s`: megagrpo gen
tokens/s divided by the best TRL line's of the same workload and dtype (the thread setting most
favourable to TRL), and the same ratio per CPU second.
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
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workloads as W  # noqa: E402
import rollout_floor as RF  # noqa: E402

from megagrpo.cli import torchrun_command  # noqa: E402
from megagrpo.runtime.machine import cpu_name  # noqa: E402

ROOT = W.ROOT
PHASES = ("rollout", "advantage", "score", "update", "weight_sync", "reference_sync")
# per-phase sums recorded by StepCounter, in this order
COUNTS = ("processed", "real", "loss", "flops")


def row_lengths(ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Real tokens of each row [b] of a right-padded micro-batch (ids, mask [b, S]): up to the
    last non-pad token or the last loss target, whichever is later (pad may equal EOS, and a
    chat prompt may hold that id too, so counting non-pad ids would be wrong)."""
    pos = torch.arange(1, ids.shape[1] + 1)
    last_tok = torch.where(ids != pad_id, pos, 0).amax(dim=1)
    last_loss = torch.where(mask.bool(), pos + 1, 0).amax(dim=1)  # target of column j: j + 1
    return torch.maximum(last_tok, last_loss).clamp(max=ids.shape[1])


class StepCounter:
    """What the policy processes per phase, from the micro-batches reaching `tr.passes.forward`:
    processed (b x S), real and loss tokens, useful FLOPs (x3 in the update); and the sampled
    completion lengths (replica rank 0 only, so a replica counts once)."""

    def __init__(self, model_cfg, pad_id: int, count_lengths: bool,
                 rollout_dtype: str = "float32") -> None:
        self.model_cfg = model_cfg
        self.pad_id = pad_id
        self.count_lengths = count_lengths
        self.phase = "other"
        self.sums: dict[str, torch.Tensor] = {}
        self.lengths: list[int] = []
        self.rollout_flops = 0.0
        self.rollouts: list[list] = []  # rollout_floor.rollout_costs of each rollout
        self.warmup_s: list[float] = []  # the unmeasured steps' wall times (compiles land here)
        self.nbytes = RF.dtype_bytes(rollout_dtype)

    def install(self, tr) -> None:
        """Wraps the trainer's forward step (`tr.passes.forward`, its observation hook) and the
        trainer's score / update / build_batch."""
        tr.passes.forward = partial(self._forward, tr.passes.forward)
        tr.update = partial(self._in_phase, "update", tr.update)
        tr.score = partial(self._in_phase, "score", tr.score)
        tr.build_batch = partial(self._build_batch, tr.build_batch)

    def reset(self) -> None:
        self.sums = {}
        self.rollout_flops = 0.0

    def step_counts(self, phase: str) -> torch.Tensor:
        return self.sums.get(phase, torch.zeros(len(COUNTS), dtype=torch.float64))

    def _in_phase(self, phase: str, fn, *args, **kwargs):
        self.phase = phase
        try:
            return fn(*args, **kwargs)
        finally:
            self.phase = "other"

    def _build_batch(self, fn, ro):
        if self.count_lengths:
            self.lengths += [len(c.token_ids) for c in ro.completions]
            per_prompt: list[list[int]] = [[] for _ in ro.prompts]
            for c in ro.completions:
                per_prompt[c.prompt_index].append(len(c.token_ids))
            prompts = [len(p) for p in ro.prompts]
            self.rollout_flops += W.rollout_flops(self.model_cfg, prompts, per_prompt)
            self.rollouts.append(RF.rollout_costs(self.model_cfg, self.nbytes, prompts,
                                                  per_prompt))
        return fn(ro)

    def _forward(self, fn, micro, *args, **kwargs):
        # a megagrpo.parallel.batch.MicroBatch (its rows, trimmed to their width, maybe packed end
        # to end: then the model processes the packed tokens) or a plain Batch
        mb = getattr(micro, "batch", micro)
        packed = getattr(micro, "packed", None)
        n = row_lengths(mb.ids, mb.mask, self.pad_id)
        loss = float(mb.mask.sum())
        flops = W.forward_flops(self.model_cfg, n[n > 0], loss) * (
            3.0 if self.phase == "update" else 1.0)
        processed = (packed if packed is not None else mb).ids.numel()
        row = torch.tensor([float(processed), float(n.sum()), loss, flops],
                           dtype=torch.float64)
        self.sums[self.phase] = self.step_counts(self.phase) + row
        return fn(micro, *args, **kwargs)


def _measure(tr, counter: StepCounter, warmup: int, steps: int,
             compile_ab: bool = False) -> tuple[list[dict], list[dict]]:
    """Runs warmup + steps trainer steps; per measured step the trainer's metrics plus the
    world's token, FLOP and CPU counts (every rank of a replica counted the replica's batch).
    compile_ab: one eager warm-up step more, then each measured step is paired with one with
    the layers eager, in ABBA order (`megagrpo.model.compile.use_compiled`); the eager steps'
    metrics come back apart and leave no lengths or rollouts in `counter`."""
    import torch.distributed as dist

    rows, eager_rows = [], []
    pairs = [(True, False), (False, True)]  # ABBA: a drift in machine speed cancels
    modes = [True] * warmup + [False] * compile_ab + [
        m for k in range(steps) for m in (pairs[k % 2] if compile_ab else (True,))]
    for i, compiled in enumerate(modes):
        if compile_ab:
            _use_compiled(tr, compiled)
        counter.reset()
        n_len, n_ro = len(counter.lengths), len(counter.rollouts)
        t, c = time.perf_counter(), time.process_time()
        m = tr.step()
        m["step_s"] = time.perf_counter() - t
        cpu = time.process_time() - c
        gen = float(sum(counter.lengths[n_len:]))
        v = torch.cat([counter.step_counts("update"), counter.step_counts("score"),
                       torch.tensor([cpu, gen, counter.rollout_flops], dtype=torch.float64)])
        dist.all_reduce(v)
        v[:2 * len(COUNTS)] /= tr.ranks.mp_size
        names = [f"{k}_{p}" for p in ("update", "score") for k in COUNTS] + [
            "cpu_s", "gen", "flops_rollout"]
        m.update(zip(names, v.tolist()))
        if i < warmup + compile_ab:
            counter.warmup_s.append(round(m["step_s"], 3))
        elif compiled:
            rows.append(m)
            continue
        else:
            eager_rows.append(m)
        del counter.lengths[n_len:], counter.rollouts[n_ro:]
    return rows, eager_rows


def _use_compiled(tr, on: bool) -> None:
    """The policy's and the reference's compiled layers switched on or off."""
    from megagrpo.model.compile import use_compiled

    use_compiled(tr.policy, on)
    if getattr(tr.reference, "model", None) is not None:
        use_compiled(tr.reference.model, on)


def compile_seconds(tr) -> float | None:
    """Dynamo's and inductor's own seconds in this process where compute.compile_layers
    compiled the policy's layers (None where it did not): the first steps pay them."""
    from megagrpo.model.compile import compiled_layers

    if not compiled_layers(tr.policy):
        return None
    from torch._dynamo.utils import calculate_time_spent

    return round(calculate_time_spent().get("total_wall_time", 0.0), 2)


def _record(rows: list[dict], lengths: list[int]) -> dict:
    """The JSON fields computed from the measured steps' means (rank 0)."""
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]
            if isinstance(rows[0][k], (int, float)) and not isinstance(rows[0][k], bool)}
    step, cpu = mean["step_s"], mean["cpu_s"]

    def share(phase: str) -> float | None:
        p = mean[f"processed_{phase}"]
        return round(1.0 - mean[f"real_{phase}"] / p, 4) if p else None

    return dict(
        **{f"time_{p}_s": round(mean.get(f"time_{p}", 0.0), 4) for p in PHASES},
        step_s=round(step, 4), cpu_s_per_step=round(cpu, 4),
        gen_tokens_per_step=round(mean["gen"], 1), gen_tokens_per_s=round(mean["gen"] / step, 1),
        gen_tokens_per_cpu_s=round(mean["gen"] / cpu, 1),
        trained_tokens_per_s=round(mean["real_update"] / step, 1),
        loss_tokens_per_s=round(mean["loss_update"] / step, 1),
        padded_token_share=share("update"), padded_token_share_score=share("score"),
        processed_tokens_update=round(mean["processed_update"], 1),
        real_tokens_update=round(mean["real_update"], 1),
        flops_update=mean["flops_update"], flops_score=mean["flops_score"],
        flops_rollout=mean["flops_rollout"],
        **W.length_stats(lengths), reward_mean=round(mean.get("reward_mean", float("nan")), 4),
        logp_gap_vllm_mean=mean.get("logp_gap_vllm_mean"))


def worker(recipe: str, sets: list[str], warmup: int, steps: int, out_dir: str,
           compile_ab: bool = False) -> None:
    """Runs on every rank under torchrun; rank 0 prints `RESULT {json}`."""
    import torch.distributed as dist

    from megagrpo.config.train import load_config
    from megagrpo.run import setup

    cfg = load_config(recipe, [*sets, f"run.out_dir={out_dir}", "run.overwrite=true"])
    t0 = time.perf_counter()
    tr = setup(cfg)
    tr.sync_weights()
    setup_s = time.perf_counter() - t0
    counter = StepCounter(tr.model_cfg, tr.tokens.pad_id, count_lengths=tr.ranks.mp_rank == 0,
                          rollout_dtype=cfg.rollout.dtype)
    counter.install(tr)
    rows, eager_rows = _measure(tr, counter, warmup, steps, compile_ab)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counter.lengths)
    rollouts = [None] * dist.get_world_size()
    dist.all_gather_object(rollouts, counter.rollouts)
    if tr.ranks.rank == 0:
        rec = dict(system="megagrpo", nproc=dist.get_world_size(), tp=cfg.parallel.tp,
                   dp=tr.ranks.dp,
                   batch_prompts=cfg.data.batch_size, group_size=cfg.algo.group_size,
                   max_tokens=cfg.rollout.max_tokens, warmup=warmup, steps=steps,
                   setup_s=round(setup_s, 2), **_record(rows, [n for ls in every for n in ls]),
                   threads=torch.get_num_threads(), cpus=os.cpu_count(),
                   loadavg_1m=round(os.getloadavg()[0], 2), cpu=cpu_name(),
                   warmup_step_s=counter.warmup_s, compile_s=compile_seconds(tr),
                   model=dict(hidden=tr.model_cfg.hidden_size, ffn=tr.model_cfg.ffn_hidden_size,
                              layers=tr.model_cfg.num_layers, vocab=tr.model_cfg.vocab_size),
                   rollout_profiles=[r for rs in rollouts for r in rs])
        if compile_ab:
            rec["eager"] = dict(step_s=round(statistics.mean(r["step_s"] for r in eager_rows), 4),
                                **{f"time_{p}_s": round(statistics.mean(
                                    r.get(f"time_{p}", 0.0) for r in eager_rows), 4)
                                   for p in PHASES})
        print("RESULT " + json.dumps(rec), flush=True)
    dist.barrier()
    os._exit(0)  # skip vLLM's shutdown hooks (they tear down the process group)


def launch(nproc: int, recipe: str, sets: list[str], warmup: int, steps: int,
           threads: int = 0, script: str = __file__, worker_args: tuple = ()) -> dict:
    """One torchrun launch of `script --worker` (this file's `worker` by default); its RESULT
    record."""
    out_dir = tempfile.mkdtemp(prefix=f"grpo_step_{nproc}_")
    cmd = torchrun_command(nproc, script, "--worker", "--recipe", recipe, "--warmup", str(warmup),
                           "--steps", str(steps), "--out-dir", out_dir, *worker_args,
                           *(a for kv in sets for a in ("--set", kv)))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    found = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"nproc={nproc} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(found[-1])


def expected_threads(nproc: int, threads: int) -> int:
    """Intra-op threads of a launch in all: torchrun sets OMP_NUM_THREADS=1 per rank when
    nproc > 1 and it is unset; one rank keeps torch's default (all cores)."""
    return nproc * threads if threads else (os.cpu_count() or 1) if nproc == 1 else nproc


def measure_gemm(gemm: dict, dtype: str, threads: int) -> tuple[float, int]:
    """torch.mm's rate at (dtype, threads), kept as the best of every measurement so far: on a
    shared machine a busy moment lowers one measurement, and a low denominator would inflate
    the MFU (the best rate makes it conservative)."""
    rate, n = W.gemm_gflops(dtype, threads)
    if (dtype, threads) not in gemm or rate > gemm[(dtype, threads)][0]:
        gemm[(dtype, threads)] = (rate, n)
    return gemm[(dtype, threads)]


FLOOR_PHASES = ("rollout", "score", "update")


def measure_bandwidth(bw: dict, threads: int) -> tuple[float, str]:
    """The memory read bandwidth at `threads` (`machine.memory_read_gbs`), the best of every
    measurement so far (as `measure_gemm`: a busy moment lowers one)."""
    from megagrpo.runtime.machine import memory_read_gbs

    rate, method = memory_read_gbs(threads)
    if threads not in bw or rate > bw[threads][0]:
        bw[threads] = (rate, method)
    return bw[threads]


def add_mfu(rec: dict, dtype: str, gemm: dict, bw: dict | None = None) -> dict:
    """Per phase (rollout, score, update) and for the step: the floor (score and update: the
    phase's useful FLOPs at torch.mm's best rate at the run's total threads, measured before
    the launches and again now, `measure_gemm`; the rollout: `rollout_floor`'s bandwidth-aware
    floor when `bw` is given and the record holds its rollouts' costs, else its FLOPs at that
    rate), the fraction of it achieved (floor / time), achieved GFLOP/s; mfu_update /
    mfu_score are the same fractions under their older names. The step's floor is the sum of
    the three (advantage, weight sync and the reference reset do no model FLOPs: their time
    counts against the step's fraction)."""
    total = rec["nproc"] * rec["threads"]
    rate, n = measure_gemm(gemm, dtype, total)
    rec.update(gemm_gflops=round(rate, 1), gemm_n=n, gemm_threads=total)
    floors = {p: rec[f"flops_{p}"] / (rate * 1e9) for p in FLOOR_PHASES}
    if bw is not None and rec.get("rollout_profiles"):
        gbs, method = measure_bandwidth(bw, total)
        ro = RF.rollout_floor(rec["rollout_profiles"], rate, gbs)
        floors["rollout"] = ro["floor_s"] / rec["steps"]
        rec.update(mem_read_gbs=round(gbs, 2), mem_read_method=method,
                   floor_rollout_flops_only_s=rec["flops_rollout"] / (rate * 1e9),
                   rollout_decode_flop_s=ro["decode_flop_s"] / rec["steps"],
                   rollout_decode_byte_s=ro["decode_byte_s"] / rec["steps"],
                   rollout_prefill_floor_s=ro["prefill_s"] / rec["steps"],
                   rollout_decode_steps=ro["steps"],
                   rollout_bandwidth_bound_steps=ro["bandwidth_bound_steps"])
    for phase in FLOOR_PHASES:
        t, flops, floor = rec[f"time_{phase}_s"], rec[f"flops_{phase}"], floors[phase]
        ok = t > 0 and flops > 0
        rec[f"floor_{phase}_s"] = floor
        rec[f"floor_frac_{phase}"] = round(floor / t, 4) if ok else None
        rec[f"achieved_gflops_{phase}"] = round(flops / t / 1e9, 2) if ok else None
    rec["mfu_update"], rec["mfu_score"] = rec["floor_frac_update"], rec["floor_frac_score"]
    rec["floor_step_s"] = sum(floors.values())
    rec["floor_frac_step"] = (round(rec["floor_step_s"] / rec["step_s"], 4)
                              if rec["step_s"] > 0 else None)
    return rec


def compare(records: list[dict], trl_path: str) -> list[dict]:
    """Adds megagrpo gen tokens/s over the best TRL line's of the same workload and dtype
    (wall and per CPU second)."""
    trl = [json.loads(ln) for ln in Path(trl_path).read_text().splitlines() if ln.strip()]
    for r in records:
        same = [t for t in trl if t.get("system") == "trl" and "skipped" not in t
                and t.get("workload", "demo") == r["workload"]
                and t.get("dtype", "float32") == r["dtype"]]
        if not same:
            continue
        best = max(same, key=lambda t: t["gen_tokens_per_s"])
        best_cpu = max(t["gen_tokens_per_cpu_s"] for t in same)
        r["trl_gen_tokens_per_s"] = best["gen_tokens_per_s"]
        r["trl_threads"] = best["threads"]
        r["vs_trl_gen_tokens_per_s"] = round(r["gen_tokens_per_s"] / best["gen_tokens_per_s"], 2)
        r["vs_trl_gen_tokens_per_cpu_s"] = round(r["gen_tokens_per_cpu_s"] / best_cpu, 2)
    return records


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="demo", help="demo, varlen, midsize or smollm2")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--nprocs", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/grpo_step_cpu.jsonl")
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS per rank (default: torchrun's, all cores for 1 rank)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override on top of the workload (repeatable; give the "
                         "TRL baseline the same)")
    ap.add_argument("--compare", default="", help="TRL baseline JSONL to compare against")
    ap.add_argument("--compile-ab", action="store_true",
                    help="compute.compile_layers=true, and every measured step is paired with "
                         "one with the layers eager in the same process (separate processes "
                         "drift more than the difference here); the eager steps' means go "
                         "under `eager`")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    return ap.parse_args()


def write_lines(records: list[dict], out: str, append: bool) -> None:
    lines = [json.dumps(r) for r in records]
    print("\n".join(lines), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a" if append else "w") as f:
            f.write("".join(ln + "\n" for ln in lines))


def main() -> None:
    args = _args()
    if args.worker:
        worker(args.recipe, args.set, args.warmup, args.steps, args.out_dir, args.compile_ab)
        return
    w, dtype = W.get_workload(args.workload), W.check_dtype(args.dtype)
    head = dict(workload=w.name, dtype=dtype, overrides=list(args.set))
    if why := W.missing_model(w):
        print(why, file=sys.stderr)
        write_lines([dict(system="megagrpo", **head, skipped=why)], args.out, args.append)
        return
    if args.compile_ab:
        head["overrides"].append("compute.compile_layers=true")
        head["compile_ab"] = True
    sets = W.overrides(w, dtype, head["overrides"])
    gemm: dict = {}
    bw: dict = {}
    for n in {expected_threads(int(n), args.threads) for n in args.nprocs.split(",")}:
        measure_gemm(gemm, dtype, n)  # before the runs, too: the best rate of the session
        measure_bandwidth(bw, n)
    records = []
    for n in args.nprocs.split(","):
        rec = launch(int(n), str(ROOT / w.recipe), sets, args.warmup, args.steps, args.threads,
                     worker_args=("--compile-ab",) if args.compile_ab else ())
        records.append(add_mfu({**head, **rec}, dtype, gemm, bw))
    if args.compare:
        records = compare(records, args.compare)
    write_lines(records, args.out, args.append)


if __name__ == "__main__":
    main()
