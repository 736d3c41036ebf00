"""The native layer against independent oracles: threading, os and /proc."""

import errno
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cpupin
from cpupin import _native
from tests.support.helpers import (
    in_forked_child,
    parked_threads,
    proc_comm,
    proc_last_cpu,
    proc_schedstat,
    proc_tids,
)


def run_in_threads(fn, count=8):
    """Run ``fn`` in ``count`` threads at once; return their results."""
    results = [None] * count
    errors = []
    barrier = threading.Barrier(count)

    def body(i):
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


# --- gettid ----------------------------------------------------------------


def test_gettid_is_the_native_id_in_every_thread():
    assert cpupin.gettid() == threading.get_native_id()
    pairs = run_in_threads(lambda: (cpupin.gettid(), threading.get_native_id(), cpupin.gettid()))
    assert all(a == b == c for a, b, c in pairs)
    assert len({a for a, _, _ in pairs}) == len(pairs)


def test_gettid_in_a_forked_child_is_the_childs():
    cpupin.gettid()  # cache the parent's
    assert in_forked_child(lambda: cpupin.gettid() == os.getpid() == threading.get_native_id())


# --- getcpu ----------------------------------------------------------------


def test_getcpu_is_the_cpu_the_thread_is_pinned_to():
    for cpu in sorted(os.sched_getaffinity(0)):
        cpupin.set_affinity({cpu})
        os.sched_yield()
        assert cpupin.getcpu() == cpu
        assert proc_last_cpu(threading.get_native_id()) == cpu


def test_getcpu_in_threads_pinned_apart(two_cpus):
    def pinned(cpu):
        cpupin.set_affinity({cpu})
        os.sched_yield()
        return cpupin.getcpu(), proc_last_cpu(threading.get_native_id())

    got = run_in_threads(lambda: pinned(two_cpus[threading.get_native_id() % 2]), count=6)
    assert all(a == b and a in two_cpus for a, b in got)


# --- affinity --------------------------------------------------------------


def test_get_affinity_matches_os_for_self_and_other_threads():
    assert cpupin.get_affinity() == os.sched_getaffinity(0)
    with parked_threads(4) as tids:
        for tid in tids:
            assert cpupin.get_affinity(tid) == os.sched_getaffinity(tid)
    got = run_in_threads(lambda: (cpupin.get_affinity(), os.sched_getaffinity(0)))
    assert all(a == b for a, b in got)


def test_get_affinity_returns_a_frozenset():
    assert type(cpupin.get_affinity()) is frozenset


def test_set_affinity_pins_the_calling_thread_only(two_cpus):
    first, second = two_cpus
    with parked_threads(1) as (other,):
        before = os.sched_getaffinity(other)
        cpupin.set_affinity({first})
        assert os.sched_getaffinity(0) == {first}
        assert cpupin.get_affinity() == {first}
        assert os.sched_getaffinity(other) == before
        cpupin.set_affinity([second])
        assert os.sched_getaffinity(0) == {second}


def test_set_affinity_of_another_thread_by_tid(two_cpus):
    first, _ = two_cpus
    seen = {}
    go = threading.Event()
    done = threading.Event()

    def target():
        seen["tid"] = threading.get_native_id()
        go.wait()
        os.sched_yield()
        seen["mask"] = os.sched_getaffinity(0)
        seen["cpu"] = cpupin.getcpu()
        done.set()

    t = threading.Thread(target=target)
    t.start()
    while "tid" not in seen:
        os.sched_yield()
    cpupin.set_affinity({first}, tid=seen["tid"])
    assert cpupin.get_affinity(seen["tid"]) == {first}
    go.set()
    t.join()
    assert seen["mask"] == {first}
    assert seen["cpu"] == first


@pytest.mark.parametrize("cpus", ["0-1", range(2), (0, 1), [1, 0], {0, 1}])
def test_set_affinity_takes_any_iterable_or_a_cpulist(cpus):
    if os.sched_getaffinity(0) != {0, 1}:
        pytest.skip("needs CPUs 0 and 1")
    cpupin.set_affinity(cpus)
    assert os.sched_getaffinity(0) == {0, 1}


