"""The outside view judges the target, not the caller: its cgroup's quota
and weight, its record, its OpenMP binding, and what its threads wanted.

Real cgroups (v1 or v2, whichever this machine mounts with the cpu
controller) hold real processes; the kernel's figures (the cgroup's files,
``schedstat``) are the oracle. A contended process is made for real: a
computing thread in a cgroup of a tenth of the default weight shares one
CPU with a computing thread in a cgroup of the default, so it waits nine
tenths of the time, with no quota to throttle it. (Not less: schedstat adds
a thread's wait when it next runs, so one that hardly ever runs shows none.)
"""

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.host.cgroup import Weight
from cpupin.measure.demand import CONTENDED_MS_PER_S, Demand, demand_of
from tests.support.cgroups import in_cgroup, quota_cgroup
from tests.support.helpers import proc_schedstat
from tests.support.probe import build_probe

ROOT = Path(__file__).resolve().parents[2]


def _cpupin(*args, env=None):
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    return out


def _json(*args, env=None, rc=0):
    out = _cpupin(*args, env=env)
    assert out.returncode == rc, out.stderr
    return json.loads(out.stdout)


@contextmanager
def _started(cmd, preexec=None, env=None):
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=preexec,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        first = proc.stdout.readline()
        assert first == "ready\n", first
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _both(*steps):
    def run():
        for step in steps:
            step()

    return run


# The target's cgroup --------------------------------------------------------


def test_doctor_pid_reads_the_targets_quota_and_weight_not_its_own(tmp_path):
    """A process in a cgroup of half a CPU and a low weight: doctor --pid
    says its quota and weight (the caller runs in another cgroup), and
    judges its pools by the one CPU the quota pays for."""
    probe = build_probe(tmp_path)
    with quota_cgroup(50_000, 100_000, weight=50) as (path, _):
        with _started([probe, "sleeper"], preexec=in_cgroup(path)) as child:
            data = _json("doctor", "--pid", str(child.pid), "--json", "--irq-interval", "0")
            oracle_v1 = Path(path, "cpu.cfs_quota_us")
            assert data["quota"] is not None, data["quota"]
            assert data["quota"]["quota_us"] == 50_000 and data["quota"]["period_us"] == 100_000
            process = data["process"]
            assert process["cgroup"].endswith(Path(path).name), process["cgroup"]
            weight = process["weight"]
            expected = 50 * 1024 // 100 if oracle_v1.exists() else 50
            assert weight["value"] == expected and weight["value"] < weight["default"], weight
            assert data["pools"]["usable_cpus"] == 1


