"""Weight sync policy -> colocated vLLM: in-memory streaming vs a disk round trip vs memcpy.

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,10m,50m,100m] [--repeats 3]
        [--out benchmarks/results/weight_sync_cpu.jsonl]

Prints one JSON line per model size. Each size runs in its own process (one vLLM engine per
process: vLLM's shutdown tears down the process group), single rank, megatron TP=1:
  sync       megagrpo.sync.source.iter_hf_weights (gather + HF convert) streamed into
             VLLMEngine.update_weights (validate + vLLM reload_weights + prefix-cache reset)
  disk       baseline: export_hf writes safetensors, then the files are read back (safe_open)
             into the same engine. vLLM's own reload_weights(weights_path=...) needs an engine
             started from a real checkpoint (load_format != "dummy"), so it is not used here.
  memcpy     one flat copy of the same number of bytes (the floor for any in-memory sync)
  check      after the sync, vLLM greedy tokens vs transformers on the exported checkpoint
  repack     what bounds vLLM's side (`repack_split`): the CPU build's packing of every linear
             (oneDNN handles, repack_s) vs copying the same tensors into plain ones
             (plain_copy_s), and what plain weights would cost each decode step
             (decode_plain_s vs decode_packed_s, every linear at 8 rows)
Times are medians over --repeats after one warm-up sync (the repack split: best of them).

    .venv/bin/python benchmarks/weight_sync.py \
        --table benchmarks/results/weight_sync_repack_cpu.jsonl

prints the refit table of docs/performance.md from such rows.

    .venv/bin/python benchmarks/weight_sync.py --vllm-tp 2 [--sizes ...]
        [--out benchmarks/results/weight_sync_tp2_cpu.jsonl]

vLLM TP rows: 2 ranks under torchrun (training TP=2, one vLLM engine of tensor_parallel_size=2
spanning both), rank 0 reports:
  full       iter_hf_weights: every rank gathers every full tensor (what vLLM TP=1 needs);
             vLLM keeps its slice
  slices     iter_vllm_slices: shard to shard, each rank feeds its own slice (k = training TP)
  disk       export_hf (rank 0 writes) + every rank reads the checkpoint back into its engine
  *_received_bytes: bytes a rank received through collectives (measured by the stream)

    .venv/bin/python benchmarks/weight_sync.py --separate [--sizes tiny,10m,100m,smollm2-135m]
        [--repeats 3] [--bucket-mb 64] [--lora-rank 16]
        [--out benchmarks/results/weight_sync_separate_cpu.jsonl]
    .venv/bin/python benchmarks/weight_sync.py \
        --separate-table benchmarks/results/weight_sync_separate_cpu.jsonl

Separate placement rows (rollout.placement=separate): training TP ranks (2, or 3 for
SmolLM2-135M's 3 KV heads; PP 1) and one rollout rank, spawned over gloo, random weights of each
size's shapes, the run's own wire (`sync.transport=shards`, `megagrpo.rollout.placement.
receive_weights`) into an engine stand-in that keeps nothing (vLLM's load is the colocated
rows' engine_load_s above). Per sync, median of --repeats, timed on training rank 0 up to the
rollout rank's acknowledgement:
  full        every training rank's own shards, reassembled on the rollout rank
  delta       rollout.sync_delta after every shard changed (a full fine-tuning step) and after
              only the linears changed (a LoRA merge: embeddings and norms frozen)
  adapter     a LoRA refit between merges: the peft adapter (rank --lora-rank on q/k/v/o and
              gate/up/down) broadcast to the rollout rank, written and loaded there
  colocated   the same layout colocated: a TP 1 engine's full-tensor feed (every split shard
              all-gathered over TP and unfused), and the adapter's peft folder written
  broadcast   the floor: one `broadcast` of the same bytes from rank 0 over the same group
              (the whole world for the shards, training rank 0 + the rollout rank for the
              adapter), after the syncs
  peak        each side's peak resident memory over what it held before its first sync
              (training: its own shards; rollout: nothing), the largest rank of each side
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's megagrpo
from _common import markdown_table, parser, print_table, records, write_lines  # noqa: E402
from _harness import MODEL_SIZES as SIZES  # noqa: E402

from megagrpo.cli import torchrun_command  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _read_safetensors(path: Path):
    """Stream (name, tensor) from every shard of an HF checkpoint directory."""
    from safetensors import safe_open

    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _agreement(engine, hf_dir: Path, vocab: int) -> dict:
    """Greedy vLLM (after the in-memory sync) vs a transformers argmax loop on the exported
    checkpoint: checks the whole megatron -> HF names -> vLLM chain, not just its speed."""
    import torch
    from transformers import AutoModelForCausalLM

    from megagrpo.engine import SamplingSettings

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = [[(7 * j + k) % vocab for j in range(5)] for k in (1, 2)]
    comps = engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=8))
    same, gap = True, 0.0
    with torch.no_grad():
        for prompt, comp in zip(prompts, comps):
            ids = torch.tensor([prompt + comp.token_ids])
            logp = hf(ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
            same &= logp.argmax(-1).tolist() == comp.token_ids
            ref = logp.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
            gap = max(gap, float((ref - torch.tensor(comp.logprobs).double()).abs().max()))
    return {"greedy_agrees_with_hf": same, "max_logprob_gap": float(f"{gap:.2e}")}


def vllm_linear_shapes(mcfg) -> list[tuple[int, int]]:
    """[out, in] of every linear vLLM builds for this Llama (qkv and gate_up fused, the output
    layer): the weights the CPU build packs after each load."""
    H, hd = mcfg.hidden_size, mcfg.head_dim
    q, kv = mcfg.num_attention_heads * hd, mcfg.num_query_groups * hd
    layer = [(q + 2 * kv, H), (H, q), (2 * mcfg.ffn_hidden_size, H), (H, mcfg.ffn_hidden_size)]
    return layer * mcfg.num_layers + [(mcfg.vocab_size, H)]


def repack_split(mcfg, repeats: int, decode_rows: int = 8) -> dict:
    """What bounds vLLM's engine-side load on CPU, measured in this process: the CPU build's
    packing of every linear (vLLM's `dispatch_cpu_unquantized_gemm`: fp32 weights become oneDNN
    matmul handles, `create_onednn_mm`, a reordered copy the handle owns) against copying the
    same tensors into preallocated plain ones (what an in-place update would cost if vLLM kept
    plain weights), and the decode-time price of plain weights: every linear at
    `decode_rows` rows through `F.linear` on plain weights over the packed `onednn_mm`."""
    import torch
    import torch.nn.functional as F

    try:
        from vllm import _custom_ops as ops
        create, run = ops.create_onednn_mm, ops.onednn_mm
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"weight_sync.py: this vLLM has no create_onednn_mm/onednn_mm ({e}); "
                         "the repack split measures vLLM 0.32's CPU packing path only") from None
    ws = [torch.randn(s) for s in vllm_linear_shapes(mcfg)]
    dst = [torch.empty_like(w) for w in ws]
    xs = {k: torch.randn(decode_rows, k) for k in {w.shape[1] for w in ws}}

    def best(fn) -> float:
        return min(_timed(fn) for _ in range(repeats + 1))

    handles = [create(w.t(), 32) for w in ws]
    return dict(  # 3 significant digits: the tiny model's copies take microseconds
        repack_s=_sig(best(lambda: [create(w.t(), 32) for w in ws])),
        plain_copy_s=_sig(best(lambda: [d.copy_(w) for d, w in zip(dst, ws)])),
        decode_rows=decode_rows,
        decode_packed_s=_sig(best(lambda: [run(h, xs[w.shape[1]], None)
                                           for h, w in zip(handles, ws)])),
        decode_plain_s=_sig(best(lambda: [F.linear(xs[w.shape[1]], w) for w in ws])))


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def run_one(size: str, repeats: int) -> dict:
    import torch

    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.hf import hf_config_dict
    from megagrpo.model.gpt import build_model
    from megagrpo.sync.source import ReshardStats, export_hf, iter_hf_weights
    from megagrpo.engine import VLLMEngine

    mcfg = ModelConfig(architecture="llama", max_position_embeddings=256, **SIZES[size])
    par = ParallelConfig()
    init_distributed(par, mcfg)  # before vLLM: the engine reuses this process group
    gpt = build_model(mcfg, par, seed=0)
    n_params = sum(p.numel() for p in gpt.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(mcfg)))
    t0 = time.perf_counter()
    engine = VLLMEngine(RolloutConfig(max_model_len=256, max_num_seqs=8), tmp, dtype="float32")
    start_s = time.perf_counter() - t0

    def sync():
        stats = ReshardStats()
        pairs = iter_hf_weights(gpt, mcfg, par, bucket_bytes=64 << 20, stats=stats)
        out = engine.update_weights(pairs)  # (hf_name, tensor) pairs, streamed bucket by bucket
        return out, stats

    sync()  # warm-up
    rows = []
    for i in range(repeats):
        out, stats = sync()
        ckpt = tmp / f"ckpt{i}"
        write_s = _timed(lambda: export_hf(gpt, str(ckpt), mcfg, par, bucket_bytes=64 << 20))
        read_load_s = _timed(lambda: engine.update_weights(_read_safetensors(ckpt)))
        rows.append(dict(sync_s=out.seconds, gather_convert_s=stats.gather_s + stats.convert_s,
                         engine_load_s=out.load_seconds,
                         disk_write_s=write_s, disk_read_load_s=read_load_s,
                         disk_total_s=write_s + read_load_s))
        if i == 0:
            check = _agreement(engine, ckpt, mcfg.vocab_size)
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    nbytes = out.bytes
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats + 1))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    split = repack_split(mcfg, repeats)
    return dict(
        size=size, params=n_params, tensors=out.tensors, bytes=nbytes, **split,
        memcpy_s=_sig(copy_s),
        engine_start_s=round(start_s, 2),
        **{k: round(v, 4) for k, v in med.items()},
        sync_gbps=round(nbytes / med["sync_s"] / 1e9, 3),
        disk_gbps=round(nbytes / med["disk_total_s"] / 1e9, 3),
        memcpy_gbps=round(nbytes / copy_s / 1e9, 3),
        speedup_vs_disk=round(med["disk_total_s"] / med["sync_s"], 2),
        threads=torch.get_num_threads(), repeats=repeats, **check,
    )


def run_tp(size: str, repeats: int, k: int) -> dict | None:
    """One rank of the vLLM TP=k rows (training TP=k); returns the row on rank 0."""
    import torch
    import torch.distributed as dist

    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.hf import hf_config_dict
    from megagrpo.model.gpt import build_model
    from megagrpo.sync.source import ReshardStats, export_hf, iter_hf_weights, iter_vllm_slices
    from megagrpo.engine import VLLMEngine

    mcfg = ModelConfig(architecture="llama", max_position_embeddings=256, **SIZES[size])
    par = ParallelConfig(tp=k)
    info = init_distributed(par, mcfg)
    gpt = build_model(mcfg, par, seed=0)
    tmp = Path(tempfile.gettempdir()) / f"weight_sync_tp{k}_{os.environ['MASTER_PORT']}"
    (tmp / f"rank{info.rank}").mkdir(parents=True, exist_ok=True)
    (tmp / f"rank{info.rank}" / "config.json").write_text(json.dumps(hf_config_dict(mcfg)))
    engine = VLLMEngine(RolloutConfig(max_model_len=256, max_num_seqs=8, tensor_parallel_size=k),
                        tmp / f"rank{info.rank}", dtype="float32")

    def sync(feed):
        stats = ReshardStats()
        out = engine.update_weights(feed(gpt, mcfg, par, bucket_bytes=64 << 20, stats=stats))
        return out.seconds, out.source_seconds, stats.received_bytes, out.bytes

    def disk(i):
        ckpt = tmp / f"ckpt{i}"
        t0 = time.perf_counter()
        export_hf(gpt, str(ckpt), mcfg, par, bucket_bytes=64 << 20)
        dist.barrier()
        engine.update_weights(_read_safetensors(ckpt))
        dist.barrier()
        return time.perf_counter() - t0

    sync(iter_hf_weights), sync(iter_vllm_slices)  # warm-up
    # *_stream_s: inside megagrpo's stream (collectives + slicing); the rest is vLLM's reload
    rows = [dict(zip(("full_s", "full_stream_s", "full_received_bytes", "bytes"),
                     sync(iter_hf_weights)))
            | dict(zip(("slices_s", "slices_stream_s", "slices_received_bytes"),
                       sync(iter_vllm_slices)))
            | {"disk_total_s": disk(i)} for i in range(repeats)]
    check = _agreement(engine, tmp / "ckpt0", mcfg.vocab_size)  # after a slices sync
    nbytes = rows[0]["bytes"]
    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats + 1))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    dist.barrier()
    if info.rank:
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    return dict(
        size=size, layout=f"train tp={k}, vllm tp={k}", bytes=nbytes,
        **{key: round(v, 4) for key, v in med.items() if key.endswith("_s")},
        full_received_bytes=rows[0]["full_received_bytes"],
        slices_received_bytes=rows[0]["slices_received_bytes"],
        slices_gbps=round(nbytes / med["slices_s"] / 1e9, 3),
        full_gbps=round(nbytes / med["full_s"] / 1e9, 3),
        memcpy_gbps=round(nbytes / copy_s / 1e9, 3),
        slices_vs_disk=round(med["disk_total_s"] / med["slices_s"], 2),
        slices_vs_memcpy=round(med["slices_s"] / copy_s, 1),
        threads=torch.get_num_threads(), repeats=repeats, **check)


# ---------------------------------------------------------------------- separate placement
SEPARATE_SIZES = {**SIZES, "smollm2-135m": dict(
    hidden_size=576, num_layers=30, num_attention_heads=9, num_query_groups=3, head_dim=64,
    ffn_hidden_size=1536, vocab_size=49152, tie_word_embeddings=True)}
"""--separate's models: the synthetic sizes and SmolLM2-135M's shapes (random weights)."""
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""What a LoRA merge edits (its base's delta after a merge; embeddings and norms stay)."""
SEPARATE_MODES = ("full", "delta, all changed", "delta, linears changed", "adapter")


