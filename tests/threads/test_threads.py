"""cpupin.Thread, ThreadPool, pinning step threads and finding strays, with
real threads on this machine's CPUs."""

import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.thread import BrokenThreadPool

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpupin
from cpupin import _native
from cpupin.threads import thread as cpupin_threads
from tests.support.helpers import interruptible, proc_comm, strays_now

pytestmark = pytest.mark.skipif(len(cpupin.process_cpus()) < 2, reason="needs two CPUs")


@pytest.fixture
def pinned_creator():
    """Run a function in a thread pinned to the first CPU of the mask."""
    first = min(cpupin.process_cpus())

    def run(fn):
        box = {}

        def body():
            os.sched_setaffinity(0, {first})
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc

        t = threading.Thread(target=body)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    run.cpu = first
    return run


def mask_in(thread_cls, **kwargs):
    """Start ``thread_cls`` and return the mask its run saw."""
    seen = {}
    t = thread_cls(**kwargs) if kwargs else thread_cls()
    t.seen = seen
    t.start()
    t.join()
    return seen["mask"]


def record(seen):
    seen["mask"] = cpupin.get_affinity()


class Override(cpupin.Thread):
    def run(self):  # never calls super().run()
        record(self.seen)


class SubOverride(Override):
    pass


class Mixin:
    def run(self):
        record(self.seen)


class WithMixin(Mixin, cpupin.Thread):
    pass


@pytest.fixture(params=["bootstrap", "wrapped run"])
def start_path(request, monkeypatch):
    """Both ways a cpupin.Thread takes its first step: CPython's
    _bootstrap_inner, and the wrapped run of a Python without it."""
    monkeypatch.setattr(cpupin_threads, "_BOOTSTRAP", request.param == "bootstrap")
    return request.param


def test_every_kind_of_run_starts_on_the_process_mask(pinned_creator, start_path):
    mask = cpupin.process_cpus()

    def kinds():
        out = {}
        seen = {}
        t = cpupin.Thread(target=record, args=(seen,))
        t.start()
        t.join()
        out["target"] = seen["mask"]
        out["override"] = mask_in(Override)
        out["subclass of an override"] = mask_in(SubOverride)
        out["mixin"] = mask_in(WithMixin)
        seen = {}
        t = cpupin.Thread()
        t.run = lambda: record(seen)
        t.start()
        t.join()
        out["assigned on the instance"] = seen["mask"]
        return out

    assert pinned_creator(kinds) == dict.fromkeys(
        ["target", "override", "subclass of an override", "mixin", "assigned on the instance"], mask
    )


@pytest.mark.parametrize("cpupin_names", [True, False], ids=["cpupin names", "Python names"])
def test_a_thread_moves_whoever_names_it(pinned_creator, start_path, monkeypatch, cpupin_names):
    # From 3.14 CPython names its threads and cpupin leaves the name alone:
    # the one C call then moves the thread without naming it.
    monkeypatch.setattr(cpupin_threads, "_NAME_THREADS", cpupin_names)

    def start():
        seen = {}

        def body():
            seen["mask"] = os.sched_getaffinity(0)
            seen["comm"] = proc_comm(threading.get_native_id())

        t = cpupin.Thread(target=body, name="named-by-cpupin")
        t.start()
        t.join()
        return seen, proc_comm(threading.get_native_id())

    seen, creator = pinned_creator(start)
    assert seen["mask"] == cpupin.process_cpus()
    assert seen["comm"] == ("named-by-cpupin" if cpupin_names else creator)


def test_a_direct_run_call_stays_on_the_callers_mask(pinned_creator, start_path):
    def direct():
        seen = {}
        cpupin.Thread(target=record, args=(seen,)).run()
        return seen["mask"]

    assert pinned_creator(direct) == {pinned_creator.cpu}


def test_a_plain_thread_inherits_its_creators_pin(pinned_creator):
    """The problem is real: threading.Thread starts on the creator's CPU."""

    def plain():
        seen = {}
        t = threading.Thread(target=record, args=(seen,))
        t.start()
        t.join()
        return seen["mask"]

    assert pinned_creator(plain) == {pinned_creator.cpu}


