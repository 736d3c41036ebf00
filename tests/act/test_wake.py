"""Holding the wake latency: the value format against the kernel's rules,
fake sysfs trees for what this machine lacks (a container, no cpuidle, a
hostile tree, another holder), and the real files where this machine has
them, each put back; where it has none, the refusal and its reason."""

import json
import os
import signal
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpupin
from cpupin.act import wake
from cpupin.act.server import ENV_WAKE_LATENCY, wake_latency_from_env
from cpupin.host._pmqos import MAX_US, format_resume_latency, parse_resume_latency
from cpupin.host.shapes import host_named
from cpupin.measure.doctor import diagnose
from cpupin.registry.reader import read_registry
from tests.support.handoffs import fake_handoffs
from tests.support.helpers import ready_child, run
from tests.support.wake import REAL, machine_refusal

# The host's own PM QoS and interrupts: with pytest-xdist, these tests run
# one at a time on one worker, never beside another that reads or sets them.
pytestmark = pytest.mark.xdist_group("host")

# --- the value format -----------------------------------------------------------


@given(st.none() | st.integers(0, MAX_US))
def test_a_limit_written_reads_back_as_itself(limit):
    # The kernel's store: "n/a" is 0 µs (no latency accepted), "0" no limit.
    assert parse_resume_latency(format_resume_latency(limit)) == limit


@given(st.text(max_size=20))
def test_a_resume_latency_parses_or_says_why(text):
    try:
        value = parse_resume_latency(text)
    except ValueError as exc:
        assert str(exc)
        return
    assert value is None or 0 <= value <= MAX_US


@pytest.mark.parametrize("value", ["-1", "x", "", "2000000001", "0x10", "1e3", "n/a n/a", "١٢"])
def test_a_bad_resume_latency_is_refused(value):
    with pytest.raises(ValueError):
        parse_resume_latency(value)


@pytest.mark.parametrize("bad", [-1, MAX_US + 1, 1.5, "0", True, None])
def test_a_bad_bound_names_the_value(bad):
    with pytest.raises(ValueError, match="max_us"):
        cpupin.hold_wake_latency({0}, bad)


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "2000000001", " 5 x"])
def test_a_bad_wake_latency_variable_names_it(value):
    with pytest.raises(cpupin.PlanError, match=ENV_WAKE_LATENCY):
        wake_latency_from_env({ENV_WAKE_LATENCY: value})
    assert wake_latency_from_env({ENV_WAKE_LATENCY: "0"}) == 0
    assert wake_latency_from_env({}) is None


# --- fake trees ------------------------------------------------------------------


def tree(root, cpus=(0, 1, 2, 3), driver="intel_idle", values=None):
    base = root / "sys/devices/system/cpu"
    base.mkdir(parents=True)
    (base / "online").write_text(f"0-{max(cpus)}\n")
    if driver is not None:
        (base / "cpuidle").mkdir()
        (base / "cpuidle/current_driver").write_text(driver + "\n")
    for cpu in cpus:
        power = base / f"cpu{cpu}/power"
        power.mkdir(parents=True)
        (power / "pm_qos_resume_latency_us").write_text((values or {}).get(cpu, "0") + "\n")
    return root


def value(root, cpu):
    path = root / f"sys/devices/system/cpu/cpu{cpu}/power/pm_qos_resume_latency_us"
    return path.read_text().strip()


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    where = tmp_path / "locks"
    where.mkdir()
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(where))
    yield where
    for hold in wake.holds():
        hold.release()


def journaled(root):
    """The wake journal's entries for ``root``, by CPU."""
    from cpupin.registry.holds import entries
    from cpupin.registry.journal import read_journal

    return entries(read_journal("wake", str(root))[0])


def own_record(where):
    found = read_registry(str(where))
    (record,) = [r for r in found.records if r.kind == "process" and r.pid == os.getpid()]
    return record


