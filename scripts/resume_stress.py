"""Kill-and-resume stress test: is a resumed run bitwise the run that was never interrupted?

    .venv/bin/python scripts/resume_stress.py --kills 5 [--steps 8] [--mode sync]
        [--work /tmp/stress]

Runs a tiny GRPO recipe (2 ranks = DP 2, fp32, checkpoint every 2 steps) once uninterrupted,
then N times: start the same run, SIGKILL its launcher, torchrun and ranks at once (as a crash
or an OOM kill would) at a random moment after the first step, resume it, and compare the
final policy, reference and optimizer tensors, every rank's random streams and pending batch,
the trainer state (trainer_state.json) and the metrics history (deterministic fields) with the
uninterrupted run. Prints one line per kill and "k/N resumed bitwise equal".
tests/test_resume.py drives the same functions.

--mode: sync (plain optimizer, synchronous rollout), distopt (optim.distributed_optimizer),
async (run.async_rollout), distopt+async (both), moe (a Qwen3-MoE at EP=2 with the distributed
optimizer), agent (multi-turn trajectories: tests/_agent_env.py's Digits environment, up to 3
turns, environment tokens masked), agent+async (those with the pending multi-turn batch
checkpointed), async2 (rollout.max_staleness=2: two batches drawn ahead, both checkpointed),
lora (LoRA adapters, a checkpoint every step and a reference reset, a merge, every 3:
checkpoints with and without the base, which is written only after a merge; the adapter
refit), lora+merged (the same with the merged-weight refit, lora.refit=auto's choice on CPU),
separate (rollout.placement=separate: 1 training rank + 1 rollout rank, k = 1; the rollout
rank's queued parts and sampler streams checkpointed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# fields that measure time, not what was computed
_TIMING_SUFFIXES = ("_s", "_seconds")


def tiny_overrides(out_dir: Path, steps: int, checkpoint_every: int = 2) -> list[str]:
    """A run small enough for CI: ~0.1M-parameter Llama, 2 ranks (DP=2), fp32."""
    return [
        "model.vocab_size=19", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=1",
        "model.head_dim=32", "model.max_position_embeddings=64",
        "parallel.make_vocab_size_divisible_by=16", "optim.lr=1e-3",
        "optim.lr_schedule=cosine", "optim.warmup_steps=1", "rollout.max_tokens=6",
        "rollout.max_model_len=64", "rollout.cpu_kvcache_space_gib=1", "algo.group_size=4",
        "algo.beta=0.05", "reference.sync_every_steps=3", "data.batch_size=8",
        "reward.terms=[{name: 'tests._rewards:length_reward'}]",
        "arithmetic.num_train=256", "arithmetic.num_eval=8", "compute.micro_batch_size=16",
        "compute.kernel_impl=torch", f"run.out_dir={out_dir}", f"run.steps={steps}",
        f"checkpoint.every={checkpoint_every}", "checkpoint.at_end=true",
        "checkpoint.keep_last=3", "log.progress=true", "log.tensorboard=false",
    ]


# multi-turn: the Digits environment answers turns 1 and 2 and ends after turn 3; a turn ends at
# EOS (the built-in tokenizer gives vLLM no text for stop strings), which the tiny model samples
# within 10 tokens about half the time, so batches mix 1, 2 and 3 turns (the rest are cut at
# rollout.max_tokens: truncation 'turn_length')
AGENT = ("agent.environment=tests._agent_env:Digits", "agent.max_turns=3",
         "rollout.max_tokens=10")

MODES = {
    "sync": (),
    "distopt": ("optim.distributed_optimizer=true",),
    "async": ("run.async_rollout=true",),
    "distopt+async": ("optim.distributed_optimizer=true", "run.async_rollout=true"),
    # a Qwen3-MoE of the same width (4 experts of 64, top-2) with its experts over EP=2 and
    # the distributed optimizer (dense state sharded over DP, expert state over DP / EP)
    "moe": ("model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2",
            "model.moe_ffn_hidden_size=64", "parallel.ep=2", "optim.distributed_optimizer=true"),
    "agent": AGENT,
    "agent+async": (*AGENT, "run.async_rollout=true"),
    # LoRA: the reference is the adapters off and a reset merges them into the base (after
    # steps 3 and 6): checkpoints 3 and 6 write a base, 4 and 5 name the one 3 wrote
    "lora": ("lora.rank=4", "lora.alpha=8", "lora.refit=adapter",
             "checkpoint.every=1"),
}
# issue 30: a stream two batches ahead (rollout.max_staleness=2), both in every checkpoint
MODES["async2"] = ("rollout.max_staleness=2",)
# LoRA with the merged-weight refit (lora.refit=auto's choice on vLLM's CPU build)
MODES["lora+merged"] = (*MODES["lora"][:2], "lora.refit=merged", *MODES["lora"][3:])
# bf16 mixed precision (bf16 weights and vLLM engine, fp32 main parameters and Adam moments,
# truncated rollout IS): a resume must be as bitwise as in fp32
BF16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16", "algo.rollout_is=truncate")
MODES["distopt+async+bf16"] = (*MODES["distopt+async"], *BF16)
# LoRA in bf16: a bf16 base and adapters, merges with the folded residual (docs/lora.md)
MODES["lora+merged+bf16"] = (*MODES["lora+merged"], *BF16)
# issue 47: separate placement (1 training rank + 1 rollout rank, k = 1): the rollout rank's
# finished parts the trainer had not taken and its sampler's streams are in every checkpoint
MODES["separate"] = ("rollout.placement=separate", "rollout.rollout_ranks=1",
                     "rollout.max_staleness=1")


def launch(out_dir: Path, steps: int, log: Path, *extra: str,
           env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.Popen:
    """`python -m megagrpo train --nproc 2 ...` in its own process group, output to `log`;
    `env`: variables added to this process's environment (a planted fault's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the torch kernel path: the interpreter only slows vLLM
    cmd = [sys.executable, "-m", "megagrpo", "train", "--nproc", str(nproc),
           *tiny_overrides(out_dir, steps), *extra]
    with log.open("ab") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    """Waits for a run; raises with the tail of its log when it fails."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        rc = -1
    if rc != 0:
        raise RuntimeError(f"run failed (rc={rc}):\n{log.read_text()[-6000:]}")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, read from /proc (torchrun starts each rank in a session
    of its own, so the launcher's process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the run's launcher, torchrun and ranks at once (as a crash or OOM kill would)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def logged_steps(out_dir: Path) -> list[int]:
    """Steps of the GRPO step records in metrics.jsonl (a line being written is skipped)."""
    path = out_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "reward_mean" in record:
            steps.append(record["step"])
    return steps


def wait_for_step(proc: subprocess.Popen, out_dir: Path, step: int, *,
                  checkpoint: bool = False, timeout: float = 600) -> None:
    """Returns once metrics.jsonl holds step `step` (the run is then inside step + 1), and with
    `checkpoint` once that step's checkpoint is complete as well."""
    from megagrpo.runtime.run_dir import MANIFEST, checkpoint_root

    manifest = checkpoint_root(out_dir) / f"step_{step:06d}" / MANIFEST
    t0 = time.monotonic()
    while step not in logged_steps(out_dir) or (checkpoint and not manifest.exists()):
        if proc.poll() is not None:
            raise RuntimeError(f"run ended (rc={proc.returncode}) before step {step}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"step {step} not reached in {timeout:.0f} s")
        time.sleep(0.05)


def history(out_dir: Path) -> list[dict]:
    """metrics.jsonl without the fields that measure time, and without the records that mark
    where torchrun restarted the job (`restart`: what an uninterrupted run has no record of;
    `restarts` returns them)."""
    return [{k: v for k, v in r.items() if not k.startswith("time_")
             and not k.endswith(_TIMING_SUFFIXES)} for r in _records(out_dir)
            if "restart" not in r]


def restarts(out_dir: Path) -> list[dict]:
    """The records a torchrun restart of the job wrote (`{"step", "restart",
    "resumed_from_step"}`), oldest first."""
    return [r for r in _records(out_dir) if "restart" in r]


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


def leftovers(needle: str) -> list[int]:
    """Live processes (not zombies) whose command line holds `needle` (a run's out_dir: every
    launcher, torchrun and rank of the run has it in its arguments)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle.encode() in cmdline.read_bytes():
                stat = (cmdline.parent / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z" and int(cmdline.parent.name) != \
                        os.getpid():
                    found.append(int(cmdline.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def final_state(out_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's policy, reference (where the run has one), optimizer and shared
    (a LoRA run's base, wherever it was written) tensors (dist-checkpoints, read with torch DCP,
    no process group) and every rank's random streams and pending async batch (megagrpo's
    safetensors files)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from megagrpo.checkpoint import load_tree
    from megagrpo.runtime.run_dir import checkpoint_root, refs_of, step_dirs

    ckpt = step_dirs(checkpoint_root(out_dir))[-1]
    out = {}
    folders = {part: ckpt / part for part in ("policy", "reference", "optimizer")}
    folders.update({name: ckpt / rel for name, rel in refs_of(ckpt).items()})
    for part, folder in folders.items():
        if part == "reference" and not folder.exists():  # algo.beta = 0 or LoRA: none saved
            continue
        tensors = _load_state_dict_from_keys(checkpoint_id=str(folder))
        out.update({f"{part}.{k}": v for k, v in tensors.items() if isinstance(v, torch.Tensor)})
    for part in ("rng", "rollout", "rollout_ranks"):  # rollout_ranks: separate placement
        for f in sorted((ckpt / part).glob("*.safetensors")):
            out.update(_flatten(load_tree(f), f"{part}.{f.stem}."))
    return out


def trainer_state(out_dir: Path) -> dict:
    """The newest checkpoint's trainer_state.json (counters, data position, reference
    schedule, layout) less `metrics_bytes`: the size of a log whose timing fields differ."""
    from megagrpo.runtime.run_dir import TRAINER_STATE, checkpoint_root, step_dirs

    ckpt = step_dirs(checkpoint_root(out_dir))[-1]
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    state.pop("metrics_bytes", None)
    return state


def _flatten(tree, prefix: str) -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, (int, float, str)):  # compared as 0-d tensors / bytes
        return {prefix: torch.tensor(list(tree.encode()) if isinstance(tree, str) else tree)}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        if not str(k).endswith(_TIMING_SUFFIXES):  # e.g. a pending batch's reward_time_s
            out.update(_flatten(v, f"{prefix}{k}."))
    return out


NEAR: dict[str, dict[str, float]] = {"separate": {"rollout_queue_depth": float("inf")}}
"""Metrics a mode's resumed run matches within an absolute tolerance, not bitwise: at separate
placement `rollout_queue_depth` is left out (infinite tolerance): it counts the later batches
the rollout ranks had finished when the trainer asked for its own, which depends on how fast
each side ran (the uninterrupted run itself gives 0 or 1 at a step, e.g. its last), not on what
was computed. Nothing else. (Until a
reference reset came before the step's refit, LoRA's adapter refit left vLLM, on the first step
after a resume that followed a merge, with the new base where the uninterrupted engine still
held the old base and adapter: its log-probs differed by ~1e-8.)"""


def compare(reference: Path, resumed: Path, near: dict[str, float] | None = None) -> list[str]:
    """What differs between two runs' final tensors and histories (empty: bitwise equal;
    `near`: metrics fields compared within an absolute tolerance instead)."""
    a, b = final_state(reference), final_state(resumed)
    diffs = [f"tensor sets differ: {sorted(a.keys() ^ b.keys())[:4]}"] if a.keys() != b.keys() \
        else []
    for k in sorted(a.keys() & b.keys()):
        if not torch.equal(a[k], b[k]):
            gap = float((a[k].double() - b[k].double()).abs().max())
            diffs.append(f"{k}: max |diff| {gap:.3g}")
    sa, sb = trainer_state(reference), trainer_state(resumed)
    diffs += [f"trainer_state.json {k}: {sa.get(k)} != {sb.get(k)}"
              for k in sorted(sa.keys() | sb.keys()) if sa.get(k) != sb.get(k)]
    ha, hb = history(reference), history(resumed)
    if len(ha) != len(hb):
        diffs.append(f"metrics.jsonl: {len(ha)} records vs {len(hb)}")
    near = near or {}
    for i, (x, y) in enumerate(zip(ha, hb)):
        gaps = {k: abs(x[k] - y[k]) for k in near.keys() & x.keys() & y.keys()}
        if {k: v for k, v in x.items() if k not in gaps} != \
                {k: v for k, v in y.items() if k not in gaps} \
                or any(g > near[k] for k, g in gaps.items()):
            diffs.append(f"metrics record {i}: {x} != {y}")
    return diffs


def interrupted_run(out_dir: Path, steps: int, kill_after_step: int, *extra: str,
                    delay: float = 0.0) -> str:
    """Starts the run, SIGKILLs all of it `delay` s after step `kill_after_step` was
    logged, resumes it to the end. Returns the resumed run's log."""
    log = out_dir.parent / f"{out_dir.name}.log"
    proc = launch(out_dir, steps, log, *extra)
    try:
        wait_for_step(proc, out_dir, kill_after_step)
        time.sleep(delay)
    finally:
        kill_tree(proc)
    resumed_log = out_dir.parent / f"{out_dir.name}.resumed.log"
    # killed before the first checkpoint was complete: nothing to resume, so start over (with
    # an intact checkpoint, resume wins over run.overwrite)
    finish(launch(out_dir, steps, resumed_log, *extra, "run.overwrite=true"), resumed_log)
    return resumed_log.read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--work", default="/tmp/megagrpo-resume-stress")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    ap.add_argument("--mode", choices=sorted(MODES), default="sync")
    args = ap.parse_args()
    extra = MODES[args.mode]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pick = random.Random(args.seed)
    ref = work / "uninterrupted"
    t0 = time.monotonic()
    finish(launch(ref, args.steps, work / "uninterrupted.log", "run.overwrite=true", *extra),
           work / "uninterrupted.log")
    print(f"uninterrupted run: {time.monotonic() - t0:.0f} s", flush=True)
    equal = 0
    for i in range(args.kills):
        out = work / f"kill{i}"
        step, delay = pick.randrange(1, args.steps), pick.uniform(0.0, 1.5)
        if out.exists():
            shutil.rmtree(out)
        interrupted_run(out, args.steps, step, *extra, delay=delay)
        diffs = compare(ref, out, NEAR.get(args.mode))
        equal += not diffs
        print(f"kill {i + 1}: after step {step} + {delay:.2f} s -> "
              f"{'bitwise equal' if not diffs else 'DIFFERS: ' + '; '.join(diffs[:3])}",
              flush=True)
    print(f"{equal}/{args.kills} resumed bitwise equal ({args.mode})")
    return 0 if equal == args.kills else 1


if __name__ == "__main__":
    raise SystemExit(main())