def _separate_tp(size: str) -> int:
    """The training TP of a size's --separate rows: 2, or 3 where the KV heads need it."""
    return 2 if SEPARATE_SIZES[size]["num_query_groups"] % 2 == 0 else 3


def _rss() -> tuple[int, int]:
    """(this process's resident bytes now, its peak so far)."""
    import resource

    now = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Drain:
    """The rollout rank's engine stand-in: takes every tensor it is fed and keeps none, so the
    rows time the wire and the reassembly (vLLM's own load: the colocated rows'
    engine_load_s, weight_sync_cpu.jsonl)."""

    max_lora_rank = 512

    def update_weights(self, pairs, partial: bool = False):
        from megagrpo.engine import WeightSyncStats

        n = sum(t.numel() * t.element_size() for _, t in pairs)
        return WeightSyncStats(tensors=0, bytes=n, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)

    def load_adapter(self, path: str) -> None:
        pass


def _separate_world(size: str, lora_rank: int):
    """(model, parallel, the exported specs, the adapters' peft modules) of a --separate row."""
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.params import adapted, param_specs, peft_modules
    from megagrpo.config.lora import LoRAConfig

    model = ModelConfig(architecture="llama", max_position_embeddings=256,
                        **SEPARATE_SIZES[size])
    par = ParallelConfig(tp=_separate_tp(size))
    specs = [s for s in param_specs(model, par, 0)
             if not (model.tie_word_embeddings and s.local == "output_layer.weight")]
    lora = LoRAConfig(rank=lora_rank)
    return model, par, specs, peft_modules(adapted(specs, lora.targets), model), lora


