"""The console: known non-actionable library messages and other ranks' INFO stay off it but
reach the per-rank log file (with what was logged before the file was known); the progress
view prints a line every ~5% with an ETA and a line per evaluation; a short real demo run's
console has no traceback, fits on a screen and names what runs, and --verbose shows the rest."""
import io
import logging
import re
from contextlib import redirect_stdout

import pytest

from megagrpo.runtime.console import ConsoleFilter, Progress, attach_log_file
from tests.support.cli import run_cli


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


@pytest.mark.parametrize("rank,name,level,msg,shown", [
    (0, "vllm.model_executor.model_loader.reload.layerwise", logging.WARNING,
     "RotaryEmbedding: Failed to load weights", False),
    (0, "vllm.renderers.base", logging.WARNING, "Chat template warmup failed", False),
    (0, "py.warnings", logging.WARNING, "x.py:3: UserWarning: Apex is not installed.", False),
    (0, "vllm.engine", logging.WARNING, "KV cache is too small", True),
    (0, "vllm.lora.model_manager", logging.WARNING, "Regarding Qwen2_5_VLForConditionalGeneration, "
     "no matching PunicaWrapper is found; visual.blocks.0.attn.qkv will be ignored.", False),
    (0, "vllm.lora.model_manager", logging.WARNING, "Regarding M, no matching PunicaWrapper is "
     "found; model.layers.0.mlp.fc1 will be ignored.", True),  # an adapter'd layer: said
    (0, "vllm.engine", logging.INFO, "Reloading weights took 0.1 s", False),
    (0, "megagrpo", logging.INFO, "distributed: backend=gloo", True),
    (1, "megagrpo", logging.INFO, "distributed: backend=gloo", False),
    (1, "megagrpo", logging.WARNING, "resume: optimizer state not restored", True),
])
def test_console_filter(rank, name, level, msg, shown):
    assert ConsoleFilter(rank).filter(_record(name, level, msg)) is shown


def test_log_file_gets_everything_including_what_came_before_it(tmp_path):
    from megagrpo.runtime.console import _Buffer

    root = logging.getLogger()
    buf = _Buffer()
    root.addHandler(buf)
    log = logging.getLogger("vllm.test_console")
    try:
        log.warning("before the file: RotaryEmbedding: Failed to load weights")
        path = attach_log_file(tmp_path, 3)
        log.warning("after the file")
    finally:
        for h in list(root.handlers):
            if isinstance(h, (logging.FileHandler, type(buf))):
                root.removeHandler(h)
                h.close()
    assert path == tmp_path / "logs" / "rank3.log"
    text = path.read_text()
    assert "before the file" in text and "after the file" in text


def test_progress_lines_every_five_percent_with_eta_and_evaluations():
    out = io.StringIO()
    p = Progress(40)
    with redirect_stdout(out):
        p.update({"step": 0, "eval_accuracy": 0.25})
        for s in range(1, 41):
            rec = {"step": s, "reward_mean": s / 40, "kl": 0.01, "completion_len": 5.0}
            if s == 20:
                rec["eval_accuracy"] = 0.5
            p.update(rec)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 0: held-out accuracy 0.250"
    steps = [ln for ln in lines if ln.startswith("step ") and "/40" in ln]
    assert [ln.split()[1] for ln in steps] == [f"{s}/40" for s in range(2, 41, 2)]
    assert all("eta " in ln for ln in steps) and "reward=1 " in steps[-1]
    assert "step 20: held-out accuracy 0.500" in lines and "acc=0.500" in steps[-1]


def _demo(tmp_path, *extra):
    return run_cli("demo", *extra, "run.steps=2", "cold_start.steps=2", "eval.every=0",
                   "arithmetic.num_eval=16", f"run.out_dir={tmp_path}/run",
                   "checkpoint.at_end=true", timeout=900,
                   OMP_NUM_THREADS=None)  # the launcher picks threads per rank