def test_thread_behaves_as_threading_thread():
    got = {}

    def target(a, b=None):
        got["args"] = (a, b)
        got["name"] = threading.current_thread().name
        got["native"] = threading.get_native_id()

    t = cpupin.Thread(target=target, args=(1,), kwargs={"b": 2}, name="worker-x", daemon=True)
    t.start()
    native_id = t.native_id  # valid as soon as start() returns
    t.join()
    assert got == {"args": (1, 2), "name": "worker-x", "native": native_id}
    assert t.daemon and not t.is_alive()
    assert "run" not in t.__dict__  # the wrapper is gone
    with pytest.raises(RuntimeError):
        t.start()  # a thread starts once, as in threading


def test_an_exception_in_run_reaches_threading_excepthook(monkeypatch):
    caught = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_type))

    def boom():
        raise KeyError("x")

    t = cpupin.Thread(target=boom)
    t.start()
    t.join()
    assert caught == [KeyError]


def test_thread_pool_workers_start_on_the_process_mask(pinned_creator):
    mask = cpupin.process_cpus()

    def pools():
        inits = []
        with cpupin.ThreadPool(2, initializer=lambda: inits.append(cpupin.get_affinity())) as p:
            ours = set(p.map(lambda _: cpupin.get_affinity(), range(8)))
        with ThreadPoolExecutor(2) as p:
            plain = set(p.map(lambda _: cpupin.get_affinity(), range(8)))
        return ours, inits, plain

    ours, inits, plain = pinned_creator(pools)
    assert ours == {mask} and inits and set(inits) == {mask}
    assert plain == {frozenset({pinned_creator.cpu})}


def test_a_failing_initializer_breaks_the_pool():
    def fail():
        raise ValueError("no")

    with cpupin.ThreadPool(1, initializer=fail) as pool:
        future = pool.submit(int)
        with pytest.raises(BrokenThreadPool):
            future.result(timeout=60)


def test_pins_are_validated_against_the_process_mask():
    outside = max(cpupin.online_cpus()) + 1
    for bad in ({outside}, set(), {-1}):
        with pytest.raises(ValueError):
            cpupin.pin_current_thread(bad)
    assert cpupin.get_affinity() == cpupin.process_cpus()


def test_a_pin_restores_the_previous_mask_and_unregisters():
    first = min(cpupin.process_cpus())
    with cpupin.pin_step_thread({first}) as pin:
        assert cpupin.get_affinity() == {first}
        assert cpupin.pinned_threads()[cpupin.gettid()] == {first}
        assert pin.tid == threading.get_native_id()
    assert cpupin.get_affinity() == cpupin.process_cpus()
    assert cpupin.gettid() not in cpupin.pinned_threads()


def test_stray_threads_finds_an_unregistered_pin_and_not_a_registered_one():
    # Another test's thread in this process (a daemon still ending, a pool)
    # may be on a narrower mask already: only what this test starts counts.
    before = {info.tid for info in cpupin.stray_threads()}
    first = min(cpupin.process_cpus())
    release = threading.Event()
    ready = threading.Barrier(3)
    tids = {}

    def stray():
        os.sched_setaffinity(0, {first})
        tids["stray"] = threading.get_native_id()
        ready.wait()
        release.wait()

    def pinned():
        with cpupin.pin_current_thread({first}):
            tids["pinned"] = threading.get_native_id()
            ready.wait()
            release.wait()

    threads = [
        threading.Thread(target=stray, name="stray-one"),
        threading.Thread(target=pinned, name="pinned-one"),
    ]
    for t in threads:
        t.start()
    ready.wait()
    try:
        found = {info.tid: info for info in cpupin.stray_threads()}
    finally:
        release.set()
        for t in threads:
            t.join()
    assert tids["stray"] in found and found[tids["stray"]].mask == {first}
    assert isinstance(found[tids["stray"]].name, str)  # the OS name (Python 3.14 sets it)
    assert tids["pinned"] not in found
    assert strays_now(before, ended=tids.values()) == []