def test_a_target_that_limited_its_own_pools_is_not_told_to(tmp_path):
    """Under a 1-CPU quota a process started with no pool variables runs
    host-sized pools: doctor --pid says what to set. One that called
    cpupin.limit_pools() (its record says so) is told it sized them itself."""
    code = textwrap.dedent(
        """
        import sys
        import cpupin
        if sys.argv[1] == "limits":
            cpupin.limit_pools()
            cpupin.pin_current_thread(cpupin.process_cpus(), role="main").release()
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    with quota_cgroup(100_000, 100_000) as (path, _):
        said = {}
        for mode in ("plain", "limits"):
            proc = subprocess.Popen(
                [sys.executable, "-c", code, mode], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, preexec_fn=in_cgroup(path),
                env={**clean, "CPUPIN_LOCK_DIR": str(tmp_path)},
            )  # fmt: skip
            try:
                assert proc.stdout.readline() == "ready\n"
                said[mode] = _json(
                    "doctor", "--pid", str(proc.pid), "--json", "--irq-interval", "0",
                    env={"CPUPIN_LOCK_DIR": str(tmp_path)},
                )  # fmt: skip
            finally:
                proc.kill()
                proc.wait()
    plain, limited = said["plain"], said["limits"]
    assert plain["pools"]["usable_cpus"] == 1
    assert plain["pools"]["set"].get("OMP_NUM_THREADS") == 1, plain["pools"]
    assert limited["process"]["limited"], limited["process"]
    assert limited["pools"]["set"] == {}, limited["pools"]
    problems = limited["pools"]["problems"]
    assert problems[0].startswith("it sized its pools itself (its record: limit_pools()")
    # Nothing tells it to set a variable: only what its record and OpenMP say.
    assert all(p.startswith(("it sized", "OpenMP keeps", "its record lists")) for p in problems)


# Contention without a quota -------------------------------------------------


@pytest.fixture
def contended(tmp_path):
    """A computing thread in a cgroup of a tenth of the default weight,
    sharing one CPU with one in a cgroup of the default: yields (its
    process, its cgroup's weight as the kernel holds it)."""
    probe = build_probe(tmp_path)
    cpu = min(os.sched_getaffinity(0))
    with quota_cgroup(None, weight=10) as (low, _), quota_cgroup(None, weight=100) as (high, _):
        on_cpu = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731
        with _started([probe, "compute"], preexec=_both(in_cgroup(high), on_cpu)):
            with _started([probe, "compute"], preexec=_both(in_cgroup(low), on_cpu)) as child:
                shares = Path(low, "cpu.shares")
                value = int((shares if shares.exists() else Path(low, "cpu.weight")).read_text())
                yield child, value


def _runnable_ns(pid):
    """Every thread of ``pid``: run + run-queue wait so far (schedstat), the
    figures the tools read, read here as the oracle."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        run, wait, _ = proc_schedstat(tid, pid)
        total += run + wait
    return total


def _bracket(pid):
    """The oracle's reading and the monotonic clock, read back to back."""
    return _runnable_ns(pid), time.monotonic_ns()


# "Wanted" is a rate of schedstat's figures, and the kernel adds a waiting
# thread's wait only when it next runs: a thread of a tenth of one CPU's
# weight on a loaded host can wait a second or more unaccounted, so its
# rate over any interval may read well above or below 1 (1.26 over 0.5 s
# and 1.63 over 2 s were seen under load). The tests therefore read the
# same figures themselves just before and just after each of the tool's
# readings: the tool's rate must lie between the rates those allow, on any
# host, however loaded.
DEMAND_S = 2.0


def test_top_says_what_a_contended_process_wanted_and_the_request_that_covers_it(contended):
    child, weight = contended
    ran_before = _runnable_ns(child.pid)
    data = _json("top", str(child.pid), "--count", "1", "--interval", str(DEMAND_S), "--json")
    ran_after = _runnable_ns(child.pid)
    (sample,) = data["samples"]
    demand = sample["demand"]
    # The oracle: schedstat's figures for the computing thread, as sampled.
    (busy,) = [t for t in sample["threads"] if t["name"] == "compute"]
    assert busy["wait_ms_per_s"] > busy["cpu_ms_per_s"], busy  # it waited, mostly
    assert demand["throttled"] is False and demand["contended"] is True, demand
    assert demand["weight"]["value"] == weight
    wanted = demand["wanted_cpus"]
    # Its two readings lie inside this command's run and at least the
    # interval apart: no more than everything it could have seen, over that;
    # more than nothing, since a fair scheduler runs the thread within 2 s.
    assert 0 < wanted <= (ran_after - ran_before) / 1e9 / DEMAND_S + 0.01, demand
    threads = sum(t["cpu_ms_per_s"] + t["wait_ms_per_s"] for t in sample["threads"]) / 1000
    assert wanted == pytest.approx(threads, abs=0.01), (demand, sample["threads"])
    assert demand["request_cpus"] == min(1, math.ceil(round(wanted * 10, 6)) / 10)
    remedy = demand["remedy"]
    assert f"resources.requests.cpu: {round(demand['request_cpus'] * 1000)}m" in remedy
    assert "no quota throttled them" in remedy
    assert any(line.startswith("stalled by contention: its threads wanted") for line in
               sample["remedies"])  # fmt: skip


def test_doctor_pid_and_prometheus_say_the_same_of_a_contended_process(contended):
    pytest.importorskip("prometheus_client")
    from cpupin.measure.metrics import ThreadCollector

    child, weight = contended
    data = _json("doctor", "--pid", str(child.pid), "--json", "--irq-interval", "0")
    demand = data["process"]["demand"]
    assert demand["contended"] and not demand["throttled"], demand
    assert "resources.requests.cpu" in demand["remedy"]

    collector = ThreadCollector(child.pid)

    def families():
        return {f.name: f for f in collector.collect()}

    a1 = _bracket(child.pid)
    first = families()
    b1 = _bracket(child.pid)
    assert not first["cpupin_process_wanted_cpus"].samples  # no interval yet
    (w,) = first["cpupin_cgroup_cpu_weight"].samples
    assert w.value == weight and w.labels["file"] in ("cpu.shares", "cpu.weight")
    time.sleep(DEMAND_S)
    a2 = _bracket(child.pid)
    (wanted,) = families()["cpupin_process_wanted_cpus"].samples
    b2 = _bracket(child.pid)
    # The collector read the figures and the clock between a and b of each
    # scrape: its rate lies between the least and the most those allow.
    least = (a2[0] - b1[0]) / (b2[1] - a1[1])
    most = (b2[0] - a1[0]) / (a2[1] - b1[1])
    assert least - 1e-9 <= wanted.value <= most + 1e-9, (least, wanted, most)


# The pure demand ----------------------------------------------------------


def _sample(tid, cpu, wait):
    return SimpleNamespace(tid=tid, cpu_ms_per_s=cpu, wait_ms_per_s=wait)


ms = st.floats(0, 1000, allow_nan=False)


@given(
    st.lists(st.tuples(ms, ms), max_size=20),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 64)),
    st.one_of(st.none(), st.integers(2, 262144)),
)
def test_the_demand_is_the_sum_of_what_each_thread_wanted(threads, throttled, usable, shares):
    weight = None if shares is None else Weight(shares, 1024, "cpu.shares")
    samples = [_sample(i + 1, c, w) for i, (c, w) in enumerate(threads)]
    d = demand_of(samples, throttled=throttled, weight=weight, usable_cpus=usable, step_tid=1)
    assert d.wanted_cpus == pytest.approx(sum(c + w for c, w in threads) / 1000)
    if usable is None or d.wanted_cpus <= usable:
        assert d.wanted_cpus - 1e-6 <= d.request_cpus < d.wanted_cpus + 0.1 + 1e-9
    else:
        assert d.request_cpus == usable  # no request beyond the CPUs it may use
    waited = sum(w for _, w in threads)
    assert d.contended == (not throttled and waited >= CONTENDED_MS_PER_S - 1e-9 * len(threads))
    remedy = d.remedy()
    assert (remedy is None) == (not d.contended)
    if remedy is not None:
        if usable is not None and d.wanted_cpus >= usable + 0.5:
            assert "fewer busy threads" in remedy and "request of" not in remedy
        elif shares is not None and shares != 1024 and shares / 1024 >= d.wanted_cpus - 0.05:
            assert "already covers that" in remedy
        else:
            assert f"request of {d.request_cpus:g}" in remedy
    assert (d.step is None) == (not threads)
    json.dumps(d.as_dict())


