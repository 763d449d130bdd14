"""Per-step metrics: JSONL always, TensorBoard and W&B when installed, a console line, and the
end-of-run plot. Only global rank 0 writes."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

log = logging.getLogger("megagrpo")

CONSOLE_KEYS = ("reward_mean", "kl", "entropy", "clip_frac_high", "completion_len",
                "logp_gap_vllm_mean", "tokens_per_s")


class PhaseTimer:
    """`with timer("rollout"): ...` accumulates wall seconds per phase."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + (
                time.perf_counter() - t0)


class MetricsLogger:
    """Writes one JSON object per record to out_dir/metrics.jsonl (+ TB / W&B if present)."""

    def __init__(self, out_dir: str | Path, *, enabled: bool, tensorboard: bool = True,
                 wandb: bool = False, config: dict | None = None, progress: bool = True):
        self.enabled, self.progress = enabled, progress
        self.path = Path(out_dir) / "metrics.jsonl"
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
        if self.progress and "reward_mean" in record:
            parts = " ".join(f"{k}={record[k]:.3g}" for k in CONSOLE_KEYS if k in record)
            extra = f" eval_acc={record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
            reset = record.get("reference_sync")
            ref = f" [ref reset: {reset}]" if reset else ""
            print(f"step {step:4d} | {parts}{extra}{ref}", flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] \
        if p.exists() else []


def plot_curves(records: list[dict], out_png: str | Path) -> None:
    """Reward, eval accuracy and KL against step, reference resets marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("reward_mean", steps, "train reward"), ("eval_accuracy", evals, "held-out accuracy"),
              ("kl", steps, "KL to reference"))
    resets = [r["step"] for r in steps if r.get("reference_sync")]
    for ax, (key, rows, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if rows else None)
        for s in resets:
            ax.axvline(s, color="tab:red", alpha=0.3, lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if resets:
        axes[2].plot([], [], color="tab:red", alpha=0.5, label="reference reset")
        axes[2].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
