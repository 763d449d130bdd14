"""The command line's parsing, without running anything: `key.sub=value` overrides are taken
wherever they stand after the command, in order (a later one wins in load_config)."""
from __future__ import annotations

import pytest

from megagrpo.cli import cmd_train, parse_args, torchrun_command


def test_overrides_after_an_option_are_kept():
    """The line a new user tried: argparse alone stopped at `run.out_dir=runs/x1`."""
    args = parse_args(["train", "--config", "examples/demo.yaml", "run.steps=1", "--nproc", "2",
                       "run.out_dir=runs/x1"])
    assert args.func is cmd_train
    assert (args.config, args.nproc) == ("examples/demo.yaml", 2)
    assert args.overrides == ["run.steps=1", "run.out_dir=runs/x1"]


@pytest.mark.parametrize("command", ["train", "demo", "plan", "config"])
def test_overrides_keep_their_order_around_options(command):
    args = parse_args([command, "a.b=1", "--config", "x.yaml", "a.b=2", "c.d=3"])
    assert args.overrides == ["a.b=1", "a.b=2", "c.d=3"]
    assert args.config == "x.yaml"


def test_unknown_options_are_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["train", "run.steps=1", "--nprocs", "2"])
    assert e.value.code == 2
    assert "unrecognized arguments: --nprocs" in capsys.readouterr().err


def test_commands_without_overrides_refuse_stray_words(capsys):
    with pytest.raises(SystemExit):
        parse_args(["verify", "--hf", "d", "run.steps=1"])
    assert "unrecognized arguments: run.steps=1" in capsys.readouterr().err


def test_torchrun_command_picks_a_port_each_time():
    a, b = torchrun_command(2, "w.py", "--x"), torchrun_command(2, "w.py", "--x")
    assert a[-2:] == ["w.py", "--x"] and "--nproc-per-node=2" in a
    ports = [next(s for s in c if s.startswith("--master-port=")) for c in (a, b)]
    assert all(int(p.split("=")[1]) > 0 for p in ports)


def test_max_restarts_goes_to_torchrun_not_to_the_ranks():
    """`train --max-restarts N` is the launcher's: torchrun gets it (its elastic agent restarts
    the ranks), the ranks' command line does not (nor --nproc)."""
    from megagrpo.cli import _drop_launcher_args

    args = parse_args(["train", "--nproc", "2", "run.steps=1", "--max-restarts", "3", "a.b=2"])
    assert (args.max_restarts, args.overrides) == (3, ["run.steps=1", "a.b=2"])
    assert parse_args(["train"]).max_restarts == 0
    assert _drop_launcher_args(["train", "--nproc", "2", "x=1", "--max-restarts", "3",
                                "--max-restarts=4", "--nproc=2", "y=2"]) == ["train", "x=1", "y=2"]
    assert "--max-restarts=3" in torchrun_command(2, "w.py", max_restarts=3)
