"""Trust, third round: what cpupin keeps open, the size of its records, and
its step clock's bookkeeping, tried as a runtime with unusual habits would
(closing descriptors it did not open, moving cgroups, squatting names) and
as hostile input would. A test per class of fault, over many inputs."""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpupin
from cpupin import _native
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.limits import environment_advice, omp_num_threads, pool_env, pool_threads
from cpupin.registry import writer as registry
from cpupin.registry._fields import cpu_list
from cpupin.registry._record import MAX_SIZE, SLOT, compact, decode, fit
from tests.support.cgroups import in_cgroup, quota_cgroup, throttle_file
from tests.support.helpers import in_forked_child, proc_schedstat, ready_child, run

NOBODY = 65534


@pytest.fixture
def lock_dir(monkeypatch):
    path = pathlib.Path(tempfile.mkdtemp(prefix="cpupin-trust3-", dir="/tmp"))
    os.chmod(path, 0o1777)
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- a kept descriptor is trusted only while it is still ours ----------------

# Each holder keeps descriptors open; the application then closes every
# descriptor it did not open itself (os.closerange, as a daemonizing runtime
# does) and opens files of its own, which take the freed numbers. Using and
# then dropping the holder must leave those files untouched and open, and
# the holder must work again.
CLOSED_UNDER = r"""
import json, os, sys, threading
import cpupin
from cpupin import _native
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
holder, spare = sys.argv[1], int(sys.argv[2])
lock_dir = os.environ["CPUPIN_LOCK_DIR"]
def open_fds():
    listed = [int(n) for n in os.listdir("/proc/self/fd")]
    out = set()
    for fd in listed:  # the listing's own descriptor is closed by now
        try:
            os.fstat(fd)
        except OSError:
            continue
        out.add(fd)
    return out
before = open_fds()
if holder == "registry":
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="first")
elif holder == "lock":
    claim = cpupin.claim_gpus(["0000:18:00.0"], lock_dir)
    assert claim, claim.reason
elif holder == "stepclock":
    clock = cpupin.StepClock("c")
    with clock.step():
        pass
elif holder == "tasks":
    _native.thread_stats()
elif holder == "tasks-of-another":
    _native.thread_stats(int(sys.argv[3]))
kept = sorted(open_fds() - before)
# The application's tidy-up: close what it did not open, then open its own.
for fd in kept:
    os.close(fd)
mine = {}
i = 0
while (not set(kept) <= set(mine) or spare) and i < 256:
    path = os.path.join(sys.argv[4], f"app-{i}")
    with open(path, "wb") as f:
        f.write(b"application data %d\n" % i)
    fd = os.open(path, os.O_RDWR)
    mine[fd] = path
    i += 1
    if set(kept) <= set(mine) and spare:
        spare -= 1
taken = sorted(set(kept) & set(mine))
ok = {}
if holder == "registry":
    pin.release()
    again = cpupin.pin_current_thread(cpupin.process_cpus(), role="second")
    ok["roles"] = [p.role for p in read_registry().pins_of(os.getpid())]
    again.release()
    registry._remove_at_exit()  # what exit does: close and remove the record
elif holder == "lock":
    why = claim.write_record({"version": 1, "pid": os.getpid()})
    ok["write"] = why
    claim.close()
elif holder == "stepclock":
    for _ in range(3):
        with clock.step():
            pass
    ok["steps"] = clock.steps
    clock.close()
elif holder == "tasks":
    ok["tids"] = sorted(t.tid for t in _native.thread_stats())
    ok["oracle"] = sorted(int(n) for n in os.listdir("/proc/self/task"))
    _native._readers.clear()
elif holder == "tasks-of-another":
    ok["tids"] = sorted(t.tid for t in _native.thread_stats(int(sys.argv[3])))
    ok["oracle"] = sorted(int(n) for n in os.listdir(f"/proc/{sys.argv[3]}/task"))
    _native._readers.clear()
import gc; gc.collect()
intact = {}
for fd, path in mine.items():
    try:
        data = os.pread(fd, 100, 0)
    except OSError as exc:
        data = repr(exc).encode()
    intact[fd] = data == open(path, "rb").read() and data.startswith(b"application data")
print(json.dumps({"kept": kept, "taken": taken, "intact": intact, "ok": ok}))
"""


@pytest.mark.parametrize("spare", [0, 3])
@pytest.mark.parametrize("holder", ["registry", "lock", "stepclock", "tasks", "tasks-of-another"])
def test_a_descriptor_closed_under_cpupin_is_never_written_read_or_closed(
    holder, spare, lock_dir, tmp_path
):
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        out = run(
            [sys.executable, "-c", CLOSED_UNDER, holder, str(spare), str(other.pid), str(tmp_path)]
        )
    finally:
        other.communicate(b"")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    ok = got["ok"]
    if holder == "registry":
        # The record is a mapping: no descriptor to close under it at all.
        assert not got["kept"] and ok["roles"] == ["second"], got
        return
    assert got["kept"], "the holder kept no descriptor: the test would prove nothing"
    assert got["taken"], "no application file took a freed number"
    assert all(got["intact"].values()), got  # every application file, whole and open
    if holder == "lock":
        assert "closed under cpupin" in ok["write"]
    elif holder == "stepclock":
        assert ok["steps"] == 4
    else:
        assert ok["tids"] == ok["oracle"]


