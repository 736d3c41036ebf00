"""A thread that spins is told from one that computes, sleeps or ticks.

Real threads in real processes: a C probe (built here with the compiler that
builds cpupin) runs one kind of loop a thread, and a Python child spins on
``os.sched_yield``. The kernel's own counters are the oracle for what each
thread did (its ``stat`` utime and stime, its ``status`` switches); what the
commands say is checked against them. Samples are taken until a spinner has
had a CPU for one: on a busy host a spinner that got no CPU holds none, and
is rightly not called one, so no test depends on how busy the host is.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.cli import main
from cpupin.measure.activity import (
    MAX_BLOCKS_PER_S,
    MIN_BUSY,
    MIN_KERNEL_SHARE,
    TaskCounters,
    parse_counters,
    read_counters,
    spinning,
)
from tests.support.probe import build_probe

PYTHON_SPINNER = textwrap.dedent(
    """
    import os, sys, threading
    def spin():
        while True:
            os.sched_yield()
    def compute():
        x = 1
        while True:
            x = (x * 6364136223846793005 + 1) & 0xFFFFFFFFFFFFFFFF
    name = sys.argv[1]  # one a process: two would share the GIL and block on it
    t = threading.Thread(target={"py-spin": spin, "py-compute": compute}[name], daemon=True)
    t.start()
    with open(f"/proc/self/task/{t.native_id}/comm", "w") as f:
        f.write(name)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)

CLK_TCK = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return build_probe(tmp_path_factory.mktemp("probe"))


