"""The host's view tried from outside: the registry and ``cpupin ps`` /
``audit`` against planted records and names (any content, any type, any
owner, any number of them), valid Prometheus exposition for any number of
processes, and cpupin's state across fork, signal handlers and exit."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpupin
from cpupin.cli import main
from cpupin.registry import writer as registry
from cpupin.registry.prune import prune
from cpupin.registry.reader import read_registry
from tests.support.helpers import in_forked_child, run

NOBODY = 65534


@pytest.fixture
def lock_dir(monkeypatch):
    """A sticky, world-writable lock directory under /tmp, as /tmp itself
    is: another user (nobody) can reach it and plant files."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="cpupin-trust-", dir="/tmp"))
    os.chmod(path, 0o1777)
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def me():
    """This process's pid and start time: the name its record takes."""
    pid = os.getpid()
    return pid, cpupin.process.mask.start_time(pid)


def strict_json(text):
    """Parse as a strict parser would: NaN and Infinity refused."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def children(n, code):
    """n Python children each running ``code``, started and ready (each
    prints one line first); killed after."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout.readline()
    return procs


def stop(procs):
    for p in procs:
        p.kill()
        p.wait()


PINNER = """
import sys, cpupin
cpupin.pin_current_thread(cpupin.process_cpus(), role="step", name="stepper")
print("ready", flush=True)
sys.stdin.read()
"""


# --- the normal case ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
def test_ps_prometheus_is_valid_exposition_for_any_number_of_processes(lock_dir, capsys, n):
    from prometheus_client.parser import text_string_to_metric_families

    procs = children(n, PINNER)
    try:
        assert main(["ps", "--prometheus"]) == 0
        text = capsys.readouterr().out
    finally:
        stop(procs)
    for family in ("cpupin_thread_cpu_seconds_total", "cpupin_process_threads"):
        assert text.count(f"# HELP {family} ") == 1 and text.count(f"# TYPE {family} ") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    pids = {s.labels["pid"] for s in families["cpupin_process_threads"].samples}
    assert pids == {str(p.pid) for p in procs}
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    # promtool exits 1 for lint advice (none expected) and 1 for invalid input
    # too: what it printed tells them apart.
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --- hostile records --------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
FIELDS = ["version", "pid", "start_time", "uid", "time", "pins"]
PIN_FIELDS = ["tid", "name", "cpus", "role"]


def planted(pid, started, fields, pin):
    """A record body whose every field may be anything."""
    good = {"version": 1, "pid": pid, "start_time": started, "uid": os.geteuid(), "time": 1.0}
    pins = [{"tid": pid, "name": "x", "cpus": [0], "role": "step", **pin}]
    return {**good, "pins": pins, **fields}


def raw_json(obj):
    # Python's json writes NaN and Infinity, as a hostile writer may.
    return json.dumps(obj).encode()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fields=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3),
    pin=st.dictionaries(st.sampled_from(PIN_FIELDS), json_values, max_size=2),
    nest=st.integers(0, 200_000),
    big=st.booleans(),
)
def test_no_record_content_raises_out_of_the_reader_or_ps(lock_dir, capsys, fields, pin, nest, big):
    pid, started = me()
    body = raw_json(planted(pid, started, fields, pin))
    if nest:
        body = b"[" * nest + b"]" * nest  # deep enough to exhaust a recursive parser
    if big:
        body = body.replace(b'"time": 1.0', b'"time": 1' + b"9" * 5000)
    data = body + b"\n" + f"crc32={__import__('zlib').crc32(body):08x}\n".encode()
    name = lock_dir / f"cpupin-proc-{pid}-{started}.json"
    name.write_bytes(data)
    try:
        found = read_registry()  # never raises
        for record in found.records:
            json.dumps(record.as_dict(), allow_nan=False)
        assert main(["ps", "--interval", "0.01", "--json"]) == 0
        strict_json(capsys.readouterr().out)
        assert main(["ps", "--interval", "0.01"]) == 0
        capsys.readouterr().out.encode("utf-8")
    finally:
        name.unlink()


