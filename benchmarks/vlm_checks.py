"""Qwen2.5-VL's exactness figures (docs/vlm.md): one torchrun launch (2 ranks, gloo) of
tests/_vlm_worker.py on the tiny random model of tests/support/tiny.py::tiny_qwen25_vl, the
same launch tests/test_vlm.py asserts on: verify's logits errors at TP=1 and TP=2, the model's
gradients vs float64 transformers (vision frozen and trained), and the trainer's passes on a
packed batch with images (completion log-probs and GRPO gradients vs float64 transformers at
TP=1 x DP=2 and TP=2). One JSON line (with the CPU, torch's capability and the load average)
to stdout and, with --out, appended to a file; --table renders a results file as docs/vlm.md's
table.

    python benchmarks/vlm_checks.py --out benchmarks/results/vlm_cpu.jsonl
    python benchmarks/vlm_checks.py --table benchmarks/results/vlm_cpu.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure() -> dict:
    from megagrpo.runtime.machine import cpu_name
    from tests.support.launch import run_ranks
    from tests.support.tiny import tiny_qwen25_vl

    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        tiny_qwen25_vl(hf)
        out = run_ranks(ROOT / "tests" / "_vlm_worker.py", 2, "--work", tmp, "--hf", str(hf))
        res = json.loads((Path(tmp) / "results.json").read_text())
    errors = [float(x) for x in re.findall(r"max relative error ([0-9.e+-]+)", out)]
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_name(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "verify_logits_rel": errors,
            "bitwise_round_trip": "bitwise equal" in out, **res}


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def table(path: str) -> str:
    """docs/vlm.md's table from the newest record of a results file."""
    r = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()][-1]
    t1, t2 = r["trainer"]["tp1_frozen"], r["trainer"]["tp2_trained"]
    g = r["grads"]
    rows = [
        ("HF -> megatron -> HF, every tensor", *(["bitwise"] * 2 if r["bitwise_round_trip"]
                                                else ["differs"] * 2)),
        ("verify: logits vs transformers (fp32), max relative error",
         *[_e(x) for x in r["verify_logits_rel"]]),
        ("model gradients vs float64, decoder (max abs error / max abs reference, worst tensor)",
         "", f"{_e(g['frozen']['text_max'])} frozen, {_e(g['trained']['text_max'])} trained"),
        ("model gradients vs float64, vision tower trained", "", _e(g["trained"]["vision_max"])),
        ("trainer scoring pass: completion log-probs vs float64 transformers, max abs",
         _e(t1["logp_max_abs"]), _e(t2["logp_max_abs"])),
        ("trainer GRPO gradients vs float64, decoder", _e(t1["grads"]["text_max"]),
         _e(t2["grads"]["text_max"])),
        ("trainer GRPO gradients vs float64, vision tower",
         f"frozen: none on {len(t1['grads']['missing'])} tensors",
         f"{_e(t2['grads']['vision_max'])} ({t2['grads']['vision_tensors']} tensors)"),
    ]
    lines = [f"Measured {r['date']} on {r['cpu']}, load {r['loadavg_1m']} (fp32; trainer rows: "
             f"{t1['micro_batches']} micro-batches of 2 rows, {t1['mixed']} holding images; "
             f"the trainer part took {r['trainer_s']:.1f} s of the launch).", "",
             "| check | TP=1 (DP=2) | TP=2 |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    ap.add_argument("--table", default=None, help="print a results file as a markdown table")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    rec = measure()
    line = json.dumps(rec)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