def test_sixteen_threads_pinning_and_starting_at_once_leave_the_registry_consistent():
    cpus = sorted(cpupin.process_cpus())
    barrier = threading.Barrier(16)
    errors = []

    def churn(i):
        barrier.wait()
        try:
            for j in range(20):
                with cpupin.pin_current_thread({cpus[(i + j) % len(cpus)]}):
                    seen = {}
                    t = cpupin.Thread(target=record, args=(seen,))
                    t.start()
                    t.join()
                    assert seen["mask"] == cpupin.process_cpus()
                    assert cpupin.pinned_threads()[cpupin.gettid()] == {cpus[(i + j) % len(cpus)]}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = {info.tid for info in cpupin.stray_threads()}
    threads = [threading.Thread(target=churn, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert cpupin.pinned_threads() == {}
    assert strays_now(before, ended=[t.native_id for t in threads]) == []


def test_ten_thousand_threads_leave_no_garbage():
    def start_join(n):
        for _ in range(n):
            t = cpupin.Thread(target=int)
            t.start()
            t.join()

    start_join(200)  # warm caches
    gc.collect()
    before = len(gc.get_objects())
    tracemalloc.start()
    start_join(10_000)
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(gc.get_objects()) - before < 100
    assert current < 256 * 1024


SPAWNED = """
import multiprocessing as mp, os, sys, threading

def child(q):
    import cpupin
    q.put((sorted(cpupin.process_cpus()), sorted(os.sched_getaffinity(0))))

def from_pinned(q, how):
    import cpupin
    if how == "registered":
        cpupin.pin_current_thread({{{cpu}}})  # a pin the child can recognise
    else:
        os.sched_setaffinity(0, {{{cpu}}})  # narrowed as a launcher would
    ctx = mp.get_context("spawn")
    if how != "plain":
        os.environ.update(cpupin.child_env())
    p = ctx.Process(target=child, args=(q,))
    p.start(); p.join()

if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    t = threading.Thread(target=from_pinned, args=(q, sys.argv[1]))
    t.start(); t.join()
    print(q.get())
"""


@pytest.mark.parametrize("how", ["registered", "by hand", "plain"])
def test_a_child_spawned_from_a_pinned_thread(tmp_path, how):
    """With child_env, a child started from a registered pin takes the
    parent's process mask; one started from a thread narrowed by hand (as
    taskset narrows a launcher) keeps its mask: the variable never widens
    what a launcher gave. Without child_env the inherited mask stands."""
    first = min(cpupin.process_cpus())
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNED.format(cpu=first))
    out = subprocess.run(
        [sys.executable, str(script), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)},
    )
    recorded, main_mask = eval(out.stdout.strip())  # noqa: S307 - our own output
    mask = sorted(cpupin.process_cpus())
    if how == "registered":
        assert recorded == main_mask == mask
    else:
        assert recorded == main_mask == [first]  # the inherited mask, kept


LAUNCHED = (
    "import cpupin, os; print((sorted(cpupin.process_cpus()), sorted(os.sched_getaffinity(0))))"
)


@settings(max_examples=20)
@given(data=st.data())
def test_an_inherited_process_mask_never_widens_a_launchers_mask(data, tmp_path_factory):
    """Whatever CPUPIN_PROCESS_CPUS says and whatever mask taskset gives,
    the process mask is the launcher's mask (the variable applies only when
    it equals it, or when the mask is a registered pin of the parent's: the
    child reads an empty lock directory, so that a pin another test left in
    this process's record does not count)."""
    empty = tmp_path_factory.mktemp("locks")
    here = sorted(os.sched_getaffinity(0))
    launcher = data.draw(st.sets(st.sampled_from(here), min_size=1))
    inherited = data.draw(st.sets(st.sampled_from(here), min_size=1))
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHED],
        preexec_fn=lambda: os.sched_setaffinity(0, launcher),  # as taskset would
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={
            **os.environ,
            "CPUPIN_PROCESS_CPUS": ",".join(map(str, inherited)),
            "CPUPIN_LOCK_DIR": str(empty),
        },
    )
    recorded, mask = eval(out.stdout)  # noqa: S307 - our own output
    assert recorded == mask == sorted(launcher)