def _first_in_line():
    """``preexec_fn``: the highest CPU weight a user may give (nice -20 as
    root), so that a thread that yields its CPU to any other still gets one
    on a busy host (a yield loop beside busy threads of equal weight holds
    almost none, and is rightly not called a spinner)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -20)
    except OSError:
        pass  # not root: the test samples until the thread had a CPU


def _start(cmd):
    child = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_first_in_line
    )
    assert child.stdout.readline() == "ready\n"
    return child


def _stop(child):
    child.kill()
    child.wait()


def _threads_json(pid, capsys, interval=0.5):
    assert main(["threads", str(pid), "--json", "--interval", str(interval)]) == 0
    return json.loads(capsys.readouterr().out)


def _kernel_share(pid, tid, before):
    """The kernel's own figures for a thread since ``before``: CPU ticks,
    the share of them in the kernel, and voluntary switches."""
    after = _stat(pid, tid)
    user, kernel = after[0] - before[0], after[1] - before[1]
    return user + kernel, kernel / max(1, user + kernel), after[2] - before[2]


def _stat(pid, tid):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        switches = next(
            int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
        )
    return int(fields[11]), int(fields[12]), switches


def _sampled(pid, capsys, names, rounds=8):
    """Samples of ``threads PID`` until each thread named in ``names`` has
    had a CPU in one (at most ``rounds``); returns every thread's verdicts,
    by name, and the kernel's figures for each sample it ran in.

    A thread had a CPU in a sample when the kernel gave it a tenth of the
    sample and the command itself saw it busy (run and run-queue wait at
    least :data:`MIN_BUSY`, a fifth of it running): the command's window
    is inside the test's, so only then are both about the same work."""
    verdicts = {}
    kernel = {}
    for _ in range(rounds):
        tids = {int(t): _stat(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
        data = _threads_json(pid, capsys)
        for t in data["threads"]:
            verdicts.setdefault(t["name"], []).append(t["spinning"])
            if t["tid"] in tids and t["cpu_ms_per_s"] is not None:
                ticks, share, blocked = _kernel_share(pid, t["tid"], tids[t["tid"]])
                cpu, wait = t["cpu_ms_per_s"], t["wait_ms_per_s"]
                if ticks >= 10 and cpu >= 200 and cpu + wait >= MIN_BUSY * 1000:
                    kernel.setdefault(t["name"], []).append((share, blocked, t["spinning"]))
        if all(n in kernel for n in names):
            break
    return verdicts, kernel


@pytest.mark.parametrize("kind", ["yield-spin", "poll-spin"])
def test_a_c_loop_that_yields_or_polls_is_spinning(probe, kind, capsys):
    child = _start([probe, kind])
    try:
        verdicts, kernel = _sampled(child.pid, capsys, [kind])
        assert kind in kernel, f"{kind} never had a CPU over eight samples"
        # The kernel's figures: most of its time in the kernel, no blocking.
        for share, blocked, _ in kernel[kind]:
            assert share >= MIN_KERNEL_SHARE and blocked <= MAX_BLOCKS_PER_S, kernel
        assert all(said for _, _, said in kernel[kind]), (verdicts, kernel)
        assert not any(verdicts.get("probe", [])), verdicts  # its main thread sleeps
    finally:
        _stop(child)


def test_a_thread_that_computes_sleeps_or_ticks_is_not_spinning(probe, capsys):
    child = _start([probe, "compute", "sleeper", "ticker"])
    try:
        verdicts, kernel = _sampled(child.pid, capsys, ["compute"], rounds=3)
        assert set(verdicts) == {"probe", "compute", "sleeper", "ticker"}
        assert not any(any(v) for v in verdicts.values()), verdicts
        # The oracle agrees: the computing thread spends nearly nothing in
        # the kernel.
        assert all(share < MIN_KERNEL_SHARE for share, _, _ in kernel["compute"]), kernel
    finally:
        _stop(child)


def test_a_python_loop_on_sched_yield_is_spinning_and_a_python_loop_that_computes_is_not(
    capsys,
):
    # One after the other: a loop on sched_yield gives its CPU to any
    # thread that wants it, so beside a computing one it holds none.
    spinner = _start([sys.executable, "-c", PYTHON_SPINNER, "py-spin"])
    try:
        verdicts, kernel = _sampled(spinner.pid, capsys, ["py-spin"])
        assert any(said for _, _, said in kernel.get("py-spin", [])), (verdicts, kernel)
    finally:
        _stop(spinner)
    computer = _start([sys.executable, "-c", PYTHON_SPINNER, "py-compute"])
    try:
        verdicts, kernel = _sampled(computer.pid, capsys, ["py-compute"], rounds=3)
        assert not any(any(v) for v in verdicts.values()), verdicts
    finally:
        _stop(computer)


def _until(look, rounds=8):
    """``look()``'s first answer that is not ``None``, over at most
    ``rounds`` samples: a spinner on a busy host may get no CPU in one."""
    for _ in range(rounds):
        found = look()
        if found is not None:
            return found
    raise AssertionError(f"{look.__name__} never saw the spinner in {rounds} samples")


def test_top_and_ps_name_a_spinning_thread_as_threads_does(probe, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    child = _start([probe, "poll-spin"])
    try:

        def top():
            assert main(["top", str(child.pid), "--count", "1", "--interval", "0.5", "--json"]) == 0
            (sample,) = json.loads(capsys.readouterr().out)["samples"]
            spun = [t for t in sample["threads"] if t["spinning"]]
            return (spun[0], sample["remedies"]) if spun else None

        def ps():
            assert main(["ps", "--all", "--json", "--interval", "0.5"]) == 0
            found = json.loads(capsys.readouterr().out)["unrecorded"]
            return next((p for p in found if p["pid"] == child.pid), None)

        spinner, remedies = _until(top)
        assert spinner["name"] == "poll-spin"
        assert any("spin" in line and "poll-spin" in line for line in remedies)
        listed = _until(ps)
        assert any("spinning: poll-spin" in f for f in listed["findings"]), listed
        assert listed["details"] == f"cpupin threads {child.pid}"
    finally:
        _stop(child)


def test_ps_all_leaves_out_a_quiet_process(probe, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    child = _start([probe, "sleeper"])
    try:
        assert main(["ps", "--all", "--json", "--interval", "0.2"]) == 0
        found = json.loads(capsys.readouterr().out)["unrecorded"]
        mine = [p for p in found if p["pid"] == child.pid]
        # Only what it inherited from this test's cgroup or mask may be said
        # of it (a CI runner's quota, say): nothing of its own threads.
        for p in mine:
            for line in p["findings"]:
                assert "spin" not in line and "pool" not in line and "GPU" not in line, p
    finally:
        _stop(child)


# The pure verdict --------------------------------------------------------

TICKS = CLK_TCK  # one second of CPU


def _counters(utime=0, stime=0, minflt=0, voluntary=0, io=0):
    return TaskCounters(utime, stime, minflt, voluntary, io)


@pytest.mark.parametrize(
    "what, after, busy, spins",
    [
        ("a C yield loop: 85% kernel, no blocking", _counters(15, 85, 0, 0, 0), 1.0, True),
        ("a Python yield loop: 60% kernel", _counters(40, 60, 2, 1, 0), 1.0, True),
        ("a computing thread", _counters(98, 2, 0, 0, 0), 1.0, False),
        ("a 1 ms ticker blocks 1,000 times a second", _counters(1, 3, 0, 1000, 0), 0.6, False),
        ("a copy from the page cache moves data", _counters(30, 70, 0, 2, 1 << 30), 1.0, False),
        ("mapping memory in a loop faults", _counters(20, 80, 50_000, 0, 0), 1.0, False),
        ("it barely ran: too few ticks to judge", _counters(0, 3, 0, 0, 0), 1.0, False),
        ("it wanted a CPU a third of the time", _counters(10, 90, 0, 0, 0), 0.3, False),
    ],
)
def test_what_tells_a_spinner_from_a_busy_thread(what, after, busy, spins):
    scale = TICKS / 100  # the rows are in hundredths of a second
    after = after._replace(utime=int(after.utime * scale), stime=int(after.stime * scale))
    assert spinning(_counters(), after, busy, 1.0) is spins, what


counter = st.integers(0, 10**9)


@given(
    before=st.tuples(counter, counter, counter, counter, counter),
    delta=st.tuples(counter, counter, counter, counter, counter),
    busy=st.floats(0, 2),
    interval=st.floats(0.01, 10),
)
def test_the_verdict_follows_its_rules(before, delta, busy, interval):
    b = TaskCounters(*before)
    a = TaskCounters(*(x + d for x, d in zip(before, delta, strict=True)))
    said = spinning(b, a, busy, interval)
    user, kernel, faults, blocked, moved = delta
    if said:
        assert busy >= MIN_BUSY
        assert kernel / (user + kernel) >= MIN_KERNEL_SHARE
        assert blocked / interval <= MAX_BLOCKS_PER_S
    # Counters that went backwards (a reused tid) never make a spinner.
    assert not spinning(a, b, busy, interval)


@given(st.text(max_size=300), st.one_of(st.none(), st.text(max_size=300)))
def test_counters_parse_or_say_none_on_any_text(stat, status):
    found = parse_counters(stat, status, status)
    if found is not None:
        assert all(v is None or 0 <= v < 1 << 63 for v in found)


def test_counters_agree_with_the_kernels_own_figures_for_this_process():
    """psutil reads the same files its own way: the oracle for the parse."""
    psutil = pytest.importorskip("psutil")
    end = time.monotonic() + 0.05
    while time.monotonic() < end:  # some CPU time to compare
        pass
    pid = os.getpid()
    mine = read_counters(pid, [pid])[pid]
    theirs = next(t for t in psutil.Process().threads() if t.id == pid)
    # Read a moment apart: the main thread ran between the two reads.
    assert abs(mine.utime / CLK_TCK - theirs.user_time) <= 0.05
    assert abs(mine.stime / CLK_TCK - theirs.system_time) <= 0.05
    with open(f"/proc/{pid}/io") as f:
        io = {k: int(v) for k, v in (line.split(": ") for line in f)}
    assert mine.io_bytes is not None and mine.io_bytes <= io["rchar"] + io["wchar"]
