"""Run on local ranks (2 ranks, gloo) by tests/test_smollm2.py on the real SmolLM2-135M-Instruct
HF folder. One launch:
  1. PP=2 (15 layers a stage; the tied embedding on both ends): the GPTModel loaded from the HF
     folder; full logits of a chat prompt through the pipeline schedule -> WORK/logits_pp2.pt;
     the model saved as a megagrpo checkpoint (+ tokenizer snapshot, as `convert --to-megatron`
     does) -> WORK/megatron_pp2.
  2. TP=1 (DP=2): the same logits from rank 0's unsharded model -> WORK/logits_tp1.pt.
  3. A real trainer at PP=2 (chat template, math reward, in-process vLLM per rank): vLLM greedy
     vs a megatron argmax loop before and after one GRPO step, the step's metrics, the
     parameters it moved, then a training checkpoint. Rank 0 writes WORK/results.json."""
import argparse
import gc
from pathlib import Path

import torch
import torch.distributed as dist

from tests._trainer_worker import local_params, megatron_greedy, vllm_greedy
from tests.support.launch import write_results


def _all_logits(batch, model):
    out = model(batch, torch.arange(batch.shape[1]).expand_as(batch), None)
    return out, lambda o: (o.sum() * 0, {"logits": o[0].detach()})


def full_logits(gpt, ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """[S, V] logits of one sequence through megatron's schedule (PP stages pass activations);
    on the last stage, else None. TP=1: the last stage holds the whole (padded) vocabulary."""
    from megagrpo.model.optim import forward_backward

    out = forward_backward(gpt, _all_logits, [ids], 1, seq_length=ids.shape[1],
                           micro_batch_size=1, forward_only=True)
    return out[0]["logits"][:, :vocab] if out else None


def load_layout(hf: str, pp: int, build: bool = True):
    """init_distributed at TP=1 x PP=pp; this rank's stage loaded from the HF folder."""
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed

    model = model_config_from_hf(hf)
    parallel = ParallelConfig(pp=pp)
    info = init_distributed(parallel, model)
    if not build:
        return None, model
    gpt = build_model(model, parallel).eval()
    load_hf_weights(gpt, hf, model, parallel, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    return gpt, model


def logits_checks(work: Path, hf: str, ids: torch.Tensor) -> None:
    """PP=2 logits and checkpoint, then TP=1 logits on rank 0 only (one full model in memory:
    the machine is shared)."""
    from megagrpo.checkpoint import save_model
    from megagrpo.hf.export import save_hf_source_tokenizer

    gpt, model = load_layout(hf, 2)
    logits = full_logits(gpt, ids, model.vocab_size)
    if logits is not None:
        torch.save(logits, work / "logits_pp2.pt")
    save_model(gpt, work / "megatron_pp2", model, extra={"source": hf})
    if dist.get_rank() == 0:
        save_hf_source_tokenizer(work / "megatron_pp2", hf)
    del gpt, logits
    gpt, model = load_layout(hf, 1, build=dist.get_rank() == 0)  # DP=2
    if gpt is not None:
        torch.save(full_logits(gpt, ids, model.vocab_size), work / "logits_tp1.pt")
    del gpt
    gc.collect()
    dist.barrier()


def make_config(work: Path, hf: str):
    from megagrpo.config.train import load_config

    return load_config(None, [
        f"run.init={hf}", "parallel.pp=2", "data.task=file", f"data.path={work}/train.jsonl",
        f"data.eval_path={work}/eval.jsonl", "data.template=chat", f"data.tokenizer={hf}",
        "data.batch_size=2", "algo.group_size=2", "algo.beta=0", "optim.lr=2e-5",
        "optim.warmup_steps=0", "rollout.max_tokens=24", "rollout.max_model_len=256",
        "rollout.max_num_seqs=8",
        "eval.max_tokens=12", "compute.micro_batch_size=6", "compute.kernel_impl=torch",
        # the length term (weight 0.01) keeps a group's rewards apart, so the step has a gradient
        "reward.terms=[{name: math, correctness: true}, "
        "{name: 'tests._rewards:length_reward', weight: 0.01}]",
        f"run.out_dir={work}/run", "run.steps=1",
        "log.progress=false", "log.tensorboard=false",
    ])


def trainer_checks(work: Path, hf: str):
    from megagrpo.data import encode_prompt
    from megagrpo.run import checkpoints, setup

    tr = setup(make_config(work, hf))
    tr.sync_weights()
    prompts = [encode_prompt(tr.tokenizer, e.prompt) for e in tr.task.eval[:2]]
    res = {"greedy_initial": [megatron_greedy(tr, prompts, 12), vllm_greedy(tr, prompts, 12)]}
    before = local_params(tr.policy)
    m = tr.step()
    after = local_params(tr.policy)
    res["greedy_after_step"] = [megatron_greedy(tr, prompts, 12), vllm_greedy(tr, prompts, 12)]
    res["moved_params"] = sum(not torch.equal(before[n], after[n]) for n in before)
    res["num_params"] = len(before)
    res["metrics"] = {k: v for k, v in m.items() if isinstance(v, (int, float))}
    res["eos_id"] = tr.tokens.eos_id
    checkpoints(tr).save(tr.step_idx)
    return tr, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--hf", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    ids = torch.load(work / "prompt_ids.pt")
    logits_checks(work, args.hf, ids)
    tr, res = trainer_checks(work, args.hf)
    res["rank"] = dist.get_rank()
    write_results(res, work)
    tr.engine.close()  # last: vLLM's shutdown destroys the process groups


if __name__ == "__main__":
    main()
