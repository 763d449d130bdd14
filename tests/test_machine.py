"""megagrpo.runtime.machine.cpu_name: what every results file records as the CPU a figure
came from."""
import torch

import megagrpo.runtime.machine as machine


def test_cpu_name_names_model_family_and_capability(monkeypatch):
    """The model name alone is not enough (VMs show a bare "AMD EPYC" for CPUs 2x apart): the
    family and model numbers and torch's capability come with it, read from /proc/cpuinfo's
    first processor; a machine without /proc/cpuinfo still gets a name."""
    monkeypatch.setattr(machine, "_cpuinfo", lambda: {
        "processor": "0", "model name": "AMD EPYC", "cpu family": "25", "model": "17"})
    cap = torch.backends.cpu.get_cpu_capability()
    assert machine.cpu_name() == f"AMD EPYC (family 25 model 17), {cap}"
    monkeypatch.setattr(machine, "_cpuinfo", dict)
    assert machine.cpu_name() == f"unknown CPU, {cap}"


def test_cpuinfo_reads_the_first_processor_only():
    """_cpuinfo stops at the first blank line: the fields are the first processor's (on a
    2-socket machine the second's could differ), and its model name is /proc/cpuinfo's first."""
    info = machine._cpuinfo()
    with open("/proc/cpuinfo") as f:
        first = next(line for line in f if line.startswith("model name"))
    assert info["model name"] == first.split(":", 1)[1].strip()
    assert info["processor"] == "0"