@pytest.mark.parametrize(
    "cpus, says",
    [
        (set(), "empty"),
        ({-1}, "-1"),
        ({True}, "True"),
        ([0, False], "False"),
        ({1.0}, "1.0"),
        (["0"], "'0'"),
        (5, "5"),
        ("0-", "'0-'"),
    ],
)
def test_set_affinity_refuses_what_is_not_a_set_of_cpus(cpus, says):
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError) as info:
        cpupin.set_affinity(cpus)
    assert says in str(info.value)
    assert os.sched_getaffinity(0) == before


def test_set_affinity_names_an_offline_cpu_and_the_online_list():
    before = os.sched_getaffinity(0)
    online = cpupin.format_cpulist(cpupin.online_cpus())
    for cpu in (max(cpupin.online_cpus()) + 1, 1023, 1024, 4095, 4096):
        with pytest.raises(ValueError) as info:
            cpupin.set_affinity({0, cpu})
        assert f"CPU {cpu} " in str(info.value)
        assert online in str(info.value)
    assert os.sched_getaffinity(0) == before


def test_set_affinity_refuses_a_bad_tid():
    for tid in (-1, True, "1", 1.0):
        with pytest.raises(ValueError, match="tid"):
            cpupin.set_affinity({0}, tid=tid)
        with pytest.raises(ValueError, match="tid"):
            cpupin.get_affinity(tid)


def gone_tid():
    """The tid of a thread that has exited. join() returns once the thread's
    Python state is done, a moment before the kernel task ends: wait for the
    task to go from /proc too."""
    box = []
    t = threading.Thread(target=lambda: box.append(threading.get_native_id()))
    t.start()
    t.join()
    for _ in range(100000):
        if not os.path.exists(f"/proc/self/task/{box[0]}"):
            return box[0]
        time.sleep(0.0001)
    raise AssertionError(f"thread {box[0]} never left /proc/self/task")


def test_affinity_of_a_gone_thread_is_processlookuperror_naming_it():
    tid = gone_tid()
    with pytest.raises(ProcessLookupError, match=f"tid {tid}"):
        cpupin.get_affinity(tid)
    with pytest.raises(ProcessLookupError, match=f"tid {tid}"):
        cpupin.set_affinity({0}, tid=tid)


@pytest.fixture
def set_size():
    """Sets the CPU-set size in words the native layer starts from."""
    saved = _native._nwords

    def use(nwords):
        _native._nwords = nwords
        _native._encoded.clear()
        _native._forget_thread_state()

    yield use
    use(saved)


def test_a_cpu_set_too_small_for_the_kernel_grows_on_einval(set_size):
    set_size(0)  # refused with EINVAL as a set smaller than the kernel's is
    assert cpupin.get_affinity() == os.sched_getaffinity(0)
    assert _native._nwords >= 1
    set_size(0)
    cpupin.set_affinity({0})
    assert os.sched_getaffinity(0) == {0}


@pytest.mark.parametrize("nwords", [1, 16, 64, 257, 1024])
def test_cpu_sets_sized_for_hosts_of_up_to_65536_cpus(set_size, nwords):
    """Sets of 64 to 65536 CPUs (the heap past 16384) read and write alike."""
    set_size(nwords)
    assert cpupin.get_affinity() == os.sched_getaffinity(0)
    cpupin.set_affinity({0})
    assert cpupin.get_affinity() == {0} == os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="CPU 5000 is not online"):
        cpupin.set_affinity({0, 5000})


def test_get_affinity_decodes_masks_past_the_first_word():
    """Masks of several words decode to their CPUs (the kernel cannot give
    this machine one, so the decoder is checked directly)."""
    key = (0b101, 0, 1 << 63, 1)
    assert _native._key_set(key) == {0, 2, 191, 192}
    assert _native._key_set(1 << 63 | 1) == {0, 63}


