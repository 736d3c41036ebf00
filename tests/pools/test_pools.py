"""Pools: usable CPUs against fake trees and shipped hosts with quotas, the
caps against what a child's torch, threadpoolctl and os report, the census
of a real process, throttling against a real quota'd cgroup, hostile
cpu.stat and pressure files, and the step clock against schedstat."""

import bisect
import errno
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpupin
from cpupin.host.shapes import HOSTS, build_tree, host_named
from cpupin.host.throttle import ThrottleProbe, parse_cpu_stat, parse_pressure
from cpupin.measure.sampling import Sampler
from cpupin.measure.stepclock import BUCKETS_S
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.census import FITS, FROM_HOST, OVERSUBSCRIBED, pool_name, verdict
from cpupin.pools.limits import POOL_VARS, cpu_plan, environment_advice, pool_env
from tests.support.cgroups import in_cgroup, quota_cgroup, throttle_file
from tests.support.helpers import proc_schedstat, run

CPU = "sys/devices/system/cpu"


def write(root, files):
    for rel, text in files.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def fmt(cpus):
    return cpupin.format_cpulist(frozenset(cpus))


# --- usable CPUs -----------------------------------------------------------


def tree(online, cpuset=None, quotas=(), v1=False, path="/job/step"):
    """Files of a host with ``online`` CPUs whose process sits in ``path``,
    with a quota (quota_us, period_us) a level, leaf first."""
    files = {f"{CPU}/online": fmt(online) + "\n"}
    if v1:
        files["proc/self/mounts"] = (
            "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n"
            "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n"
        )
        files["proc/self/cgroup"] = f"3:cpuset:{path}\n2:cpu,cpuacct:{path}\n"
        base, folder = "sys/fs/cgroup/cpu,cpuacct", path
        for quota, period in quotas:
            files[f"{base}{folder}/cpu.cfs_quota_us"] = f"{quota}\n"
            files[f"{base}{folder}/cpu.cfs_period_us"] = f"{period}\n"
            folder = os.path.dirname(folder)
        if cpuset is not None:
            files[f"sys/fs/cgroup/cpuset{path}/cpuset.effective_cpus"] = fmt(cpuset) + "\n"
    else:
        files["proc/self/mounts"] = "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"
        files["proc/self/cgroup"] = f"0::{path}\n"
        folder = path
        for quota, period in quotas:
            files[f"sys/fs/cgroup{folder}/cpu.max"] = f"{quota} {period}\n"
            folder = os.path.dirname(folder)
        if cpuset is not None:
            files[f"sys/fs/cgroup{path}/cpuset.cpus.effective"] = fmt(cpuset) + "\n"
        files[f"sys/fs/cgroup{path}/cgroup.procs"] = "1\n"
    return files


cpu_sets = st.frozensets(st.integers(0, 63), min_size=1, max_size=64)
quotas = st.lists(
    st.tuples(st.integers(1_000, 6_400_000), st.sampled_from([50_000, 100_000, 250_000])),
    max_size=2,
)


@given(cpu_sets, st.one_of(st.none(), cpu_sets), cpu_sets, quotas, cpu_sets, st.booleans())
def test_usable_cpus_is_mask_cpuset_online_under_the_strictest_quota_less_pinned(
    online, cpuset, mask, levels, pinned, v1
):
    with tempfile.TemporaryDirectory() as root:
        write(root, tree(online, cpuset, levels, v1))
        plan = cpu_plan(root=root, mask=mask, pinned=pinned)
    allowed = mask & online
    if cpuset is not None:
        allowed = allowed & cpuset or allowed
    cap = min((math.ceil(q / p) for q, p in levels), default=len(allowed))
    expected = max(1, max(1, min(len(allowed), cap)) - len(pinned & allowed))
    assert plan.mask == allowed and plan.pinned == pinned & allowed
    assert plan.usable_cpus == expected
    assert 1 <= plan.usable_cpus <= max(1, len(allowed))


@pytest.mark.parametrize("name", ["dgx-h100", "xeon6-b300"])
def test_usable_cpus_of_a_shipped_host_with_a_v2_quota_and_its_parents(tmp_path, name):
    """The shipped tree with a quota of 6.5 CPUs at the leaf and 4 at its
    parent: the parent's is the strictest; without a quota the host's CPUs."""
    host = host_named(name)
    root = build_tree(HOSTS[name], tmp_path)
    files = {
        "proc/self/mounts": "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "650000 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "400000 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
    }
    assert cpu_plan(root=root, mask=host.cpus, pinned=()).usable_cpus == len(host.cpus)
    write(root, files)
    plan = cpu_plan(root=root, mask=host.cpus, pinned={0, 1})
    assert plan.quota is not None and plan.quota.source.endswith("kubepods/pod1/cpu.max")
    assert plan.capacity == 4 and plan.usable_cpus == 2
    assert plan.usable_cpus == CpuPlan.for_host(cpupin.read_host(root), None, {0, 1}).usable_cpus


