"""Guarding pins: drift found against the kernel's masks, its likely cause
named, the pin re-applied, and the count seen from outside; with a real C
call moving a pinned thread, and with the real libgomp binding one."""

import json
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpupin
from cpupin.threads.guard import AFFINITY_VARS, likely_cause
from tests.support.helpers import ready_child, run


def mask_of(pid, tid):
    """The oracle: the kernel's own list of a thread's CPUs."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    return cpupin.parse_cpulist(line.split(":", 1)[1].strip())


@given(
    st.dictionaries(
        st.sampled_from([*AFFINITY_VARS, "NCCL_DEBUG", "PATH"]),
        st.sampled_from(["", "false", "FALSE", "true", "0", "0-3", "spread"]),
    ),
    st.booleans(),
)
def test_the_likely_cause_follows_what_is_set(environ, nccl_loaded):
    now, mask = frozenset({0}), frozenset({0, 1})
    cause = likely_cause(now, mask, environ, nccl_loaded)
    named = [k for k in AFFINITY_VARS if environ.get(k, "").strip().lower() not in ("", "false")]
    if named:
        assert all(k in cause for k in named) and "OpenMP" in cause
    elif nccl_loaded or "NCCL_DEBUG" in environ:
        assert "NCCL_IGNORE_CPU_AFFINITY=1" in cause
    else:
        assert "another library" in cause
    assert likely_cause(mask, mask, {}, False).startswith("moved back")


def test_a_guard_needs_a_sane_interval():
    for bad in (0, -1, 1e9, "1", float("nan")):
        with pytest.raises(ValueError, match="interval"):
            cpupin.guard_pins(bad)


MOVED_BY_C = """
import json, sys, threading
import cpupin
from cpupin import _native
a, b = sorted(cpupin.process_cpus())[:2]
ready, done = threading.Event(), threading.Event()
tid = []
def step():
    pin = cpupin.pin_current_thread({a}, role="step")
    tid.append(cpupin.gettid())
    ready.set()
    done.wait()
    print(json.dumps({"check": str(pin.check())}), flush=True)
t = cpupin.Thread(target=step, name="step")
t.start()
ready.wait()
print("ready", flush=True)
sys.stdin.readline()                      # the test reads the kernel's masks
_native.set_affinity({b}, tid[0])         # a C call of sched_setaffinity from another thread
print(json.dumps({"tid": tid[0]}), flush=True)
sys.stdin.readline()
drifts = cpupin.check_pins(reapply=True)
print(json.dumps([[d.tid, sorted(d.pinned), sorted(d.now), d.cause, d.reapplied] for d in drifts]),
      flush=True)
sys.stdin.readline()
print(json.dumps({"again": len(cpupin.check_pins()), "total": cpupin.threads.guard.drift_total()}),
      flush=True)
sys.stdin.readline()
done.set()
t.join()
"""


def test_a_pin_moved_by_a_c_call_is_found_named_and_pinned_back(tmp_path, two_cpus):
    a, b = two_cpus
    child = ready_child(MOVED_BY_C, tmp_path)
    try:
        child.stdin.write("\n")
        child.stdin.flush()
        tid = json.loads(child.stdout.readline())["tid"]
        assert mask_of(child.pid, tid) == {b}  # moved, as the kernel says
        child.stdin.write("\n")
        child.stdin.flush()
        (drift,) = json.loads(child.stdout.readline())
        assert drift[:3] == [tid, [a], [b]] and drift[4] is True
        assert "another library or tool" in drift[3]
        assert mask_of(child.pid, tid) == {a}  # pinned back
        env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
        audit = json.loads(run([sys.executable, "-m", "cpupin", "audit", str(child.pid),
                                "--json"], env=env).stdout)  # fmt: skip
        ps = json.loads(run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval",
                             "0.05"], env=env).stdout)  # fmt: skip
        child.stdin.write("\n")
        child.stdin.flush()
        after = json.loads(child.stdout.readline())
        child.stdin.write("\n")
        child.stdin.flush()
        last = json.loads(child.stdout.readline())
    finally:
        child.communicate("\n", timeout=30)
    assert after == {"again": 0, "total": 1}
    assert last == {"check": "None"}  # Pin.check() on its own thread: back on its pin
    assert audit["pin_drift"] == 1 and audit["off_pin"] == []
    (proc,) = [p for p in ps["processes"] if p["pid"] == child.pid]
    assert proc["pin_drift"]["total"] == 1 and f"tid {tid}" in proc["pin_drift"]["last"]


OFF_PIN_NOW = """
import sys, threading
import cpupin
from cpupin import _native
a, b = sorted(cpupin.process_cpus())[:2]
ready = threading.Event()
def step():
    pin = cpupin.pin_current_thread({a}, role="step")
    _native.set_affinity({b})
    ready.set()
    threading.Event().wait()
