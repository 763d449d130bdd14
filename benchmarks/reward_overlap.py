"""Reward-model scoring overlapped with sampling: the step time with a reward model of the
policy's size, without overlap and with each way megagrpo overlaps it, against the same run
without a reward model.

The policy is a named workload of benchmarks/_workloads.py (varlen by default: a Llama of
hidden 256 x 6 layers, 16 prompts x G=8, completions up to 96 tokens at temperature 1; a random
init, so the lengths vary). The reward model has the policy's transformer layers (hidden size,
layers, heads, KV groups, FFN width) as a `LlamaForSequenceClassification` with one output,
seeded random weights and the character tokenizer of the tests (tests/support/tiny.py), written
once under benchmarks/.cache/. It scores every sample ("{prompt}{completion}", the text the
policy saw and wrote) with weight 0.1 beside the task's rule reward (weight 1, correctness), in
batches of 32, in the reward-model source's own thread (docs/rewards.md).

Modes, each run twice (`megagrpo train`, one rank: the trainer and its vLLM engine colocated),
without the reward model (the rule reward alone) and with it:

  serial    rollout.max_staleness=0, reward.score_chunks=1: the batch is sampled, then scored;
            the future overlaps nothing but the gather (reward_wait_s ~ the whole scoring)
  chunks4   rollout.max_staleness=0, reward.score_chunks=4: each quarter of the batch is scored
            while the next quarter samples
  async-k1  rollout.max_staleness=1: batch i is scored while batch i+1 samples on the side
            thread, and both while the trainer updates

Per run (a JSON line): the step time (mean over the steps after the first --warmup, the sum of
the trainer's phase times), the reward model's own scoring seconds per step
(`reward_model_time_s`), and the reward phases of docs/rewards.md (`reward_blocking_s`,
`reward_overlap_s`, `reward_wait_s`). The table puts each mode's two runs side by side: the
step time's excess with the reward model, and the share of the scoring no step waited for
(1 - reward_wait_s / the reward model's seconds, both measured in the same run). The excess
compares two runs whose samples drift apart after the first update (the reward model's 0.1
changes the advantages), so it carries their difference in completion lengths too; and on a
2-core CPU an overlapped forward still competes with sampling for the cores: what the hidden
share saves is what a GPU (scoring on its own stream or device) would, not this machine.

    .venv/bin/python benchmarks/reward_overlap.py [--workload varlen] [--steps 6] [--warmup 1]
        [--out benchmarks/results/reward_overlap_cpu.jsonl]
    .venv/bin/python benchmarks/reward_overlap.py --smoke    # demo workload, 2 steps, async-k1
    .venv/bin/python benchmarks/reward_overlap.py --table JSONL   # docs/rewards.md's table
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared benchmark helpers
from _common import add_out_and_table, markdown_table, parser, print_table, records, run_train  # noqa: E402
from _harness import emit  # noqa: E402
from _workloads import CACHE, ROOT, base_config, get_workload, overrides  # noqa: E402

MODES = {
    "serial": ["rollout.max_staleness=0", "reward.score_chunks=1"],
    "chunks4": ["rollout.max_staleness=0", "reward.score_chunks=4"],
    "async-k1": ["rollout.max_staleness=1"],
}
SMOKE = ("async-k1",)
METRICS = ("reward_model_time_s", "reward_blocking_s", "reward_overlap_s", "reward_wait_s")
RULES = {"source": "rules", "weight": 1.0, "correctness": True}


def reward_model_dir(workload: str) -> Path:
    """The reward model of the workload policy's size (written once; rebuilt when the policy's
    layer shapes change)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    sys.path.insert(0, str(ROOT))
    from tests.support.tiny import tiny_char_tokenizer

    m = base_config(get_workload(workload), "float32").model
    shape = dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                 num_attention_heads=m.num_attention_heads,
                 num_key_value_heads=m.num_query_groups, head_dim=m.head_dim,
                 intermediate_size=m.ffn_hidden_size)
    out = CACHE / f"rm-{workload}"
    key = json.dumps(shape, sort_keys=True)
    if (out / "rm_key.json").exists() and (out / "rm_key.json").read_text() == key:
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.manual_seed(0)
    vocab = len(tiny_char_tokenizer(out))
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=vocab, max_position_embeddings=1024, num_labels=1, pad_token_id=0, **shape))
    model.save_pretrained(out)
    (out / "rm_key.json").write_text(key)
    return out


