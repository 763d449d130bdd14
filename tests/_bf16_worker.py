"""Run on local ranks (2 ranks, TP=2, gloo) by tests/test_bf16.py: the trainer in bf16 mixed
precision on CPU (bf16 policy and vLLM engine, fp32 main parameters in the optimizer, truncated
rollout IS), then fp16 loss scaling (tests/_fp16_checks.py). Rank 0 writes WORK/results.json."""
import argparse
import json
from pathlib import Path

import torch

from tests._fp16_checks import fp16_checks
from tests._trainer_worker import local_params, make_config
from tests.support.launch import write_results

CAP = 1.0005  # low enough that bf16 rounding gaps (mean |log ratio| ~7e-4) reach it


def optimizer_dtypes(tr) -> dict:
    """dtypes of the model's weight matrices and norm vectors, of the optimizer's (main)
    parameters, and whether each bf16 parameter equals its fp32 main copy rounded to bf16."""
    opts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    main = [p.dtype for o in opts for g in o.optimizer.param_groups for p in g["params"]]
    pairs = [(m, p) for o in opts
             for mg, pg in zip(getattr(o, "fp32_from_float16_groups", []),
                               getattr(o, "float16_groups", []))
             for m, p in zip(mg, pg)]
    params = list(tr.policy.parameters())
    return {"matrices": sorted({str(p.dtype) for p in params if p.dim() == 2}),
            "vectors": sorted({str(p.dtype) for p in params if p.dim() == 1}),
            "main": sorted({str(d) for d in main}), "pairs": len(pairs),
            "copies_exact": all(torch.equal(m.to(torch.bfloat16), p) for m, p in pairs),
            "optimizer": sorted({type(o).__name__ for o in opts})}


def main_params(tr) -> list[torch.Tensor]:
    """Copies of the optimizer's (fp32 main) parameters."""
    opts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    return [p.detach().clone() for o in opts for g in o.optimizer.param_groups for p in g["params"]]


def is_check(tr) -> dict:
    """The truncated-IS weights the loss gets vs min(exp(old - rollout), cap), in float64."""
    batch, prep = tr.prepare(tr.rollout())
    metrics = prep.metrics
    mask = batch.mask.bool()
    ratio = (batch.old_logp.double() - batch.rollout_logp.double()).exp().clamp(max=CAP)
    err = (batch.is_weight.double() - ratio)[mask].abs().max().item()
    return {"err": err, "metrics": metrics,
            "below_one": float((batch.is_weight[mask] < 1).float().mean()),
            "capped": float((batch.is_weight[mask] >= CAP).float().mean())}


def stream_dtypes(work: Path) -> None:
    """One process, TP=1: the dtypes of the HF tensors the weight sync / export streams from a
    bf16 model -> WORK/stream_dtypes.json ({dtype: [names]})."""
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.sync.source import iter_hf_weights

    cfg = make_config(str(work))
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.model.dtype = "bfloat16"
    init_distributed(cfg.parallel, cfg.model)
    gpt = build_model(cfg.model, cfg.parallel)
    seen: dict[str, list[str]] = {}
    for name, t in iter_hf_weights(gpt, cfg.model, cfg.parallel):
        seen.setdefault(str(t.dtype), []).append(name)
    (work / "stream_dtypes.json").write_text(json.dumps(seen))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--stream-dtypes", action="store_true", help="one process: stream_dtypes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.stream_dtypes:
        return stream_dtypes(Path(args.work))
    from megagrpo.run import setup

    cfg = make_config(args.work)
    cfg.parallel.pp = 1
    cfg.model.dtype = cfg.rollout.dtype = "bfloat16"
    cfg.algo.rollout_is, cfg.algo.rollout_is_cap = "truncate", CAP
    tr = setup(cfg)
    tr.sync_weights()
    res = {"dtypes_before": optimizer_dtypes(tr), "is": is_check(tr)}
    before, main_before = local_params(tr.policy), main_params(tr)
    m = tr.step()
    after, main_after = local_params(tr.policy), main_params(tr)
    res["step"] = {k: v for k, v in m.items() if isinstance(v, (int, float))}
    # bf16 matrices move; a norm weight near 1 may not (its update is below bf16's resolution
    # there, 2^-7) but its fp32 main copy does: that is what the main copy is for
    matrices = [n for n in before if before[n].dim() == 2]
    res["moved_matrices"] = sum(not torch.equal(before[n], after[n]) for n in matrices) / len(
        matrices)
    res["moved_main"] = sum(not torch.equal(a, b) for a, b in zip(main_before, main_after)) / len(
        main_before)
    res["dtypes_after"] = optimizer_dtypes(tr)
    # fp16 loss scaling on the same process groups (megatron's model and optimizer, no vLLM)
    res["fp16"] = fp16_checks(cfg, Path(args.work))
    write_results(res, args.work)
    tr.engine.close()


if __name__ == "__main__":
    main()