def test_demo_console_is_short_and_has_no_traceback(tmp_path):
    p = _demo(tmp_path)
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-4000:]
    lines = console.splitlines()
    assert "Traceback" not in console and "Warning" not in console, console
    # 40 lines, not counting the note said only when other processes hold the cores at start
    assert sum("other processes use" not in ln for ln in lines) <= 40, console
    assert any("layer spec: local" in ln and "Apex not installed" in ln for ln in lines)
    assert any(ln.startswith("run summary") for ln in lines)
    # the recipe's GRPO target is not checked without periodic evaluations, and says so
    assert any("eval.target_accuracy=0.92 is not checked during GRPO: eval.every=0" in ln
               for ln in lines), console
    # said once by the launcher, not again by rank 0 (it still runs the checks); vLLM's
    # hybrid-model note goes to the log only
    assert sum("preflight ok" in ln for ln in lines) == 1, console
    assert "Reset SSM cache" not in console, console
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "Failed to load weights" in log and "Chat template warmup failed" in log
    # vLLM's CPU platform says it only on CPUs with AVX-512 bf16 (vllm/platforms/cpu.py)
    import torch

    assert ("Reset SSM cache" in log) == torch.cpu._is_avx512_bf16_supported()
    assert (tmp_path / "run" / "logs" / "rank1.log").exists()


def test_summary_names_tensorboard_only_when_it_was_written(tmp_path):
    """The end-of-run table points at `tensorboard --logdir` only where the run wrote tb/
    (log.tensorboard=false, or tensorboard not installed, writes none)."""
    from megagrpo.runtime.console import summary_table

    table = summary_table({"steps": 3, "wall_seconds": 75.0}, tmp_path)
    assert re.search(r"wall_time +1m15s", table) and "--logdir" not in table
    (tmp_path / "tb").mkdir()
    table = summary_table({"steps": 3}, tmp_path)
    assert f"browse: tensorboard --logdir {tmp_path / 'tb'}" in table


def test_async_runs_name_their_staleness_correction():
    """run.async_rollout: the start-up console says the batch is one update stale and which
    rollout-IS correction (or none) handles it."""
    from megagrpo.config.train import load_config
    from megagrpo.train.offpolicy import start_line as async_note

    on = async_note(load_config(None, ["run.async_rollout=true", "algo.rollout_is=truncate"]))
    assert "one update behind" in on and "algo.rollout_is=truncate" in on
    # the default (rollout_is=none) is not left uncorrected (issue 30): it runs the decoupled
    # objective on stale batches and names the cap and how to choose it explicitly
    off = async_note(load_config(None, ["run.async_rollout=true"]))
    assert "decoupled objective" in off and "algo.rollout_is_cap=2" in off
    assert "set algo.rollout_is=truncate to choose it explicitly" in off
    assert "partial rollouts" not in off
    # partial rollouts say what a weight update does to the running draw; multi-turn says
    # where a trajectory pauses (issue 47 item 1)
    single = async_note(load_config(None, ["rollout.max_staleness=2",
                                           "rollout.partial_rollouts=true"]))
    assert "pauses between two decode steps" in single and "multi-turn" not in single
    assert single.endswith("a trajectory spans at most 2 updates")
    multi = async_note(load_config(None, ["rollout.max_staleness=1",
                                          "rollout.partial_rollouts=true",
                                          "agent.environment=tests._agent_env:Digits"]))
    assert "a trajectory between turns takes its next turn with the new weights" in multi
    assert "a resume continues paused trajectories whose environment saves its state " \
        "(Environment.state_dict), the others restart from their prompt" in multi
    assert multi.endswith("a trajectory spans at most 1 update")
    # on the rollout ranks no paused trajectory is ever checkpointed: no restart to announce
    apart = async_note(load_config(None, ["rollout.max_staleness=1",
                                          "rollout.partial_rollouts=true",
                                          "agent.environment=tests._agent_env:Digits",
                                          "rollout.placement=separate", "rollout.rollout_ranks=1"]))
    assert "holds none paused" in apart and "restarts paused" not in apart