# --- records: never too big to write, never too big to read -----------------


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 65536),
    st.integers(0, 40),
    st.text(min_size=0, max_size=64),
)
def test_a_server_record_of_any_mask_fits_what_readers_read(n, workers, device):
    """A server's record with a process mask of up to 65,536 CPUs (hosts of
    1,000 and more exist) is written in whole slots no larger than a reader
    reads, and reads back to the same CPUs."""
    mask = list(range(n))
    record = {
        "version": 1,
        "pid": 1,
        "process_mask": mask,
        "workers": [{"device": device, "cpus": mask[: 1 + i]} for i in range(workers)],
    }
    try:
        data = fit(record)
    except ValueError as exc:
        # Only a record that cannot fit even as ranges is refused, with why.
        assert "larger than" in str(exc)
        assert len(json.dumps(compact(record))) > MAX_SIZE - 100
        return
    assert len(data) % SLOT == 0 and len(data) <= MAX_SIZE
    back = decode(data)
    host = frozenset(range(n))
    assert cpu_list(back["process_mask"], "process_mask", host) == host
    for w, got in zip(record["workers"], back["workers"]):
        assert cpu_list(got["cpus"], "worker", host) == frozenset(w["cpus"])


@given(st.one_of(st.text(max_size=30), st.integers(), st.lists(st.integers(), max_size=5)))
def test_a_cpu_list_read_as_ranges_is_refused_with_a_reason_or_within_the_host(value):
    host = frozenset(range(8))
    try:
        cpus = cpu_list(value, "pin", host)
    except ValueError as exc:
        assert "pin" in str(exc)
    else:
        assert cpus and cpus <= host


def test_a_plan_on_a_host_of_a_thousand_cpus_writes_its_record(lock_dir):
    """plan_server on a mask of 1,000+ CPUs: the record (4.6 KiB as lists)
    is written as ranges, the plan stands and the lock is held, never an
    exception after the lock was taken."""
    from cpupin.registry.lock import Claim, claim_gpus

    claim = claim_gpus(["0000:18:00.0"], lock_dir)
    try:
        assert isinstance(claim, Claim) and claim
        record = {
            "version": 1,
            "pid": os.getpid(),
            "process_mask": list(range(1024)),
            "workers": [{"device": "0000:18:00.0", "cpus": [0, 1024 + 0]}],
        }
        assert len(registry.encode(record, None)) > SLOT  # the old writer raised here
        assert claim.write_record(record) == ""
        raw = (lock_dir / "cpupin-gpu-0000:18:00.0.lock").read_bytes()
        assert decode(raw)["process_mask"] == "0-1023"
        huge = {**record, "notes": ["x" * 100] * 1000}
        assert "larger than" in claim.write_record(huge)  # a reason, not an exception
    finally:
        claim.close()


MANY_PINS = r"""
import json, os, sys, threading
import cpupin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
n, name = int(sys.argv[1]), sys.argv[2]
cpus = cpupin.process_cpus()
gate = threading.Barrier(n + 1)
def pin():
    cpupin.pin_current_thread(cpus, role="step")
    gate.wait(); gate.wait()
threads = [cpupin.Thread(target=pin, name=name) for _ in range(n)]
for t in threads: t.start()
gate.wait()
found = [r for r in read_registry().records if r.pid == os.getpid()]
sizes = [os.path.getsize(os.path.join(os.environ["CPUPIN_LOCK_DIR"], f))
         for f in os.listdir(os.environ["CPUPIN_LOCK_DIR"]) if f.startswith("cpupin-proc-")]
print(json.dumps({"found": len(found), "pins": len(found[0].pins) if found else 0,
                  "notes": list(found[0].notes) if found else [], "sizes": sizes}))
gate.wait()
"""


@pytest.mark.parametrize(
    "n, name",
    [
        (200, "w" * 64),
        (200, "\N{SNOWMAN}" * 64),
        (200, "\x01\x7f" * 32),
        (1500, "\N{CJK UNIFIED IDEOGRAPH-4E00}" * 20),
    ],
)
def test_a_process_with_many_long_named_pins_never_vanishes_from_ps(n, name, lock_dir):
    out = run([sys.executable, "-c", MANY_PINS, str(n), name])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["found"] == 1, got
    assert all(size <= MAX_SIZE for size in got["sizes"])
    if got["pins"] < n:  # left out to fit: and it says how many
        assert any(f"{n - got['pins']} of {n} pins left out" in note for note in got["notes"])
    else:
        assert got["pins"] == n


# --- names another user squats, files moved under a running process -----------

SQUATTED_TMP = r"""
import json, os, sys
import cpupin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
sys.stdin.readline()  # the squatter plants its names meanwhile
pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
print(json.dumps([p.role for p in read_registry().pins_of(os.getpid())]))
"""


@pytest.mark.parametrize("squat", ["file", "symlink", "directory", "fifo"])
def test_the_temporary_name_cannot_be_squatted(squat, lock_dir):
    """Another user makes the temporary name a process would have taken
    (``cpupin-tmp-<pid>.tmp``, and a few neighbours) before it writes its
    record: the record is written all the same."""
    child = subprocess.Popen(
        [sys.executable, "-c", SQUATTED_TMP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "CPUPIN_LOCK_DIR": str(lock_dir)},
    )  # fmt: skip

    def plant():
        for name in (f"cpupin-tmp-{child.pid}.tmp", f"cpupin-tmp-{child.pid}-0.tmp"):
            path = lock_dir / name
            if squat == "file":
                path.write_text("mine")
            elif squat == "symlink":
                os.symlink("/etc/passwd", path)
            elif squat == "directory":
                os.mkdir(path)
            else:
                os.mkfifo(path)
        return True

    try:
        assert in_forked_child(plant, uid=NOBODY)
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert json.loads(out) == ["step"]


