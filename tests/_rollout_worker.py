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
from types import SimpleNamespace

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
    result["multi_turn"] = multi_turn(engine, model, prompts)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


STOP = tuple(range(2, 128, 2))
"""Greedy turns end at the first even id (or after 5 tokens): several short turns."""


def multi_turn(engine, model, prompts):
    """Greedy 3-turn trajectories on the TP=2 engine (issue 29) and their transformers replay:
    per turn the argmax continuation of the exact token prefix (ids, log-probs), the
    environment's ids (tests._agent_env.Ids) between turns."""
    from megagrpo.agent.runner import TrajectoryRunner
    from megagrpo.config.agent import AgentConfig
    from megagrpo.engine import SamplingSettings
    from tests._agent_env import Ids
    from tests._rollout_model import EOS

    agent = AgentConfig(environment="tests._agent_env:Ids", max_turns=3)
    # text is for the environment's parsing only, and Ids does not parse
    untext = SimpleNamespace(decode=lambda ids: "")
    runner = TrajectoryRunner(engine=engine, tokenizer=untext, agent=agent, max_model_len=128,
                              factory=lambda record: Ids(record))
    s = SamplingSettings(temperature=0.0, max_tokens=5, stop_token_ids=STOP)
    comps = runner.run(prompts, [{"k": i} for i in range(len(prompts))], s)
    rows = []
    for i, (p, c) in enumerate(zip(prompts, comps)):
        seq, mask, lps, env = list(p), [], [], Ids({"k": i})
        for turn in range(3):
            ids, lp = hf_turn(model, seq, 5)
            seq, mask, lps = seq + ids, mask + [True] * len(ids), lps + lp
            if turn == 2 or len(ids) == 5 and ids[-1] not in (*STOP, EOS):
                break
            obs = list(env.step_ids(turn))
            seq, mask, lps = seq + obs, mask + [False] * len(obs), lps + [0.0] * len(obs)
        gap = max(abs(a - b) for a, b, m in zip(c.logprobs, lps, c.loss_mask) if m)
        rows.append({"vllm": list(p) + c.token_ids, "hf": seq, "mask": c.loss_mask,
                     "hf_mask": mask, "turns": c.turns, "max_gap": gap,
                     "env_logprobs": [x for x, m in zip(c.logprobs, c.loss_mask) if not m]})
    return rows


def hf_turn(model, prefix, max_tokens):
    """transformers argmax from `prefix` until EOS or an id of STOP (kept) or max_tokens."""
    from tests._rollout_model import EOS, hf_greedy

    ids, lps = [], []
    for _ in range(max_tokens):
        tok, lp = hf_greedy(model, prefix + ids, 1)
        ids, lps = ids + tok, lps + lp
        if tok[0] in STOP or tok[0] == EOS:
            break
    return ids, lps


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
    os._exit(0)  # skip vLLM's shutdown hooks (they tear down the process group mid-exit)