def _separate_rank(rank: int, world: int, size: str, repeats: int, bucket_mb: int,
                   lora_rank: int, out: str) -> None:
    """One rank of --separate: `world - 1` training ranks (TP, PP 1) then one rollout rank,
    gloo over a file store, the run's own wire (`Shards.send`, `deliver_remote_adapter`,
    `receive_weights`). Rank 0 times each sync up to the rollout rank's acknowledgement; each
    rank writes what it measured to `out/rank<r>.json`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megagrpo.data import Example, PromptLoader
    from megagrpo.engine.shard_feed import SentDigests
    from megagrpo.hf import unfuse_shards
    from megagrpo.lora.export import save_peft_adapter
    from megagrpo.rollout.placement import Placement, RemoteEngine, receive_weights
    from megagrpo.sync.transports.collective import deliver_remote_adapter
    from megagrpo.sync.transports.shards import Shards

    torch.set_num_threads(1)
    model, par, specs, modules, lora = _separate_world(size, lora_rank)
    tp, timeout = par.tp, timedelta(seconds=600)
    store = dist.FileStore(f"{out}/store", world)
    rollout = rank == tp
    cross = (dist.ProcessGroupGloo(dist.PrefixStore("cross/", store), int(rollout), 2, timeout)
             if rank in (0, tp) else None)
    weights = dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), rank, world, timeout)
    place = Placement(rank=rank, train_world=tp, rollout_ranks=1,
                      store=dist.PrefixStore("stream/", store), cross=cross, timeout_s=600,
                      weights=weights, model=model, parallel=par, lora=lora,
                      adapter_dir=Path(out) / "adapters")
    ack = torch.zeros(1)
    payload = tp * sum(torch.Size(s.local_shape(tp)).numel() * 4 for s in specs)
    adapter_bytes = sum(lora_rank * (i + o) * 4 for _, i, o in modules)
    if rollout:
        engine, peak = _Drain(), 0
        while True:
            before = _rss()
            sync = receive_weights(place, engine)
            peak = max(peak, _rss()[1] - max(before))
            if sync.stop:
                break
            cross.send([ack], 0, 0).wait()
        _floors(rank, weights, cross, payload, adapter_bytes, repeats)
        Path(f"{out}/rank{rank}.json").write_text(json.dumps({"peak_extra": peak}))
        return
    tp_group = dist.ProcessGroupGloo(dist.PrefixStore("tp/", store), rank, tp, timeout)
    shards = []
    for s in specs:  # filled in place: no temporary to raise the peak before the syncs
        t = torch.empty(s.local_shape(tp))
        shards.append((s.local, t.normal_(generator=torch.Generator().manual_seed(
            rank * 1000 + len(shards)))))
    place.store.set(f"shards/0/{rank}", str(rank))
    remote = RemoteEngine(place=place, loader=PromptLoader([Example(prompt="1", answer="1")], 1),
                          sends=True, bucket_bytes=bucket_mb << 20, dtype="float32")
    full, delta = Shards(remote, 0), Shards(remote, 0, SentDigests(), tp_group)
    by_name = {s.local: s for s in specs}
    adapters = {f"base_model.model.{n}.lora_{ab}.weight": torch.randn(shape)
                for n, i, o in modules for ab, shape in (("A", (lora_rank, i)),
                                                          ("B", (o, lora_rank)))}

    def acked(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if cross is not None:
            cross.recv([ack], 1, 0).wait()
        return time.perf_counter() - t0

    def colocated_full() -> None:
        """A colocated TP 1 engine's feed at this layout: every split shard all-gathered over
        TP and unfused into HF tensors (the full-tensor stream; vLLM's load excluded)."""
        for n, t in shards:
            parts = [t]
            if by_name[n].split_dim is not None:
                parts = [torch.empty_like(t) for _ in range(tp)]
                tp_group.allgather([parts], [t]).wait()
            for _ in unfuse_shards(parts, by_name[n], model):
                pass

    before = _rss()
    acked(lambda: full.send(iter(shards)))  # warm-up: the peak over the shards it holds
    times: dict[str, list[float]] = {"full": [], "colocated full": [], "colocated adapter": []}
    res = {"peak_extra": _rss()[1] - max(before), "sent": {}}
    for _ in range(repeats):
        times["full"].append(acked(lambda: full.send(iter(shards))))
        t0 = time.perf_counter()
        colocated_full()
        times["colocated full"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        save_peft_adapter(Path(out) / f"colocated{rank}", adapters, lora, base="")
        times["colocated adapter"].append(time.perf_counter() - t0)
    acked(lambda: res["sent"].update(full=full.send(iter(shards)).bytes))
    acked(lambda: delta.send(iter(shards)))  # its digests: what the engine holds now
    for mode, linears in (("delta, all changed", False), ("delta, linears changed", True)):
        times[mode] = []
        for _ in range(repeats):
            for n, t in shards:
                if not linears or any(k in n for k in LINEARS):
                    t.add_(1e-3)
            got = []
            times[mode].append(acked(lambda: got.append(delta.send(iter(shards)).bytes)))
            res["sent"][mode] = got[0]
    times["adapter"] = [acked(lambda: deliver_remote_adapter(full, None, adapters))
                        for _ in range(repeats)]
    res["sent"]["adapter"] = adapter_bytes if rank == 0 else 0
    remote.close()
    floors = _floors(rank, weights, cross, payload, adapter_bytes, repeats)
    if rank == 0:
        res.update(times={k: statistics.median(v) for k, v in times.items()}, floors=floors,
                   payload=payload, adapter_bytes=adapter_bytes)
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(res))


def _floors(rank: int, weights, cross, payload: int, adapter_bytes: int, repeats: int
            ) -> dict:
    """The floor of each sync, after the syncs (its buffers would raise the peaks): one
    `broadcast` from rank 0 of the same bytes over the same group (the whole world for the
    shards, the cross group for the adapters), up to the rollout rank's acknowledgement;
    median of `repeats` after a warm-up (every rank of a group calls it)."""
    import torch

    ack, out = torch.zeros(1), {}
    for key, n, group in (("full", payload, weights), ("adapter", adapter_bytes, cross)):
        if group is None:
            continue
        buf, times = torch.zeros(n // 4), []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            group.broadcast(buf, 0).wait()
            if cross is not None:
                (cross.recv([ack], 1, 0) if rank == 0 else cross.send([ack], 0, 0)).wait()
            times.append(time.perf_counter() - t0)
        out[key] = statistics.median(times[1:])
    return out


def run_separate(size: str, repeats: int, bucket_mb: int, lora_rank: int) -> dict:
    """One --separate row: the ranks spawned over gloo, their measurements combined."""
    import torch
    import torch.multiprocessing as mp

    tp = _separate_tp(size)
    with tempfile.TemporaryDirectory(prefix="weight_sync_separate_") as out:
        mp.spawn(_separate_rank, args=(tp + 1, size, repeats, bucket_mb, lora_rank, out),
                 nprocs=tp + 1)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(tp + 1)]
    model, _, specs, _, _ = _separate_world(size, lora_rank)
    head = ranks[0]
    sent = {m: sum(r["sent"][m] for r in ranks[:tp]) for m in SEPARATE_MODES}
    return dict(
        size=size, params=sum(torch.Size(s.full_shape).numel() for s in specs),
        layout=f"train tp={tp} -> 1 rollout rank", bucket_mb=bucket_mb, lora_rank=lora_rank,
        model_bytes=sum(torch.Size(s.full_shape).numel() * 4 for s in specs),
        **{f"{m}_bytes": sent[m] for m in SEPARATE_MODES},
        **{f"{m}_s": round(head["times"][m], 4) for m in (*SEPARATE_MODES, "colocated full",
                                                          "colocated adapter")},
        broadcast_full_s=round(head["floors"]["full"], 4),
        broadcast_adapter_s=round(head["floors"]["adapter"], 4),
        broadcast_full_bytes=head["payload"],
        peak_train_mib=round(max(r["peak_extra"] for r in ranks[:tp]) / 2**20, 1),
        peak_rollout_mib=round(ranks[tp]["peak_extra"] / 2**20, 1),
        repeats=repeats, threads=1, cpu=_cpu(), loadavg_1m=round(os.getloadavg()[0], 2))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def separate_table(path: str) -> str:
    """The weight sync table of docs/performance.md ("Weight sync to rollout ranks"): per
    --separate row of `path`, each mode's bytes and seconds against the colocated feed and a
    plain broadcast of the same bytes on the same group, and each side's peak memory."""
    out = []
    for r in records(path):
        if "full_bytes" not in r:
            continue
        mb = lambda n: f"{n / 1e6:.3g} MB"  # noqa: E731
        modes = [("colocated, full tensors (TP gather)", r["model_bytes"], r["colocated full_s"],
                  None),
                 ("colocated, adapter (peft folder)", r["adapter_bytes"],
                  r["colocated adapter_s"], None),
                 ("separate, full (shard to shard)", r["full_bytes"], r["full_s"],
                  r["broadcast_full_s"]),
                 ("separate, delta, all changed", r["delta, all changed_bytes"],
                  r["delta, all changed_s"], None),
                 ("separate, delta, linears changed", r["delta, linears changed_bytes"],
                  r["delta, linears changed_s"], None),
                 ("separate, adapter", r["adapter_bytes"], r["adapter_s"],
                  r["broadcast_adapter_s"])]
        for name, n, s, floor in modes:
            out.append([f"{r['size']} ({r['params'] / 1e6:.3g}M, {r['layout']})", name, mb(n),
                        f"{s:.4f}", f"{n / s / 1e9:.3g}",
                        f"{floor:.4f} ({s / floor:.1f}x)" if floor else "",
                        f"{r['peak_train_mib']:.0f} / {r['peak_rollout_mib']:.0f}"
                        if name.startswith("separate, full") else ""])
    return markdown_table(["model (layout)", "sync", "bytes", "seconds", "GB/s",
                           "dist.broadcast of the bytes (s)",
                           "peak MiB over own shards: training / rollout"], out)


def _launch(size: str, repeats: int, vllm_tp: int, env: dict) -> str:
    """Runs one size in its own process (torchrun with vllm_tp ranks for the TP rows)."""
    one = [__file__, "--one", size, "--repeats", str(repeats), "--vllm-tp", str(vllm_tp)]
    cmd = [sys.executable, *one] if vllm_tp == 1 else torchrun_command(vllm_tp, *one)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"size {size} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return found[-1]


def table(path: str) -> str:
    """The refit table of docs/performance.md: per row of `path` with the repack split, the
    sync against the disk round trip and memcpy, and vLLM's packing against a plain copy."""
    return markdown_table(
        ["model", "bytes", "sync (s)", "disk round trip (s)", "disk / sync", "sync / memcpy",
         "engine load (s)", "repack alone (s)", "plain copy (s)", "repack / memcpy",
         "decode, plain / packed weights"],
        ([r["size"], f"{r['bytes'] / 1e6:.0f} MB", f"{r['sync_s']:.3f}",
          f"{r['disk_total_s']:.3f}", f"{r['disk_total_s'] / r['sync_s']:.2f}x",
          f"{r['sync_s'] / r['memcpy_s']:.1f}x", f"{r['engine_load_s']:.3f}",
          f"{r['repack_s']:.3f}", f"{r['plain_copy_s']:.3f}",
          f"{r['repack_s'] / r['memcpy_s']:.1f}x",
          f"{r['decode_plain_s'] / r['decode_packed_s']:.2f}x"]
         for r in records(path) if "repack_s" in r))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/weight_sync_cpu.jsonl")
    ap.add_argument("--vllm-tp", type=int, default=1,
                    help="vLLM TP rows: this many ranks, training TP = vLLM TP")
    ap.add_argument("--table", help="print the refit table from this results file and exit")
    ap.add_argument("--separate", action="store_true",
                    help="separate placement rows (training ranks -> a rollout rank)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="--separate: bucket size")
    ap.add_argument("--lora-rank", type=int, default=16, help="--separate: the adapter's rank")
    ap.add_argument("--separate-table", help="print the separate placement table and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if print_table(args, table=table, separate_table=separate_table):
        return
    if args.separate:
        out = (args.out if args.out != ap.get_default("out")
               else "benchmarks/results/weight_sync_separate_cpu.jsonl")
        sizes = args.sizes if args.sizes != ap.get_default("sizes") else \
            "tiny,10m,100m,smollm2-135m"
        lines = []
        for size in sizes.split(","):
            lines.append(json.dumps(run_separate(size, args.repeats, args.bucket_mb,
                                                 args.lora_rank)))
            print(lines[-1], flush=True)
        if out:
            write_lines(out, lines)
        return
    if args.one:
        row = (run_one(args.one, args.repeats) if args.vllm_tp == 1
               else run_tp(args.one, args.repeats, args.vllm_tp))
        if row is not None:
            print("RESULT " + json.dumps(row), flush=True)
        os._exit(0)  # skip vLLM's shutdown hooks
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.vllm_tp > 1 and args.out == ap.get_default("out"):
        args.out = f"benchmarks/results/weight_sync_tp{args.vllm_tp}_cpu.jsonl"
    lines = []
    for size in args.sizes.split(","):
        lines.append(_launch(size, args.repeats, args.vllm_tp, env))
        print(lines[-1], flush=True)
    if args.out:
        write_lines(args.out, lines)


if __name__ == "__main__":
    main()
