"""The agent section's checks before compute (`megagrpo.preflight` runs them): the environment
imports, the tool environment renders through the tokenizer's chat template, and the
trajectory's token budget fits the context window."""
from __future__ import annotations

import dataclasses

from megagrpo.config.agent import OPENENV
from megagrpo.config.train import TrainConfig


def check_environment(cfg: TrainConfig) -> None:
    """agent.environment imports and names an Environment subclass; multi-turn runs without
    routing replay (vLLM's routes would cover one turn's call, not the trajectory)."""
    if not cfg.agent.enabled:
        return
    from megagrpo.agent.runner import environment_class

    # 'tools' and 'openenv:...' need the tokenizer: check_tool_environment
    if cfg.agent.environment != "tools" and not cfg.agent.environment.startswith(OPENENV):
        environment_class(cfg.agent.environment)
    if cfg.algo.routing_replay:
        raise ValueError("algo.routing_replay=true with multi-turn rollouts "
                         f"(agent.environment={cfg.agent.environment!r}): vLLM's routes cover one "
                         "turn's call, not the trajectory; set algo.routing_replay=false (the "
                         "MoE trains, routed afresh by the trainer) or drop agent.environment")


def check_tool_environment(cfg: TrainConfig, task):
    """agent.environment=tools: the tools load, the tokenizer's chat template renders them
    (`megagrpo.agent.registry.load_environment`), and the prompts carry the tool list. `task`: the
    run's `megagrpo.tasks.Task`; returned with its prompts carrying the tools.
    agent.environment='openenv:...': data.template=chat, and the environment loads with the
    tokenizer (megagrpo.agent.hub_openenv: the role renders, the fields exist, a server answers)."""
    from megagrpo.agent.registry import load_environment, with_tool_prompts

    if cfg.agent.environment.startswith(OPENENV):
        if cfg.data.template != "chat":
            raise ValueError(f"agent.environment={cfg.agent.environment!r} renders the "
                             "environment's messages through the chat template, so the prompt "
                             "must be the template's too: set data.template=chat (it is "
                             f"{cfg.data.template!r})")
        load_environment(cfg.agent, task.tokenizer)  # template, fields, the server's /schema
        return task
    if cfg.agent.environment != "tools":
        return task
    factory = load_environment(cfg.agent, task.tokenizer)
    return dataclasses.replace(task, train=with_tool_prompts(task.train, factory, cfg.data),
                               eval=with_tool_prompts(task.eval, factory, cfg.data))


def check_agent_budget(cfg: TrainConfig, longest_prompt: int) -> None:
    """agent.max_total_tokens (when set) fits rollout.max_model_len after the longest prompt
    (each turn's rollout.max_tokens already does: `fit_prompts`)."""
    budget, max_len = cfg.agent.max_total_tokens, cfg.rollout.max_model_len
    if cfg.agent.enabled and budget and longest_prompt + budget > max_len:
        raise ValueError(
            f"agent.max_total_tokens={budget} does not fit rollout.max_model_len={max_len} "
            f"after the longest prompt ({longest_prompt} tokens): lower it to <= "
            f"{max_len - longest_prompt}, raise rollout.max_model_len, or set it to 0 "
            "(rollout.max_model_len minus each prompt)")