# --- schedstat -------------------------------------------------------------


def test_schedstat_of_a_parked_thread_is_what_proc_says():
    with parked_threads(3) as tids:
        for tid in tids:
            assert tuple(cpupin.schedstat(tid)) == proc_schedstat(tid)
            assert tuple(cpupin.schedstat(tid, pid=os.getpid())) == proc_schedstat(tid)


def test_schedstat_of_the_calling_thread_moves_forward():
    tid = threading.get_native_id()
    before = proc_schedstat(tid)
    mine = cpupin.schedstat()
    after = proc_schedstat(tid)
    for b, m, a in zip(before, mine, after):
        assert b <= m <= a


def test_schedstat_of_a_gone_thread_names_it():
    tid = gone_tid()
    with pytest.raises(ProcessLookupError, match=f"tid {tid}"):
        cpupin.schedstat(tid)


def test_schedstat_refuses_tid_0_of_another_process():
    with pytest.raises(ValueError, match="calling thread"):
        cpupin.schedstat(0, pid=1)
    with pytest.raises(ValueError, match="pid"):
        cpupin.schedstat(1, pid=-3)


# --- thread_stats ----------------------------------------------------------


def check_against_proc(stats, parked, pid="self"):
    by_tid = {s.tid: s for s in stats}
    for tid in parked:
        s = by_tid[tid]
        assert (s.run_ns, s.wait_ns, s.timeslices) == proc_schedstat(tid, pid)
        assert s.name == proc_comm(tid, pid)
        if s.last_cpu is not None:
            assert s.last_cpu == proc_last_cpu(tid, pid)


@pytest.mark.parametrize("count", [3, 70, 200])
def test_thread_stats_lists_every_thread_as_proc_does(count):
    with parked_threads(count) as tids:
        for last_cpu in (False, True, False):
            stats = cpupin.thread_stats(last_cpu=last_cpu)
            assert [s.tid for s in stats] == proc_tids()
            check_against_proc(stats, tids)
            assert all((s.last_cpu is None) != last_cpu for s in stats)
    assert all(isinstance(s, cpupin.ThreadStat) for s in stats)


def test_thread_stats_drops_threads_that_exit_and_finds_new_ones():
    with parked_threads(5) as first:
        assert set(first) <= {s.tid for s in cpupin.thread_stats()}
    with parked_threads(5, name="second") as second:
        stats = cpupin.thread_stats()
        assert [s.tid for s in stats] == proc_tids()
        assert not set(first) & {s.tid for s in stats} or set(first) & set(second)
        check_against_proc(stats, second)


def test_thread_stats_while_threads_come_and_go_never_raises():
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    churners = [threading.Thread(target=churn) for _ in range(2)]
    for t in churners:
        t.start()
    try:
        for _ in range(300):
            stats = cpupin.thread_stats(last_cpu=True)
            assert threading.get_native_id() in {s.tid for s in stats}
    finally:
        stop.set()
        for t in churners:
            t.join()


def test_thread_stats_reads_names_as_they_change():
    with parked_threads(1) as (tid,):
        first = {s.tid: s.name for s in cpupin.thread_stats()}[tid]
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write("renamed-thread")
        second = {s.tid: s.name for s in cpupin.thread_stats()}[tid]
    assert first != "renamed-thread"
    assert second == "renamed-thread"


def test_thread_stats_of_another_process():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading,sys; e=threading.Event(); "
            "[threading.Thread(target=e.wait, daemon=True).start() for _ in range(3)]; "
            "print(flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()
        stats = cpupin.thread_stats(child.pid, last_cpu=True)
        assert [s.tid for s in stats] == proc_tids(child.pid)
        assert stats[0].tid == child.pid
    finally:
        child.stdin.close()
        child.wait()
    with pytest.raises(ProcessLookupError, match=f"pid {child.pid}"):
        cpupin.thread_stats(child.pid)


def test_thread_stats_refuses_a_bad_pid():
    for pid in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="pid"):
            cpupin.thread_stats(pid)