def test_a_record_of_a_root_process_written_by_another_user_is_ignored(lock_dir):
    """Another user plants a record naming a root process (this one) and
    its own uid: the file's owner is not the uid that process runs as, so
    the record does not vouch for the root process's threads."""
    os.chmod(lock_dir, 0o1777)
    pid, started = me()
    name = f"cpupin-proc-{pid}-{started}.json"
    for uid in (NOBODY, 0):
        record = planted(pid, started, {"uid": uid}, {"tid": pid})

        def plant(record=record):
            with open(lock_dir / name, "wb") as f:
                f.write(registry.encode(record, size=None))
            return True

        assert in_forked_child(plant, uid=NOBODY)
        found = read_registry()
        assert found.pins_of(pid) == [] and not found.knows(pid)
        assert any("runs as uid 0" in why for _, why in found.ignored), found.ignored
        os.unlink(lock_dir / name)


def test_a_server_record_counts_only_from_the_locks_holder(lock_dir):
    """A lock file nobody holds is stale and never read; one held by this
    process but naming another pid is ignored."""
    gpu = "0000:01:00.0"
    claim = cpupin.claim_gpus([gpu], lock_dir)
    pid, started = me()
    mask = sorted(cpupin.process_cpus())
    other = os.getppid()
    record = {
        "version": 1, "pid": other, "start_time": cpupin.process.mask.start_time(other),
        "uid": os.geteuid(), "time": 1.0, "setting": "auto", "devices": [gpu],
        "workers": [], "result_cpu": None, "process_mask": mask,
    }  # fmt: skip
    assert claim.write_record(record) == ""
    found = read_registry()
    assert found.records == [] and f"pid {pid} holds the lock" in found.ignored[0][1]
    assert claim.write_record({**record, "pid": pid, "start_time": started}) == ""
    (server,) = read_registry().records
    assert server.live and server.pid == pid
    claim.close()
    (server,) = read_registry().records
    assert not server.live and server.pid == 0  # not read: who wrote it is unknown


def test_unrelated_names_never_hide_a_record_and_limits_count_what_is_read(lock_dir):
    """Thousands of names that are not records, and thousands of records of
    processes that have exited or of CPUs this host lacks: the live record is
    found, and only so many are listed (the rest counted)."""
    for i in range(3000):
        (lock_dir / f"aaa-{i}").touch()
        (lock_dir / f"cpupin-proc-{4_000_000 + i}-1.json").touch()  # exited pids
    pid, started = me()
    wide = planted(pid, started, {}, {"cpus": [max(cpupin.online_cpus()) + 1]})
    for i in range(1, 4):
        (lock_dir / f"cpupin-proc-{pid}-{started}-{i}.json").write_bytes(
            registry.encode(wide, size=None)
        )
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
    try:
        found = read_registry()
        assert [p.role for p in found.pins_of(pid)] == ["step"]
        stale = [r for r in found.records if not r.live]
        assert len(stale) == registry.MAX_LISTED
        assert found.not_listed == 3000 - registry.MAX_LISTED + 3 - len(found.ignored)
        assert all("does not have online" in why for _, why in found.ignored)
    finally:
        pin.release()


def test_a_live_server_is_found_among_many_other_locks(lock_dir, tmp_path, monkeypatch):
    """/proc/locks of a busy host (100,000 other flocks before ours) is read
    whole: the holder is still found. The holder is the fake file's own pid
    (not this process, which the real /proc/locks shows), so the answer can
    only come from reading the fake to its last line."""
    from cpupin.registry import _files

    claim = cpupin.claim_gpus(["0000:01:00.0"], lock_dir)
    info = os.stat(lock_dir / "cpupin-gpu-0000:01:00.0.lock")
    ours = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    fake = tmp_path / "locks"
    holder = 4_000_000 - 1
    with open(fake, "w") as f:
        for i in range(100_000):
            f.write(f"{i + 1}: FLOCK  ADVISORY  WRITE {i + 10} 00:99:{i} 0 EOF\n")
        f.write(f"100001: FLOCK  ADVISORY  WRITE {holder} {ours} 0 EOF\n")
    monkeypatch.setattr(_files, "PROC_LOCKS", str(fake))
    try:
        key = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        holders = _files.flock_holders({key})
        assert list(holders.values()) == [holder]
    finally:
        claim.close()


# --- what the writer does ---------------------------------------------------------