@pytest.mark.parametrize("max_us, written", [(0, "n/a"), (50, "50"), (1, "1")])
def test_a_hold_writes_the_bound_records_what_it_replaced_and_puts_it_back(
    tmp_path, lock_dir, max_us, written
):
    # CPUs this host has online: a record naming others would be refused.
    held = sorted(os.sched_getaffinity(0))[:2]
    before = {cpu: str(20 + i) for i, cpu in enumerate(held)}
    root = tree(tmp_path / "root", cpus=tuple(range(max(held) + 2)), values=before)
    every = range(max(held) + 2)
    hold = cpupin.hold_wake_latency(set(held), max_us, root=str(root))
    assert [value(root, c) for c in every] == [written if c in held else "0" for c in every]
    assert hold.previous == before and hold.mechanism == "sysfs"
    (recorded,) = own_record(lock_dir).wake_holds
    assert recorded.cpus == set(held) and recorded.max_us == max_us
    assert {c: e.original for c, e in journaled(root).items()} == before
    assert hold.release() == []
    assert [value(root, c) for c in every] == [before.get(c, "0") for c in every]
    assert own_record(lock_dir).wake_holds == ()
    assert journaled(root) == {}
    assert hold.release() == []  # twice is once


def test_a_value_changed_since_the_hold_is_left_with_a_note(tmp_path, lock_dir):
    root = tree(tmp_path / "root")
    with cpupin.hold_wake_latency("1-2", 0, root=str(root)) as hold:
        path = root / "sys/devices/system/cpu/cpu1/power/pm_qos_resume_latency_us"
        path.write_text("30\n")  # an operator, or another tool
    assert value(root, 1) == "30" and value(root, 2) == "0"
    assert len(hold.notes) == 1 and "CPU 1" in hold.notes[0] and "30" in hold.notes[0]


@pytest.mark.parametrize("driver", [None, "none", ""])
def test_no_cpuidle_refuses_and_writes_nothing(tmp_path, lock_dir, driver):
    root = tree(tmp_path / "root", driver=driver)
    with pytest.raises(cpupin.HoldRefused, match="cpuidle") as refused:
        cpupin.hold_wake_latency({1}, 0, root=str(root))
    assert "nothing to hold" in refused.value.strerror
    assert [value(root, c) for c in range(4)] == ["0"] * 4


@pytest.mark.parametrize("kind", ["missing", "fifo", "symlink", "directory", "garbage"])
def test_a_hidden_or_hostile_file_refuses_the_whole_hold(tmp_path, lock_dir, kind):
    """All or nothing: CPU 1 was written before CPU 2's file turned out bad,
    and CPU 1 gets its value back."""
    root = tree(tmp_path / "root", values={1: "7"})
    path = root / "sys/devices/system/cpu/cpu2/power/pm_qos_resume_latency_us"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "directory":
        path.mkdir()
    elif kind == "garbage":
        path.write_text("lots\n")
    with pytest.raises(cpupin.HoldRefused) as refused:
        cpupin.hold_wake_latency({1, 2}, 0, root=str(root))
    assert "CPU 2" in refused.value.strerror
    assert value(root, 1) == "7"
    assert wake.holds() == []


@pytest.mark.parametrize("first_out", [True, False])
def test_two_holds_of_one_cpu_share_it_and_the_stricter_bound_holds(tmp_path, lock_dir, first_out):
    root = tree(tmp_path / "root", values={1: "5", 2: "6", 3: "7"})
    first = cpupin.hold_wake_latency({1, 2}, 0, root=str(root))
    second = cpupin.hold_wake_latency({2, 3}, 50, root=str(root))
    assert [value(root, c) for c in range(4)] == ["0", "n/a", "n/a", "50"]
    assert any("shared with this process's holds" in n for n in second.notes), second.notes
    (first if first_out else second).release()
    if first_out:
        assert [value(root, c) for c in range(4)] == ["0", "5", "50", "50"]
    else:
        assert [value(root, c) for c in range(4)] == ["0", "n/a", "n/a", "7"]
    (second if first_out else first).release()
    assert [value(root, c) for c in range(4)] == ["0", "5", "6", "7"]
    assert journaled(root) == {}