SCRIPT_LOW_FD_LIMIT = """
import resource, threading, os, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import cpupin
release = threading.Event()
threads = [threading.Thread(target=release.wait) for _ in range(60)]
for t in threads: t.start()
for _ in range(3):
    stats = cpupin.thread_stats(last_cpu=True)
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    assert [s.tid for s in stats] == tids, (len(stats), len(tids))
fds = len(os.listdir("/proc/self/fd"))
release.set()
for t in threads: t.join()
assert fds <= 48 // 8 + 8, fds
print("ok")
"""


def test_thread_stats_keeps_to_its_share_of_the_open_files_limit():
    """Past its descriptor budget a read opens and closes; nothing is lost."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT_LOW_FD_LIMIT], capture_output=True, text=True, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_thread_stats_in_a_forked_child_reads_the_childs_threads():
    cpupin.thread_stats()  # opens this process's reader
    assert in_forked_child(lambda: [s.tid for s in cpupin.thread_stats()] == [os.getpid()])


# --- process mask ----------------------------------------------------------


SCRIPT_IMPORT_FROM_PINNED_THREAD = """
import os, threading
box = {}
def worker():
    os.sched_setaffinity(0, {0})
    import cpupin
    box["process"] = cpupin.process_cpus()
t = threading.Thread(target=worker); t.start(); t.join()
import cpupin
os.sched_setaffinity(0, {1})
print(sorted(box["process"]), sorted(cpupin.process_cpus()))
"""


def test_process_cpus_is_the_main_threads_mask_at_import(two_cpus):
    if set(two_cpus) != {0, 1}:
        pytest.skip("needs CPUs 0 and 1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT_IMPORT_FROM_PINNED_THREAD],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split("] [")[0] + "]" == str(sorted(os.sched_getaffinity(0)))
    assert out.stdout.strip().endswith(str(sorted(os.sched_getaffinity(0))))


def test_set_process_cpus_overrides_and_validates():
    saved = cpupin.process_cpus()

    def new_thread_mask():
        box = []
        t = cpupin.Thread(target=lambda: box.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        return box[0]

    try:
        assert cpupin.set_process_cpus("0") == {0}
        assert cpupin.process_cpus() == {0}
        assert new_thread_mask() == {0}  # the words a new thread takes moved too
        for bad, says in ((set(), "empty"), ({100000}, "100000"), ([True], "True")):
            with pytest.raises(ValueError, match=says):
                cpupin.set_process_cpus(bad)
        assert cpupin.process_cpus() == {0}
        assert new_thread_mask() == {0}
    finally:
        cpupin.set_process_cpus(saved)
    assert new_thread_mask() == saved


def test_raise_oserror_picks_the_subclass_and_names_the_thread():
    for err, kind in ((errno.ESRCH, ProcessLookupError), (errno.EPERM, PermissionError)):
        with pytest.raises(kind, match="tid 42"):
            _native.raise_oserror(-err, "tid 42")


def test_open_files_budget_is_a_fraction_of_the_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 0 <= _native._fd_budget() <= max(soft // 8, 8192)


# --- a pin's calls in one: swap_affinity --------------------------------------


def test_swap_affinity_moves_and_returns_the_mask_it_had(two_cpus):
    """The mask it returns is the one os read just before (the oracle); the
    mask it leaves is the one asked; threads beside it are untouched."""
    first, second = two_cpus
    with parked_threads(1) as (other,):
        beside = os.sched_getaffinity(other)
        before = os.sched_getaffinity(0)
        assert _native.swap_affinity(frozenset({first})) == before
        assert os.sched_getaffinity(0) == {first}
        assert _native.swap_affinity(frozenset({second})) == {first}
        assert os.sched_getaffinity(0) == {second}
        assert _native.swap_affinity(frozenset(before)) == {second}
        assert os.sched_getaffinity(other) == beside


def test_swap_affinity_refuses_an_offline_cpu_and_moves_nothing():
    before = os.sched_getaffinity(0)
    top = max(cpupin.online_cpus()) + 1
    with pytest.raises(ValueError, match=f"CPU {top} "):
        _native.swap_affinity(frozenset({0, top}))
    assert os.sched_getaffinity(0) == before


CPUSET_CUT = r"""
import os, sys
from cpupin import _native
sys.stdin.readline()  # moved meanwhile into a cpuset of the first CPU only
try:
    _native.swap_affinity(frozenset({int(sys.argv[1]), int(sys.argv[2])}))