def test_the_writer_never_follows_a_symlinked_lock_directory(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path / "link"))
    pin = cpupin.pin_current_thread(cpupin.process_cpus())
    pin.release()
    assert os.listdir(real) == []
    assert "symbolic link" in main_err(["ps", "--interval", "0.01"], tmp_path / "link")


def main_err(argv, where):
    out = run([sys.executable, "-m", "cpupin", *argv, "--lock-dir", str(where)])
    return out.stdout + out.stderr


def test_a_lock_file_with_a_second_link_is_refused(lock_dir):
    gpu = "0000:02:00.0"
    (lock_dir / "elsewhere").touch()
    os.link(lock_dir / "elsewhere", lock_dir / f"cpupin-gpu-{gpu}.lock")
    claim = cpupin.claim_gpus([gpu], lock_dir)
    assert not claim and "2 hard links" in claim.reason


@pytest.mark.parametrize("squat", ["directory", "file", "fifo"])
def test_a_squatted_record_name_is_passed_over(lock_dir, squat):
    """Another user (nobody) owns something at a process's record name in a
    sticky directory: the record goes under the next name, and is read. The
    pinning process runs as a third user: root may rename over anything."""
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            os.setgid(12345)
            os.setuid(12345)
            os.read(go_read, 1)
            started = cpupin.process.mask.start_time(os.getpid())
            pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
            second = lock_dir / f"cpupin-proc-{os.getpid()}-{started}-1.json"
            found = read_registry().pins_of(os.getpid())
            ok = second.is_file() and [p.role for p in found] == ["step"]
            pin.release()  # the record stays, with no pins, until the process exits
            ok = ok and second.is_file() and read_registry().pins_of(os.getpid()) == []
        finally:
            os._exit(0 if ok else 1)
    name = lock_dir / f"cpupin-proc-{pid}-{cpupin.process.mask.start_time(pid)}.json"

    def plant():
        if squat == "directory":
            os.mkdir(name)
        elif squat == "file":
            name.write_text("mine")
        else:
            os.mkfifo(name)
        return True

    try:
        assert in_forked_child(plant, uid=NOBODY)
    finally:
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        os.close(go_read)
        os.close(go_write)
    assert os.waitstatus_to_exitcode(status) == 0
    assert name.exists()  # the squatter's, untouched


FULL_DISK = """
import os, resource, sys, threading, cpupin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="first")
size = max(os.path.getsize(os.path.join(sys.argv[1], n)) for n in os.listdir(sys.argv[1]))
if sys.argv[2] == "grow":  # a record that outgrows its slot, on a nearly full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8, size + 8))
    gate = threading.Barrier(81)
    def pin_and_wait():
        cpupin.pin_current_thread(cpupin.process_cpus(), role="many" * 8)
        gate.wait()
        gate.wait()
    threads = [threading.Thread(target=pin_and_wait) for _ in range(80)]
    for t in threads:
        t.start()
    gate.wait()
else:  # a limit below the file's size: a write in place would be cut short
    resource.setrlimit(resource.RLIMIT_FSIZE, (size - 100, size - 100))
    cpupin.pin_current_thread(cpupin.process_cpus(), role="second")
found = read_registry()
print(sorted({p.role for p in found.pins_of(os.getpid())}), len(found.pins_of(os.getpid())),
      len(found.ignored))
print(sorted(n for n in os.listdir(sys.argv[1]) if n.endswith(".tmp")))
print([r.out_of_date for r in found.records if r.pid == os.getpid()])
if sys.argv[2] == "grow":
    gate.wait()
"""


@pytest.mark.parametrize("how", ["grow", "limit below the file"])
def test_a_short_write_keeps_the_good_record(lock_dir, how):
    """The record is updated in place while its layout holds it: a store
    into its mapping, which no file size limit cuts short (a limit below
    the file's size changes nothing). A record that outgrows its layout on
    a full disk goes through a new file, which fails whole: the last good
    record stays, readable, marked out of date with why, and nothing is
    left; the warning says what ps shows."""
    out = run([sys.executable, "-c", FULL_DISK, str(lock_dir), how.split()[0]])
    assert out.returncode == 0, out.stderr
    found, tmps, stale = out.stdout.splitlines()
    roles, pins, ignored = found.rsplit(" ", 2)
    assert tmps == "[]" and ignored == "0"
    if how == "grow":  # as many of the 80 as have slots, then no more
        assert stale == "['an update failed: File too large']", out.stdout + out.stderr
        assert "cpupin ps shows the record written before, marked out of date" in out.stderr
        assert roles == "['first', 'manymanymanymanymanymanymanymany']" and 1 < int(pins) < 81
    else:
        assert stale == "['']" and "cpupin:" not in out.stderr, out.stdout + out.stderr
        assert roles == "['second']" and pins == "1"