def test_named_cpus_must_be_online_and_some(tmp_path, lock_dir):
    root = tree(tmp_path / "root")
    with pytest.raises(ValueError, match="not online"):
        cpupin.hold_wake_latency({7}, 0, root=str(root))
    with pytest.raises(ValueError, match="no CPU named"):
        cpupin.hold_wake_latency(set(), 0, root=str(root))
    with pytest.raises(ValueError, match="every CPU"):
        cpupin.hold_wake_latency({1}, 0, mechanism="dma", root=str(root))
    with pytest.raises(ValueError, match="mechanism"):
        cpupin.hold_wake_latency({1}, 0, mechanism="poll", root=str(root))


HOLDER = """
import sys
import cpupin
hold = cpupin.hold_wake_latency({CPUS}, 0, root=sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_cpu_another_live_process_holds_is_shared_naming_it(tmp_path, lock_dir):
    cpu = min(os.sched_getaffinity(0))  # online here: the child's record names it
    root = tree(tmp_path / "root", cpus=tuple(range(cpu + 2)), values={cpu: "9"})
    child = ready_child(HOLDER.replace("{CPUS}", f"{{{cpu}}}"), lock_dir, str(root))
    try:
        hold = cpupin.hold_wake_latency({cpu, cpu + 1}, 40, root=str(root))
        assert any(f"shared with pid {child.pid}" in n for n in hold.notes), hold.notes
        assert value(root, cpu) == "n/a" and value(root, cpu + 1) == "40"
    finally:
        child.communicate("\n", timeout=30)
    assert value(root, cpu) == "40"  # the child let go: the bound still held is mine
    hold.release()
    assert value(root, cpu) == "9" and value(root, cpu + 1) == "0"  # the host's, not the child's


def test_ps_shows_a_hold_in_text_json_and_prometheus(tmp_path, lock_dir):
    pytest.importorskip("prometheus_client", reason="pip install prometheus_client")
    cpu = min(os.sched_getaffinity(0))
    root = tree(tmp_path / "root", cpus=tuple(range(cpu + 1)))
    child = ready_child(HOLDER.replace("{CPUS}", f"{{{cpu}}}"), lock_dir, str(root))
    try:
        args = [sys.executable, "-m", "cpupin", "ps", "--lock-dir", str(lock_dir)]
        text = run([*args, "--interval", "0.05"])
        data = run([*args, "--interval", "0.05", "--json"])
        prom = run([*args, "--prometheus"])
    finally:
        child.communicate("\n", timeout=30)
    assert f"holds CPUs {cpu}: no wake latency (pm_qos_resume_latency_us) since" in text.stdout
    (proc,) = [p for p in json.loads(data.stdout)["processes"] if p["pid"] == child.pid]
    (held,) = proc["wake_holds"]
    assert held["cpus"] == [cpu] and held["max_us"] == 0
    line = (
        f'cpupin_wake_latency_hold_microseconds{{cpus="{cpu}",mechanism="sysfs",'
        f'pid="{child.pid}"}} 0.0'
    )
    assert line in prom.stdout, prom.stdout


# --- the doctor's judgement (pure) ---------------------------------------------------


@pytest.mark.parametrize(
    "idle, busy, held, verdict, pays",
    [
        (26, 27, 2.5, "hold", True),  # this kind of VM: pinning does not pay, the hold does
        (160, 5, 3, "auto", True),  # a deep C-state: pinning pays, and the hold too
        (26, 27, 20, "off", False),  # the hold removes too little
        (8, 6, 2, "off", False),  # a wake that costs little is not worth polling CPUs
    ],
)
def test_the_doctor_says_hold_where_the_hold_removes_most_of_the_wake(
    idle, busy, held, verdict, pays
):
    host = host_named("h100-vm")
    us = 1000
    handoffs = fake_handoffs(
        [
            ("same CPU busy", 0, 1 * us, 1 * us),
            ("other core busy", 0, busy * us, busy * us),
            ("other core idle", 200, idle * us, idle * us),
            ("other core held", 200, held * us, held * us),
        ]
    )
    d = diagnose(host, handoffs, "this machine")
    assert d.verdict == verdict, d.why
    assert d.hold.startswith("pays" if pays else "does not pay"), d.hold
    if verdict == "hold":
        assert "cpupin exec --wake-latency 0" in d.why


def test_the_doctor_says_why_the_hold_was_not_measured():
    handoffs = fake_handoffs(
        [
            ("same CPU busy", 0, 1_000, 1_000),
            ("other core busy", 0, 27_000, 27_000),
            ("other core idle", 200, 26_000, 26_000),
        ]
    )
    d = diagnose(host_named("h100-vm"), handoffs, "this machine", None, "not measured: why")
    assert d.verdict == "off" and d.hold == "not measured: why"
    assert diagnose(host_named("h100-vm"), None).hold == ""


# --- this machine ---------------------------------------------------------------------


def dma_value():
    with open("/dev/cpu_dma_latency", "rb") as f:
        return struct.unpack("=i", f.read(4))[0]


def test_a_real_hold_of_one_cpu_is_put_back(lock_dir):
    cpu = min(os.sched_getaffinity(0))
    refusal = machine_refusal()
    if refusal is not None:
        with pytest.raises(cpupin.HoldRefused, match=refusal):
            cpupin.hold_wake_latency({cpu}, 0)
        return
    before = Path(REAL.format(cpu)).read_text().strip()
    try:
        with cpupin.hold_wake_latency({cpu}, 0) as hold:
            assert Path(REAL.format(cpu)).read_text().strip() == "n/a"
            assert hold.previous == {cpu: before}
        assert Path(REAL.format(cpu)).read_text().strip() == before
    finally:
        Path(REAL.format(cpu)).write_text(before)


def test_a_real_hold_of_every_cpu_lasts_while_its_descriptor_is_open(lock_dir):
    refusal = machine_refusal(sysfs=False)
    if refusal is not None:
        with pytest.raises(cpupin.HoldRefused, match=refusal):
            cpupin.hold_wake_latency(None, 0)
        return
    with cpupin.hold_wake_latency(None, 0) as hold:
        assert hold.mechanism == "dma" and dma_value() == 0
        # A forked child closes its copy: the hold ends with the parent's release.
        pid = os.fork()
        if pid == 0:
            os._exit(0 if hold.fd not in map(int, os.listdir("/proc/self/fd")) else 1)
        assert os.waitpid(pid, 0)[1] == 0
    assert dma_value() > 0


READ_DMA = (
    "import struct; print(struct.unpack('=i', open('/dev/cpu_dma_latency', 'rb').read(4))[0])"
)


@pytest.mark.parametrize("bound", [0, 20])
def test_exec_holds_every_cpu_for_the_commands_lifetime(bound):
    cpu = min(os.sched_getaffinity(0))
    out = run([sys.executable, "-m", "cpupin", "exec", "--cpus", str(cpu),
               "--wake-latency", str(bound), "--", sys.executable, "-c", READ_DMA])  # fmt: skip
    refusal = machine_refusal(sysfs=False)
    if refusal is not None:
        assert out.returncode == 2 and refusal in out.stderr, out.stderr
        return
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == bound
    assert dma_value() > bound  # the kernel dropped it with the command


PLAN_HOLD = """
import json, os, sys
import cpupin
cpus = sorted(cpupin.process_cpus())
plan = cpupin.plan_server(str(cpus[0]) if len(cpus) > 1 else "off", ["w0"])
print(json.dumps({"pinned": plan.pinned, "cpus": sorted(plan.placement.cpus),
                  "held": plan.wake_hold and sorted(plan.wake_hold.cpus),
                  "refused": plan.wake_refused}))