TORCH_PIN = """
import os, sys, threading
import torch
torch.set_num_threads(2)
import cpupin
first = min(cpupin.process_cpus())
if sys.argv[1] == "warm":
    cpupin.pin_step_thread({first})
else:
    cpupin.pin_current_thread({first})  # no warm-up
torch.empty(1 << 22, dtype=torch.uint8).fill_(1)  # a parallel op: the pool exists now
me = threading.get_native_id()
alone = []
for tid in os.listdir("/proc/self/task"):
    if int(tid) != me and cpupin.get_affinity(int(tid)) == {first}:
        alone.append(tid)
print(len(os.listdir("/proc/self/task")), len(alone))
"""


def run_torch(mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    out = subprocess.run(
        [sys.executable, "-c", TORCH_PIN, mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return tuple(map(int, out.stdout.split()))


torch_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="needs torch"
)


@torch_missing
def test_pin_step_thread_warms_torchs_pool_onto_the_process_mask():
    threads, alone = run_torch("warm")
    assert threads >= 2  # an OpenMP pool of at least one more thread exists
    assert alone == 0


@torch_missing
def test_without_the_warm_up_torchs_pool_lands_on_the_pinned_cpu():
    """The control: the test above fails if the warm-up is removed."""
    threads, alone = run_torch("cold")
    assert threads >= 2 and alone >= 1


# --- drop-in: CPython's own suites with cpupin's classes substituted --------

THREADING_SUITE = """
import threading, unittest
import cpupin
threading.Thread = cpupin.Thread
from test import test_threading
suite = unittest.defaultTestLoader.loadTestsFromModule(test_threading)
result = unittest.TextTestRunner(verbosity=0).run(suite)
print()
print("RAN", result.testsRun)
print("FAILED", *sorted(t.id().rsplit(".", 1)[1] for t, _ in result.failures + result.errors))
"""

POOL_SUITE = """
import importlib.util, sys, unittest
import concurrent.futures, concurrent.futures.thread
import cpupin
concurrent.futures.ThreadPoolExecutor = cpupin.ThreadPool
concurrent.futures.thread.ThreadPoolExecutor = cpupin.ThreadPool
spec = importlib.util.spec_from_file_location("test_concurrent_futures", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["test_concurrent_futures"] = mod
spec.loader.exec_module(mod)
load = unittest.defaultTestLoader.loadTestsFromTestCase
names = [n for n in dir(mod) if n.startswith("ThreadPool") and n.endswith(("Test", "Tests"))]
suite = unittest.TestSuite(load(getattr(mod, n)) for n in names)
result = unittest.TextTestRunner(verbosity=0).run(suite)
print()
print("RAN", result.testsRun)
print("FAILED", *sorted(t.id().rsplit(".", 1)[1] for t, _ in result.failures + result.errors))
"""


def suite_result(script, *args):
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
        preexec_fn=interruptible,  # CPython's tests interrupt the main thread
    )  # fmt: skip
    # unittest's own progress may share the line: find the two markers.
    ran = re.search(r"RAN (\d+)", out.stdout)
    failed = re.search(r"^FAILED(.*)$", out.stdout, re.MULTILINE)
    assert ran and failed, out.stdout[-2000:] + out.stderr[-2000:]
    return int(ran.group(1)), set(failed.group(1).split()), out.stderr[-3000:]


def test_cpython_test_threading_passes_with_cpupin_thread():
    ran, failed, err = suite_result(THREADING_SUITE)
    assert ran > 150, err
    # The one test that checks threading.__all__ against the module's names.
    assert failed <= {"test__all__"}, err


def _pool_suite_path():
    import sysconfig

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in (sysconfig.get_paths()["stdlib"] + "/test", f"/usr/lib/{version}/test"):
        path = os.path.join(folder, "test_concurrent_futures.py")
        if os.path.exists(path):
            return path
    return None


def test_cpython_thread_pool_tests_pass_with_cpupin_threadpool():
    path = _pool_suite_path()
    if path is None:
        pytest.skip(
            "CPython's test_concurrent_futures.py is not installed "
            "(apt-get install libpython3.11-testsuite; .ci/run does)"
        )
    ran, failed, err = suite_result(POOL_SUITE, path)
    assert ran > 30, err
    # These start a fresh interpreter with -I (the standard library's class,
    # not cpupin's) that imports test.test_concurrent_futures, which a Python
    # whose own test package lacks it cannot.
    fresh_interpreter = {
        "test_cancel_futures_wait_false",
        "test_hang_gh83386",
        "test_interpreter_shutdown",
        "test_submit_after_interpreter_shutdown",
    }
    # The one deliberate difference: without max_workers, cpupin's pool has a
    # worker a usable CPU, not os.cpu_count() + 4 (which counts the host).
    deliberate = {"test_default_workers"}
    assert failed <= fresh_interpreter | deliberate, err


def test_threadpool_refuses_an_initializer_that_is_not_callable():
    with pytest.raises(TypeError, match="initializer must be a callable"):
        cpupin.ThreadPool(initializer=42)


def test_a_run_assigned_while_the_thread_runs_is_kept_as_in_threading():
    for cls in (threading.Thread, cpupin.Thread):
        started, go = threading.Event(), threading.Event()
        t = cls(target=lambda started=started, go=go: (started.set(), go.wait()))
        t.start()
        started.wait()

        def replacement():
            pass

        t.run = replacement
        go.set()
        t.join()
        assert t.run is replacement, cls


def test_a_traceback_shows_one_frame_more_than_threading(capsys):
    def fail():
        raise RuntimeError("boom")

    frames = {}
    for cls in (threading.Thread, cpupin.Thread):
        seen = []
        old = threading.excepthook
        threading.excepthook = lambda args, seen=seen: seen.append(args.exc_traceback)
        try:
            t = cls(target=fail)
            t.start()
            t.join()
        finally:
            threading.excepthook = old
        tb, count = seen[0], 0
        while tb is not None:
            count += 1
            tb = tb.tb_next
        frames[cls] = count
    assert frames[cpupin.Thread] - frames[threading.Thread] <= 1


# --- names the kernel shows ------------------------------------------------


def test_threads_and_pool_workers_carry_their_names_in_the_kernel():
    box = {}

    def record(key):
        box[key] = (threading.get_native_id(), threading.current_thread().name)

    t = cpupin.Thread(target=record, args=("thread",), name="gpu-loop-worker-0")
    t.start()
    t.join()
    with cpupin.ThreadPool(1, thread_name_prefix="plan") as pool:
        pool.submit(lambda: (record("pool"), time.sleep(0.0))).result()
        tid = box["pool"][0]
        assert proc_comm(tid) == box["pool"][1][:15] == "plan_0"
    # The thread is gone once joined; its name was checked from inside too.
    assert box["thread"][1] == "gpu-loop-worker-0"


def test_a_thread_names_itself_in_proc_while_it_runs():
    ready, done = threading.Event(), threading.Event()
    box = []

    def body():
        box.append(threading.get_native_id())
        ready.set()
        done.wait()

    t = cpupin.Thread(target=body, name="encoder-ü-long-name")
    t.start()
    ready.wait()
    try:
        name = proc_comm(box[0])
        assert name == "encoder-ü-long" and len(name.encode()) <= 15  # cut on a character
    finally:
        done.set()
        t.join()


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=24) | st.text(st.characters(codec="utf-8"), min_size=12, max_size=20))
def test_the_name_cut_in_c_is_the_one_python_makes(name):
    # The oracle is the Python cut that named threads before: 15 bytes at
    # most, on a character boundary, NUL as "?". A name that is not strict
    # UTF-8 (a lone surrogate) never reaches C: the creator cuts it itself.
    try:
        raw = name.encode()
    except UnicodeEncodeError:
        raw = _native.thread_name_bytes(name)
    assert _native.thread_name_cut(raw) == _native.thread_name_bytes(name)


