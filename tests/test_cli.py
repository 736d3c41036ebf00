"""The cpupin command as a user runs it: exit codes, JSON and messages."""

import json
import os
import subprocess
import sys

import pytest

from cpupin.cli import main


def run(*args):
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", *args], capture_output=True, text=True, check=False
    )
    return out.returncode, out.stdout, out.stderr


def test_help_lists_the_subcommands():
    code, out, _ = run("--help")
    assert code == 0
    for command in ("topo", "threads"):
        assert command in out


def test_topo_json_of_the_dgx_h100(capsys):
    assert main(["topo", "--host", "dgx-h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["cpus"]) == 224 and len(data["cores"]) == 112
    assert data["cores"][0] == [0, 112]
    assert sorted(data["nodes"]) == ["0", "1"]
    assert data["nodes"]["0"] == list(range(56)) + list(range(112, 168))
    assert [g["address"] for g in data["gpus"]][:2] == ["0000:18:00.0", "0000:2a:00.0"]
    assert {g["node"] for g in data["gpus"]} == {0, 1}
    assert data["gpus"][0]["class"] == "0x030200" and data["gpus"][0]["vendor"] == "nvidia"
    assert data["deepest_idle_state"] == {"name": "C6", "latency_us": 290}
    assert data["usable_cpus"] == 224 and len(data["mask"]) == 224
    assert {"idle_states", "local_cpus"} <= set(data) | set(data["gpus"][0])


def test_topo_json_of_this_machine_is_this_machine(capsys):
    assert main(["topo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpus"] == list(range(os.cpu_count()))
    assert set(data["mask"]) == os.sched_getaffinity(0)
    assert data["usable_cpus"] <= len(data["mask"])


def test_topo_reads_a_root(tmp_path, capsys):
    cpu = tmp_path / "sys/devices/system/cpu"
    (cpu / "cpu0/topology").mkdir(parents=True)
    (cpu / "online").write_text("0\n")
    (cpu / "cpu0/topology/thread_siblings_list").write_text("0\n")
    assert main(["topo", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 online (0)" in out and "no NUMA nodes listed" in out


@pytest.mark.parametrize(
    "args, says",
    [
        (["topo", "--host", "dgx-a100"], "no shipped host 'dgx-a100'"),
        (["topo", "--root", "/no/such/dir"], "'/no/such/dir' is not a directory"),
        (["threads", "999999999"], "pid 999999999"),
        (["topo", "--root", "/proc"], "lists no online CPU"),
        (["topo", "--root", ""], "an empty --root"),
        (["doctor", "--host", ""], "no shipped host ''"),
        (["plan", "--host", "dgx-h100", "--mask", "5000"], "names no online CPU"),
        (["handoff", "--plot", "x.png"], "add --matrix"),
        (["top", "1", "--interval", "inf"], "'inf' is not a number of seconds"),
        (["top", "1", "--count", "1_0"], "'1_0' is not a whole number"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, says):
    code, out, err = run(*args)
    assert code == 2
    assert says in err and "Traceback" not in err


def test_threads_json_lists_this_process(capsys):
    assert main(["threads", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert os.getpid() in {row["tid"] for row in rows}
    assert {"tid", "name", "run_ns", "wait_ns", "last_cpu", "mask"} <= set(rows[0])
