"""Checks that need the filesystem or imports, run before any process group, model or engine
exists: `run.init`, the architecture it implies, reward modules and their keyword arguments,
the tokenizer, the data files and every prompt's length.

`python -m megagrpo train` runs `preflight` in the launcher before it relaunches under torchrun,
so a bad recipe fails within seconds; `megagrpo.run.setup` runs it again on every rank (cheap)
and builds the run from what it returns (the architecture included: `Preflight.model`, which
`setup` passes on instead of rewriting cfg.model), so nothing is loaded twice and a plain
`torchrun ...` start gets the same checks. Once they pass, `megagrpo.run.train` freezes the
config: no setting changes during the run.

Prompt length rule: a prompt, encoded exactly as the trainer encodes it (`encode_prompt`: the
template or chat template, then BOS), plus `rollout.max_tokens` must fit
`rollout.max_model_len` (evaluation prompts: plus `eval.max_tokens`). Then no completion is
cut short by the context window, and vLLM never rejects a prompt mid-run (it refuses prompts of
max_model_len tokens or more, on one rank, which leaves the others waiting in a collective).
`data.overlong_prompts` chooses between refusing the run and dropping (and counting) them.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config.data import ArithmeticConfig, DataConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.rollout import check_cpu_moe_width, check_head_dim
from megagrpo.config.seqpar import resolve_sequence_parallel
from megagrpo.config.train import TrainConfig
from megagrpo.data import Example, Tokenizer, encode_prompt
from megagrpo.tasks import Task

_SHOWN = 3  # overlong prompts listed by index in an error


@dataclass(kw_only=True)
class Preflight:
    """What the checks found; `setup` builds the run from it."""

    task: Task
    """Train/eval prompts (overlong ones already dropped when data.overlong_prompts=drop)."""
    model: ModelConfig
    """The architecture: from run.init's checkpoint when it has one, else cfg.model."""
    parallel: ParallelConfig
    """cfg.parallel with parallel.sequence_parallel decided for this model (`setup` runs it)."""
    sequence_parallel_why: str
    """Why sequence parallelism is on or off (the console's line)."""
    dropped_train: int
    """Training prompts dropped as too long."""
    dropped_eval: int
    """Evaluation prompts dropped as too long."""
    longest_prompt: int
    """Tokens of the longest prompt kept (train and eval)."""
    mean_train_prompt: float
    """Mean tokens of the training prompts kept (what compute.compile_layers=auto prices a
    sequence's prompt at)."""
    seconds: float
    """Wall time of the checks."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What the checks found suspect but not fatal (logged after the summary line)."""

    def summary(self) -> str:
        """One console line."""
        dropped = ""
        if self.dropped_train or self.dropped_eval:
            dropped = (f", dropped {self.dropped_train} train / {self.dropped_eval} eval prompts "
                       "as too long (data.overlong_prompts=drop)")
        return (f"preflight ok in {self.seconds:.1f} s: {len(self.task.train)} train / "
                f"{len(self.task.eval)} eval prompts, longest {self.longest_prompt} tokens"
                f"{dropped}")


def check_transport(name: str) -> None:
    """sync.transport names a module of megagrpo/sync/transports/ or a registered transport
    (found without importing it: the launcher stays quick)."""
    from megagrpo.sync.transports import check

    check(name)


