"""Per-step metrics: JSONL always, TensorBoard and W&B when installed, a console line, and the
end-of-run plot. Only global rank 0 writes."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megagrpo.runtime.console import Progress

if TYPE_CHECKING:  # the watchdog is only passed through here
    from megagrpo.runtime.watchdog import Watchdog

log = logging.getLogger("megagrpo")

METRICS_FILE = "metrics.jsonl"


class PhaseTimer:
    """`with timer("rollout"): ...` accumulates wall seconds per phase (`times`, keys
    'time_<name>'), and marks each phase of `step` on the run's stall watchdog when given."""

    def __init__(self, watchdog: Watchdog | None = None, step: int | None = None) -> None:
        self.times: dict[str, float] = {}
        self.watchdog, self.step = watchdog, step

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.set_phase(name, self.step)
        try:
            yield
        finally:
            self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + (
                time.perf_counter() - t0)
            if self.watchdog is not None:  # what follows is no longer this phase
                self.watchdog.set_phase(f"after {name}")


class MetricsLogger:
    """Writes one JSON object per record to out_dir/metrics.jsonl (+ TB / W&B if present)."""

    def __init__(self, out_dir: str | Path, *, enabled: bool, tensorboard: bool = True,
                 wandb: bool = False, config: dict | None = None, progress: bool = True,
                 total_steps: int = 0):
        self.enabled = enabled
        self.progress = Progress(total_steps, enabled=enabled and progress)
        self.path = Path(out_dir) / METRICS_FILE
        self.tb = self.wb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except Exception:  # tensorboard not installed
                log.info("tensorboard not installed: metrics go to metrics.jsonl only")
        if wandb:
            try:
                import wandb as wb

                self.wb = wb.init(project="megagrpo", config=config or {}, dir=str(out_dir))
            except Exception as e:
                log.info("wandb unavailable (%s): metrics go to metrics.jsonl only", e)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record.get("step", 0))
        nums = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(nums, step=step)
        self.progress.update(record)  # the bar (or a line every ~5%) and evaluation lines

    def close(self) -> None:
        self.progress.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def history_size(out_dir: str | Path) -> int:
    """Bytes of out_dir/metrics.jsonl now (a checkpoint records it: its history ends there)."""
    p = Path(out_dir) / METRICS_FILE
    return p.stat().st_size if p.exists() else 0


def rewind_history(out_dir: str | Path, size: int) -> int:
    """Cuts out_dir/metrics.jsonl back to `size` bytes, the history of the checkpoint a run
    resumes from: the records a crashed run wrote after it are superseded by the resumed run's.
    Returns how many records were dropped. (TensorBoard / W&B keep theirs: they cannot rewind.)"""
    p = Path(out_dir) / METRICS_FILE
    if not p.exists() or p.stat().st_size <= size:
        return 0
    with p.open("r+b") as f:
        f.seek(size)
        dropped = sum(1 for line in f if line.strip())
        f.truncate(size)
    return dropped


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] \
        if p.exists() else []


def plot_curves(records: list[dict], out_png: str | Path) -> None:
    """Reward, eval accuracy and KL against step, reference resets marked; multi-turn runs with
    tool calls add well-formed tool calls per trajectory (tool_calls - tool_errors)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    panels = [("reward_mean", steps, "train reward"), ("eval_accuracy", evals, "held-out accuracy"),
              ("kl", steps, "KL to reference")]
    if any(r.get("tool_calls") for r in steps):
        for r in steps:
            r["well_formed_calls"] = r.get("tool_calls", 0.0) - r.get("tool_errors", 0.0)
        panels.insert(2, ("well_formed_calls", steps, "well-formed tool calls / trajectory"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    resets = [r["step"] for r in steps if r.get("reference_sync")]
    for ax, (key, rows, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if rows else None)
        for s in resets:
            ax.axvline(s, color="tab:red", alpha=0.3, lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if resets:
        axes[-1].plot([], [], color="tab:red", alpha=0.5, label="reference reset")
        axes[-1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
