"""What a person sees: one line per thing worth knowing, a progress bar with ETA, the final
table. Everything else (third-party warnings, every rank's INFO, vLLM's own log) goes to
`out_dir/logs/rank<N>.log`; `--verbose` (env MEGAGRPO_VERBOSE=1) shows all of it on the console.

What is filtered from the console, and why it is safe to (each is checked elsewhere):
- vLLM "RotaryEmbedding: Failed to load weights" at every weight sync: rotary embeddings have
  no weights; every real tensor is loaded (vLLM greedy == megatron greedy is tested).
- vLLM "Chat template warmup failed" (a traceback) and "Using None for EOS token id": the
  engine runs without a tokenizer (megagrpo tokenizes, and passes the stop ids itself).
- vLLM notes on tcmalloc/iomp preloads, thread binding, eager mode, Triton, the V1 runner and
  the global seed: performance hints for serving, or about state megagrpo restores itself.
- megatron-core "Transformer Engine / Apex not installed, falling back": said once, in the
  'layer spec' line, as what runs; deprecation/Future warnings of the libraries.
- vLLM CPU "Reset SSM cache type to float32 ...": a setting of hybrid (mamba) models, which
  megagrpo does not train; megatron-core's CUDA_DEVICE_MAX_CONNECTIONS warning at TP > 1 on CPU
  (a CUDA stream setting: there is no CUDA).
- torch's "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", raised
  (through the CPU shim's torch-function mode) where megatron-core's distributed optimizer reads
  the gradients of its fp32 shard views, as designed; its steps are checked against the plain
  optimizer's and across resumes (tests/test_resume.py).
- math-verify's "Timeout is disabled" (reward threads): megagrpo enforces reward.timeout_s.
- torch C++ warnings (NUMA binding): TORCH_CPP_LOG_LEVEL=ERROR unless --verbose.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import time
from pathlib import Path

VERBOSE_ENV = "MEGAGRPO_VERBOSE"
PREFLIGHT_SHOWN_ENV = "MEGAGRPO_PREFLIGHT_SHOWN"  # set by the launcher for the ranks it starts
LOG_DIR = "logs"
_FORMAT = "[%(name)s] %(message)s"
_FILE_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
# (logger name prefix, message fragment): records that say nothing a user can act on
QUIET = (
    ("vllm", "Failed to load weights"),
    ("vllm", "Chat template warmup failed"),
    ("vllm", "Using None for EOS token id"),
    ("vllm", "is not found in LD_PRELOAD"),
    ("vllm", "torch.set_num_threads"),
    ("vllm", "The global random seed is set"),
    ("vllm", "Enforce eager set"),
    ("vllm", "Inductor compilation was disabled"),
    ("vllm", "Triton is not installed"),
    ("vllm", "Triton is installed, but"),
    ("vllm", "Model Runner V2 requires Triton"),
    ("py.warnings", "Transformer Engine and Apex are not installed"),
    ("py.warnings", "Apex is not installed"),
    ("py.warnings", "cuda_graph_scope"),
    # compute.recompute=selective: megatron's caution for TE's fused attention, on every rank
    # (the console's recompute line says what runs)
    ("py.warnings", "need to set 'core_attn' to recompute"),
    ("py.warnings", "CUDA_DEVICE_MAX_CONNECTIONS"),
    ("py.warnings", "attribute of a Tensor that is not a leaf Tensor is being accessed"),
    ("py.warnings", "DeprecationWarning"),
    ("py.warnings", "FutureWarning"),
    ("math_verify", "Timeout is disabled"),  # megagrpo enforces reward.timeout_s itself
    ("vllm", "Reset SSM cache type"),  # hybrid (mamba) models only
    # partial rollouts hand token prompts to the engine core's add_request (run_partial): vLLM
    # 0.32 notes, once per engine, that its renderer will take them instead
    ("vllm", "Passing raw prompts to InputProcessor is deprecated"),
    # LoRA on a VLM: megagrpo's adapters are on the language model only; vLLM's LoRA manager
    # says, for each vision-tower module, that it has no wrapper for it (it carries no adapter)
    ("vllm.lora", "no matching PunicaWrapper is found; visual."),
    ("megagrpo", "reference re-initialised"),  # the progress bar marks it ("ref reset")
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class ConsoleFilter(logging.Filter):
    """Console only: rank 0's megagrpo INFO, every rank's warnings, minus `QUIET`."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and (
                self.rank != 0 or not record.name.startswith("megagrpo")):
            return False
        text = record.getMessage()
        return not any(record.name.startswith(name) and frag in text for name, frag in QUIET)


