"""Baseline for benchmarks/grpo_step.py: Hugging Face TRL's GRPOTrainer on the same config, CPU.

    bash scripts/setup_trl_venv.sh            # once: .venv-trl (TRL kept out of .venv)
    .venv-trl/bin/python benchmarks/trl_grpo_baseline.py [--warmup 2] [--steps 5] [--threads 2]
        [--set KEY=VALUE ...] [--out benchmarks/results/grpo_step_cpu.jsonl --append]

What is the same as grpo_step.py: the model (a transformers LlamaForCausalLM built from the
config.json megagrpo writes for examples/demo.yaml: hidden 128, 4 layers, 4 heads x 32, 2 KV
groups, FFN 384, vocab 19; random init, fp32, saved once and loaded by TRL for policy and
reference), the prompts (the arithmetic task's training split, BOS + characters), the
tokenizer ids (the task's sentencepiece model rebuilt as a `PreTrainedTokenizerFast`, checked
id for id), the reward (megagrpo.tasks.arithmetic.reward), the batch (32 prompts x G=8 =
256 completions per optimizer step, 4 micro-batches of 64), max completion length 6,
temperature 1, beta 0.02, eps 0.2/0.28, lr 3e-4, and a reference re-initialisation every step
(TRL's sync_ref_model, alpha 1). TRL samples with transformers' `generate` (no vLLM) in the
training process; one process, --threads intra-op threads (default: all cores).

Timed per optimizer step, from one on_step_begin to the next (a TrainerCallback; one extra
step runs to close the last interval); TRL generates once per step here, since
steps_per_generation = gradient_accumulation_steps = 4.
Generated tokens are counted from the completion ids the reward function receives. Prints one
JSON line in grpo_step.py's format: time_rollout_s is TRL's `_generate` (tokenize, generate,
decode), time_score_s the rest of `_generate_and_score_completions` (rewards, advantages,
reference log-probs), time_update_s everything else in the step (loss passes, optimizer,
reference sync, logging); plus
the process CPU seconds per step (all threads), which a loaded machine disturbs less than wall
time. On 2 shared cores, 2 intra-op threads can be several times slower than 1 when another
process is busy (OpenMP spin-waits): run --threads 1 and 2 and compare with the faster.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # megagrpo's config, task and HF config (torch-only imports)

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from megagrpo.config.train import load_config  # noqa: E402
from megagrpo.data import encode_prompt  # noqa: E402
from megagrpo.hf import hf_config_dict  # noqa: E402
from megagrpo.tasks import arithmetic  # noqa: E402

DEMO = ROOT / "examples" / "demo.yaml"


def hf_tokenizer(sp):
    """The task's sentencepiece char model as a `PreTrainedTokenizerFast` with the same ids:
    one token per character, BOS prepended by the post-processor, pieces fused on decode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {sp.sp.id_to_piece(i).replace("\u2581", " "): i for i in range(sp.vocab_size)}
    special = {i: sp.sp.id_to_piece(i) for i in (sp.pad_id, sp.sp.unk_id(), sp.bos_id, sp.eos_id)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special[sp.sp.unk_id()]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = special[sp.bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                       special_tokens=[(bos, sp.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                   eos_token=special[sp.eos_id], pad_token=special[sp.pad_id],
                                   unk_token=special[sp.sp.unk_id()])


class StepTimer(TrainerCallback):
    """Wall and process CPU seconds (all threads) from one optimizer step's start to the next's:
    generation, loss passes, optimizer, TRL's reference sync (a callback that runs after this
    one's on_step_end) and logging all fall inside. `phases` accumulates the wall seconds of
    wrapped trainer methods (see `wrap`); they are read per step at the same marks."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, dict]] = []
        self.phases: dict[str, float] = {}

    def wrap(self, obj, method: str, phase: str) -> None:
        self.phases[phase] = 0.0
        setattr(obj, method, partial(_timed, self.phases, phase, getattr(obj, method)))

    def on_step_begin(self, args, state, control, **kw):
        self.marks.append((time.perf_counter(), time.process_time(), dict(self.phases)))

    def intervals(self) -> list[dict]:
        """Per step: wall `step_s`, `cpu_s` and each phase's seconds."""
        return [dict(step_s=b[0] - a[0], cpu_s=b[1] - a[1],
                     **{k: b[2][k] - a[2][k] for k in a[2]})
                for a, b in zip(self.marks, self.marks[1:])]


def _timed(acc: dict, phase: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        acc[phase] += time.perf_counter() - t0


def make_reward(counts: list[int]):
    """megagrpo's arithmetic reward in TRL's signature; also counts the generated tokens."""

    def arithmetic_reward(prompts, completions, completion_ids, answer, **kw):
        counts.append(sum(len(ids) for ids in completion_ids))
        return [arithmetic.reward(c, a) for c, a in zip(completions, answer)]

    return arithmetic_reward


def run(warmup: int, steps: int, threads: int, sets: list[str] = ()) -> dict:
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    cfg = load_config(str(DEMO), ["run.sft_steps=0", *sets])
    sp = arithmetic.build_tokenizer(cfg.arithmetic.tokenizer_dir)
    tok = hf_tokenizer(sp)
    examples = arithmetic.train_examples(cfg.arithmetic)
    for e in examples[:50]:  # the HF tokenizer must give megagrpo's prompt ids exactly
        assert tok(e.prompt)["input_ids"] == encode_prompt(sp, e.prompt), e.prompt
    hf = hf_config_dict(cfg.model)
    hf.update(bos_token_id=sp.bos_id, eos_token_id=sp.eos_id, pad_token_id=sp.pad_id)
    hf.pop("architectures"), hf.pop("model_type"), hf.pop("torch_dtype")
    torch.manual_seed(cfg.run.seed)
    model_dir = tempfile.mkdtemp(prefix="trl_model_")  # TRL builds its reference from a path
    LlamaForCausalLM(LlamaConfig(**hf)).float().save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    B, G, micro = cfg.data.batch_size, cfg.algo.group_size, cfg.run.micro_batch_size
    accum = B * G // micro
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), use_cpu=True, bf16=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=G,
        max_completion_length=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
        top_p=1.0, top_k=0, beta=cfg.algo.beta, epsilon=cfg.algo.eps_low,
        epsilon_high=cfg.algo.eps_high, loss_type="grpo", num_iterations=cfg.algo.mu,
        scale_rewards="group", learning_rate=cfg.optim.lr, max_grad_norm=cfg.optim.clip_grad,
        lr_scheduler_type="constant", sync_ref_model=True, ref_model_sync_steps=1,
        ref_model_mixup_alpha=1.0, max_steps=warmup + steps + 1, logging_steps=1,
        save_strategy="no", report_to="none", seed=cfg.run.seed, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False, model_init_kwargs={"dtype": torch.float32})
    counts: list[int] = []
    timer = StepTimer()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=make_reward(counts), args=args,
                          train_dataset=data, processing_class=tok, callbacks=[timer])
    # rollout: tokenize + generate + decode; rollout+score: + rewards, advantages, reference
    # log-probs (TRL's whole "make a batch" call)
    timer.wrap(trainer, "_generate", "rollout")
    timer.wrap(trainer, "_generate_and_score_completions", "rollout_and_score")
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = timer.intervals()
    assert len(rows) == warmup + steps and len(counts) == warmup + steps + 1, (
        len(rows), len(counts))
    mean = {k: statistics.mean(r[k] for r in rows[warmup:]) for k in rows[0]}
    step, cpu = mean["step_s"], mean["cpu_s"]
    gen = statistics.mean(counts[warmup:-1])
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h][warmup:-1]
    return dict(system="trl", trl_version=__import__("trl").__version__,
                transformers_version=__import__("transformers").__version__, nproc=1,
                batch_prompts=B, group_size=G, max_tokens=cfg.rollout.max_tokens,
                overrides=list(sets),
                warmup=warmup, steps=steps, train_wall_s=round(wall, 2),
                time_rollout_s=round(mean["rollout"], 4),
                time_score_s=round(mean["rollout_and_score"] - mean["rollout"], 4),
                time_update_s=round(step - mean["rollout_and_score"], 4), step_s=round(step, 4),
                cpu_s_per_step=round(cpu, 4), gen_tokens_per_step=round(gen, 1),
                gen_tokens_per_s=round(gen / step, 1), gen_tokens_per_cpu_s=round(gen / cpu, 1),
                reward_mean=round(statistics.mean(rewards), 4) if rewards else None,
                threads=torch.get_num_threads(), cpus=os.cpu_count(),
                loadavg_1m=round(os.getloadavg()[0], 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch intra-op threads (default: all cores)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="megagrpo config override on top of the demo (as grpo_step.py --set)")
    ap.add_argument("--out", default="", help="also write the JSON line to this file")
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing")
    args = ap.parse_args()
    line = json.dumps(run(args.warmup, args.steps, args.threads, args.set))
    print(line, flush=True)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
