"""One process, run by tests/test_model_families.py: `megagrpo verify` at TP=1 on each HF folder
given, then again with a deliberately broken HF -> megatron mapping (k and v swapped in the
fused QKV, a classic converter bug), so the test sees verify pass and fail on the same weights.
Writes {folder: {"ok": exit status, "broken": exit status}} to --out."""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import megagrpo.hf as hf  # noqa: E402
from megagrpo.cli import main  # noqa: E402


def status(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def run() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", default="64")
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    fuse = hf.fuse_qkv
    res = {}
    for d in args.dirs:
        argv = ["verify", "--hf", d, "--seq-len", args.seq_len]
        res[d] = {"ok": status(argv)}
        hf.fuse_qkv = lambda q, k, v, groups: fuse(q, v, k, groups)
        res[d]["broken"] = status(argv)
        hf.fuse_qkv = fuse
    Path(args.out).write_text(json.dumps(res))


if __name__ == "__main__":
    run()