def test_the_docs_example_is_what_the_demand_says():
    """docs/pools.md shows the contention finding: it is this text."""
    d = Demand(2.0, 1.1, False, Weight(2048, 1024, "/sys/fs/cgroup/cpu/k/cpu.shares"), 4)
    said = "stalled by contention: " + d.remedy()
    text = (ROOT / "docs" / "pools.md").read_text()
    block = text.split("```text\nstalled by contention:", 1)[1].split("```", 1)[0]
    assert " ".join(("stalled by contention:" + block).split()) == said


# OpenMP binding and limits, on torch's libgomp ----------------------------

COLLAPSE = textwrap.dedent(
    """
    import sys, threading
    import torch
    x = torch.rand(1_000_000)
    (x * x).sum()  # the team starts
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.parametrize(
    "binding, collapses",
    [({"OMP_PROC_BIND": "TRUE"}, True), ({"OMP_PLACES": "{0:2}", "OMP_PROC_BIND": "TRUE"}, False)],
)
def test_an_openmp_binding_that_collapses_a_process_is_a_finding(binding, collapses, tmp_path):
    pytest.importorskip("torch")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a collapse onto one CPU needs a mask of two CPUs or more")
    cpus = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in binding.items()}
    if "OMP_PLACES" in env:
        env["OMP_PLACES"] = f"{{{cpus[0]}:{len(cpus)}}}"  # the whole mask: no collapse
    env["CPUPIN_LOCK_DIR"] = str(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    proc = subprocess.Popen(
        [sys.executable, "-c", COLLAPSE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**clean, **env},
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        # The kernel's own answer: the main thread's mask and that of the
        # thread started after the import (the team's workers have theirs).
        masks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")}
        later = masks[max(masks)]
        assert (masks[proc.pid] == later == {cpus[0]}) is collapses, masks
        threads = _json("threads", str(proc.pid), "--json", "--interval", "0")
        audit = _cpupin("audit", str(proc.pid), "--json", "--fail-on-narrow")
        doctor = _json("doctor", "--pid", str(proc.pid), "--json", "--irq-interval", "0")
    finally:
        proc.kill()
        proc.wait()
    found = threads["openmp_collapse"]
    assert (found is not None) is collapses, found
    assert (json.loads(audit.stdout)["openmp_collapse"] is not None) is collapses
    assert (audit.returncode == 3) is collapses, audit.stderr
    assert (doctor["process"]["openmp_collapse"] is not None) is collapses
    if collapses:
        assert "OMP_PROC_BIND" in found["what"], found
        assert "OMP_PROC_BIND=false" in found["remedy"] and "OMP_PLACES" in found["remedy"]
        assert "start them from an unpinned thread" not in json.dumps(threads)


LIMITS = textwrap.dedent(
    """
    import json, os, threading
    import torch
    import cpupin

    def tasks():
        return {int(t) for t in os.listdir("/proc/self/task")}

    cpupin.limit_pools()
    a = torch.rand(600, 600)

    def team(key, apply=False):
        # The threads a thread's OpenMP team adds, as the kernel lists them
        # (torch.get_num_threads() answers from torch's own global, not the
        # team this thread would start).
        if apply:
            cpupin.apply_thread_limits()
        before = tasks()
        for _ in range(3):
            a @ a
            x = torch.rand(4_000_000)
            (x * x).sum()
        said[key] = len(tasks() - before)

    said = {}
    team("main")
    for key, cls, apply in (("plain", threading.Thread, False),
                            ("cpupin.Thread", cpupin.Thread, False),
                            ("plain, applied", threading.Thread, True)):
        t = cls(target=team, args=(key, apply))
        t.start()
        t.join()
    pool = cpupin.ThreadPool(1)
    pool.submit(team, "cpupin.ThreadPool").result()
    pool.shutdown()
    said["host"] = len(cpupin.process_cpus())
    said["census"] = [
        (p.name, p.threads, p.verdict, p.remedy) for p in cpupin.census().pools
        if p.name.endswith(" in threads not limited")
    ]
    print(json.dumps(said))
    """
)


def test_openmps_limit_is_per_thread_and_cpupins_threads_carry_it(tmp_path):
    """Measured on torch's libgomp, under a quota of one CPU in a mask of
    two: limit_pools() limits the calling thread; a plain thread runs the
    default team; cpupin.Thread, ThreadPool and apply_thread_limits() carry
    the limit."""
    pytest.importorskip("torch")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a limit below the default team needs a mask of two CPUs or more")
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    with quota_cgroup(100_000, 100_000) as (path, _):
        out = subprocess.run(
            [sys.executable, "-c", LIMITS], capture_output=True, text=True, check=False,
            preexec_fn=in_cgroup(path), env={**clean, "CPUPIN_LOCK_DIR": str(tmp_path)},
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    # A team of one adds no thread; the default team, one a CPU of the mask.
    assert said["main"] == 0, said
    assert said["plain"] == said["host"] - 1 >= 1, said
    assert said["cpupin.Thread"] == said["cpupin.ThreadPool"] == said["plain, applied"] == 0
    # The census counts the default team any other thread would start.
    assert said["census"], said
    for _, threads, verdict, remedy in said["census"]:
        assert threads == said["host"] and verdict != "fits", said["census"]
        assert "cpupin.Thread" in remedy or "apply_thread_limits" in remedy, remedy