USABLE_HERE = """
import json, os, cpupin
cpus = sorted(cpupin.process_cpus())
before = cpupin.usable_cpus()
pin = cpupin.pin_current_thread({cpus[0]}, role="step")
print(json.dumps([len(os.sched_getaffinity(0)), len(cpus), before, cpupin.usable_cpus()]))
"""


def test_usable_cpus_of_a_real_process_under_a_real_quota(two_cpus):
    """In a cgroup whose quota is 1 CPU, a process whose mask has two: one
    usable CPU; outside it, the mask's CPUs, less one once a thread pins it.
    The oracles: the quota the test wrote, os.sched_getaffinity."""
    out = run([sys.executable, "-c", USABLE_HERE])
    assert out.returncode == 0, out.stderr
    _, mask, free, pinned = json.loads(out.stdout)
    assert mask == len(os.sched_getaffinity(0)) and free == mask and pinned == mask - 1
    with quota_cgroup(100_000) as (path, _):
        inside = subprocess.run(
            [sys.executable, "-c", USABLE_HERE], capture_output=True, text=True, timeout=60,
            check=False, preexec_fn=in_cgroup(path),
        )  # fmt: skip
    assert inside.returncode == 0, inside.stderr
    _, mask, free, pinned = json.loads(inside.stdout)
    assert mask >= 2 and free == 1 and pinned == 1  # never below one


# --- capping ---------------------------------------------------------------


def test_pool_env_follows_the_plans_shares_and_keeps_what_the_user_set():
    plan = CpuPlan(frozenset(range(16)), pinned=frozenset({0, 8, 15}))
    env, limits = pool_env(plan, {"OMP_NUM_THREADS": "32", "PATH": "/bin"}, host_cpus=16)
    assert env["OMP_NUM_THREADS"] == "32" and "oversubscribed" in limits.kept["OMP_NUM_THREADS"]
    assert limits.oversubscribed == ["OMP_NUM_THREADS"]  # what cpupin exec warns of
    assert env["MKL_NUM_THREADS"] == "13" and env["RAYON_NUM_THREADS"] == "6"
    assert env["PYTHON_CPU_COUNT"] == "13" and env["PATH"] == "/bin"
    recorded = dict(item.split("=") for item in env["CPUPIN_POOL_VARS"].split(","))
    assert "OMP_NUM_THREADS" not in recorded and recorded["MKL_NUM_THREADS"] == "13"
    # What cpupin set may be lowered by a narrower plan, never raised.
    narrower, _ = pool_env(CpuPlan(frozenset(range(4))), env)
    assert narrower["MKL_NUM_THREADS"] == "4" and narrower["OMP_NUM_THREADS"] == "32"
    wider, limits = pool_env(CpuPlan(frozenset(range(64))), narrower)
    assert wider["MKL_NUM_THREADS"] == "4" and "not raised" in limits.kept["MKL_NUM_THREADS"]


@given(st.dictionaries(st.sampled_from(sorted(POOL_VARS)), st.text(max_size=8)), cpu_sets)
def test_pool_env_never_changes_a_value_the_user_set(user, mask):
    env, limits = pool_env(CpuPlan(mask), user)
    for name, value in user.items():
        assert env[name] == value and name in limits.kept
    assert set(limits.set) | set(limits.kept) == set(POOL_VARS)


LIMIT_IN_PROCESS = """
import json, os, sys
import numpy, torch, threadpoolctl
import cpupin
from cpupin.plan.cpuplan import CpuPlan
if sys.argv[1] == "interop-started":
    torch.set_num_interop_threads(2)
torch.ones(64, 64) @ torch.ones(64, 64)
limits = cpupin.limit_pools(CpuPlan(frozenset({min(cpupin.process_cpus())})))
print(json.dumps({
    "torch": torch.get_num_threads(),
    "interop": torch.get_num_interop_threads(),
    "libs": {i["internal_api"]: i["num_threads"] for i in threadpoolctl.threadpool_info()},
    "env": {k: os.environ.get(k) for k in cpupin.pools.limits.POOL_VARS},
    "set": limits.set, "kept": limits.kept,
}))
"""