MOVED_UNDER = r"""
import json, os, sys, time
import cpupin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
registry.FULL_EVERY_S = 0.05  # how often a pin's update checks the whole record
first = cpupin.pin_current_thread(cpupin.process_cpus(), role="first")
print("ready", flush=True)
sys.stdin.readline()  # the record is moved, removed or its directory swapped
time.sleep(0.1)  # past that: the next pin's update checks
second = cpupin.pin_current_thread(cpupin.process_cpus(), role="second")
print(json.dumps(sorted(p.role for p in read_registry().pins_of(os.getpid()))))
"""


@pytest.mark.parametrize("how", ["renamed", "removed", "replaced", "directory swapped"])
def test_a_record_moved_under_a_running_process_comes_back(how, lock_dir):
    child = ready_child(MOVED_UNDER, lock_dir)
    try:
        (name,) = [n for n in os.listdir(lock_dir) if n.startswith("cpupin-proc-")]
        if how == "renamed":
            os.rename(lock_dir / name, lock_dir / "elsewhere.json")
        elif how == "removed":
            os.unlink(lock_dir / name)
        elif how == "replaced":
            (lock_dir / "other").write_text("not a record")
            os.replace(lock_dir / "other", lock_dir / name)
        else:
            os.rename(lock_dir, f"{lock_dir}.old")
            os.mkdir(lock_dir)
            os.chmod(lock_dir, 0o1777)
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        shutil.rmtree(f"{lock_dir}.old", ignore_errors=True)
    assert json.loads(out) == ["second"]  # the same thread: the second pin replaced the first


# --- the step clock's own bookkeeping never fails a step ----------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("body", [None, Boom, KeyboardInterrupt, ValueError])
@pytest.mark.parametrize("slow", [None, Boom, RuntimeError])
def test_on_slow_never_replaces_the_steps_own_exception(body, slow):
    def on_slow(step):
        if slow is not None:
            raise slow("from on_slow")

    clock = cpupin.StepClock(slow_wait_us=0, on_slow=on_slow)  # every step is slow
    expected = body or slow
    try:
        if expected is None:
            with clock.step():
                pass
        else:
            with pytest.raises(expected) as caught:
                with clock.step():
                    if body is not None:
                        raise body("from the step")
            assert str(caught.value) == ("from the step" if body else "from on_slow")
            if body is not None and slow is not None:
                assert "could not record this step" in "".join(
                    getattr(caught.value, "__notes__", [""])
                ) or sys.version_info < (3, 11)
        assert clock.steps == 1
    finally:
        clock.close()


@pytest.mark.parametrize("n", [2, 3, 7])
def test_clocks_of_one_name_export_apart(n):
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="the exporter is the prometheus extra"
    )
    from cpupin.measure.metrics import ThreadCollector

    made = [cpupin.StepClock("decode") for _ in range(n)]
    try:
        names = [c.name for c in made]
        assert len(set(names)) == n and names[0] == "decode"
        reg = prometheus_client.CollectorRegistry()
        reg.register(ThreadCollector())
        text = prometheus_client.generate_latest(reg).decode()
        series = [
            line.split("{", 1)[1].split("}", 1)[0]
            for line in text.splitlines()
            if line.startswith("cpupin_step_seconds_total{")
        ]
        assert len(series) == len(set(series)) >= n  # no series twice
        for name in names:
            assert sum(f'clock="{name}"' in labels for labels in series) == 1
    finally:
        for c in made:
            c.close()


