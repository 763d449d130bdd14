"""The trainer's whole GRPO step, end to end, on whatever device megagrpo picks (CUDA when
there is one): `megagrpo.run.setup` (preflight, distributed, model, optimizer, reference) and
`Trainer.step()` a few times (rollout, reward, advantage, scoring passes, update, weight sync,
reference), printing one line per step. Its purpose is the first CUDA run of the trainer: the
micro-batches reaching the model's device, the CPU-tensor collectives under the mixed
`cpu:gloo,cuda:nccl` backend, log-probs and metrics coming back to the host.

    python benchmarks/gpu_trainer_smoke.py [--steps 3] [--engine auto|vllm|random]
        [--out-dir DIR] [--set KEY=VALUE ...]
    bash benchmarks/gpu_trainer_smoke.sh          # the GPU machine: wheels, then this

Engines: `vllm` is megagrpo's own (`python -m megagrpo train` does the same); `random` a
stand-in that needs no vLLM (the lent H200 has none: its wheel is over what a run may bring):
uniform random completion tokens of a fixed per-run seed, each ended early by EOS with
probability 1/4 per token, every log-prob -log(vocab); its `update_weights` pulls every tensor
of the weight export (the trainer's TP gather / HF conversion still runs on the device) and
counts them. `auto`: vllm when importable, else random. The reward is the completion's length
(`completion_length` below), so group advantages are non-zero with any policy.

Model: the demo's architecture (examples/demo.yaml: a ~0.8M-parameter Llama, vocab 19) on the
arithmetic task, 8 prompts x 4 samples per step, 2 minibatches, a reference (beta 0.02), the
fused output layer and, on CUDA, the Triton kernels (compute.kernel_impl=auto). Exit status 1
when a step's loss or gradient norm is not finite, no step applied an update, the weights did
not change, or the engine received no weights."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # this module: the reward term's import path
sys.path.insert(0, str(HERE.parent))   # megagrpo from the checkout

OVERRIDES = [
    "algo.group_size=4", "algo.num_minibatches=2", "algo.beta=0.02", "data.batch_size=8",
    "rollout.max_tokens=6", "reference.sync_every_steps=2", "run.overwrite=true",
    "reward.terms=[{name: 'gpu_trainer_smoke:completion_length'}]", "eval.every=0",
    "cold_start.steps=0", "compute.micro_batch_size=8", "compute.fused_output_layer=true",
    "log.progress=false", "log.tensorboard=false",
]


def completion_length(completion: str, answer: str) -> float:
    """Reward: the completion's length in characters / 10 (varies across every group)."""
    return len(completion) / 10.0


class RandomEngine:
    """A rollout engine without vLLM (module docstring). `vocab` and `eos_id` are set once the
    tokenizer is known (after `setup`)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.eos_id = 0, 0
        self.synced_tensors = self.synced_bytes = 0

    def generate(self, prompt_token_ids, sampling=None, *, n=None):
        from megagrpo.engine import Completion

        n = n or (sampling.n if sampling is not None else 1)
        max_tokens = sampling.max_tokens if sampling is not None else 8
        out = []
        for p in range(len(prompt_token_ids)):
            for s in range(n):
                ids = []
                while len(ids) < max_tokens:
                    if torch.rand((), generator=self.gen) < 0.25:
                        ids.append(self.eos_id)
                        break
                    ids.append(int(torch.randint(3, self.vocab, (), generator=self.gen)))
                stop = bool(ids) and ids[-1] == self.eos_id
                out.append(Completion(prompt_index=p, sample_index=s, token_ids=ids,
                                      logprobs=[-math.log(self.vocab)] * len(ids),
                                      finish_reason="stop" if stop else "length"))
        return out

    def update_weights(self, named_tensors, *, partial=False, dtypes=None):
        from megagrpo.engine import WeightSyncStats

        t0, n, size = time.perf_counter(), 0, 0
        for name, t in named_tensors:
            if dtypes is not None and dtypes.get(name) != t.dtype:  # as the real feed checks
                raise ValueError(f"{name} arrived as {t.dtype}; declared {dtypes.get(name)}")
            n, size = n + 1, size + t.numel() * t.element_size()
        self.synced_tensors += n
        self.synced_bytes += size
        s = time.perf_counter() - t0
        return WeightSyncStats(tensors=n, bytes=size, seconds=s, source_seconds=s,
                               load_seconds=0.0)

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engine", choices=("auto", "vllm", "random"), default="auto")
    ap.add_argument("--out-dir", default="runs/gpu_trainer_smoke")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="further config overrides (after the script's own)")
    args = ap.parse_args(argv)

    from megagrpo.config.train import load_config
    from megagrpo.runtime.distributed import shutdown
    from megagrpo.model.gpt import unwrap
    from megagrpo.run import setup

    engine_kind = args.engine if args.engine != "auto" else (
        "vllm" if vllm_importable() else "random")
    cfg = load_config(str(HERE.parent / "examples" / "demo.yaml"),
                      [*OVERRIDES, f"run.steps={args.steps}", f"run.out_dir={args.out_dir}",
                       *args.set])
    engine = RandomEngine(cfg.run.seed) if engine_kind == "random" else None
    t0 = time.perf_counter()
    tr = setup(cfg, engine=engine)
    if engine is not None:
        engine.vocab, engine.eos_id = tr.model_cfg.vocab_size, tr.tokens.eos_id
    gpt = unwrap(tr.policy)
    device = next(gpt.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[smoke] setup {time.perf_counter() - t0:.1f} s; policy on {device} ({name}); "
          f"engine {engine_kind}; backend "
          f"{torch.distributed.get_backend() if torch.distributed.is_initialized() else '-'}",
          flush=True)
    before = [p.detach().clone() for p in gpt.parameters()]
    tr.sync_weights()
    ok = True
    for _ in range(args.steps):
        t = time.perf_counter()
        m = tr.step()
        finite = all(math.isfinite(float(m[k])) for k in ("loss", "grad_norm"))
        ok &= finite
        print(f"[smoke] step {m['step']}: loss {m['loss']:.4f} grad_norm {m['grad_norm']:.4f} "
              f"kl {m['kl']:.4f} reward_mean {m['reward_mean']:.3f} "
              f"{time.perf_counter() - t:.2f} s{'' if finite else '  NOT FINITE'}", flush=True)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, gpt.parameters()))
    if device.type == "cuda":
        print(f"[smoke] peak CUDA memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} "
              "MiB", flush=True)
    if engine is not None:
        print(f"[smoke] weight syncs: {engine.synced_tensors} tensors, "
              f"{engine.synced_bytes / 2**20:.2f} MiB", flush=True)
        ok &= engine.synced_tensors > 0
    ok &= changed and tr.opt_steps > 0
    print(f"[smoke] {'ok' if ok else 'FAILED'}: weights changed {changed}, device {device}",
          flush=True)
    tr.engine.close()
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