def needs_torch():
    """A check whose child process imports torch: skipped, with the reason,
    where torch is not installed (CI installs it, and fails on any skip)."""
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")


def limit_in_child(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    out = run([sys.executable, "-c", LIMIT_IN_PROCESS, *args], env={**clean, **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_limit_pools_caps_torch_every_library_and_the_environment():
    needs_torch()
    got = limit_in_child("fresh")
    assert got["torch"] == 1 and got["interop"] == 1
    assert got["libs"] and all(n == 1 for n in got["libs"].values()), got["libs"]
    assert all(v == "1" for v in got["env"].values()), got["env"]
    assert got["set"]["torch intra-op"] == 1 or "not raised" in got["kept"]["torch intra-op"]


def test_limit_pools_keeps_the_users_openmp_and_says_why_interop_stays():
    needs_torch()
    got = limit_in_child("interop-started", env={"OMP_NUM_THREADS": "2"})
    assert got["torch"] == 2 and got["env"]["OMP_NUM_THREADS"] == "2"
    assert "set by the user" in got["kept"]["torch intra-op"]
    assert "already started" in got["kept"]["torch inter-op"] and got["interop"] == 2
    assert got["env"]["PYTHON_CPU_COUNT"] == "1"


def test_server_plan_child_env_carries_the_caps_where_they_narrow(tmp_path):
    cpus = sorted(cpupin.process_cpus())
    plan = cpupin.plan_server("off", ["slot0"], mask=cpus, lock_dir=str(tmp_path), environ={})
    # Nothing pinned, no quota: every library counts the mask itself, so
    # nothing is set that an engine would take for the user's choice.
    env = plan.child_env({"PATH": "/bin"})
    if plan.cpu_plan.usable_cpus == len(cpus):
        assert not set(POOL_VARS) & set(env)
    else:  # a quota narrows this machine
        assert env["OMP_NUM_THREADS"] == str(plan.cpu_plan.pool_size())
    assert "OMP_NUM_THREADS" not in plan.child_env({"PATH": "/bin"}, pools=False)
    if len(cpus) < 2:
        return
    pinned = cpupin.plan_server(
        str(cpus[0]), ["slot1"], mask=cpus, lock_dir=str(tmp_path), environ={}
    )
    env = pinned.child_env({"PATH": "/bin"})
    assert pinned.cpu_plan.usable_cpus < len(cpus)
    assert env["OMP_NUM_THREADS"] == str(pinned.cpu_plan.pool_size())


@given(cpu_sets, st.integers(0, 4), st.integers(1, 4096))
def test_pool_env_sets_a_variable_only_where_it_narrows_what_its_readers_count(mask, pins, host):
    """The rule that keeps ``cpupin exec`` from slowing an engine that plans
    its own pools: a value equal to what a library counts unset is never set."""
    plan = CpuPlan(mask, pinned=frozenset(sorted(mask)[:pins]))
    host = max(host, len(mask))
    env, limits = pool_env(plan, {}, host_cpus=host)
    for name, share in POOL_VARS.items():
        counted = host if share == "usable" else len(mask)
        if plan.usable_cpus < counted:
            assert env[name] == str(limits.set[name])
            assert int(env[name]) <= plan.usable_cpus
        else:
            assert name not in env and "left unset" in limits.kept[name]


def test_environment_advice_names_the_unset_variables_that_count_the_host():
    plan = CpuPlan(frozenset(range(8)), pinned=frozenset({0, 1}))
    problems, advice = environment_advice(plan, 64, {}, python=(3, 13))
    assert any(p.startswith("OMP_NUM_THREADS unset: OpenMP counts 8") for p in problems)
    assert any(p.startswith("PYTHON_CPU_COUNT unset: os.cpu_count() counts 64") for p in problems)
    assert advice["OMP_NUM_THREADS"] == 6
    fine = {k: "1" for k in POOL_VARS}
    assert environment_advice(plan, 64, fine, python=(3, 13)) == ([], {})


# --- a real quota ------------------------------------------------------------


BUSY = """
import sys, threading, time
import cpupin
def spin():
    while True:
        pass
for i in range(2):
    cpupin.Thread(target=spin, name=f"busy{i}", daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_throttling_from_a_real_quota_is_told_from_contention():
    with quota_cgroup(20_000) as (path, oracle):  # 0.2 CPU for two busy threads
        child = subprocess.Popen(
            [sys.executable, "-c", BUSY],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=in_cgroup(path),
        )
        try:
            assert child.stdout.readline() == "ready\n"
            before = oracle()
            with Sampler(child.pid) as sampler:
                time.sleep(0.5)
            after = oracle()
            throttling = sampler.throttling
            assert throttling is not None and throttling.source.endswith("cpu.stat")
            assert throttling.throttled_periods > 0 and throttling.throttled_ms_per_s > 0
            assert throttling.throttled_periods <= after[1] - before[1]
            throttled_ns = round(throttling.throttled_ms_per_s * throttling.interval_s * 1e6)
            assert throttled_ns <= after[0] - before[0]  # within the oracle's wider window
            busy = [s for s in sampler.samples if s.cpu_ms_per_s > 50]
            assert busy and all(s.stall == "quota" for s in busy), sampler.samples
            top = run(
                [
                    sys.executable,
                    "-m",
                    "cpupin",
                    "top",
                    str(child.pid),
                    "--count",
                    "1",
                    "--interval",
                    "0.3",
                    "--json",
                ]
            )
            assert top.returncode == 0, top.stderr
            (sample,) = json.loads(top.stdout)["samples"]
            assert sample["throttled_ms_per_s"] > 0
            families = scrape(child.pid)
            (seconds,) = families["cpupin_cgroup_throttled_seconds"].samples
            (periods,) = families["cpupin_cgroup_throttled_periods"].samples
            assert seconds.value > 0 and periods.value > 0
            assert round(seconds.value * 1e9) <= oracle()[0]  # seconds as floats: to ns exactly
        finally:
            child.kill()
            child.wait()


def scrape(pid=None):
    """The collector's families for ``pid``, parsed as Prometheus would."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from cpupin.measure.metrics import ThreadCollector

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(ThreadCollector(pid))
    text = prometheus_client.generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_contention_without_a_quota_is_contention(two_cpus):
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ready\n"
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            os.sched_setaffinity(int(tid), {two_cpus[0]})  # three threads on one CPU
        with Sampler(child.pid) as sampler:
            time.sleep(0.4)
        busy = [s for s in sampler.samples if s.cpu_ms_per_s > 50]
        assert busy and all(s.stall == "contention" for s in busy), sampler.samples
        quota = sampler.throttling
        assert quota is not None and (quota.throttled_periods or 0) == 0
    finally:
        child.kill()
        child.wait()


CAPPED_CHILD = """
import json, os, torch, threadpoolctl
torch.ones(64, 64) @ torch.ones(64, 64)
print(json.dumps({
    "torch": torch.get_num_threads(),
    "libs": [i["num_threads"] for i in threadpoolctl.threadpool_info()],
    "cpu_count": os.cpu_count(),
    "python_cpu_count": os.environ.get("PYTHON_CPU_COUNT"),
    "affinity": len(os.sched_getaffinity(0)),
}))
"""


def test_exec_caps_a_childs_pools_to_the_quota(two_cpus):
    needs_torch()
    clean = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    with quota_cgroup(100_000) as (path, _):  # 1 CPU of the 2 in the mask

        def child(*flags):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "cpupin",
                    "exec",
                    "--node",
                    "0",
                    *flags,
                    "--",
                    sys.executable,
                    "-c",
                    CAPPED_CHILD,
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                env=clean,
                preexec_fn=in_cgroup(path),
            )
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        capped = child()
        assert capped["affinity"] >= 2 and capped["torch"] == 1
        assert capped["libs"] and all(n == 1 for n in capped["libs"])
        assert capped["python_cpu_count"] == "1"
        if sys.version_info >= (3, 13):
            assert capped["cpu_count"] == 1
        free = child("--no-pools")
        assert free["torch"] == free["affinity"] >= 2 and free["python_cpu_count"] is None


STEPS_UNDER_QUOTA = """
import json, time
import cpupin
clock = cpupin.StepClock("decode")
end = time.monotonic() + 0.6
while time.monotonic() < end:
    with clock.step():
        t = time.monotonic() + 0.005
        while time.monotonic() < t:
            pass
print(json.dumps({"source": clock.throttle_source, "throttled": clock.throttled_sum_ns,
                  "wait": clock.wait_sum_ns, "steps": clock.steps}))
"""


def test_step_clock_counts_the_quotas_throttling():
    with quota_cgroup(20_000) as (path, oracle):
        before = oracle()
        out = subprocess.run(
            [sys.executable, "-c", STEPS_UNDER_QUOTA],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            preexec_fn=in_cgroup(path),
        )
        after = oracle()
        expected = throttle_file(path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # The oracle is cpu.stat's counter, whichever file the clock read.
    assert got["source"] and got["source"].endswith("/" + expected)
    assert 0 < got["throttled"] <= after[0] - before[0]
    assert got["wait"] > 0  # throttled time is run-queue wait to the kernel too


# --- the census --------------------------------------------------------------

CENSUS_CHILD = """
import concurrent.futures as cf, json, multiprocessing as mp, os, sys, threading, time
import torch
import cpupin
torch.ones(256, 256) @ torch.ones(256, 256)  # the OpenMP pool
pool = cf.ThreadPoolExecutor()  # sized from os.cpu_count()
gate = threading.Barrier(pool._max_workers + 1)
for _ in range(pool._max_workers):
    pool.submit(gate.wait)
gate.wait()  # every worker started
pin = cpupin.pin_current_thread({min(cpupin.process_cpus())}, role="step")
q = mp.Queue()
q.put(1)  # its feeder thread starts here, from the pinned thread: it inherits the pin
time.sleep(0.2)
print(json.dumps(cpupin.census().as_dict()), flush=True)
sys.stdin.readline()
"""


def test_census_of_a_real_process_in_process_and_from_outside(tmp_path):
    needs_torch()
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    for name in POOL_VARS:
        env.pop(name, None)
    child = subprocess.Popen(
        [sys.executable, "-c", CENSUS_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        inside = json.loads(child.stdout.readline())
        pools = {p["name"]: p for p in inside["pools"]}
        host = os.cpu_count()
        executor = pools["ThreadPoolExecutor-0"]
        assert executor["threads"] == min(32, host + 4) and executor["verdict"] == FROM_HOST
        feeder = pools["QueueFeederThread"]
        assert feeder["threads"] == 1 and feeder["stray"] == 1
        assert pools["torch intra-op"]["kind"] == "configured"
        assert inside["usable_cpus"] == max(1, len(cpupin.process_cpus()) - 1)
        assert inside["pinned"] == [min(cpupin.process_cpus())]
        out = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"], env=env)
        assert out.returncode == 0, out.stderr
        outside = json.loads(out.stdout)
        assert outside["usable_cpus"] == inside["usable_cpus"]
        kernel = {p["name"]: p for p in outside["pools"]}
        assert kernel["main thread"]["threads"] == 1
        # The record names the executor and torch's pool: as inside.
        seen = kernel["ThreadPoolExecutor-0"]
        assert (seen["threads"], seen["verdict"], seen["guess"]) == (
            executor["threads"], executor["verdict"], False,
        )  # fmt: skip
        configured = kernel["torch intra-op"]
        assert configured["kind"] == "configured"
        assert configured["threads"] == pools["torch intra-op"]["threads"]
        big = max(outside["pools"], key=lambda p: p["threads"])
        assert big["threads"] >= executor["threads"] and big["verdict"] != FITS
        assert sum(p["stray"] for p in outside["pools"]) >= 1  # the feeder, from outside too
        text = run([sys.executable, "-m", "cpupin", "threads", str(child.pid)], env=env)
        assert "pools: " in text.stdout and big["verdict"] in text.stdout
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    "name, pool",
    [
        ("ThreadPoolExecutor-0_3", "ThreadPoolExecutor-0"),
        ("Thread-7 (worker)", "Thread (worker)"),
        ("pt_main_thread", "pt_main_thread"),
        ("ZMQbg/IO/0", "ZMQbg/IO"),
        ("cuda-EvtHandlr", "cuda-EvtHandlr"),
        ("7", "7"),
    ],
)
def test_pool_names(name, pool):
    assert pool_name(name) == pool


@given(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300))
def test_a_verdict_is_fits_exactly_when_the_threads_fit(threads, usable, host):
    got = verdict(threads, usable, {host})
    assert (got == FITS) == (threads <= usable)
    assert got != FROM_HOST or threads == host
    assert got in (FITS, OVERSUBSCRIBED, FROM_HOST)


# --- hostile files -------------------------------------------------------------


@given(st.text(max_size=300))
def test_cpu_stat_and_pressure_parse_or_say_why(text):
    for parse in (parse_cpu_stat, parse_pressure):
        try:
            value = parse(text)
        except ValueError as exc:
            assert str(exc)
            continue
        assert value is not None


@pytest.mark.parametrize(
    "make",
    ["fifo", "symlink-out", "huge", "digits", "garbage", "directory"],
)
def test_hostile_cpu_stat_and_pressure_under_a_root(tmp_path, make):
    root = tmp_path / "root"
    write(root, tree({0, 1}, quotas=[(50_000, 100_000)]))
    outside = tmp_path / "outside"
    outside.write_text("nr_periods 1\nnr_throttled 1\nthrottled_usec 999\n")
    for rel in ("sys/fs/cgroup/job/step/cpu.stat", "proc/pressure/cpu"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if make == "fifo":
            os.mkfifo(path)
        elif make == "symlink-out":
            path.symlink_to(outside)
        elif make == "huge":
            path.write_text("nr_periods 1\n" * 100_000)
        elif make == "digits":
            path.write_text(
                "nr_periods 1\nnr_throttled 1\nthrottled_usec " + "9" * 4000 + "\n"
                "some avg10=0 total=" + "9" * 4000 + "\n"
            )
        elif make == "garbage":
            path.write_bytes(os.urandom(2000))
        else:
            path.mkdir()
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(10)
    try:
        probe = ThrottleProbe(root=str(root)).start()
        got = probe.stop()
    finally:
        signal.alarm(0)
    assert got.throttled_ms_per_s is None and got.pressure_ms_per_s is None
    assert all(len(r) < 300 for r in probe.reasons)
    assert not any("999" in r for r in probe.reasons)


def test_pressure_of_the_cgroup_is_preferred_to_the_hosts(tmp_path):
    files = tree({0, 1})
    files["sys/fs/cgroup/job/step/cpu.pressure"] = "some avg10=0 avg60=0 avg300=0 total=5000\n"
    files["proc/pressure/cpu"] = "some avg10=0 avg60=0 avg300=0 total=1\n"
    root = write(tmp_path, files)
    probe = ThrottleProbe(root=root).start()
    Path(root, "sys/fs/cgroup/job/step/cpu.pressure").write_text(
        "some avg10=0 avg60=0 avg300=0 total=105000\nfull avg10=0 avg60=0 avg300=0 total=0\n"
    )
    got = probe.stop()
    assert got.pressure_ms_per_s == pytest.approx(100 / got.interval_s)


# --- the step clock ------------------------------------------------------------


def test_step_clock_wait_is_the_threads_own_schedstat(two_cpus):
    """A competitor on the step thread's CPU makes it wait; the steps' waits
    add up to schedstat's own count over the loop (marks chain: a step
    starts where the last ended), read in plain Python."""
    os.sched_setaffinity(0, {two_cpus[0]})
    stop = threading.Event()

    def compete():
        os.sched_setaffinity(0, {two_cpus[0]})
        while not stop.is_set():
            pass

    rival = threading.Thread(target=compete, daemon=True)
    rival.start()
    tid = threading.get_native_id()
    clock = cpupin.StepClock("t")
    try:
        before = proc_schedstat(tid)
        for _ in range(40):
            with clock.step():
                end = time.monotonic() + 0.002
                while time.monotonic() < end:
                    pass
        after = proc_schedstat(tid)
    finally:
        stop.set()
        rival.join()
    assert clock.steps == 40 and len(clock.recent()) == 40
    assert 0 < clock.wait_sum_ns <= after[1] - before[1]
    assert clock.wall_sum_ns > 0 and all(s.wall_ns > 0 for s in clock)
    buckets, total = clock.histogram()
    assert buckets[-1] == ("+Inf", 40) and total == clock.wait_sum_ns / 1e9
    # The C layer's buckets against Python's own count of the kept steps.
    bounds = [round(b * 1e9) for b in BUCKETS_S]
    expected = [0] * (len(bounds) + 1)
    for step in clock:
        expected[bisect.bisect_left(bounds, step.wait_ns)] += 1
    assert clock.wait_counts == expected
    assert sum(s.wait_ns for s in clock) == clock.wait_sum_ns
    pct = clock.percentiles()
    assert pct["wait_us"]["p50"] <= pct["wait_us"]["p99"]


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
@pytest.mark.parametrize("local", ["counter", "empty", "absent", "fifo", "other key"])
def test_step_clock_reads_the_local_throttled_counter_where_the_kernel_has_it(tmp_path, v1, local):
    """Beside the quota's cpu.stat, a cpu.stat.local that holds the
    throttled counter is what each mark reads; one without it (the
    controller off), missing, or not a regular file leaves cpu.stat. The
    figure of a step is the file's own difference (v2 in µs, v1 in ns),
    capped at the step's wall time."""
    folder = "sys/fs/cgroup/cpu,cpuacct/job/step" if v1 else "sys/fs/cgroup/job/step"
    key = "throttled_time" if v1 else "throttled_usec"
    unit = 1 if v1 else 1000

    def counters(stat, own):
        files = {f"{folder}/cpu.stat": f"nr_periods 9\nnr_throttled 9\n{key} {stat}\n"}
        if local == "counter":
            files[f"{folder}/cpu.stat.local"] = f"{key} {own}\n"
        elif local == "empty":
            files[f"{folder}/cpu.stat.local"] = ""
        elif local == "other key":
            files[f"{folder}/cpu.stat.local"] = f"nr_periods {own}\n"
        return files

    root = write(tmp_path, {**tree({0, 1}, None, [(150_000, 100_000)], v1), **counters(900, 5)})
    if local == "fifo":
        os.mkfifo(Path(root, folder, "cpu.stat.local"))
    clock = cpupin.StepClock("local", root=root)
    try:
        name = "cpu.stat.local" if local == "counter" else "cpu.stat"
        assert clock.throttle_source == f"/{folder}/{name}"
        clock.begin()
        write(root, counters(903, 6))  # cpu.stat moves by 3, the local counter by 1
        clock.end()
        step = clock.last
        moved = (1 if local == "counter" else 3) * unit
        assert step is not None and step.throttled_ns == min(moved, step.wall_ns)
        assert clock.throttle_lost is None
    finally:
        clock.close()


def test_step_clock_keeps_the_last_steps_and_calls_on_slow():
    slow = []
    clock = cpupin.StepClock(keep=10, slow_wait_us=0, on_slow=slow.append)
    for _ in range(25):
        clock.begin()
        clock.end()
    assert clock.steps == 25 and len(clock.recent()) == 10 and len(slow) == 25
    assert clock.last == clock.recent()[-1] == slow[-1]
    assert clock.last.throttled_ns is None or clock.throttle_source


def test_step_clock_measures_the_thread_that_made_it():
    from cpupin import _native

    box = []
    made = threading.Thread(target=lambda: box.append(cpupin.StepClock()))
    made.start()
    made.join()
    (clock,) = box
    # join() returns when Python is done with the thread, a moment before the
    # kernel's thread is gone: wait for the kernel (CI saw the tid still
    # listed under load), at most 10 s.
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{clock.tid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/task/{clock.tid}")
    # Used from another thread, it says so (it would time the maker), at
    # either mark, and records nothing.
    before = list(clock._state[0:20])
    for mark in (clock.begin, clock.end):
        with pytest.raises(RuntimeError, match=f"times tid {clock.tid}, the thread that made it"):
            mark()
    with pytest.raises(RuntimeError, match="the thread that made it"), clock:
        pass
    assert clock._begin() == clock._end() == _native.STEP_OTHER_THREAD
    assert list(clock._state[0:20]) == before and clock.steps == 0
    # A thread that takes the dead owner's identity (glibc hands a new
    # thread the stack, and so the pthread_t, of one that ended) passes the
    # check and gets the kernel's word: that thread is gone.
    _native.step_own(clock._state)
    assert clock._begin() == -errno.ESRCH
    with pytest.raises(ProcessLookupError, match=f"tid {clock.tid}, the thread this StepClock"):
        clock.begin()
    clock.close()
    mine = cpupin.StepClock()
    mine.close()
    with pytest.raises(RuntimeError, match="closed"):
        mine.begin()


def test_a_step_clock_refuses_a_mark_from_another_thread_while_its_owner_steps():
    """The owner's open step survives another thread's begin() and end():
    neither touches the clock, and the owner's end records the one step,
    whose run time is the owner's (its busy loop), not the intruder's."""
    from cpupin import _native

    clock = cpupin.StepClock()
    errors: list[RuntimeError] = []
    codes: list[int] = []

    def intrude() -> None:
        for mark in (clock.begin, clock.end, clock.begin):
            try:
                mark()
            except RuntimeError as e:
                errors.append(e)
        codes.append(clock._end())  # the raw mark's code

    with clock:
        before = list(clock._state[0:20])
        intruder = threading.Thread(target=intrude)
        intruder.start()
        intruder.join()
        assert list(clock._state[0:20]) == before
        cpu0 = time.thread_time_ns()
        while time.thread_time_ns() - cpu0 < 20_000_000:  # 20 ms on this thread's CPU
            pass
    assert len(errors) == 3 and codes == [_native.STEP_OTHER_THREAD]
    assert all(f"this is tid {intruder.native_id}" in str(e) for e in errors)
    assert clock.steps == 1
    # The owner's CPU time in the step: its busy loop, less at most the
    # tick by which schedstat's count lags thread_time_ns's (same counter,
    # brought up to date at ticks and switches; HZ >= 100).
    assert clock.last is not None and clock.last.run_ns >= 20_000_000 - 10_000_000
    clock.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"keep": 0}, ValueError),
        ({"keep": True}, ValueError),
        ({"keep": 1 << 30}, ValueError),
        ({"slow_wait_us": -1}, ValueError),
        ({"slow_wait_us": float("nan")}, ValueError),
        ({"on_slow": 3}, TypeError),
    ],
)
def test_step_clock_refuses_bad_arguments_naming_them(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        cpupin.StepClock(**kwargs)


def test_step_clock_after_fork():
    """The forking thread's clock goes on in the child with the child's
    schedstat; another thread's clock refuses."""
    mine = cpupin.StepClock("main")
    box = []
    other = threading.Thread(target=lambda: box.append(cpupin.StepClock("other")))
    other.start()
    other.join()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with mine.step():
                pass
            if mine.tid != threading.get_native_id():
                code = 3
            try:
                box[0].begin()
                code = 4
            except RuntimeError:
                pass
        except BaseException:  # noqa: BLE001
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_step_clock_histogram_reaches_prometheus():
    clock = cpupin.StepClock("prom")
    for _ in range(7):
        with clock.step():
            pass
    families = scrape()
    counts = [
        s.value
        for s in families["cpupin_step_wait_seconds"].samples
        if s.name.endswith("_count") and s.labels["clock"] == "prom"
    ]
    assert counts == [7]
    assert families["cpupin_usable_cpus"].samples[0].value == cpupin.usable_cpus()


@pytest.mark.parametrize("pools", ["cap", "leave"])
def test_the_example_runtime_times_its_steps_with_pools_capped_or_left(tmp_path, pools):
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    env["CPUPIN_LOCK_DIR"] = str(tmp_path)
    runtime = Path(__file__).resolve().parents[2] / "examples" / "runtime.py"
    out = run(
        [
            sys.executable,
            str(runtime),
            "--setting",
            "off",
            "--steps",
            "60",
            "--pools",
            pools,
            "--json",
        ],
        env=env,
    )
    assert out.returncode == 0, out.stderr
    (clock,) = json.loads(out.stdout)["step_clocks"]
    assert clock["steps"] == 60 and clock["wait_us"]["p50"] <= clock["wait_us"]["p99"]


TORCH_PER_THREAD = r"""
import json, os, threading, time, torch, cpupin
from cpupin.pools.census import census

torch.set_num_threads(3)
torch.get_num_threads()  # the main thread's own count is now 3 (torch reads it lazily)
made = threading.Event()
done = threading.Event()
out = {}

def step_thread():
    torch.set_num_threads(1)  # what an engine sets on its step thread
    out["tid"] = threading.get_native_id()
    clock = cpupin.StepClock()
    with clock.step():
        torch.ones(4).sum()
    made.set()
    done.wait()

def read(into):
    into.append({p.name: p for p in census().pools}["torch intra-op"])

t = cpupin.Thread(target=step_thread)
t.start()
made.wait()
before = []
read(before)  # asked from the main thread, whose own count is 3
other = []
reader = cpupin.Thread(target=read, args=(other,))
reader.start(); reader.join()
done.set(); t.join()
while os.path.exists(f"/proc/self/task/{out['tid']}"):
    time.sleep(0.001)  # join() returns a moment before the kernel drops the tid
after = []
read(after)  # the step thread has gone: the caller's own count again
print(json.dumps({
    "tid": out["tid"], "main": torch.get_num_threads(),
    "seen": [before[0].threads, list(before[0].tids)],
    "other": [other[0].threads, list(other[0].tids)],
    "after": [after[0].threads, list(after[0].tids)],
}))
"""


def test_the_census_reads_torch_on_the_thread_that_steps():
    # libgomp keeps torch's count per thread: the census must give the step
    # thread's count whichever thread asks, and say which thread it read.
    needs_torch()
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    out = run([sys.executable, "-c", TORCH_PER_THREAD], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["main"] == 3  # the oracle: the main thread's own count differs
    assert got["seen"] == [1, [got["tid"]]]
    assert got["other"] == [1, [got["tid"]]]
    assert got["after"] == [3, []]