@pytest.mark.parametrize(
    "name",
    [
        "x" * 15,
        "x" * 16,
        "engine-\0-core",
        "encoder-" + "\U0001f600" * 3,  # a 4-byte character across byte 15
        "decoder-\ud800-lone",  # a lone surrogate: cut the slow way
        "x" * 13 + "\u00e9",  # 15 bytes, a 2-byte character last
        "x" * 14 + "\u00e9",  # 16 bytes: the character goes whole
    ],
)
def test_a_thread_carries_the_cut_name_in_the_kernel(name):
    box = []

    def body():
        box.append(proc_comm(threading.get_native_id()))

    t = cpupin.Thread(target=body, name=name)
    t.start()
    t.join()
    assert box == [_native.thread_name_bytes(name).decode()]
    assert len(box[0].encode()) <= 15


def test_pins_name_the_thread_when_asked_and_never_the_main_thread_by_default():
    before = proc_comm(os.getpid())
    box = []

    def body():
        pin = cpupin.pin_current_thread(cpupin.process_cpus(), name="step-main")
        box.append((threading.get_native_id(), proc_comm(threading.get_native_id())))
        pin.release()

    t = threading.Thread(target=body)  # a thread cpupin did not start
    t.start()
    t.join()
    assert box[0][1] == "step-main"
    pin = cpupin.pin_current_thread(cpupin.process_cpus())
    pin.release()
    assert proc_comm(os.getpid()) == before
    with pytest.raises(ValueError, match="thread name"):
        cpupin.pin_current_thread(cpupin.process_cpus(), name="")


