"""The census from outside: a process that keeps a record names its pools
there, so that `cpupin threads PID` sees them as the process does; other
threads that only inherited their creator's name are grouped by what they
wait in, and such a pool says it is a guess."""

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.pools.census import census, pool_name
from cpupin.registry._fields import pool_list
from cpupin.registry._record import MAX_POOL_TIDS
from tests.support.helpers import ready_child, run

# A one-process runtime as the issue describes it, on cpupin's parts: a
# plain loader thread, a tokenizer pool, a step thread pinned to the last
# CPU that puts on a queue (its feeder starts from the pinned thread), a
# result thread that takes from it.
RUNTIME = """
import json, sys, threading
import cpupin
cpus = sorted(cpupin.process_cpus())
stop = threading.Event()
loader = threading.Thread(target=stop.wait, name="loader")
loader.start()
tokens = cpupin.Queue()
tok = cpupin.ThreadPool(2, thread_name_prefix="tokenizer")
gate = threading.Barrier(3)
futures = [tok.submit(gate.wait) for _ in range(2)]
gate.wait()
stepping = threading.Event()
def step():
    with cpupin.pin_step_thread({cpus[-1]}, name="step"):
        tokens.put("token")
        stepping.set()
        stop.wait()
def result():
    tokens.get()
    stop.wait()
threads = [cpupin.Thread(target=step, name="step"), cpupin.Thread(target=result, name="result")]
for t in threads:
    t.start()
stepping.wait()  # the feeder started (and was named, and recorded) within put()
print("ready", flush=True)
print(json.dumps(cpupin.census().as_dict()), flush=True)
sys.stdin.readline()
stop.set()
"""


def _by_name(census_dict):
    return {p["name"]: p for p in census_dict["pools"]}


def test_a_runtime_with_a_record_is_seen_from_outside_as_from_inside(tmp_path):
    child = ready_child(RUNTIME, tmp_path)
    try:
        inside = _by_name(json.loads(child.stdout.readline()))
        out = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"],
                  env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)})  # fmt: skip
        assert out.returncode == 0, out.stderr
        outside = _by_name(json.loads(out.stdout))
    finally:
        child.communicate("\n", timeout=30)
    for name in ("main thread", "loader", "tokenizer", "step", "result", "QueueFeederThread"):
        assert name in inside, (name, sorted(inside))
    assert inside["tokenizer"]["threads"] == 2
    assert inside["QueueFeederThread"]["stray"] == 0  # cpupin.Queue moved it off the pin
    # Every pool the process sees, from outside with the same threads and verdict.
    for name, pool in inside.items():
        if pool["kind"] != "threads":
            continue
        seen = outside.get(name)
        assert seen is not None, (name, sorted(outside))
        assert (seen["threads"], sorted(seen["tids"]), seen["verdict"]) == (
            pool["threads"], sorted(pool["tids"]), pool["verdict"],
        ), name  # fmt: skip
        assert seen["guess"] is False
    assert not [p for p in outside.values() if p["guess"]]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 names its threads itself")