@settings(max_examples=80, deadline=None)
@given(deltas=st.lists(st.integers(0, 10**12), min_size=1, max_size=12))
def test_a_steps_throttled_time_is_never_more_than_its_wall_time(tmp_path_factory, deltas):
    """The cgroup's throttled counter (here a file the test writes, as v2's
    ``throttled_usec``) may grow by more than a step lasts (it sums the
    group's run queues): a step's figure is capped at its wall time, and
    the sum is the sum of the figures."""
    path = tmp_path_factory.mktemp("stat") / "cpu.stat"
    total = 0
    path.write_text(f"usage_usec 1\nthrottled_usec {total}\n")
    clock = cpupin.StepClock(throttle=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        _native.step_files(clock._state, clock._sched_fd, fd, 2, 0)
        clock.begin()
        for delta in deltas:
            total += delta
            path.write_text(f"usage_usec 1\nthrottled_usec {total}\n")
            clock.end()
            step = clock.last
            assert step.throttled_ns == min(delta * 1000, step.wall_ns)
        figures = [s.throttled_ns for s in clock.recent()]
        assert clock.throttled_sum_ns == sum(f for f in figures if f)
    finally:
        os.close(fd)
        clock.close()


@settings(max_examples=60, deadline=None)
@given(
    content=st.one_of(
        st.sampled_from([b"1 2 3\n", b"99999999999 99999999999 9\n", b"0 0 0\n", b""]),
        st.binary(max_size=200),
    ),
    when=st.sampled_from(["before begin", "between begin and end"]),
)
def test_a_step_read_from_a_file_that_is_not_the_clocks_is_never_recorded(
    tmp_path_factory, content, when
):
    """The start of a step reads its schedstat before checking the
    descriptor (the end's check vouches for both reads): an application
    file put under the clock's number, before the step or during it, even
    one that reads as a schedstat, never makes a step's figures. Every step
    recorded is the thread's own by /proc's count around it, the file is
    untouched and stays open, and the clock goes on with a fresh descriptor."""
    path = tmp_path_factory.mktemp("app") / "data"
    path.write_bytes(content)
    clock = cpupin.StepClock(throttle=False)
    tid = clock.tid
    number = clock._sched_fd
    app = os.open(path, os.O_RDONLY)
    try:
        before, steps = proc_schedstat(tid), clock.steps
        if when == "before begin":
            os.dup2(app, number)  # closes the clock's file, as os.closerange() then open() would
            clock.begin()
        else:
            clock.begin()
            os.dup2(app, number)
        clock.end()
        clock.begin()  # the clock goes on
        clock.end()
        after = proc_schedstat(tid)
        made = clock.recent()[-(clock.steps - steps) :] if clock.steps > steps else []
        assert 1 <= len(made) <= 2 and clock._sched_fd != number
        for step in made:
            assert 0 <= step.run_ns <= after[0] - before[0]
            assert 0 <= step.wait_ns <= after[1] - before[1]
        assert os.pread(number, len(content) + 1, 0) == content == path.read_bytes()
        clock.close()
        assert os.fstat(number).st_ino == os.fstat(app).st_ino  # never closed by the clock
    finally:
        clock.close()
        for fd in {app, number}:
            os.close(fd)


def test_a_clock_whose_cgroup_went_away_goes_on_stepping():
    """The process moves to another cgroup and the old one is removed: the
    next steps run and are counted, their throttled time unknown, and the
    clock says why; never an exception out of the step."""
    code = r"""
import json, sys
import cpupin
clock = cpupin.StepClock("moved")
with clock.step():
    pass
print(json.dumps({"source": clock.throttle_source}), flush=True)
sys.stdin.readline()  # moved out, and the old group removed
for _ in range(5):
    with clock.step():
        pass
print(json.dumps({"steps": clock.steps, "last": clock.last.throttled_ns,
                  "lost": clock.throttle_lost}))
"""
    with quota_cgroup(100_000) as (path, _):
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, preexec_fn=in_cgroup(path),
        )  # fmt: skip
        try:
            first = json.loads(child.stdout.readline())
            assert first["source"] and first["source"].endswith("/" + throttle_file(path))
            parent = os.path.dirname(path)
            pathlib.Path(parent, "cgroup.procs").write_text(str(child.pid))
            os.rmdir(path)
            out, err = child.communicate("go\n", timeout=60)
        finally:
            child.kill()
            os.makedirs(path, exist_ok=True)  # quota_cgroup removes it
    assert child.returncode == 0, err
    got = json.loads(out)
    assert got["steps"] == 6 and got["last"] is None
    assert got["lost"] and "cpu.stat" in got["lost"]


def test_a_clock_used_from_another_thread_says_so():
    clock = cpupin.StepClock("maker")
    errors = []

    def other():
        try:
            with clock.step():
                pass
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    try:
        assert len(errors) == 1 and f"times tid {clock.tid}" in errors[0]
        assert clock.steps == 0  # nothing was timed on the wrong thread
        with clock.step():
            pass
        assert clock.steps == 1
    finally:
        clock.close()


def test_an_ebadf_mark_is_the_kernels_word_for_a_closed_clock():
    clock = cpupin.StepClock()
    clock.close()
    assert clock._begin() == -errno.EBADF


# --- lazy imports under fork and signals -------------------------------------

# A finder that makes the import of one cpupin module stop half way (its
# module object made and listed, its code not yet run to the end) until told
# to go on: the moment another thread forks, or a signal arrives.
SLOW_IMPORT = r"""
import importlib.abc, importlib.machinery, os, signal, sys, threading, time
import cpupin
target, how = sys.argv[1], sys.argv[2]
entered, go_on = threading.Event(), threading.Event()

class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target_=None):
        if name != f"cpupin.{target}":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            entered.set()
            if how == "signal":
                os.kill(os.getpid(), signal.SIGUSR1)  # arrives mid-import
                for _ in range(1000):
                    sum(range(100))  # bytecodes, where a handler would run
            else:
                go_on.wait(30)
            run(module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Slow())
name = {"measure.sampling": "Sampler", "host.launcher": "explain_cpus", "host.irqs": "read_irqs"}[
    target]
if how == "signal":
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(getattr(cpupin, name).__name__))
    getattr(cpupin, name)
    if not entered.is_set():
        sys.exit(f"the import of cpupin.{target} never began")
    time.sleep(0.05)  # a handler held back runs at the next check
    print("handler saw", got)
else:
    importer = threading.Thread(target=lambda: getattr(cpupin, name))
    importer.start()
    if not entered.wait(30):
        sys.exit(f"the import of cpupin.{target} never began")
    threading.Timer(0.2, go_on.set).start()  # the import finishes in its own time
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang fails the test instead of stopping it
        ok = getattr(cpupin, name).__name__ == name
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    importer.join()
    print("child exit", os.waitstatus_to_exitcode(status))
"""


#: Each module the tests import slowly, and the public name that loads it.
LAZY_NAMES = {
    "measure.sampling": "Sampler",
    "host.launcher": "explain_cpus",
    "host.irqs": "read_irqs",
}