def preflight(cfg: TrainConfig, world_size: int | None = None, warn: bool = True) -> Preflight:
    """Everything checkable before compute; raises ValueError naming the field, the value and
    what is valid. `cfg` is not modified. `warn`: also look for what is suspect but not fatal
    (`Preflight.warnings`; it encodes every prompt and answer again, so only the process that
    prints the warnings asks)."""
    t0 = time.perf_counter()
    check_init(cfg.run.init)
    model = model_config(cfg)
    cfg = dataclasses.replace(cfg, model=model)  # the layout is checked against the real model
    parallel, sp_why = resolve_sequence_parallel(cfg, model)
    cfg = dataclasses.replace(cfg, parallel=parallel)
    cfg.validate(world_size)
    check_transport(cfg.sync.resolved(cfg.rollout, cfg.parallel))
    check_paths(cfg.data)
    from megagrpo.reward import check_source  # imports torch: after the config-only checks

    check_source(cfg.reward)
    from megagrpo.reward.judge import check_with_run

    check_with_run(cfg.reward, engine_tp=cfg.rollout.tensor_parallel_size,
                   lora_enabled=cfg.lora.enabled, lora_refit=cfg.lora.refit)

    from megagrpo.agent.preflight import (
        check_agent_budget,
        check_environment,
        check_tool_environment,
    )
    from megagrpo.tasks.arithmetic_tools import check_tool_task

    check_environment(cfg)
    check_tool_task(cfg)
    task = load_task(cfg.data, cfg.arithmetic)
    task = check_tool_environment(cfg, task)
    check_model(cfg, model, task.tokenizer)
    if model.is_vlm and not (Path(cfg.data.tokenizer).expanduser()
                             / "preprocessor_config.json").is_file():
        raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r} has no preprocessor_config.json: "
                         f"a vision-language model ({model.architecture}) needs its image "
                         "processor beside the tokenizer (the model folder's, or a run's "
                         "tokenizer snapshot)")
    train, dropped_train, train_lens = fit_prompts(
        task.train, task.tokenizer, cfg, ("rollout.max_tokens", cfg.rollout.max_tokens), "training")
    evals, dropped_eval, eval_lens = fit_prompts(
        task.eval, task.tokenizer, cfg, ("eval.max_tokens", cfg.eval.max_tokens),
        "evaluation")
    if len(train) < cfg.data.batch_size:
        source = cfg.data.path if cfg.data.task == "file" else "arithmetic.num_train"
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} needs at least that many training prompts; "
            f"{source} gives {len(train)}" + (f" ({dropped_train} dropped as too long)"
                                              if dropped_train else ""))
    longest = max(train_lens + eval_lens, default=0)
    check_agent_budget(cfg, longest)
    task = dataclasses.replace(task, train=train, eval=evals)
    warnings = unknown_token_warnings(
        task, cfg.data.tokenizer or "the task's tokenizer") if warn else []
    return Preflight(task=task, model=model, parallel=parallel, sequence_parallel_why=sp_why,
                     dropped_train=dropped_train, warnings=warnings,
                     dropped_eval=dropped_eval, longest_prompt=longest,
                     mean_train_prompt=sum(train_lens) / max(1, len(train_lens)),
                     seconds=time.perf_counter() - t0)


def check_init(init: str) -> None:
    """run.init is 'random' or a folder holding an HF or a megagrpo checkpoint."""
    if init == "random":
        return
    what = ("use 'random', an HF checkpoint folder (config.json + *.safetensors) or a megagrpo "
            "checkpoint folder")
    path = Path(init).expanduser()
    if not path.is_dir():
        raise ValueError(f"run.init={init!r}: no such folder; {what}")
    from megagrpo.checkpoint import MODEL_JSON  # imports torch: only once a folder is there

    if not (path / "config.json").is_file() and not (path / MODEL_JSON).is_file():
        raise ValueError(f"run.init={init!r} holds neither config.json nor {MODEL_JSON}; {what}")
    from megagrpo.lora.checkpoint import refuse_lora_init

    refuse_lora_init(init, path / MODEL_JSON)


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The architecture: read from run.init's checkpoint when it has one, else cfg.model."""
    if cfg.run.init == "random":
        return cfg.model
    from megagrpo.checkpoint import MODEL_JSON, read_model_config
    from megagrpo.hf import model_config_from_hf

    init = Path(cfg.run.init).expanduser()
    if (init / "config.json").exists():
        try:
            return model_config_from_hf(init, dtype=cfg.model.dtype)
        except KeyError as e:
            raise ValueError(f"run.init={cfg.run.init!r}: config.json lacks {e}") from None
    if (init / MODEL_JSON).exists():
        return read_model_config(init)[0]
    check_init(cfg.run.init)  # raises with the reason
    return cfg.model


def check_paths(data: DataConfig) -> None:
    """The data files and a local tokenizer exist (cheap: before anything is imported or read).
    A tokenizer that is neither a .model file nor a local path may be a hub name."""
    names = ("path", "eval_path") if data.task == "file" else ()
    for name in names:
        value = getattr(data, name)
        if value and not Path(value).expanduser().exists():
            raise ValueError(f"data.{name}={value!r}: no such file or folder")
    spec = data.tokenizer
    local = spec.endswith(".model") or spec.startswith(("/", ".", "~"))
    if spec and local and not Path(spec).expanduser().exists():
        raise ValueError(f"data.tokenizer={spec!r}: no such file or folder (a sentencepiece "
                         ".model file or an HF tokenizer folder)")


def load_task(data: DataConfig, arith: ArithmeticConfig) -> Task:
    """The tokenizer and the prompts, with file and field errors naming the data.* setting."""
    from megagrpo.tasks import build_task

    try:
        return build_task(data, arith)
    except KeyError as e:  # a missing record field: get_field's message names it
        raise ValueError(f"data.prompt_field / data.answer_field: {e.args[0]}") from None
    except (OSError, ImportError) as e:
        where = f"data.tokenizer={data.tokenizer!r}" if data.tokenizer else "data"
        raise ValueError(f"{where}: {type(e).__name__}: {e}") from None


