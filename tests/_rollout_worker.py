"""torchrun worker for tests/test_rollout.py: vLLM tensor_parallel_size=2 spanning 2 ranks.

    torchrun --nproc-per-node 2 tests/_rollout_worker.py MODEL_DIR OUT_DIR [TP=2]

Each rank initialises gloo first, starts the engine (external_launcher), pushes the full HF
weights from MODEL_DIR/weights.pt, greedily decodes, compares with a transformers argmax loop,
perturbs the weights, updates again and re-compares; writes OUT_DIR/rank<r>.json."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(model_dir: str, out_dir: str, tp: int = 2) -> None:
    torch.set_num_threads(1)  # before vLLM turns set_num_threads into a no-op
    dist.init_process_group("gloo")  # before the engine: vLLM reuses the world group
    from transformers import AutoConfig, LlamaForCausalLM

    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.engine import SamplingSettings, VLLMEngine
    from tests._rollout_model import hf_greedy

    model = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir)).eval()
    model.load_state_dict(torch.load(Path(model_dir) / "weights.pt"))
    cfg = RolloutConfig(tensor_parallel_size=tp, max_model_len=128, max_num_seqs=16)
    engine = VLLMEngine(cfg, model_dir, dtype="float32")
    prompts = [[0, 40, 41, 42], [0, 70, 80, 90, 5, 6], [0, 33]]
    greedy = SamplingSettings(temperature=0.0, max_tokens=10)
    torch.manual_seed(1)  # same perturbation on both ranks
    result = {"rank": dist.get_rank(), "rounds": []}
    for round_ in range(2):
        if round_:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        stats = engine.update_weights((k, v) for k, v in model.state_dict().items())
        comps = engine.generate(prompts, greedy)
        rows = []
        for prompt, comp in zip(prompts, comps):
            ref, ref_lp = hf_greedy(model, prompt, greedy.max_tokens)
            gap = max((abs(a - b) for a, b in zip(comp.logprobs, ref_lp)), default=0.0)
            rows.append({"vllm": comp.token_ids, "hf": ref, "max_gap": gap})
        result["rounds"].append({"tensors": stats.tensors, "rows": rows})
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
    os._exit(0)  # skip vLLM's shutdown hooks (they tear down the process group mid-exit)