DEFAULT_POOL = """
import json, os, cpupin
with cpupin.ThreadPool() as pool:
    default = pool._max_workers
with cpupin.ThreadPool(7) as pool:
    given = pool._max_workers
print(json.dumps([default, given, cpupin.usable_cpus()]))
"""


def test_the_drop_in_pools_default_follows_the_usable_cpus_not_the_host():
    """In a real 1-CPU quota on this machine's CPUs, and outside it: the
    default is the usable CPUs (the census then calls the pool fitting);
    max_workers still wins."""
    from tests.support.cgroups import in_cgroup, quota_cgroup

    out = subprocess.run([sys.executable, "-c", DEFAULT_POOL], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    default, given, usable = json.loads(out.stdout)
    assert default == usable == len(os.sched_getaffinity(0)) and given == 7
    with quota_cgroup(100_000) as (path, _):
        inside = subprocess.run(
            [sys.executable, "-c", DEFAULT_POOL], capture_output=True, text=True, timeout=60,
            check=True, preexec_fn=in_cgroup(path),
        )  # fmt: skip
    default, given, usable = json.loads(inside.stdout)
    assert default == usable == 1 and given == 7


FEEDER = """
import json, multiprocessing as mp, os, sys, threading
import cpupin

def child(q):
    q.put(("from the child", sorted(os.sched_getaffinity(0))))

if __name__ == "__main__":
    which = sys.argv[1]
    ctx = mp.get_context(sys.argv[2])
    first = min(cpupin.process_cpus())
    pin = cpupin.pin_current_thread({first}, role="step")
    q = cpupin.Queue(ctx=ctx) if which == "cpupin" else ctx.Queue()
    before = {t.native_id for t in threading.enumerate()}
    q.put(1)  # the feeder starts here, from the pinned thread
    feeder = next(t for t in threading.enumerate() if t.native_id not in before)
    mask = sorted(os.sched_getaffinity(feeder.native_id))
    assert q.get(timeout=30) == 1
    p = ctx.Process(target=child, args=(q,)); p.start()
    got = q.get(timeout=60); p.join()
    strays = [t.tid for t in cpupin.stray_threads()]
    print(json.dumps({"feeder": mask, "process": sorted(cpupin.process_cpus()), "child": got,
                      "stray": feeder.native_id in strays}))
"""


@pytest.mark.parametrize("which", ["cpupin", "multiprocessing"])
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_queue_feeder_started_from_a_pinned_thread_runs_on_the_process_mask(
    which, method, two_cpus, tmp_path
):
    """A real multiprocessing.Queue put to from a pinned step thread: the
    standard one's feeder inherits the pin (a stray); cpupin.Queue's runs on
    the process mask (the oracle: the kernel's mask of the feeder's tid),
    and the queue still crosses to a child."""
    script = tmp_path / "feeder.py"  # spawn re-imports the main module: a file
    script.write_text(FEEDER)
    out = subprocess.run([sys.executable, str(script), which, method], capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["child"][0] == "from the child"
    if which == "cpupin":
        assert got["feeder"] == got["process"] and not got["stray"]
    else:
        assert got["feeder"] == [two_cpus[0]] and got["stray"]
