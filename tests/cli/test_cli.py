"""The cpupin command as a user runs it: exit codes, JSON and messages of
topo, threads, plan, top, handoff and audit (exec: test_binding.py; doctor:
test_measure.py; every flag fuzzed: test_cli_fuzz.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import cpupin
from cpupin.cli import main
from tests.support.helpers import interruptible, sleeper_on

GPU7 = "0000:fa:00.0"  # the second GPU of node 3 on xeon6-b300


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
    data = json.loads(capsys.readouterr().out)
    assert data["pid"] == os.getpid() and data["process_mask"] == sorted(cpupin.process_cpus())
    rows = data["threads"]
    assert os.getpid() in {row["tid"] for row in rows}
    assert {"tid", "name", "run_ns", "wait_ns", "last_cpu", "mask", "mask_list"} <= set(rows[0])
    assert rows[0]["mask"] == sorted(os.sched_getaffinity(rows[0]["tid"]))


def test_threads_of_another_process_shows_its_mask_not_ours(capsys, two_cpus):
    with sleeper_on(two_cpus[1]) as child:
        assert main(["threads", str(child.pid)]) == 0
        out = capsys.readouterr().out
        head, columns, row = out.splitlines()[:3]
        assert f"pid {child.pid}: 1 thread; process mask {two_cpus[1]}" in head
        assert columns.split()[-1] == "mask" and row.split()[-1] == str(two_cpus[1])


# --- cpupin plan ---------------------------------------------------------


def plan_json(*args, capsys):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_all_gpus_of_the_dgx_h100_is_eight_disjoint_placements(capsys):
    data = plan_json("--host", "dgx-h100", "--all-gpus", "--setting", "auto", capsys=capsys)
    assert set(data) == {"setting", "mask", "mask_list", "servers"}
    assert data["setting"] == "auto" and data["mask_list"] == "0-223"
    assert data["mask"] == list(range(224))
    servers = data["servers"]
    assert len(servers) == 8 and all(s["pinned"] for s in servers)
    assert servers[0] == {
        "devices": ["0000:18:00.0"],
        "pinned": True,
        "reason": servers[0]["reason"],
        "workers": [{"device": "0000:18:00.0", "cpus": [0, 112]}],
        "result_cpu": 55,
        "usable_cpus": 221,  # 224 less the step core's two CPUs and the result CPU
    }
    cpus = [set(w["cpus"]) | {s["result_cpu"]} for s in servers for w in s["workers"]]
    assert sum(map(len, cpus)) == len(set().union(*cpus)) == 24


def test_plan_of_one_server_with_a_split_config(capsys):
    data = plan_json(
        "--host",
        "xeon6-b300",
        "--setting",
        "auto",
        "--mask",
        "96-127,224-255",
        "--gpu",
        GPU7,
        "--device",
        "7",
        capsys=capsys,
    )
    (server,) = data["servers"]
    assert server["workers"] == [
        {"device": GPU7, "cpus": [97, 225]},
        {"device": GPU7, "cpus": [99, 227]},
    ]


def test_plan_that_pins_nothing_has_no_workers_and_a_null_result(capsys):
    data = plan_json(
        "--host",
        "xeon6-b300",
        "--setting",
        "auto",
        "--mask",
        "32-39",
        "--gpu",
        "0000:17:00.0",
        capsys=capsys,
    )
    (server,) = data["servers"]
    assert server["pinned"] is False and server["workers"] == [] and server["result_cpu"] is None
    assert "4 core(s) for 6 GPU(s), and each needs two" in server["reason"]


def test_plan_uses_the_runtimes_setting_and_says_what_it_ignores(monkeypatch, capsys):
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0-3")
    monkeypatch.setenv("CPUPIN_STEP_THREAD_CORE", "auto")
    data = plan_json("--host", "dgx-h100", capsys=capsys)
    assert data["setting"] == "auto" and all(s["pinned"] for s in data["servers"])
    assert "with_auto" not in data
    assert main(["plan", "--host", "dgx-h100", "--json"]) == 0
    err = capsys.readouterr().err
    assert "GOMP_CPU_AFFINITY" in err and "ignores CPUPIN_STEP" not in err
    monkeypatch.delenv("CPUPIN_STEP_THREAD_CORE")  # the default: off, and auto beside it
    data = plan_json("--host", "dgx-h100", capsys=capsys)
    assert data["setting"] == "off" and not any(s["pinned"] for s in data["servers"])
    assert data["with_auto"]["setting"] == "auto"
    assert all(s["pinned"] for s in data["with_auto"]["servers"])
    assert main(["plan", "--host", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "setting off" in out and "with auto instead of off" in out and "ABCD" in out


def test_plan_names_a_bad_setting_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("CPUPIN_STEP_THREAD_CORE", "bogus")
    assert main(["plan", "--host", "dgx-h100"]) == 2
    assert "CPUPIN_STEP_THREAD_CORE='bogus'" in capsys.readouterr().err


def test_plan_with_a_setting_that_fails_exits_2_with_its_message():
    code = textwrap.dedent("""
        import sys
        from cpupin.cli import main
        sys.exit(main(["plan", "--host", "xeon6-b300", "--mask", "96-103", "--setting", "101",
                       "--gpu", "0000:e4:00.0", "--gpu", "0000:e4:00.0", "--gpu", "0000:fa:00.0"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "step_thread_core 101 leaves no allowed CPU for worker 2 in 96-103" in out.stderr
    assert "Traceback" not in out.stderr


def test_plan_human_view_draws_the_cores_of_each_node(capsys):
    assert main(["plan", "--host", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "ABCD" in out and "dcba" in out and "no lock taken" in out


# --- cpupin top and cpupin handoff ---------------------------------------

two_cpus = pytest.mark.skipif(len(cpupin.process_cpus()) < 2, reason="needs two CPUs")


def test_top_json_is_one_document_and_json_lines_one_line_a_sample(capsys):
    pid = str(os.getpid())
    assert main(["top", pid, "--count", "2", "--interval", "0.05", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # one document, however many samples
    assert data["pid"] == os.getpid() and len(data["samples"]) == 2
    rows = data["samples"][0]["threads"]
    keys = {"tid", "name", "cpu_ms_per_s", "wait_ms_per_s", "last_cpu", "mask", "mask_list"}
    assert rows and keys <= set(rows[0]) and isinstance(rows[0]["mask"], list)
    assert main(["top", pid, "--count", "2", "--interval", "0.05", "--json-lines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["threads"] for line in lines)


def test_top_ends_on_ctrl_c_with_exit_0():
    child = subprocess.Popen(
        [sys.executable, "-m", "cpupin", "top", "1", "--interval", "0.05", "--json-lines"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    first = child.stdout.readline()  # it is sampling: Ctrl-C now
    child.send_signal(signal.SIGINT)
    rest, err = child.communicate(timeout=60)
    assert child.returncode == 0 and "Traceback" not in err, err
    assert json.loads(first)["threads"]


def test_top_json_at_ctrl_c_prints_the_samples_taken(monkeypatch, capsys):
    from cpupin.cli import top

    calls = []

    def sleep(seconds):
        calls.append(seconds)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user's Ctrl-C, during the third sample

    monkeypatch.setattr(top.time, "sleep", sleep)
    assert main(["top", str(os.getpid()), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["samples"]) == 2


@two_cpus
def test_handoff_json_for_one_pair(capsys):
    assert main(["handoff", "--cpus", "0,1", "--rounds", "200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"cpus", "mode", "median_ns", "p99_ns", "rounds"} <= set(data)
    assert data["cpus"] == [0, 1] and data["rounds"] == 200


@two_cpus
def test_handoff_matrix_json_with_progress_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["handoff", "--matrix", "--rounds", "100", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    n = len(data["cpus"])
    assert len(data["median_ns"]) == n and all(len(row) == n for row in data["median_ns"])
    assert "pairs" in captured.err and "\r[" in captured.err


def test_handoff_matrix_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "m.png"
    assert main(["handoff", "--matrix", "--rounds", "50", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, says",
    [
        (["handoff", "--cpus", "0,0", "--spin"], "two different CPUs"),
        (["handoff", "--cpus", "0,9999"], "outside the process mask"),
        (["handoff", "--rounds", "0"], "--rounds 0"),
        (["top", "nobody"], "'nobody' is not a pid"),
        (["top", "self", "--interval", "0"], "--interval: '0' is not a number of seconds"),
    ],
)
def test_bad_measurement_arguments_exit_2(args, says):
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", *args], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr


# --- cpupin audit --------------------------------------------------------


AUDITED = """
import os, sys, threading
release = threading.Event()
def narrow():
    try:
        os.sched_setaffinity(0, {{{cpu}}})
        print(threading.get_native_id(), flush=True)
    except BaseException:
        os._exit(1)  # never leave the test waiting on a child that cannot answer
    release.wait()
t = threading.Thread(target=narrow, name="narrowed")
t.start()
sys.stdin.readline()
release.set(); t.join()
# join() returns when Python is done with the thread; the kernel's task may
# outlive it by a moment (seen under load): "gone" is said once it is gone.
import time
for _ in range(10000):
    if len(os.listdir("/proc/self/task")) == 1:
        break
    time.sleep(0.001)
print("gone", flush=True)
sys.stdin.readline()
"""


@two_cpus
def test_audit_fails_on_a_narrowed_thread_until_it_is_gone(capsys):
    first = min(cpupin.process_cpus())
    child = subprocess.Popen(
        [sys.executable, "-c", AUDITED.format(cpu=first)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        tid = int(child.stdout.readline())
        assert main(["audit", str(child.pid), "--fail-on-narrow"]) == 3
        out = capsys.readouterr().out
        assert f"({tid})" in out and "deliberate pin" in out
        assert "-> a narrower thread not registered" in out  # and what to do
        assert main(["audit", str(child.pid)]) == 0
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "gone"
        capsys.readouterr()
        assert main(["audit", str(child.pid), "--fail-on-narrow", "--json"]) == 0
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_doctor_and_topo_agree_on_a_shipped_hosts_facts(capsys):
    for name in ("gh200", "dgx-h100", "h100-vm"):
        assert main(["topo", "--host", name, "--json"]) == 0
        topo = json.loads(capsys.readouterr().out)
        assert main(["doctor", "--host", name, "--json"]) == 0
        doctor = json.loads(capsys.readouterr().out)
        for key in ("cpus", "smt", "nodes", "gpus", "mask", "quota", "hypervisor"):
            assert doctor[key] == topo[key], (name, key)
        assert main(["doctor", "--host", name]) == 0
        text = capsys.readouterr().out
        assert f"{len(topo['nodes'])} node(s)" in text


# --- the command line as a person meets it -------------------------------------


def test_cpupin_alone_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "usage: cpupin" in out.err and "exec" in out.err


@pytest.mark.parametrize(
    "command", ["threads", "audit", "topo", "plan", "top", "handoff", "exec", "doctor", "ps"]
)
def test_every_subcommands_help_opens_with_what_it_does(command):
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    paragraphs = out.stdout.split("\n\n")
    assert paragraphs[0].startswith(f"usage: cpupin {command}")
    said = paragraphs[1].strip()
    assert (
        said[0].isupper() and said.endswith(".") and not said.startswith(("positional", "options"))
    )


def test_threads_self_is_this_commands_own_threads(capsys):
    assert main(["threads", "self", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] == os.getpid()


def test_ps_says_how_long_it_really_sampled(tmp_path, capsys):
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, cpupin; cpupin.pin_current_thread("
         "cpupin.process_cpus()); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)},
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "ready\n"
        assert main(["ps", "--lock-dir", str(tmp_path), "--interval", "0.2", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["interval_s"] == 0.2 and data["sampled_s"] >= 0.2  # it slept that long
        assert main(["ps", "--lock-dir", str(tmp_path), "--interval", "0.2"]) == 0
        assert "sampled over 0.2" in capsys.readouterr().out
    finally:
        child.kill()
        child.wait()


TOPPED = """
import os, sys, threading, cpupin
cpu = min(cpupin.process_cpus())
cpupin.Thread(target=threading.Event().wait, daemon=True).start()  # on the process mask
cpupin.pin_current_thread({cpu}, role="step")
def loose():
    os.sched_setaffinity(0, {cpu})  # behind cpupin's back, on the pinned CPU
    threading.Event().wait()
threading.Thread(target=loose, daemon=True).start()
print(threading.get_native_id(), flush=True)
sys.stdin.read()
"""


def test_top_tells_a_registered_pin_from_an_interloper(tmp_path, capsys, two_cpus):
    child = subprocess.Popen(
        [sys.executable, "-c", TOPPED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)},
    )  # fmt: skip
    try:
        main_tid = int(child.stdout.readline())
        os.environ["CPUPIN_LOCK_DIR"] = str(tmp_path)
        try:
            assert (
                main(["top", str(child.pid), "--count", "1", "--interval", "0.05", "--json"]) == 0
            )
        finally:
            del os.environ["CPUPIN_LOCK_DIR"]
        (sample,) = json.loads(capsys.readouterr().out)["samples"]
        states = {t["tid"]: t["state"] for t in sample["threads"]}
        assert states[main_tid] == "pinned"
        assert sorted(states.values()).count("interloper") == 1, states
    finally:
        child.kill()
        child.wait()


def test_advice_never_names_a_lower_cpu_when_there_is_none():
    from cpupin.host.shapes import host_named

    host = host_named("h100-vm")
    cpus = sorted(host.cpus)[:6]
    slots = [f"slot{i}" for i in range(8)]
    for setting, lower in ((cpus[0], False), (cpus[2], True)):
        with pytest.raises(cpupin.PlanError, match="leaves no allowed CPU") as err:
            cpupin.place(host, frozenset(cpus), slots, setting)
        assert ("name a lower CPU" in str(err.value)) == lower, str(err.value)


def test_a_progress_bar_is_drawn_on_a_terminal_only(two_cpus):
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", "handoff", "--matrix", "--rounds", "20"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr and "pairs" not in out.stderr


def test_an_off_plan_of_many_servers_says_it_once(capsys):
    assert main(["plan", "--host", "dgx-h100", "--all-gpus", "--setting", "off"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  all 8 servers pin nothing: step_thread_core is off")
    assert sum("pin nothing" in line or "pins nothing" in line for line in out) == 1
    assert "with auto instead of off" in "\n".join(out)  # what auto would do follows


@pytest.mark.parametrize("columns", [None, "50", "200", "0", "-3", "wide"])
def test_the_help_is_as_wide_as_shutil_would_make_it(columns, monkeypatch):
    """The parser finds the terminal's width without importing shutil (2 ms
    of every run); shutil's own answer is the oracle, $COLUMNS or not."""
    import shutil

    from cpupin.cli import _parser

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert _parser._columns() == shutil.get_terminal_size().columns