def check_model(cfg: TrainConfig, model: ModelConfig, tokenizer: Tokenizer) -> None:
    """The architecture against the tokenizer, vLLM and run.init's tensors."""
    import torch

    if cfg.run.init == "random" and model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({tokenizer.vocab_size}); set model.vocab_size >= "
                         f"{tokenizer.vocab_size}")
    check_head_dim(model.head_dim, on_cpu=not torch.cuda.is_available())
    check_cpu_moe_width(model.moe_ffn_hidden_size, cfg.rollout.tensor_parallel_size,
                        on_cpu=not torch.cuda.is_available())
    from megagrpo.model.moe import check_routing_replay
    from megagrpo.sync.adapters import unavailable

    # separate placement checkpoints no batch drawn ahead (a resume redraws them, routes and
    # all): only a colocated stream's would lack its routes
    check_routing_replay(cfg.algo.routing_replay, model,
                         cfg.pipelined_by() if cfg.rollout.placement != "separate" else None)
    # lora.refit=adapter that vLLM cannot serve: refused before compute
    unavailable(cfg.lora, cfg.rollout.tensor_parallel_size, model,
                on_cpu=not torch.cuda.is_available())
    if cfg.parallel.cp > 1 and torch.cuda.is_available():
        raise ValueError(
            f"parallel.cp={cfg.parallel.cp} on a CUDA machine: megagrpo's context-parallel "
            "attention runs torch's CPU flash kernel and Transformer Engine's context "
            "parallelism is not wired in yet (docs/context-parallel.md); set parallel.cp=1 "
            "(use TP + sequence parallelism + compute.recompute for long traces on GPUs)")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if cfg.compute.kernel_impl == "triton" and not torch.cuda.is_available() and not interpreted:
        raise ValueError(
            "compute.kernel_impl=triton needs CUDA (or the Triton interpreter, "
            "TRITON_INTERPRET=1, which is for tests and far slower); on this machine use "
            "compute.kernel_impl=auto or torch")
    if cfg.rollout.max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
            f"max_position_embeddings={model.max_position_embeddings} (vLLM refuses to start): "
            f"lower rollout.max_model_len to <= {model.max_position_embeddings}")
    init = Path(cfg.run.init).expanduser()
    if cfg.run.init != "random" and (init / "config.json").exists():
        from megagrpo.hf import check_hf_checkpoint

        check_hf_checkpoint(init, model)


def fit_prompts(examples: list[Example], tokenizer: Tokenizer, cfg: TrainConfig,
                new_tokens: tuple[str, int], what: str) -> tuple[list[Example], int, list[int]]:
    """Examples whose encoded prompt plus `new_tokens` (the setting's name and value) fits
    rollout.max_model_len; the others are an error (data.overlong_prompts=error) or dropped.
    Returns (kept, number dropped, the kept prompts' token counts)."""
    field, budget = new_tokens
    max_len = cfg.rollout.max_model_len
    limit = max_len - budget
    if limit < 1:
        raise ValueError(f"{field}={budget} leaves no room for a prompt in rollout.max_model_len"
                         f"={max_len}: lower it or raise rollout.max_model_len")
    lengths = [len(encode_prompt(tokenizer, e.prompt)) for e in examples]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if over and cfg.data.overlong_prompts == "error":
        shown = ", ".join(f"#{i + 1} ({lengths[i]} tokens)" for i in over[:_SHOWN])
        raise ValueError(
            f"{len(over)} of {len(examples)} {what} prompts are longer than rollout.max_model_len"
            f"={max_len} - {field}={budget} = {limit} tokens (encoded with data.template and "
            f"BOS), e.g. {shown}: raise rollout.max_model_len, lower {field}, or set "
            "data.overlong_prompts=drop to skip them")
    dropped = set(over)
    kept = [e for i, e in enumerate(examples) if i not in dropped]
    return kept, len(over), [n for i, n in enumerate(lengths) if i not in dropped]


def unknown_token_warnings(task: Task, name: str) -> list[str]:
    """Prompts and answers holding text the tokenizer maps to its unknown token (a tokenizer
    that does not cover the data: the model never sees those characters, and cannot write an
    answer made of them, so a reward that compares completions to it stays 0). One line per
    split and field, naming the characters; none for tokenizers without an unknown token."""
    tok = task.tokenizer
    unk = getattr(tok, "unk_id", None)
    if unk is None:
        return []
    out = []
    for what, examples in (("training", task.train), ("evaluation", task.eval)):
        for field, harm in (("prompt", "the model sees <unk> in their place"),
                            ("answer", "the model can never write them, so a reward that "
                                       "compares completions to the answer cannot be earned")):
            texts = [getattr(e, field) for e in examples]
            hit = [i for i, t in enumerate(texts) if t and unk in tok.encode(t)]
            if not hit:
                continue
            chars = sorted({c for i in hit for c in texts[i] if unk in tok.encode(c)})
            shown = "".join(chars[:20]) + ("..." if len(chars) > 20 else "")
            out.append(f"{len(hit)} of {len(texts)} {what} {field}s hold characters the "
                       f"tokenizer ({name}) maps to its unknown token: {shown!r} (e.g. "
                       f"#{hit[0] + 1}: {texts[hit[0]][:60]!r}); {harm}. Check data.tokenizer "
                       "against the data")
    return out