"""


def test_a_plan_that_pins_holds_the_cpus_it_pins(tmp_path):
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path), ENV_WAKE_LATENCY: "0"}
    out = run([sys.executable, "-c", PLAN_HOLD], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if not got["pinned"]:  # one CPU: nothing to pin apart, nothing held
        assert got["held"] is None and got["refused"] == ""
        return
    refusal = machine_refusal()
    if refusal is None:
        assert got["held"] == got["cpus"] and got["refused"] == ""
    else:
        assert got["held"] is None and refusal in got["refused"]


KILLED_HOLDER = """
import sys
import cpupin
cpupin.hold_wake_latency({int(sys.argv[1])}, 0)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_ps_prune_puts_back_what_a_killed_holder_held(tmp_path):
    """SIGKILL leaves no chance to release: the record keeps the value to put back."""
    cpu = min(os.sched_getaffinity(0))
    refusal = machine_refusal()
    if refusal is not None:
        out = run([sys.executable, "-c", KILLED_HOLDER, str(cpu)],
                  env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)})  # fmt: skip
        assert out.returncode != 0 and refusal in out.stderr
        return
    before = Path(REAL.format(cpu)).read_text().strip()
    try:
        # No warden (tests/act/test_warden.py has it put back): the prune's own way.
        child = ready_child(KILLED_HOLDER, tmp_path, str(cpu), env={"CPUPIN_WARDEN": "0"})
        assert Path(REAL.format(cpu)).read_text().strip() == "n/a"
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert Path(REAL.format(cpu)).read_text().strip() == "n/a"  # it outlived the holder
        out = run([sys.executable, "-m", "cpupin", "ps", "--prune", "--lock-dir", str(tmp_path),
                   "--interval", "0.01"])  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert f"restored pid {child.pid}: wake latency of CPU {cpu} put back" in out.stderr
        assert Path(REAL.format(cpu)).read_text().strip() == before
    finally:
        Path(REAL.format(cpu)).write_text(before)