def configure(rank: int | None = None) -> None:
    """Console logging for this process (call first, before torch / vLLM are imported).
    Records are also buffered until `attach_log_file` names the file they go to."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if not verbose():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # vLLM then logs through the root logger (its own handler would bypass the filter)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(_FORMAT))
    if verbose():
        console.setLevel(logging.INFO)
    else:
        console.addFilter(ConsoleFilter(rank))
    root.addHandler(console)
    root.addHandler(_Buffer())
    logging.captureWarnings(True)  # warnings.warn -> logger 'py.warnings' (filtered, logged)


class _Buffer(logging.Handler):
    """Holds the records of the start-up (the newest `size`) until the log file is known."""

    def __init__(self, size: int = 20_000) -> None:
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def attach_log_file(out_dir: str | os.PathLike, rank: int) -> Path:
    """Sends this rank's full log to out_dir/logs/rank<N>.log, starting with what was buffered
    since `configure`. Returns the file's path."""
    path = Path(out_dir).expanduser() / LOG_DIR / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _Buffer):
            for record in h.records:
                handler.handle(record)
            root.removeHandler(h)
    root.addHandler(handler)
    return path


def what_runs(layer_spec: str, kernel_impl: str, attention: str = "",
              packed: bool | None = None, cp: int = 1) -> str:
    """One line naming the implementations in use and why (instead of the libraries' fallback
    warnings on every rank). `attention`: `megagrpo.model.gpt.attention_impl_name`'s answer;
    `packed`: `megagrpo.model.gpt.sequence_packing`'s (None: not said); `cp`: parallel.cp (at
    cp > 1 megagrpo's SDPA slot runs `megagrpo.parallel.context_parallel.cp_attention`)."""
    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    te = " (Transformer Engine not installed)" if layer_spec == "local" and not te_installed \
        else ""
    apex = importlib.util.find_spec("apex") is not None
    norms = "apex" if apex else "torch (Apex not installed)"
    # megatron-core's choice (megatron/core/optimizer/__init__.py); torch's: megagrpo.model.optim
    optimizer = ("Transformer Engine FusedAdam" if te_installed
                 else "Apex FusedAdam" if apex else "torch AdamW, fused kernel")
    kernels = kernel_impl if kernel_impl != "auto" else ("triton" if cuda else "torch (no CUDA)")
    # the local spec's core attention (Transformer Engine's spec brings its own)
    names = {"sdpa": "torch sdpa", "megatron": "megatron"}
    if attention == "sdpa" and cp > 1:
        names["sdpa"] = (f"causal chunks over cp={cp} (gathered K/V, torch's CPU flash kernel "
                         "per block, merged by log-sum-exp)")
    attn = f", attention: {names[attention]}" if attention in names else ""
    pack = ("" if packed is None else "; micro-batches: packed end to end" if packed
            else "; micro-batches: padded rows")
    return (f"layer spec: {layer_spec}{te}{attn}; norms: {norms}; optimizer: {optimizer}; "
            f"loss kernels: {kernels}{pack}")


def summary_table(summary: dict, out_dir: str | os.PathLike) -> str:
    """The end-of-run table: every summary figure, then where the run's files are."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    if "wall_seconds" in summary:
        w = summary["wall_seconds"]
        rows.append(("wall_time", f"{int(w // 60)}m{int(w % 60):02d}s"))
    width = max(len(k) for k, _ in rows)
    out = Path(out_dir)
    lines = [f"run summary ({out / 'summary.json'})"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    files = f"files: {out / 'metrics.jsonl'}, {out / 'curves.png'}, {out / LOG_DIR}/"
    if (out / "tb").is_dir():  # log.tensorboard on and tensorboard installed
        files += f"; browse: tensorboard --logdir {out / 'tb'}"
    lines.append(files)
    return "\n".join(lines)


def _terminal_width() -> int:
    """Columns of the terminal stderr writes to; 0 when it is not a terminal (or has no size,
    as under `script` or some CI runners, where tqdm would draw nothing)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns if sys.stderr.isatty() else 0
    except (OSError, ValueError):
        return 0