@pytest.mark.parametrize("target", sorted(LAZY_NAMES))
def test_a_child_forked_during_a_lazy_import_gets_a_working_name(target):
    out = run([sys.executable, "-c", SLOW_IMPORT, target, "fork"], timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child exit 0", out.stdout + out.stderr


@pytest.mark.parametrize("target", sorted(LAZY_NAMES))
def test_a_signal_handler_during_a_lazy_import_gets_a_working_name(target):
    out = run([sys.executable, "-c", SLOW_IMPORT, target, "signal"], timeout=90)
    assert out.returncode == 0, out.stderr
    name = LAZY_NAMES[target]
    assert out.stdout.strip() == f"handler saw ['{name}']", out.stdout + out.stderr


# --- the outside view agrees with the inside ----------------------------------

BOUND_WORKER = r"""
import json, os, sys, threading
import cpupin
first, second = sorted(cpupin.process_cpus())[:2]
where = {"first": [first], "second": [second]}[sys.argv[1]]
pin_at = {"none": None, "inside": where, "outside": [second if where == [first] else first]}[
    sys.argv[2]]
stop = threading.Event()
box = {}
def stepper():
    if pin_at is not None:
        box["pin"] = cpupin.pin_current_thread(pin_at, role="step")
    box["tid"] = threading.get_native_id()
    stop.wait()
t = cpupin.Thread(target=stepper, name="stepper")
t.start()
while "tid" not in box:
    pass
binding = cpupin.bind_process(cpus=where, memory="none")
print(json.dumps({
    "strays": [s.tid for s in cpupin.stray_threads()],
    "pins": {str(k): sorted(v) for k, v in cpupin.pinned_threads().items()},
    "stepper": box["tid"], "stepper_mask": sorted(os.sched_getaffinity(box["tid"])),
    "reason": binding.reason,
}), flush=True)
sys.stdin.readline()
stop.set()
"""


@pytest.mark.parametrize("where", ["first", "second"])
@pytest.mark.parametrize("pinned", ["none", "inside", "outside"])
def test_a_worker_bound_after_child_env_looks_the_same_from_outside(
    where, pinned, two_cpus, lock_dir
):
    """The README's recipe: a worker started with ``child_env()`` (its
    ``CPUPIN_PROCESS_CPUS`` names the launcher's CPUs) binds itself. Inside
    nothing is stray; from outside ``cpupin threads`` agrees and ``audit
    --fail-on-narrow`` passes. A thread cpupin pinned within the new CPUs
    keeps its pin; one pinned outside is moved, its pin released, and the
    binding says so."""
    from cpupin.cli import main

    env = cpupin.child_env()
    child = subprocess.Popen(
        [sys.executable, "-c", BOUND_WORKER, where, pinned], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        inside = json.loads(child.stdout.readline())
        outside = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"])
        assert outside.returncode == 0, outside.stderr
        seen = json.loads(outside.stdout)
        audit = main(["audit", str(child.pid), "--fail-on-narrow", "--json"])
    finally:
        child.communicate("\n", timeout=60)
    cpu = two_cpus[0] if where == "first" else two_cpus[1]
    assert inside["strays"] == []
    assert seen["process_mask"] == [cpu], seen["process_mask_from"]
    assert "its record" in seen["process_mask_from"]
    stray_outside = [t["tid"] for t in seen["threads"] if t["mask"] != [cpu]]
    assert stray_outside == [] and sum(p["stray"] for p in seen["pools"]) == 0
    assert audit == 0
    if pinned == "inside":
        assert inside["pins"] == {str(inside["stepper"]): [cpu]} and inside["reason"] == ""
    elif pinned == "outside":
        assert inside["pins"] == {} and inside["stepper_mask"] == [cpu]
        assert "pins released" in inside["reason"] and str(inside["stepper"]) in inside["reason"]
    else:
        assert inside["pins"] == {} and inside["stepper_mask"] == [cpu]


# --- pool variables read as the runtimes read them ---------------------------

OMP_VALUES = [
    "+64", "1000000", "0", "", " ", "-1", "-0", "2x", "1e3", "0x4", "00003", " 3 ", "\t2\n",
    "4,2", "4, 2", "4,x", "3,0", " +2,+1", "4,", ",4", "9223372036854775807",
    "9223372036854775808", "18446744073709551616", "1,2,3,4", "+", "1 2",
]  # fmt: skip


def _libgomp():
    import ctypes.util

    name = ctypes.util.find_library("gomp")
    if name is None:
        pytest.skip("no libgomp here (GCC's OpenMP runtime, the oracle)")
    return name


GOMP = """
import ctypes, sys
print(ctypes.CDLL(sys.argv[1]).omp_get_max_threads())
"""


def _libgomp_reads(lib, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_NUM_THREADS"] = value
    out = run([sys.executable, "-c", GOMP, lib], env=env)
    assert out.returncode == 0, out.stderr
    return int(out.stdout), "Invalid value" in out.stderr


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(
        st.sampled_from(OMP_VALUES),
        st.lists(st.one_of(st.integers(-3, 300).map(str), st.sampled_from(["", " ", "+7", "a"])),
                 min_size=1, max_size=3).map(",".join),
        st.text(alphabet=" +-,0123456789x\t", max_size=8),
    )
)  # fmt: skip
def test_omp_num_threads_is_read_as_libgomp_reads_it(value):
    """The oracle is libgomp itself: ``omp_get_max_threads()`` in a process
    started with the value. A refused value is one thread a CPU."""
    if "\x00" in value:
        return
    lib = _libgomp()
    mask = len(os.sched_getaffinity(0))
    got, refused = _libgomp_reads(lib, value)
    ours = pool_threads("OMP_NUM_THREADS", {"OMP_NUM_THREADS": value}, mask)
    if got >= 0 and ours < 1 << 31:  # libgomp's int cuts what is larger
        assert ours == got, (value, ours, got)
    assert (omp_num_threads(value) is None) == refused


OPENBLAS = """
import json, numpy, threadpoolctl
print(json.dumps([i["num_threads"] for i in threadpoolctl.threadpool_info()
                  if i["internal_api"] == "openblas"]))
"""


@pytest.mark.parametrize("value", ["+64", "1000000", "0", "", "-1", "2x", "1", " 1 "])
@pytest.mark.parametrize("omp", [None, "1"])
def test_openblas_num_threads_is_read_as_openblas_reads_it(value, omp):
    pytest.importorskip("numpy", reason="numpy's OpenBLAS is the oracle")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env["OPENBLAS_NUM_THREADS"] = value
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = run([sys.executable, "-c", OPENBLAS], env=env)
    assert out.returncode == 0, out.stderr
    (got,) = json.loads(out.stdout)
    mask = len(os.sched_getaffinity(0))
    assert pool_threads("OPENBLAS_NUM_THREADS", env, mask) == got


@pytest.mark.parametrize("value", ["+64", "1000000", "0", "", "2x", "-1"])
def test_a_pool_variable_that_oversubscribes_is_named_with_what_the_runtime_makes_of_it(value):
    """With one usable CPU (a quota) in a mask of two, each of these gives
    libgomp a team larger than the usable CPUs: the doctor's advice and
    ``pool_env`` (what ``exec`` warns of) say so."""
    from cpupin.host.cgroup import Quota

    plan = CpuPlan(frozenset({0, 1}), quota=Quota(100_000, 100_000, "cpu.max"))
    assert plan.usable_cpus == 1
    env = {"OMP_NUM_THREADS": value}
    lines, advice = environment_advice(plan, 2, env)
    assert any(line.startswith("OMP_NUM_THREADS=") for line in lines), lines
    assert advice["OMP_NUM_THREADS"] == 1
    _, limits = pool_env(plan, env, host_cpus=2)
    assert "OMP_NUM_THREADS" in limits.oversubscribed
    assert "oversubscribed" in limits.kept["OMP_NUM_THREADS"]


@given(st.one_of(st.text(max_size=40), st.integers(1, 64).map(str)), st.integers(1, 64).map(str))
def test_a_value_the_user_put_in_place_of_cpupins_is_kept(user, recorded):
    """``CPUPIN_POOL_VARS`` handed down names OMP_NUM_THREADS with the value
    cpupin set; a different value now in its place is the user's: kept by
    every later cap."""
    plan = CpuPlan(frozenset({0, 1, 2, 3}), pinned=frozenset({0, 1}))
    env = {"OMP_NUM_THREADS": user, "CPUPIN_POOL_VARS": f"OMP_NUM_THREADS={recorded}"}
    out, limits = pool_env(plan, env, host_cpus=4)
    if user != recorded:
        assert out["OMP_NUM_THREADS"] == user and "by the user" in limits.kept["OMP_NUM_THREADS"]
    else:
        assert "OMP_NUM_THREADS" not in limits.kept or "by the user" not in limits.kept[
            "OMP_NUM_THREADS"]  # fmt: skip


@pytest.mark.parametrize("taken", [1, 2, 4])
def test_top_json_of_a_process_that_exits_prints_the_samples_it_took(taken, monkeypatch, capsys):
    """``--count`` samples asked, the process exits after ``taken`` of them:
    the JSON document still prints, with the samples taken and why it
    stopped, and the command says so and exits 2."""
    from cpupin.cli import main
    from cpupin.cli import top as top_module

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    real = top_module.Sampler

    class EndsAfter(real):
        done = 0

        def stop(self):
            out = super().stop()
            EndsAfter.done += 1
            if EndsAfter.done == taken:
                child.communicate(b"")  # exits, and is reaped
            return out

    monkeypatch.setattr(top_module, "Sampler", EndsAfter)
    try:
        rc = main(["top", str(child.pid), "--count", "9", "--interval", "0.01", "--json"])
    finally:
        child.kill()
        child.wait()
    out, err = capsys.readouterr()
    assert rc == 2
    got = json.loads(out)
    assert got["pid"] == child.pid and len(got["samples"]) == taken
    assert "exited" in got["stopped"] and f"pid {child.pid} exited" in err


# --- bounded work on hostile captures -------------------------------------------


@pytest.mark.parametrize("rows", [20_000, 2_000_000])
def test_a_huge_proc_interrupts_is_read_to_a_bound_and_says_so(rows):
    """Millions of IRQ rows (a capture within the read limit): at most
    MAX_IRQS are kept (each would cost its affinity files), and a reason
    says where reading stopped."""
    from cpupin.host.irqs import MAX_IRQS, parse_interrupts

    text = "           CPU0       CPU1\n" + "".join(
        f"{i}: 1 2 IR-PCI-MSI eth0-rx-{i}\n" for i in range(rows)
    )
    reasons = []
    got = parse_interrupts(text, reasons)
    assert len(got.counts) == min(rows, MAX_IRQS)
    assert got.counts["0"] == (1, 2)
    assert any("read no further" in r for r in reasons) == (rows > MAX_IRQS)


class _Values:
    """A Reader that answers integer() from a table (path -> value)."""

    def __init__(self, table):
        self.table = table
        self.reasons = []

    def integer(self, rel, lo, hi):
        return self.table.get(rel)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=1, max_size=300))
