"""Threads and processes under faults: ids out of range, reused pids and tids,
a process out of descriptors, and a cpuset that shrinks while it runs."""

import json
import logging
import os
import subprocess
import sys
import threading
import uuid

import pytest

import cpupin
from cpupin import _native
from cpupin.measure import sampling
from cpupin.process import mask as process_mask
from cpupin.threads import thread as threads
from tests.support.helpers import run_python, sleeper_on

BAD_IDS = [-1, 1 << 22, 2**31, 2**31 + 5, 2**64, 2**64 + 1, 1 << 20000]
IDS = ["-1", "2^22", "2^31", "2^31+5", "2^64", "2^64+1", "2^20000"]


@pytest.mark.parametrize("tid", BAD_IDS, ids=IDS)
def test_a_tid_past_the_kernels_range_is_refused_before_any_native_call(tid):
    words = _native._nwords
    for call in (
        lambda: cpupin.get_affinity(tid),
        lambda: cpupin.set_affinity({0}, tid),
        lambda: cpupin.schedstat(tid),
    ):
        with pytest.raises(ValueError, match="is not a thread id") as info:
            call()
        assert len(str(info.value)) < 200
    assert _native._nwords == words  # no cached buffer grew


@pytest.mark.parametrize("pid", [0, *BAD_IDS], ids=["0", *IDS])
def test_a_pid_past_the_kernels_range_is_refused(pid):
    for call in (
        lambda: cpupin.thread_stats(pid),
        lambda: cpupin.schedstat(1, pid=pid),
        lambda: cpupin.Sampler(pid),
    ):
        with pytest.raises(ValueError, match="is not a process id") as info:
            call()
        assert len(str(info.value)) < 200


def test_thread_stats_out_of_descriptors_raises_emfile_never_a_short_list():
    """With every descriptor taken, a read raises EMFILE; with one free it
    reads open-read-close; it never drops threads and answers."""
    out = run_python("""
        import errno, os, resource, threading, json
        import cpupin
        stop = threading.Event()
        for _ in range(12):
            threading.Thread(target=stop.wait, daemon=True).start()
        expected = sorted(int(t) for t in os.listdir("/proc/self/task"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        results = []
        for free in (2, 3, 5):  # the reader itself needs two
            while len(held) > 64 - free - 8:
                os.close(held.pop())
            while True:
                try:
                    held.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            for _ in range(free):
                os.close(held.pop())
            try:
                got = [s.tid for s in cpupin.thread_stats(os.getpid())]
                results.append("ok" if got == expected else f"short {len(got)}")
            except OSError as exc:
                results.append(errno.errorcode[exc.errno])
            cpupin._native._readers.clear()
        print(json.dumps(results))
        stop.set()
    """)
    results = json.loads(out)
    assert set(results) <= {"ok", "EMFILE"}, results
    assert results[0] == "EMFILE" and results[-1] == "ok", results


def test_thread_stats_of_a_process_that_exited_raises_never_answers_empty():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        cpupin.thread_stats(child.pid)


# --- reused tids: a Pin acts only on its own thread ------------------------


def test_a_pin_released_after_its_thread_exited_leaves_a_reusing_child_alone(two_cpus):
    """The pin's tid is made to name a child process, as a reused tid would:
    release must not touch the child's mask."""
    box = {}

    def pinned():
        box["pin"] = cpupin.pin_current_thread({two_cpus[0]})

    t = cpupin.Thread(target=pinned)
    t.start()
    t.join()
    pin = box["pin"]
    with sleeper_on(two_cpus[1]) as child:
        pin.tid = child.pid  # the tid now names a task outside this process
        pin.previous = frozenset({two_cpus[0]})
        pin.release()
        assert os.sched_getaffinity(child.pid) == {two_cpus[1]}


def test_a_pin_released_from_another_thread_restores_a_live_thread(two_cpus):
    ready, done = threading.Event(), threading.Event()
    box = {}

    def pinned():
        box["pin"] = cpupin.pin_current_thread({two_cpus[0]})
        box["tid"] = threading.get_native_id()
        ready.set()
        done.wait()

    before = os.sched_getaffinity(0)
    t = cpupin.Thread(target=pinned)
    t.start()
    ready.wait()
    assert os.sched_getaffinity(box["tid"]) == {two_cpus[0]}
    box["pin"].release()  # from the main thread: the tid is still its thread
    assert os.sched_getaffinity(box["tid"]) == before
    done.set()
    t.join()


# --- reused pids: sampling stops -------------------------------------------


def test_sampling_stops_when_the_pid_names_another_process(monkeypatch):
    starts = iter([100, 200])
    monkeypatch.setattr(sampling, "start_time", lambda pid: next(starts))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = cpupin.Sampler(child.pid).start()
        with pytest.raises(ProcessLookupError, match="now names another process"):
            sampler.stop()
    finally:
        child.kill()
        child.wait()


def test_sampling_a_process_that_exits_midway_raises():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    sampler = cpupin.Sampler(child.pid).start()
    child.wait()
    with pytest.raises(ProcessLookupError, match=f"pid {child.pid}"):
        sampler.stop()