except ValueError as exc:
    print(exc)
"""


def _cpuset_mount():
    """Where a cpuset cgroup can be made: ("v1", mount) or ("v2", mount)."""
    v2 = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] == "cgroup" and "cpuset" in parts[3].split(","):
                return "v1", parts[1]
            if parts[2] == "cgroup2":
                try:
                    if "cpuset" in Path(parts[1], "cgroup.controllers").read_text().split():
                        v2 = ("v2", parts[1])
                except OSError:
                    pass
    return v2 or (None, None)


def test_swap_affinity_says_what_the_kernel_kept_when_a_cpuset_cut_it(two_cpus):
    """A process moved into a narrower cpuset while it runs (what a
    Kubernetes CPU manager does): the kernel keeps only the cpuset's CPUs of
    the mask asked, and the read-back names the CPU it dropped."""
    first, second = two_cpus
    kind, mount = _cpuset_mount()
    if os.geteuid() != 0 or mount is None:
        pytest.skip("needs root and a cgroup hierarchy with the cpuset controller")
    if kind == "v2":
        Path(mount, "cgroup.subtree_control").write_text("+cpuset")
    path = Path(mount, f"cpupin-test-{os.getpid()}")
    path.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", CPUSET_CUT, str(first), str(second)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        (path / "cpuset.cpus").write_text(str(first))
        if kind == "v1":
            (path / "cpuset.mems").write_text(Path(mount, "cpuset.mems").read_text())
        (path / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        child.wait()
        path.rmdir()
    assert f"the kernel dropped CPU {second}" in out, out


DEFAULT_SIGNAL = """
import signal
from cpupin import _native
def ignored():
    mask = next(l for l in open('/proc/self/status') if l.startswith('SigIgn:')).split()[1]
    return {n for n in _native.IGNORED_BY_PYTHON if int(mask, 16) >> (n - 1) & 1}
before = ignored()
for n in _native.IGNORED_BY_PYTHON:
    _native.default_signal(n)
print(sorted(before) == sorted(_native.IGNORED_BY_PYTHON), sorted(ignored()))
"""


def test_default_signal_undoes_what_python_ignores():
    """The kernel's own record (SigIgn) is the oracle: Python starts with
    SIGPIPE and SIGXFSZ ignored, and default_signal takes both back."""
    assert set(_native.IGNORED_BY_PYTHON) == {signal.SIGPIPE, signal.SIGXFSZ}
    out = subprocess.run([sys.executable, "-c", DEFAULT_SIGNAL], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "[]"], out.stderr


@pytest.mark.parametrize("signum", [0, -1, 4096])
def test_default_signal_names_a_signal_the_kernel_refuses(signum):
    with pytest.raises(OSError, match=f"signal {signum}"):
        _native.default_signal(signum)


NOFILE = """
import resource, sys
from cpupin import _native
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
print(_native.nofile_limit() == (None if soft == resource.RLIM_INFINITY else soft), soft)
"""


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_nofile_limit_is_what_resource_reads(fraction):
    """resource.getrlimit is the oracle, at the limit this process has and
    at others a child sets for itself (the hard limit's own included)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert _native.nofile_limit() == (None if soft == resource.RLIM_INFINITY else soft)
    top = hard if hard != resource.RLIM_INFINITY else 1 << 20
    wanted = max(16, int(top * fraction))
    out = subprocess.run(
        [sys.executable, "-c", NOFILE, str(wanted)], capture_output=True, text=True, check=False
    )
    assert out.stdout.split() == ["True", str(wanted)], out.stderr