def test_core_classes_group_every_core_once_whatever_their_number(perfs):
    """The classes of any number of cores and of distinct speeds: each core
    in exactly one class, the counts add up, and each class's value is the
    highest of its cores (the oracle: grouping by the cores' own ranks)."""
    from cpupin.host.topology import Core, _classes

    cores = tuple(Core((i,)) for i in range(len(perfs)))
    table = {}
    for i, (perf, cap) in enumerate(perfs):
        table[f"sys/devices/system/cpu/cpu{i}/acpi_cppc/highest_perf"] = perf * 100
        table[f"sys/devices/system/cpu/cpu{i}/cpu_capacity"] = cap * 400
    ranked, classes = _classes(_Values(table), cores)
    assert sum(c.cores for c in classes) == len(cores)
    by_rank = {}
    for i, core in enumerate(ranked):
        by_rank.setdefault(core.rank, []).append(i)
    assert sorted(by_rank) == [c.rank for c in classes]
    for c in classes:
        mine = by_rank[c.rank]
        assert c.cores == len(mine)
        assert c.values["highest_perf"] == max(perfs[i][0] * 100 for i in mine)


EVERY_CPU_PINNED = r"""
import json, os, sys, threading
import cpupin
first, second = sorted(cpupin.process_cpus())[:2]
stop = threading.Event()
tids = {}
def pinned(cpu, role):
    cpupin.pin_current_thread({cpu}, role=role)
    tids[role] = threading.get_native_id()
    stop.wait()
def narrowed():
    os.sched_setaffinity(0, {first})  # onto a pinned CPU, not registered: the stray
    tids["stray"] = threading.get_native_id()
    stop.wait()
def plain():
    tids.setdefault("plain", []).append(threading.get_native_id())
    stop.wait()
threads = [cpupin.Thread(target=pinned, args=(first, "step")),
           cpupin.Thread(target=pinned, args=(second, "result")),
           threading.Thread(target=narrowed)]
threads += [cpupin.Thread(target=plain) for _ in range(4)]  # a pool, on the process mask
for t in threads: t.start()
while len(tids) < 4 or len(tids.get("plain", [])) < 4:
    pass
print(json.dumps(tids), flush=True)
sys.stdin.readline()
stop.set()
"""