def test_without_a_record_an_unnamed_thread_is_a_guess(tmp_path):
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path), "CPUPIN_REGISTRY": "0"}
    child = subprocess.Popen(
        [sys.executable, "-c", RUNTIME], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "ready\n"
        child.stdout.readline()
        out = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"], env=env)
    finally:
        child.communicate("\n", timeout=30)
    assert out.returncode == 0, out.stderr
    outside = _by_name(json.loads(out.stdout))
    # cpupin's threads carry their names in the kernel; the plain loader
    # carries only the process's name, so it is grouped as a guess.
    assert {"tokenizer", "step", "result"} <= set(outside)
    guessed = [p for p in outside.values() if p["guess"]]
    assert guessed and all("[" in p["name"] for p in guessed)


WAITERS = """
import os, sys, threading, time
stop = threading.Event()
r, w = os.pipe()
ts = [threading.Thread(target=stop.wait) for _ in range(2)]
ts.append(threading.Thread(target=time.sleep, args=(600,), daemon=True))
ts.append(threading.Thread(target=os.read, args=(r, 1), daemon=True))
for t in ts:
    t.start()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
"""


def _wchan_groups(pid):
    """The oracle: the threads that carry the process's own name, grouped
    by the wchan that /proc shows."""
    task = f"/proc/{pid}/task"

    def read(tid, what):
        with open(f"{task}/{tid}/{what}") as f:
            return f.read().strip()

    main = read(pid, "comm")
    groups = {}
    for tid in os.listdir(task):
        if int(tid) != pid and read(tid, "comm") == main:
            wait = read(tid, "wchan")
            groups.setdefault("running" if wait == "0" else wait, set()).add(int(tid))
    return main, groups


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 names its threads itself")
def test_unnamed_threads_are_grouped_by_what_they_wait_in(tmp_path):
    """On a busy host a thread may not have reached its wait when the child
    says ready, or be woken for a moment: the census is compared with the
    oracle read around it once all four wait and none moved meanwhile
    (waiting on that condition, never on a time)."""
    child = ready_child(WAITERS, tmp_path)
    try:
        deadline = time.monotonic() + 120  # a bound on the wait, not a verdict
        while time.monotonic() < deadline:
            main, before = _wchan_groups(child.pid)
            if "running" in before or sum(map(len, before.values())) != 4:
                time.sleep(0.005)
                continue  # one has not reached its wait yet
            found = census(child.pid)
            _, after = _wchan_groups(child.pid)
            if before == after:
                break
        text = run([sys.executable, "-m", "cpupin", "threads", str(child.pid)])
    finally:
        child.communicate("\n", timeout=30)
    assert before == after and "running" not in before, "the waiters never settled"
    got = {p.name: set(p.tids) for p in found.pools if p.guess}
    assert got == {f"{pool_name(main)} [{w}]": tids for w, tids in before.items()}
    assert sum(len(t) for t in got.values()) == 4
    assert {p.name for p in found.pools if not p.guess} == {"main thread"}
    # Two threads wait on an Event: a pool of two, listed and marked.
    assert "(guessed)" in text.stdout and "guessed: threads that only carry" in text.stdout


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-5, 1 << 40) | st.text(max_size=80),
        lambda inner: (
            st.lists(inner, max_size=6)
            | st.dictionaries(
                st.sampled_from(["name", "kind", "threads", "tids", "x"]), inner, max_size=5
            )
        ),
        max_leaves=30,
    )
)
def test_a_records_pools_parse_or_say_why(value):
    try:
        pools = pool_list(value)
    except ValueError as exc:
        assert str(exc)
        return
    assert sum(len(p.tids) for p in pools) <= MAX_POOL_TIDS
    for p in pools:
        assert p.kind in ("threads", "configured") and 0 <= p.threads <= 1 << 20
        assert all(0 < t for t in p.tids) and p.name.isprintable()


def test_a_record_that_lists_too_many_thread_ids_is_refused():
    pool = {"name": "big", "kind": "threads", "threads": 600, "tids": list(range(1, 601))}
    with pytest.raises(ValueError, match="at most 512"):
        pool_list([pool])
    assert pool_list([{**pool, "tids": list(range(1, 513))}])[0].threads == 600


# The newcomer's runtime as it was walked: no pin, `limit_pools()`, a queue a
# host CPU on a narrower mask. Its record (written by limit_pools) puts it in
# `ps`, and its feeders, one a queue, are never "sized from the host".
NEWCOMER = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import cpupin
cpupin.limit_pools()
queues = [cpupin.Queue() for _ in range(os.cpu_count())]
for q in queues:
    q.put(1)
for q in queues:
    q.get()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_runtime_that_only_limits_its_pools_is_listed_and_its_feeders_judged_right(tmp_path):
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    child = ready_child(NEWCOMER, tmp_path)
    try:
        ps = run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval", "0.05"], env=env)
        threads = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"],
                      env=env)  # fmt: skip
    finally:
        child.communicate("\n", timeout=30)
    assert ps.returncode == 0 and threads.returncode == 0, ps.stderr + threads.stderr
    (proc,) = [p for p in json.loads(ps.stdout)["processes"] if p["pid"] == child.pid]
    assert any(n.startswith("limit_pools(): usable CPUs 1") for n in proc["notes"]), proc["notes"]
    feeders = _by_name(json.loads(threads.stdout))["QueueFeederThread"]
    assert feeders["threads"] == os.cpu_count() and not feeders["guess"]
    assert feeders["verdict"] == "fits" and feeders["remedy"] is None  # one a queue: no pool
    assert feeders["usable_cpus"] == 1