cpupin.Thread(target=step, name="step", daemon=True).start()
ready.wait()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_audit_names_a_registered_pin_found_elsewhere(tmp_path, two_cpus):
    a, b = two_cpus
    child = ready_child(OFF_PIN_NOW, tmp_path)
    try:
        env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
        data = json.loads(run([sys.executable, "-m", "cpupin", "audit", str(child.pid),
                               "--json"], env=env).stdout)  # fmt: skip
        text = run([sys.executable, "-m", "cpupin", "audit", str(child.pid)], env=env).stdout
    finally:
        child.communicate("\n", timeout=30)
    (off,) = data["off_pin"]
    assert off["pinned"] == [a] and off["mask"] == [b]
    assert "its pin drifted" in text and "cpupin.guard_pins()" in text


GOMP = """
import json, sys, threading
import cpupin
a, b = sorted(cpupin.process_cpus())[:2]
found, moved = [], threading.Event()
def on_drift(d):
    found.append([d.tid, sorted(d.pinned), sorted(d.now), d.cause, d.reapplied])
    moved.set()
guard = cpupin.guard_pins(0.05, on_drift=on_drift)
out = {}
def step():
    cpupin.pin_current_thread({b}, role="step")
    out["tid"] = cpupin.gettid()
    import torch  # libgomp loads here, and binds this thread to GOMP_CPU_AFFINITY's CPU
    torch.ones(64, 64) @ torch.ones(64, 64)
    moved.wait(60)
    for _ in range(200):  # the guard pinned it back: the kernel says so
        if cpupin.get_affinity() == {b}:
            break
        threading.Event().wait(0.01)
    out["after"] = sorted(cpupin.get_affinity())
t = cpupin.Thread(target=step, name="step")
t.start()
t.join()
guard.stop()
print(json.dumps({**out, "found": found, "checks": guard.checks}), flush=True)
"""


def test_the_guard_pins_back_a_thread_that_libgomp_bound(tmp_path, two_cpus):
    pytest.importorskip("torch", reason="pip install torch==2.13.0")
    a, b = two_cpus
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path), "GOMP_CPU_AFFINITY": str(a)}
    out = run([sys.executable, "-c", GOMP], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["found"], got
    tid, pinned, now, cause, reapplied = got["found"][0]
    assert (tid, pinned, now, reapplied) == (got["tid"], [b], [a], True)
    assert f"GOMP_CPU_AFFINITY={a}" in cause
    assert got["after"] == [b] and got["checks"] >= 1


@pytest.mark.parametrize("moment", ["between judgement and re-apply", "after the re-apply"] * 4)
def test_a_pin_released_while_the_guard_judges_it_is_never_pinned_again(
    two_cpus, monkeypatch, moment, tmp_path
):
    """The guard judges a pin off its CPUs, then, before it re-applies it,
    the thread releases it (its mask back to what it had). Forced at that
    exact point (the guard's first look, outside the pins' lock that release
    takes): the guard neither re-pins the released thread nor counts a
    drift. Released after the re-apply, the thread gets its mask back."""
    import threading

    from cpupin.threads import pins as table

    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    first, second = two_cpus
    ready, release, done = threading.Event(), threading.Event(), threading.Event()
    box = {}

    def worker():
        box["tid"] = threading.get_native_id()
        box["before"] = os.sched_getaffinity(0)
        box["pin"] = cpupin.pin_current_thread({first}, role="step")
        os.sched_setaffinity(0, {second})  # drift: off its pin
        ready.set()
        release.wait(30)
        done.wait(30)

    t = threading.Thread(target=worker)
    t.start()
    ready.wait(30)
    real = table._drift
    looks = []

    def judged_then_released(*args):
        found = real(*args)
        looks.append(found)
        if len(looks) == 1 and moment.startswith("between") and found is not None:
            box["pin"].release()  # the thread lets go between judgement and re-apply
        return found

    monkeypatch.setattr(table, "_drift", judged_then_released)
    total = cpupin.threads.guard.drift_total()
    try:
        drifts = cpupin.check_pins(reapply=True)
        if moment.startswith("between"):
            assert drifts == [] and cpupin.threads.guard.drift_total() == total
        else:
            assert [d.reapplied for d in drifts] == [True]
            assert mask_of(os.getpid(), box["tid"]) == {first}
            box["pin"].release()
        assert mask_of(os.getpid(), box["tid"]) == box["before"]
    finally:
        release.set()
        done.set()
        t.join(30)