def test_ps_flags_only_the_thread_narrowed_onto_a_pinned_cpu(two_cpus, lock_dir):
    """A plan that pins every CPU of the mask (step on one, result on the
    other): the main thread and a pool on the process mask are not
    interlopers; the one thread narrowed onto a pinned CPU without a
    registered pin is, and ps names it alone."""
    child = subprocess.Popen(
        [sys.executable, "-c", EVERY_CPU_PINNED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "CPUPIN_LOCK_DIR": str(lock_dir)},
    )  # fmt: skip
    try:
        tids = json.loads(child.stdout.readline())
        out = run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval", "0.05"])
    finally:
        child.communicate("\n", timeout=60)
    assert out.returncode == 0, out.stderr
    (proc,) = [p for p in json.loads(out.stdout)["processes"] if p["pid"] == child.pid]
    assert [t["tid"] for t in proc["interlopers"]] == [tids["stray"]]


@pytest.mark.parametrize("python", [(3, 10), (3, 11), (3, 12), (3, 13), (3, 14)])
def test_the_doctor_advises_python_cpu_count_only_where_python_reads_it(python):
    from cpupin.host.cgroup import Quota

    plan = CpuPlan(frozenset({0, 1}), quota=Quota(100_000, 100_000, "cpu.max"))
    lines, advice = environment_advice(plan, 2, {}, python=python)
    text = " ".join(lines)
    if python >= (3, 13):
        assert advice["PYTHON_CPU_COUNT"] == 1 and "PYTHON_CPU_COUNT unset" in text
    else:
        assert "PYTHON_CPU_COUNT" not in advice and "does not read PYTHON_CPU_COUNT" in text
    assert advice["OMP_NUM_THREADS"] == 1  # a fix on every version


@pytest.mark.parametrize("setting", ["off", "auto", "3"])
def test_plan_off_on_a_host_without_a_gpu_is_not_an_error(setting, capsys, tmp_path):
    """On a GPU-less host's tree: the user asked for off, and nothing is
    pinned, which is no error; auto (or a CPU) with nothing to place by
    is, and each says how to see a placement."""
    import dataclasses

    from cpupin.cli import main
    from cpupin.host.shapes import HOSTS, build_tree

    root = build_tree(dataclasses.replace(HOSTS["h100-vm"], gpus=()), tmp_path / "t")
    rc = main(["plan", "--root", str(root), "--setting", setting])
    out, err = capsys.readouterr()
    if setting == "off":
        assert rc == 0 and "nothing is pinned" in out and "cpupin plan --setting" in out
    else:
        assert rc == 2 and f"so {setting} has no device to place by" in err
        assert "cpupin plan --setting" in err


