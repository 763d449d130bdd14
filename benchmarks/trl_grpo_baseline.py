"""Baseline for benchmarks/grpo_step.py: Hugging Face TRL's GRPOTrainer on the same workload, CPU.

    bash scripts/setup_trl_venv.sh            # once: .venv-trl (TRL kept out of .venv)
    .venv-trl/bin/python benchmarks/trl_grpo_baseline.py [--workload demo|varlen|smollm2]
        [--dtype float32|bfloat16] [--threads 1,2] [--warmup 2] [--steps 5]
        [--set KEY=VALUE ...] [--out benchmarks/results/grpo_step_cpu.jsonl [--append]]

What is the same as grpo_step.py (benchmarks/_workloads.py defines the workloads): the weights
(the workload's seeded HF init folder, or models/smollm2-135m, loaded by TRL for policy and
reference), the precision (dtype=float32, or dtype=bfloat16 with bf16=True), the prompts (the
task's templated training prompts, token ids checked against megagrpo's), the tokenizer (the
arithmetic task's sentencepiece model rebuilt as a `PreTrainedTokenizerFast`, checked id for
id; SmolLM2's own), the reward (megagrpo's `RuleTerms` on the workload's reward terms: the
arithmetic reward, or math-verify), G, prompts per step, the minibatch structure
(algo.num_minibatches optimizer steps per generation, each over micro-batches of megagrpo's
micro-batch size, so TRL computes old log-probs exactly when megagrpo must), max completion
length, temperature, beta, eps low/high, lr, grad clip, loss aggregation, advantage scale and a
reference re-initialisation every GRPO step where there is a reference (TRL's sync_ref_model,
alpha 1). Not the same: megagrpo's rollout_is (smollm2) has no TRL counterpart without vLLM
(TRL samples with the trained model itself). TRL samples with transformers' `generate` (no
vLLM) in the training process; one process, --threads intra-op threads; each thread setting of
the sweep runs in its own process and prints its own line (the comparison takes the best).

Timed per GRPO step (one generation and its num_minibatches x mu optimizer steps), from one
generation's on_step_begin to the next (a TrainerCallback; one extra step runs to close the last
interval). Generated tokens are counted from the completion ids the reward function receives.
Prints one JSON line per thread setting in grpo_step.py's format: time_rollout_s is TRL's
`_generate` (tokenize, generate, decode), time_score_s the rest of
`_generate_and_score_completions` (rewards, advantages, old and reference log-probs),
time_update_s everything else in the step (loss passes, optimizer, reference sync, logging);
plus the process CPU seconds per step (all threads), which a loaded machine disturbs less than
wall time. On 2 shared cores, 2 intra-op threads can be several times slower than 1 when another
process is busy (OpenMP spin-waits): hence the sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# megagrpo's config, task, rewards (torch-only imports). ROOT goes first: the script's own folder
# (benchmarks/, where _workloads lives) holds a kernels.py that must not shadow the `kernels`
# package transformers probes for
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import _workloads as W  # noqa: E402
from _common import parser  # noqa: E402
from megagrpo.data import encode_prompt  # noqa: E402
from megagrpo.reward import RuleTerms  # noqa: E402
from megagrpo.tasks import build_task  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


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
    """Wall and process CPU seconds (all threads) from one GRPO step's start (every `every`-th
    optimizer step: a generation) to the next's: generation, loss passes, optimizer, TRL's
    reference sync (a callback that runs after this one's on_step_end) and logging all fall
    inside. `phases` accumulates the wall seconds of wrapped trainer methods (see `wrap`); they
    are read per step at the same marks."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.marks: list[tuple[float, float, dict]] = []
        self.phases: dict[str, float] = {}

    def wrap(self, obj, method: str, phase: str) -> None:
        self.phases[phase] = 0.0
        setattr(obj, method, partial(_timed, self.phases, phase, getattr(obj, method)))

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step % self.every == 0:
            self.marks.append((time.perf_counter(), time.process_time(), dict(self.phases)))

    def intervals(self) -> list[dict]:
        """Per GRPO step: wall `step_s`, `cpu_s` and each phase's seconds."""
        return [dict(step_s=b[0] - a[0], cpu_s=b[1] - a[1],
                     **{k: b[2][k] - a[2][k] for k in a[2]})
                for a, b in zip(self.marks, self.marks[1:])]


def _timed(acc: dict, phase: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        acc[phase] += time.perf_counter() - t0


def make_reward(reward_fn: RuleTerms, lengths: list[list[int]]):
    """megagrpo's configured reward in TRL's signature; records each generation's completion
    lengths (tokens)."""

    def megagrpo_reward(prompts, completions, completion_ids, answer, **kw):
        lengths.append([len(ids) for ids in completion_ids])
        return reward_fn.score_texts(list(completions), list(answer))[0].tolist()

    return megagrpo_reward


def trl_tokenizer(task):
    """The task's tokenizer for TRL, with a pad token; checked against megagrpo's prompt ids."""
    from transformers import PreTrainedTokenizerBase

    hf = getattr(task.tokenizer, "tok", None)
    tok = hf if isinstance(hf, PreTrainedTokenizerBase) else hf_tokenizer(task.tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for e in task.train[:50]:  # TRL tokenizes text prompts with tok(text): megagrpo's ids exactly
        assert tok(e.prompt)["input_ids"] == encode_prompt(task.tokenizer, e.prompt), e.prompt
    return tok


def grpo_args(cfg, dtype: str, total_steps: int) -> tuple:
    """TRL's GRPOConfig mirroring megagrpo's step: (args, optimizer steps per GRPO step)."""
    from trl import GRPOConfig

    B, G, n_mini, mu = cfg.data.batch_size, cfg.algo.group_size, cfg.algo.num_minibatches, \
        cfg.algo.mu
    rows = B * G // n_mini
    micro = max(1, min(cfg.compute.micro_batch_size, rows))  # megagrpo's Trainer.micro_size
    if B * G % n_mini or rows % micro or cfg.algo.loss_agg not in LOSS_TYPES:
        raise SystemExit(f"TRL cannot mirror {B}x{G} sequences in {n_mini} minibatches of "
                         f"micro-batches of {micro} with loss {cfg.algo.loss_agg!r}")
    per_step = n_mini * mu
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), use_cpu=True, bf16=dtype == "bfloat16",
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        steps_per_generation=B * G // micro, num_generations=G, num_iterations=mu,
        max_completion_length=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
        top_p=1.0, top_k=0, beta=cfg.algo.beta, epsilon=cfg.algo.eps_low,
        epsilon_high=cfg.algo.eps_high, loss_type=cfg.algo.loss_agg,
        scale_rewards=cfg.algo.std_mode, mask_truncated_completions=cfg.algo.mask_truncated,
        learning_rate=cfg.optim.lr, max_grad_norm=cfg.optim.clip_grad,
        weight_decay=cfg.optim.weight_decay, lr_scheduler_type="constant",
        sync_ref_model=cfg.algo.beta > 0, ref_model_sync_steps=per_step,
        ref_model_mixup_alpha=1.0, max_steps=total_steps * per_step, logging_steps=1,
        save_strategy="no", report_to="none", seed=cfg.run.seed, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
        model_init_kwargs={"dtype": getattr(torch, dtype)})
    return args, per_step


def run(w: W.Workload, dtype: str, warmup: int, steps: int, threads: int,
        sets: list[str] = ()) -> dict:
    """One TRL training run: warmup + steps measured GRPO steps (+1 closing the last)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    torch.set_num_threads(threads)
    cfg = W.base_config(w, dtype, sets)
    model_dir = str(ROOT / w.model_dir) if w.model_dir else str(W.ensure_init(w, dtype, sets))
    task = build_task(cfg.data, cfg.arithmetic)
    tok = trl_tokenizer(task)
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in task.train])
    args, per_step = grpo_args(cfg, dtype, warmup + steps + 1)
    lengths: list[list[int]] = []
    timer = StepTimer(per_step)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=make_reward(RuleTerms(cfg.reward), lengths),
                          args=args, train_dataset=data, processing_class=tok, callbacks=[timer])
    # rollout: tokenize + generate + decode; rollout+score: + rewards, advantages, old and
    # reference log-probs (TRL's whole "make a batch" call)
    timer.wrap(trainer, "_generate", "rollout")
    timer.wrap(trainer, "_generate_and_score_completions", "rollout_and_score")
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = timer.intervals()
    assert len(rows) == warmup + steps and len(lengths) == warmup + steps + 1, (
        len(rows), len(lengths))
    mean = {k: statistics.mean(r[k] for r in rows[warmup:]) for k in rows[0]}
    step, cpu = mean["step_s"], mean["cpu_s"]
    measured = lengths[warmup:-1]
    gen = statistics.mean(sum(ls) for ls in measured)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return dict(system="trl", workload=w.name, dtype=dtype, overrides=list(sets),
                trl_version=__import__("trl").__version__,
                transformers_version=__import__("transformers").__version__, nproc=1,
                batch_prompts=cfg.data.batch_size, group_size=cfg.algo.group_size,
                max_tokens=cfg.rollout.max_tokens, micro_batch=args.per_device_train_batch_size,
                optimizer_steps_per_step=per_step, warmup=warmup, steps=steps,
                train_wall_s=round(wall, 2), time_rollout_s=round(mean["rollout"], 4),
                time_score_s=round(mean["rollout_and_score"] - mean["rollout"], 4),
                time_update_s=round(step - mean["rollout_and_score"], 4), step_s=round(step, 4),
                cpu_s_per_step=round(cpu, 4), gen_tokens_per_step=round(gen, 1),
                gen_tokens_per_s=round(gen / step, 1), gen_tokens_per_cpu_s=round(gen / cpu, 1),
                **W.length_stats([n for ls in measured for n in ls]),
                reward_mean=round(statistics.mean(rewards), 4) if rewards else None,
                threads=torch.get_num_threads(), cpus=os.cpu_count(),
                loadavg_1m=round(os.getloadavg()[0], 2))


def _sweep(args: argparse.Namespace) -> list[dict]:
    """Each thread setting in its own process (a fresh torch thread pool and TRL state)."""
    records = []
    for t in args.threads.split(","):
        cmd = [sys.executable, __file__, "--one", "--workload", args.workload, "--dtype",
               args.dtype, "--threads", t, "--warmup", str(args.warmup), "--steps",
               str(args.steps), *(a for kv in args.set for a in ("--set", kv))]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        found = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not found:
            sys.exit(f"TRL at --threads {t} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
        records.append(json.loads(found[-1]))
    return records


def main() -> None:
    ap = parser(__doc__)
    W.add_step_args(ap, warmup=2, steps=5)
    ap.add_argument("--threads", default="1,2",
                    help="comma-separated torch intra-op thread counts to sweep")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="megagrpo config override on top of the workload (as grpo_step.py --set)")
    ap.add_argument("--out", default="", help="also write the JSON lines to this file")
    ap.add_argument("--append", action="store_true", help="append to --out instead of replacing")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    w, dtype = W.get_workload(args.workload), W.check_dtype(args.dtype)
    if why := W.missing_model(w):
        print(why, file=sys.stderr)
        records = [dict(system="trl", workload=w.name, dtype=dtype, skipped=why)]
    elif args.one:
        records = [run(w, dtype, args.warmup, args.steps, int(args.threads), args.set)]
    else:
        records = _sweep(args)
    lines = [json.dumps(r) for r in records]
    print("\n".join(lines), flush=True)
    if args.out and not args.one:
        with open(args.out, "a" if args.append else "w") as f:
            f.write("".join(ln + "\n" for ln in lines))


if __name__ == "__main__":
    main()