def test_cpupin_top_of_a_process_that_exits_says_so_in_one_line():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    reaper = threading.Thread(target=child.wait)  # reaped as it exits: gone, not a zombie
    reaper.start()
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", "top", str(child.pid), "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    reaper.join()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"pid {child.pid}" in out.stderr and len(out.stderr.splitlines()) == 1


# --- a cpuset that changes at run time -------------------------------------


def test_a_thread_whose_process_mask_is_no_longer_allowed_still_runs(monkeypatch, caplog):
    """Simulated: the process mask names a CPU the kernel refuses."""
    refused = lambda: frozenset({0, 5000})  # noqa: E731
    monkeypatch.setattr(threads, "process_cpus", refused)
    monkeypatch.setattr(process_mask, "process_cpus", refused)  # to_process_mask's
    # No words for C can name an offline CPU: a new thread takes the checked
    # way, as it does when C finds the kernel kept less than the mask (the
    # real cpuset test below).
    monkeypatch.setattr(process_mask, "process_words", None)
    monkeypatch.setattr(process_mask, "_warned", set())
    ran = []
    with caplog.at_level(logging.WARNING, logger="cpupin"):
        for _ in range(3):
            t = cpupin.Thread(target=lambda: ran.append(os.sched_getaffinity(0)))
            t.start()
            t.join()
        with cpupin.ThreadPool(2) as pool:
            assert pool.submit(lambda: 7).result() == 7
    assert ran == [{0}] * 3
    warnings = [r for r in caplog.records if "no longer allows" in r.getMessage()]
    assert len(warnings) == 1 and "refresh_process_cpus" in warnings[0].getMessage()


CGROUP_V1 = "/sys/fs/cgroup/cpuset"
CGROUP_V2 = "/sys/fs/cgroup"


def make_cpuset():
    """A fresh cpuset cgroup (v1 or v2) with CPUs 0-1 and memory node 0, or
    pytest.skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    name = f"cpupin-test-{uuid.uuid4().hex[:8]}"
    if os.path.exists(f"{CGROUP_V1}/cpuset.cpus"):
        path, cpus, procs = f"{CGROUP_V1}/{name}", "cpuset.cpus", "cgroup.procs"
    elif os.path.exists(f"{CGROUP_V2}/cgroup.controllers"):
        with open(f"{CGROUP_V2}/cgroup.controllers") as f:
            if "cpuset" not in f.read().split():
                pytest.skip("cgroup v2 without the cpuset controller")
        try:
            with open(f"{CGROUP_V2}/cgroup.subtree_control", "w") as f:
                f.write("+cpuset")
        except OSError as exc:
            pytest.skip(f"cannot enable the cpuset controller: {exc}")
        path, cpus, procs = f"{CGROUP_V2}/{name}", "cpuset.cpus", "cgroup.procs"
    else:
        pytest.skip("no cpuset cgroup hierarchy mounted")
    try:
        os.mkdir(path)
        with open(f"{path}/{cpus}", "w") as f:
            f.write("0-1")
        if os.path.exists(f"{path}/cpuset.mems"):
            with open(f"{path}/cpuset.mems", "w") as f:
                f.write("0")
    except OSError as exc:
        pytest.skip(f"cannot create a cpuset cgroup at {path}: {exc}")
    return path, f"{path}/{cpus}", f"{path}/{procs}"


CHILD = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import cpupin
PROCESS_MASK
print("ready", flush=True)
sys.stdin.readline()  # the parent shrinks the cpuset now
out = {}
box = []
t = cpupin.Thread(target=lambda: box.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
out["thread"] = box[0]
with cpupin.ThreadPool(2) as pool:
    out["pool"] = pool.submit(lambda: sorted(os.sched_getaffinity(0))).result()
out["refreshed"] = sorted(cpupin.refresh_process_cpus())
t = cpupin.Thread(target=lambda: box.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
out["after_refresh"] = box[-1]
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize(
    "process_mask, left, starts_on",
    [
        ("", [1], [1]),  # what is left of the process mask
        ("cpupin.set_process_cpus({0})", [1], [1]),  # none of it: the inherited mask
    ],
)
def test_threads_started_after_the_cpuset_shrank_run_their_work(process_mask, left, starts_on):
    path, cpus_file, procs = make_cpuset()
    child = None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.replace("PROCESS_MASK", process_mask)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with open(procs, "w") as f:
            f.write(str(child.pid))
        assert child.stdout.readline().strip() == "ready"
        with open(cpus_file, "w") as f:
            f.write(",".join(map(str, left)))
        out, err = child.communicate("go\n", timeout=60)
        assert child.returncode == 0, err
        result = json.loads(out)
        assert result["thread"] == starts_on
        assert result["pool"] == starts_on
        assert result["refreshed"] == left and result["after_refresh"] == left
        assert err.count("no longer allows the whole process mask") == 1, err
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        try:
            os.rmdir(path)
        except OSError:
            pass