@pytest.mark.parametrize(
    "command, words",
    [
        ([], ["examples:", "exit codes:", "cpupin exec --node 0 -- CMD"]),
        (["threads"], ["census", "oversubscribed", "sized from the host", "idle", "spinning"]),
        (["top"], ["'quota'", "'contention'", "stalled"]),
        (["ps"], ["with a record in the lock directory", "--all", "cpupin threads PID"]),
        (["doctor"], ["reads the cgroup", "--pid", "three times"]),
        (["exec"], ["Name one target", "torchrun -- cpupin exec --node 0"]),
    ],
)
def test_each_help_says_what_a_newcomer_needs(command, words):
    out = run([sys.executable, "-m", "cpupin", *command, "--help"])
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for word in words:
        assert word in text, (word, out.stdout)


ONE_PROCESS = r"""
import json, os, sys
import torch, cpupin
order = sys.argv[1]
if order == "limit first":
    cpupin.limit_pools()
plan = cpupin.plan_server(0, ["w0"], lock_dir=sys.argv[2])
if order == "plan first":
    cpupin.limit_pools(plan.cpu_plan)
print(json.dumps({"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                  "usable": plan.cpu_plan.usable_cpus, "pinned": sorted(plan.placement.cpus)}))
"""


@pytest.mark.parametrize("order", ["limit first", "plan first"])
def test_a_one_process_runtime_gets_the_same_pools_in_either_order(order, two_cpus, tmp_path):
    """limit_pools() then a plan that pins both CPUs (step and result), or
    the plan then limit_pools(plan.cpu_plan): torch ends with the plan's
    pool size either way (the oracle: torch's own count)."""
    pytest.importorskip("torch", reason="torch's pool is the one a runtime steps with")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env.pop("CPUPIN_POOL_VARS", None)
    env.pop("CPUPIN_STEP_THREAD_CORE", None)
    out = run([sys.executable, "-c", ONE_PROCESS, order, str(tmp_path)], env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["pinned"] == two_cpus and got["usable"] == 1
    assert got["torch"] == 1 and got["omp"] == "1"


@pytest.mark.parametrize("how", [["--node", "0"], ["--cpus", "0"]])
def test_exec_leaves_no_record_behind(how, lock_dir):
    """cpupin exec binds, then becomes the command: a record it wrote (the
    new process mask) would outlive it, a stale file a run."""
    out = run([sys.executable, "-m", "cpupin", "exec", *how, "--", sys.executable, "-c",
               "import os; print(os.getpid())"])  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [n for n in os.listdir(lock_dir) if n.startswith("cpupin-")] == []


# --- every finding with its remedy -------------------------------------------------


@given(
    st.sampled_from(["ThreadPoolExecutor-0", "torch intra-op", "openmp (libgomp.so.1)",
                     "openblas (libscipy_openblas.so)", "python", "ZMQbg/IO"]),
    st.integers(1, 64), st.integers(1, 16), st.integers(0, 8),
)  # fmt: skip
def test_a_pool_that_does_not_fit_says_what_to_do_and_one_that_fits_says_nothing(
    name, threads, usable, stray
):
    from cpupin.pools.census import Pool, verdict

    v = verdict(threads, usable, {64, 68})
    pool = Pool(name, threads, usable, v, "threads", (), min(stray, threads))
    text = pool.remedy
    if v == "fits" and not pool.stray:
        assert text == "" and pool.as_dict()["remedy"] is None
        return
    if v != "fits":
        assert f"{usable}" in text
        if "ThreadPoolExecutor" in name:
            assert f"max_workers={usable}" in text
        elif name.startswith(("torch", "openmp")):
            assert f"OMP_NUM_THREADS={usable}" in text
    if pool.stray:
        assert "inherited a pin" in text and "cpupin.Thread" in text


@pytest.mark.parametrize("stalls", [{"quota"}, {"contention"}, {"quota", "contention"}, set()])
def test_top_names_what_to_do_for_each_kind_of_stall(stalls):
    from cpupin.cli.top import stall_remedies

    got = stall_remedies(stalls, 4242, 3)
    assert len(got) == len(stalls)
    text = " ".join(got)
    if "quota" in stalls:
        assert "at most 3 busy thread(s)" in text and "raise the quota" in text
    if "contention" in stalls:
        assert "cpupin threads 4242" in text
    capped = " ".join(stall_remedies(stalls, 4242, 3, capped=True))
    if "quota" in stalls:  # its pools are capped already: capping is not the advice
        assert "already capped" in capped and "limit_pools" not in capped
        assert "raise the quota" in capped


def test_threads_prints_a_remedy_under_a_pool_sized_from_the_host(capsys):
    """A real ThreadPoolExecutor sized from the host, in this process: the
    census line is followed by what to do."""
    import concurrent.futures as cf

    from cpupin.cli._pools import pool_lines
    from cpupin.pools.census import census

    with cf.ThreadPoolExecutor() as pool:
        gate = threading.Barrier(pool._max_workers + 1)
        for _ in range(pool._max_workers):
            pool.submit(gate.wait)
        gate.wait()
        found = census()
    lines = pool_lines([p.as_dict() for p in found.pools])
    at = next(i for i, line in enumerate(lines) if "ThreadPoolExecutor" in line)
    if "fits" not in lines[at]:
        assert lines[at + 1].strip().startswith("-> ") and "max_workers=" in lines[at + 1]