class Progress:
    """Rank 0's view of the GRPO loop: a tqdm bar with ETA and the key figures on a terminal,
    a plain line every ~5% of the run otherwise (logs, CI). Evaluations get a line each."""

    # the vLLM-vs-trainer log-prob gap: ~1e-7 in fp32, ~1e-3 in bf16 (rollout IS corrects it)
    # multi-turn runs (agent on) add turns per trajectory and tool calls per trajectory
    KEYS = (("reward_mean", "reward"), ("kl", "kl"), ("completion_len", "len"),
            ("logp_gap_vllm_mean", "gap"), ("turns", "turns"), ("tool_calls", "tools"))

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = self.t_prev = time.perf_counter()
        self.first: int | None = None  # steps done before this process started (resume)
        self.every = max(1, total // 20)
        self.bar = None
        self.last_acc: float | None = None
        self.tty = _terminal_width() > 0  # a bar needs a terminal that has a width

    def update(self, record: dict) -> None:
        """Takes one metrics record: a step's (advances) or an evaluation's (a line)."""
        if not self.enabled:
            return
        seen, self.t_prev = self.t_prev, time.perf_counter()
        if "eval_accuracy" in record:
            self.last_acc = record["eval_accuracy"]
            if "reward_mean" not in record:
                self.write(f"step {record.get('step', self.done)}: held-out accuracy "
                           f"{self.last_acc:.3f}")
        if "reward_mean" not in record:
            return
        self.done = int(record.get("step", self.done + 1))
        if self.first is None:
            self.first, self.t0 = self.done - 1, seen  # from the record before the first step
            if self.tty:  # created at the first step: the bar's own clock starts there
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=self.first, desc="GRPO", unit="step",
                                dynamic_ncols=True)
        figures = self.figures(record)
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(figures, refresh=True)
        elif self.done % self.every == 0 or self.done == self.total:
            self.write(f"step {self.done}/{self.total} | {figures} | eta {self.eta()}")
        if "eval_accuracy" in record:
            self.write(f"step {self.done}: held-out accuracy {self.last_acc:.3f}")

    def figures(self, record: dict) -> str:
        parts = [f"{short}={record[k]:.3g}" for k, short in self.KEYS if k in record]
        if self.last_acc is not None:
            parts.append(f"acc={self.last_acc:.3f}")
        if record.get("dropped_frac"):  # samples out of training (an environment failed)
            parts.append(f"dropped={record['dropped_frac']:.3g}")
        if record.get("rollout_ranks_out"):  # rollout.engine_failure=continue: engines lost
            parts.append(f"rollout_out={record['rollout_ranks_out']:.0f}")
        if record.get("reference_sync"):
            parts.append("ref reset")
        return " ".join(parts + self.stream_figures(record))

    @staticmethod
    def stream_figures(record: dict) -> list[str]:
        """The rollout stream's figures, on runs that draw ahead or hold stale samples:
        `queue=` batches drawn ahead when the step asked, `lag=` staleness mean/max in policy
        versions, `stale=` samples beyond rollout.max_staleness (dropped or down-weighted),
        `idle=` trainer/rollout idle seconds (the trainer waiting for samples / the engines
        not sampling)."""
        lag_max = record.get("staleness_max", 0.0)
        if not record.get("rollout_queue_depth") and not lag_max:
            return []
        parts = [f"queue={record['rollout_queue_depth']:.0f}",
                 f"lag={record.get('staleness_mean', 0.0):.2g}/{lag_max:.0f}"]
        over = record.get("stale_dropped", 0.0) + record.get("stale_weighted", 0.0)
        if over:
            parts.append(f"stale={over:.0f}")
        if "trainer_idle_s" in record:
            parts.append(f"idle={record['trainer_idle_s']:.2f}/"
                         f"{record.get('rollout_idle_s', 0.0):.2f}s")
        return parts

    def eta(self) -> str:
        steps = self.done - (self.first or 0)
        if steps <= 0:
            return "?"
        left = (time.perf_counter() - self.t0) / steps * (self.total - self.done)
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