RELATIVE = """
import os, sys, cpupin
from cpupin.registry import writer as registry
os.chdir("/")
pin = cpupin.pin_current_thread(cpupin.process_cpus())
print(registry.lock_dir(), len(os.listdir(sys.argv[1])))
"""


def test_a_relative_lock_dir_is_resolved_once_at_start(tmp_path):
    (tmp_path / "locks").mkdir()
    env = {**os.environ, "CPUPIN_LOCK_DIR": "locks"}
    out = subprocess.run(
        [sys.executable, "-c", RELATIVE, str(tmp_path / "locks")],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == [str(tmp_path / "locks"), "1"]


# --- printing what came from outside -------------------------------------------------

NAMED = """
import sys, cpupin
name = sys.stdin.buffer.readline().rstrip(b"\\n")
with open("/proc/thread-self/comm", "wb") as f:
    f.write(name[:15])
cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
print("ready", flush=True)
sys.stdin.read()
"""


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.binary(min_size=1, max_size=15).filter(lambda b: b"\n" not in b and b"\0" not in b))
def test_thread_and_file_names_are_printed_safely(lock_dir, capsys, name):
    (lock_dir / os.fsdecode(b"cpupin-proc-\xff\x1b[31m.json")).touch()
    child = subprocess.Popen(
        [sys.executable, "-c", NAMED], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        child.stdin.write(name + b"\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"ready\n"
        assert main(["ps", "--interval", "0.01"]) == 0
        text = capsys.readouterr().out
        assert main(["threads", str(child.pid)]) == 0
        text += capsys.readouterr().out
        assert main(["top", str(child.pid), "--count", "1", "--interval", "0.01"]) == 0
        text += capsys.readouterr().out
    finally:
        child.kill()
        child.wait()
    text.encode("utf-8")  # never an undecodable name
    assert not any(c in text for c in "\x1b\r\x07\x08") and all(
        line.isprintable() for line in text.splitlines()
    )


def test_a_long_thread_name_never_drops_the_record(lock_dir):
    box = {}

    def step():
        box["pin"] = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")

    t = cpupin.Thread(target=step, name="n" * 500)
    t.start()
    t.join()
    found = read_registry()
    (pin,) = found.pins_of(os.getpid())
    assert pin.role == "step" and pin.name.startswith("nnnn") and len(pin.name) <= 64


# --- fork, signals, exit, concurrency --------------------------------------------------

FORKER = """
import os, sys, threading, cpupin
stop = threading.Event()
def pinner():
    cpus = cpupin.process_cpus()
    while not stop.is_set():
        cpupin.pin_current_thread(cpus).release()
threads = [cpupin.Thread(target=pinner) for _ in range(3)]
for t in threads: t.start()
ok = 0
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        signal_alarm = __import__("signal").alarm(20)  # a hang fails, not blocks
        cpupin.pin_current_thread(cpupin.process_cpus()).release()
        cpupin.pinned_threads()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    ok += status == 0
stop.set()
for t in threads: t.join()
print(ok)
"""


def test_a_fork_while_other_threads_pin_never_leaves_a_lock_held(lock_dir):
    out = run([sys.executable, "-c", FORKER, "30"], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "30", out.stderr


STALLED_IMPORT = """
import os, signal, sys, threading, cpupin
assert "json" not in sys.modules  # a pin's record imports it on first use
entered, go = threading.Event(), threading.Event()
class Stall:
    # holds the import of json in the importing thread, under its import lock
    def find_spec(self, name, path=None, target=None):
        if name == "json" and threading.current_thread() is not threading.main_thread():
            entered.set()
            go.wait()
        return None
sys.meta_path.insert(0, Stall())
importer = cpupin.Thread(target=__import__, args=("json",))
importer.start()
entered.wait()
threading.Timer(0.2, go.set).start()  # whenever it ends, the fork goes on
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hang fails, not blocks
    cpupin.pin_current_thread(cpupin.process_cpus()).release()
    os._exit(0)
_, status = os.waitpid(pid, 0)
importer.join()
print(status)
"""


def test_a_fork_while_another_thread_imports_what_a_pin_needs_never_hangs_the_child(lock_dir):
    # Another thread importing json when one forks: the child's first pin
    # (whose record imports it) would wait for ever on an import lock no
    # thread of the child holds; the fork waits for the import instead.
    out = run([sys.executable, "-c", STALLED_IMPORT], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0", (out.stdout, out.stderr)


SIGNALLED = """
import signal, sys, time, cpupin
cpus = cpupin.process_cpus()
calls = 0
def on_alarm(signum, frame):
    global calls
    calls += 1
    cpupin.pinned_threads()
    cpupin.pin_current_thread(cpus, role="handler").release()
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
end = time.monotonic() + 2
while time.monotonic() < end:
    cpupin.pin_current_thread(cpus).release()
signal.setitimer(signal.ITIMER_REAL, 0, 0)
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
print(calls, len(read_registry().pins_of(__import__("os").getpid())))
"""


def test_a_signal_handler_that_calls_cpupin_never_deadlocks(lock_dir):
    out = run([sys.executable, "-c", SIGNALLED], timeout=60)
    assert out.returncode == 0, out.stderr
    calls, left = map(int, out.stdout.split())
    assert calls > 10 and left == 0  # every pin released: no record is left behind


DAEMONS = """
import os, sys, threading, cpupin
def pinner():
    cpus = cpupin.process_cpus()
    while True:
        cpupin.pin_current_thread(cpus)
for _ in range(4):
    cpupin.Thread(target=pinner, daemon=True).start()
while not any(n.startswith("cpupin-proc-") for n in os.listdir(sys.argv[1])):
    pass
print("pinning", flush=True)
if sys.argv[2] == "term":
    sys.stdin.read()
"""


def test_a_clean_exit_with_daemons_pinning_leaves_nothing(lock_dir):
    for _ in range(5):
        out = run([sys.executable, "-c", DAEMONS, str(lock_dir), "exit"], timeout=60)
        assert out.returncode == 0 and out.stdout == "pinning\n", out.stderr
        assert os.listdir(lock_dir) == []


def test_sigterm_leaves_a_stale_record_that_prune_removes(lock_dir, capsys):
    child = subprocess.Popen(
        [sys.executable, "-c", DAEMONS, str(lock_dir), "term"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout.readline() == "pinning\n"
    child.send_signal(signal.SIGTERM)
    child.wait()
    (record,) = [r for r in read_registry().records if r.pid == child.pid]
    assert not record.live and "exited" in record.why_stale
    assert main(["ps", "--interval", "0.01", "--prune"]) == 0
    assert "pruned" in capsys.readouterr().err
    assert [n for n in os.listdir(lock_dir) if n.startswith("cpupin-proc-")] == []


def test_prune_leaves_other_users_records(lock_dir):
    os.chmod(lock_dir, 0o1777)
    name = lock_dir / "cpupin-proc-4000000-1.json"
    assert in_forked_child(lambda: name.write_bytes(b"x") or True, uid=NOBODY)
    assert prune(lock_dir) == [] and name.exists()


BINDING = """
import threading, time, cpupin
first = min(cpupin.process_cpus())
stop = threading.Event()
def spawner():  # starts threads all the time, each from a thread not yet moved
    while not stop.is_set():
        threading.Thread(target=time.sleep, args=(0.01,), daemon=True).start()
        time.sleep(0.0005)
threading.Thread(target=spawner, daemon=True).start()
time.sleep(0.05)
cpupin.set_process_cpus({first})
binding = cpupin.bind_process(node=0, memory="none")
masks = {cpupin.get_affinity(st.tid) for st in cpupin.thread_stats()}
stop.set()
print(binding.reason == "" and masks == {frozenset({first})} or "threads" in binding.reason)
"""


def test_bind_process_moves_threads_started_while_it_runs():
    out = run([sys.executable, "-c", BINDING], timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr


C_THREAD = """
import _thread, os, threading, time, cpupin
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
done = threading.Event()
def raw():
    cpupin.pin_current_thread(cpupin.process_cpus(), role="from-c")
    done.set()
    time.sleep(30)
_thread.start_new_thread(raw, ())
done.wait()
print([p.role for p in read_registry().pins_of(os.getpid())])
"""


def test_a_pin_of_a_thread_started_through_thread_is_recorded(lock_dir):
    out = run([sys.executable, "-c", C_THREAD], timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "['from-c']", out.stderr


def test_exec_starts_the_command_with_default_signal_dispositions():
    shell = (
        f"{sys.executable} -m cpupin exec --node 0 --memory none -- yes | head -1 >/dev/null; "
        'echo "${PIPESTATUS[0]}"'
    )
    out = run(["bash", "-c", shell])
    assert out.stdout.strip() == "141", out.stdout + out.stderr  # 128 + SIGPIPE, as yes alone
    ignored = run([sys.executable, "-m", "cpupin", "exec", "--node", "0", "--memory", "none",
                   "--", "grep", "SigIgn", "/proc/self/status"]).stdout  # fmt: skip
    assert ignored == run(["grep", "SigIgn", "/proc/self/status"]).stdout


# --- smaller truths ----------------------------------------------------------------------


def test_plan_device_follows_cuda_visible_devices(capsys, monkeypatch):
    from cpupin.host.shapes import host_named

    host = host_named("dgx-h100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert main(["plan", "--host", "dgx-h100", "--device", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert json.dumps(data).count(host.gpus[3].address) >= 1
    assert host.gpus[0].address not in json.dumps(data)


AUDITED = """
import os, sys, threading, cpupin
os.environ["CPUPIN_LOCK_DIR"] = sys.argv[1]  # set at run time, after start
threading.Thread(target=sys.stdin.read, daemon=True).start()  # on the process mask
cpupin.pin_current_thread({min(cpupin.process_cpus())}, role="step")
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_audit_finds_a_lock_dir_set_at_run_time(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CPUPIN_LOCK_DIR", raising=False)
    child = subprocess.Popen(
        [sys.executable, "-c", AUDITED, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "ready\n"
        assert main(["audit", str(child.pid), "--fail-on-narrow"]) == 3  # not found
        capsys.readouterr()
        assert main(["audit", str(child.pid), "--fail-on-narrow", "--lock-dir", str(tmp_path)]) == 0
        assert "1 registered pin(s)" in capsys.readouterr().out
        monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))  # this command's own
        assert main(["audit", str(child.pid), "--fail-on-narrow"]) == 0
    finally:
        child.kill()
        child.wait()


def test_top_of_a_pid_that_never_existed_says_so(capsys):
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    assert main(["top", str(pid), "--count", "1", "--interval", "0.01"]) == 2
    assert f"pid {pid}: no such process" in capsys.readouterr().err


def test_top_of_a_pid_that_exits_mid_sampling_says_it_exited(capsys):
    import threading

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    threading.Thread(target=child.wait).start()  # reaped as it exits: no zombie
    time.sleep(0.1)
    try:
        assert main(["top", str(child.pid), "--count", "1", "--interval", "1"]) == 2
        assert f"pid {child.pid} exited" in capsys.readouterr().err
    finally:
        child.wait()


def test_exec_says_when_cpus_and_memory_are_on_different_nodes(capsys):
    from cpupin.host.shapes import host_named

    host = host_named("dgx-h100")
    gpu = next(g for g in host.gpus if g.node == 1)
    node0 = next(n.cpus for n in host.nodes if n.id == 0)
    argv = ["exec", "--host", "dgx-h100", "--gpu", gpu.address, "--dry-run",
            "--mask", cpupin.format_cpulist(node0), "--", "true"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "different nodes" in out and "memory preferred on node 1" in out


def test_prune_removes_every_stale_record_not_only_those_listed(lock_dir):
    """More stale records than a read lists: prune still removes them all."""
    count = registry.MAX_LISTED + 50
    for i in range(count):
        (lock_dir / f"cpupin-proc-{4_000_000 + i}-1.json").write_bytes(b"x")
    assert len(prune(lock_dir)) == count
    assert os.listdir(lock_dir) == []