def test_exec_dry_run_says_what_it_would_hold():
    args = [sys.executable, "-m", "cpupin", "exec", "--host", "dgx-h100", "--device", "0",
            "--wake-latency", "5", "--dry-run"]  # fmt: skip
    text = run([*args, "--", "python", "x"])
    data = run([*args, "--json", "--", "python", "x"])
    assert "wake   every CPU held at 5 µs or less while it runs" in text.stdout
    assert json.loads(data.stdout)["wake_latency_us"] == 5
    bad = run([*args[:-3], "--wake-latency", "-1", "--", "true"])
    assert bad.returncode == 2 and "--wake-latency" in bad.stderr


SERVER_MEMBER = """
import sys
import cpupin
from cpupin.registry import writer as registry
registry.describe_process(role="vllm-worker", server=(int(sys.argv[2]), int(sys.argv[3])))
cpupin.hold_wake_latency({int(sys.argv[1])}, 0)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_server_putting_away_its_killed_workers_puts_back_their_holds(tmp_path):
    """vLLM kills its workers with SIGKILL; the API server's prune of their
    records (prune_members) gives their held CPUs their values back."""
    from cpupin.host._proc import start_time
    from cpupin.registry.prune import prune_members

    cpu = min(os.sched_getaffinity(0))
    me = (os.getpid(), start_time(os.getpid()))
    args = [str(cpu), str(me[0]), str(me[1])]
    refusal = machine_refusal()
    if refusal is not None:
        out = run([sys.executable, "-c", SERVER_MEMBER, *args],
                  env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)})  # fmt: skip
        assert out.returncode != 0 and refusal in out.stderr
        return
    before = Path(REAL.format(cpu)).read_text().strip()
    try:
        # No warden: the server's prune of its members puts back, as it must
        # where a warden was killed with its worker.
        child = ready_child(SERVER_MEMBER, tmp_path, *args, env={"CPUPIN_WARDEN": "0"})
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert Path(REAL.format(cpu)).read_text().strip() == "n/a"
        removed = prune_members(me, str(tmp_path))
        assert len(removed) == 1
        assert Path(REAL.format(cpu)).read_text().strip() == before
    finally:
        Path(REAL.format(cpu)).write_text(before)


@pytest.mark.parametrize("cpus", [["a"], [-1], "x-", 5, [True]])
def test_bad_cpus_are_named(cpus):
    with pytest.raises(ValueError, match="CPU|set of CPUs"):
        cpupin.hold_wake_latency(cpus, 0)


@pytest.mark.parametrize("bound", ["0", -1, 1.5, MAX_US + 1])
def test_a_plans_bad_wake_latency_is_named(bound):
    with pytest.raises(cpupin.PlanError, match="wake_latency_us"):
        cpupin.plan_server("off", ["w0"], wake_latency_us=bound)
