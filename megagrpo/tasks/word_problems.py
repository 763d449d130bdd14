"""Addition word problems for a real chat model ("Ana has 12 coins and gets 7 more. How many
coins does Ana have now?" -> "19"), written as JSONL prompt files for `data.task=file`.

Every pair of 2-digit operands appears at most once, and the held-out split is a fixed set of
pairs, so no evaluation problem is trained on under another wording.

    python -m megagrpo.tasks.word_problems data/word_problems   # train.jsonl + eval.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia")
ITEMS = ("apples", "books", "coins", "cards", "stamps", "shells")


def problem(a: int, b: int, rng: random.Random) -> dict[str, str]:
    """One {prompt, answer} record for a + b."""
    who, what = rng.choice(NAMES), rng.choice(ITEMS)
    return {"prompt": f"{who} has {a} {what} and gets {b} more. How many {what} does {who} "
                      "have now?", "answer": str(a + b)}


def splits(num_eval: int = 200, seed: int = 0, lo: int = 10, hi: int = 99
           ) -> tuple[list[dict], list[dict]]:
    """(train, eval) records over all operand pairs in [lo, hi]^2, shuffled by `seed`; the
    first `num_eval` pairs are held out."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    rng.shuffle(pairs)
    if not 0 < num_eval < len(pairs):
        raise ValueError(f"num_eval={num_eval}: need 0 < num_eval < {len(pairs)} (the pairs)")
    records = [problem(a, b, rng) for a, b in pairs]
    return records[num_eval:], records[:num_eval]


def write(out_dir: str | Path, num_eval: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Writes out_dir/train.jsonl and out_dir/eval.jsonl; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "train.jsonl", out / "eval.jsonl")
    for path, records in zip(paths, splits(num_eval, seed)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megagrpo.tasks.word_problems",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder for train.jsonl and eval.jsonl")
    ap.add_argument("--num-eval", type=int, default=200, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0, help="seed of the split and the wording")
    args = ap.parse_args(argv)
    train, evals = write(args.out_dir, args.num_eval, args.seed)
    print(f"wrote {train} and {evals}")


if __name__ == "__main__":
    main()