def config_args(workload: str, mode: str, rm: bool) -> list[str]:
    """The overrides of one run (the workload's, the reward sources, the mode's)."""
    sources = [RULES]
    if rm:
        sources.append({"source": "reward_model", "weight": 0.1, "label": "rm", "options": {
            "path": str(reward_model_dir(workload)), "template": "{prompt}{completion}",
            "prompt_field": "", "batch_size": 32}})
    w = get_workload(workload)
    return ["--config", w.recipe, *overrides(w, "float32"), f"reward.sources={json.dumps(sources)}",
            *MODES[mode]]


def summarize(steps: list[dict], warmup: int) -> dict:
    """Per-step means over the steps after the first `warmup`."""
    kept = steps[warmup:]
    if not kept:
        raise ValueError(f"no step records after the first {warmup}")

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in kept)

    return {"steps_kept": len(kept),
            "step_s": statistics.fmean(sum(v for k, v in r.items() if k.startswith("time_"))
                                       for r in kept),
            **{k: mean(k) for k in METRICS}}


def measure(workload: str, mode: str, rm: bool, steps: int, warmup: int) -> dict:
    """One run's figures."""
    from megagrpo.runtime.machine import cpu_name

    with tempfile.TemporaryDirectory(prefix="reward_overlap_") as tmp:
        wall = run_train([*config_args(workload, mode, rm), f"run.steps={steps}",
                          f"run.out_dir={tmp}/run"], nproc=1, name=mode, timeout=1800)
        steps_ = [r for r in records(Path(tmp) / "run" / "metrics.jsonl") if "reward_mean" in r]
    return {"workload": workload, "mode": mode, "rm": rm, "cpu": cpu_name(), "wall_s": wall,
            **summarize(steps_, warmup)}


def table(path: str | Path) -> str:
    """docs/rewards.md's table: each mode's runs with and without the reward model."""
    recs = records(path)
    runs = {(r["workload"], r["mode"], r["rm"]): r for r in recs}
    rows = []
    for (workload, mode, rm), r in runs.items():
        base = runs.get((workload, mode, False))
        if not rm or base is None:
            continue
        excess, scoring = r["step_s"] - base["step_s"], r["reward_model_time_s"]
        hidden = max(0.0, 1 - r["reward_wait_s"] / scoring)
        rows.append([workload, mode, f"{base['step_s']:.2f}", f"{r['step_s']:.2f}",
                     f"{excess:+.2f}", f"{scoring:.2f}", f"{r['reward_wait_s']:.2f}",
                     f"{r['reward_overlap_s']:.2f}", f"{hidden:.0%}"])
    head = ["workload", "mode", "step s, no RM", "step s, RM", "excess s", "RM scoring s",
            "reward wait s", "reward overlap s", "scoring hidden"]
    cpus = sorted({r["cpu"] for r in recs})
    return markdown_table(head, rows) + f"\n\nCPU: {', '.join(cpus)}; {recs[0]['steps_kept']} " \
        "steps kept per run (the first left out)."


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--workload", default="varlen")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--smoke", action="store_true", help="demo workload, 2 steps, async-k1")
    add_out_and_table(ap, "print docs/rewards.md's table from a results file and stop")
    args = ap.parse_args(argv)
    if print_table(args, table=table):
        return
    names = list(SMOKE) if args.smoke else args.modes.split(",")
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; use some of {', '.join(MODES)}")
    workload, steps = ("demo", 2) if args.smoke else (args.workload, args.steps)
    for mode in names:
        for rm in (False, True):
            emit(measure(workload, mode, rm, steps, args.warmup), args.out)


if __name__ == "__main__":
    main()
