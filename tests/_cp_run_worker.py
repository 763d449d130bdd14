"""Run on local ranks (2 ranks, gloo) by tests/test_context_parallel.py: GRPO runs built by
`megagrpo.run.setup` (preflight, models, optimizer, reference, the vLLM engine of each rank)
at parallel.cp=2 and without CP, in one launch (megatron's parallel state is rebuilt for each
layout on the same two ranks; each rank's vLLM engine, which cannot start twice, is reused).

- run "cp2" (CP=2 x DP=1): 3 GRPO steps; a checkpoint after step 2 (after the scheduled
  reference reset).
- run "ref" (CP=1 x DP=2): the same 3 steps from the same seed. With data.batch_size=2 the DP
  replicas' prompts (prompt r for replica r) are the prompts the CP run's engines sample
  (engine r of the replica: prompt r), and each engine restarts from the sampler state it had
  at the start of run cp2, so both runs train on the same completions.
- run "resume" (CP=1 x DP=2): the cp2 checkpoint of step 2 loaded, step 3 from the sampler
  state engine r had before cp2's step 3 (a checkpoint's per-rank streams are restored at the
  layout it was written at only).
- run "resume_cp2" (CP=2 x DP=1): the same checkpoint at its own layout, step 3 (the sampler
  state restored by the checkpoint).

Per run and rank: the step records, the completions each step trained on, the parameters
before the first and after the last step. Rank 0 writes WORK/results.json; parameters go to
WORK/params_{run}_{rank}.pt. `--defect no_cp_grad_reduce`: megatron's DDP reduces the
gradients over DP only (not DP x CP), to show the comparison fails."""
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.launch import worker_args, write_results

METRICS = ("loss", "kl", "entropy", "grad_norm", "ratio_mean", "reward_mean",
           "advantage_abs", "completion_len")


def make_config(work: Path, run: str, cp: int):
    from megagrpo.config.train import load_config

    return load_config(None, [
        "model.vocab_size=19", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.head_dim=32", "model.max_position_embeddings=64",
        f"parallel.cp={cp}", "parallel.make_vocab_size_divisible_by=16",
        "optim.lr=1e-3", "optim.distributed_optimizer=true", "rollout.max_tokens=12",
        "rollout.max_model_len=64", "algo.group_size=4", "algo.beta=0.05", "algo.mu=2",
        "reference.sync_every_steps=2", "data.batch_size=2", "arithmetic.num_train=64",
        "arithmetic.num_eval=4", f"arithmetic.tokenizer_dir={work}/tok",
        "reward.terms=[{name: 'tests._rewards:length_reward'}]",
        "compute.micro_batch_size=4", "compute.kernel_impl=torch", f"run.out_dir={work}/{run}",
        "run.steps=3", "log.progress=false", "log.tensorboard=false",
    ])


def params(tr) -> dict:
    from megagrpo.model.gpt import unwrap

    return {n: p.detach().clone() for n, p in unwrap(tr.policy).named_parameters()}


def record_rollouts(tr, seen: list) -> None:
    """Keeps the token ids of every rollout the trainer takes (prompt-major)."""
    take = tr.rollouts.next

    def next_recorded(version):
        ro = take(version)
        seen.append([[c.prompt_index, c.token_ids] for c in ro.completions])
        return ro

    tr.rollouts.next = next_recorded


def steps(tr, n: int, rec: dict, save_after: int | None = None) -> None:
    from megagrpo.run import checkpoints

    for _ in range(n):
        rec.setdefault("sampler", []).append(tr.engine.rng_state())
        m = tr.step()
        rec["steps"].append({k: m[k] for k in (*METRICS, "step", "reference_sync")})
        if tr.step_idx == save_after:
            rec["ckpt"] = str(checkpoints(tr).save(tr.step_idx))


def run(name: str, cp: int, work: Path, engine, *, n: int, sampler=None, resume=None,
        save_after=None) -> tuple[dict, object]:
    from megagrpo.run import checkpoints, setup

    tr = setup(make_config(work, name, cp), engine=engine)
    rec = {"run": name, "rank": tr.ranks.rank, "cp": tr.ranks.cp, "dp": tr.ranks.dp,
           "steps": [], "rollouts": []}
    if resume is not None:
        checkpoints(tr).load(Path(resume))
    if sampler is not None:  # the sampler state the compared run's engine had here
        tr.engine.set_rng_state(sampler)
    record_rollouts(tr, rec["rollouts"])
    tr.sync_weights()
    before = params(tr)
    steps(tr, n, rec, save_after)
    torch.save({"before": before, "after": params(tr)},
               work / f"params_{name}_{tr.ranks.rank}.pt")
    return rec, tr


def drop_cp_grad_reduce() -> None:
    """The defect: megatron's DDP skips its gradient reduction wherever its DP x CP group is
    larger than its DP group (CP on): at CP=2 x DP=1 the CP ranks' gradients are never summed
    (nor scaled), every other layout reduces as before."""
    from megatron.core.distributed import DistributedDataParallel

    finish = DistributedDataParallel.finish_grad_sync

    def finish_without_cp(self, *args, **kwargs):
        if self.dp_cp_group.size() == self.dp_group.size():
            finish(self, *args, **kwargs)

    DistributedDataParallel.finish_grad_sync = finish_without_cp


def main():
    args = worker_args(defect="")
    work = Path(args.work)
    if args.defect == "no_cp_grad_reduce":
        drop_cp_grad_reduce()
    results = []
    cp2, tr = run("cp2", 2, work, None, n=3, save_after=2)
    engine, start = tr.engine, cp2["sampler"][0]
    results.append(cp2)
    del tr
    ref, tr = run("ref", 1, work, engine, n=3, sampler=start)
    results.append(ref)
    del tr
    res, tr = run("resume", 1, work, engine, n=1, sampler=cp2["sampler"][2],
                  resume=cp2["ckpt"])
    results.append(res)
    del tr
    # at the layout it was written at, the checkpoint restores the sampler state too
    res, tr = run("resume_cp2", 2, work, engine, n=1, resume=cp2["ckpt"])
    results.append(res)
    for r in results:
        r.pop("sampler")
    write_results(results, work, flat=False)
    dist.barrier()
    engine.close()


if __name__ == "__main__":
    main()
