"""The registry in the lock directory: records written and read back, stale
and reused pids, hostile files, no torn record under concurrent writes,
cpupin ps over all of them, and the Prometheus collector."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cpupin
from cpupin.cli import main
from cpupin.host.shapes import HOSTS, build_tree, host_named
from cpupin.registry import writer as registry
from cpupin.registry.reader import read_registry
from tests.support.helpers import ready_child
from tests.support.json_shapes import SECTIONS, same_shape

GPU7 = "0000:fa:00.0"
MASK = set(range(96, 104)) | set(range(224, 232))
#: A record is read against the CPUs of the host it is on: the B300's here.
B300 = host_named("xeon6-b300").cpus


def serve_here(lock_dir):
    """A server's claim of GPU7 with a record of this machine's CPUs (what a
    server on this host writes), still held."""
    claim = cpupin.claim_gpus([GPU7], lock_dir)
    assert claim
    mask = sorted(cpupin.process_cpus())
    record = {
        "version": 1,
        "pid": os.getpid(),
        "start_time": cpupin.process.mask.start_time(os.getpid()),
        "uid": os.geteuid(),
        "time": 1.0,
        "setting": "auto",
        "devices": [GPU7],
        "workers": [{"device": GPU7, "cpus": mask[:1]}],
        "result_cpu": mask[-1],
        "process_mask": mask,
    }
    assert claim.write_record(record) == ""
    return claim


@pytest.fixture(scope="module")
def b300_root(tmp_path_factory):
    return build_tree(HOSTS["xeon6-b300"], tmp_path_factory.mktemp("b300"))


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    return tmp_path


# --- the format ---------------------------------------------------------------


def test_a_record_round_trips_and_fills_its_slot():
    record = {"version": 1, "pid": 5, "x": [1, 2, 3]}
    data = registry.encode(record)
    assert len(data) == registry.SLOT and registry.decode(data) == record


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"", "no record"),
        (b"   \n", "no record"),
        (b'{"version": 1}\ncrc32=00000000\n', "checksum"),
        (b"garbage\x00\xff\n", "no record"),
        (registry.encode({"version": 2}), "version-1"),
        (registry.encode({"version": 1, "pid": 12345})[:12], "no record"),
    ],
)
def test_a_bad_record_is_a_reason_never_an_exception(raw, says):
    with pytest.raises(ValueError, match=says):
        registry.decode(raw)


def test_an_edited_byte_is_caught_by_the_checksum():
    data = bytearray(registry.encode({"version": 1, "pid": 1234}))
    data[data.index(b"1234")] = ord("9")
    with pytest.raises(ValueError, match="checksum"):
        registry.decode(bytes(data))


# --- servers ------------------------------------------------------------------


def test_a_claiming_server_writes_its_record_and_ps_reads_it(b300_root, lock_dir):
    plan = cpupin.plan_server("auto", [GPU7], root=b300_root, mask=MASK, environ={})
    try:
        assert plan.pinned
        found = read_registry(cpus=B300)
        (server,) = found.records
        assert server.kind == "server" and server.live and server.pid == os.getpid()
        assert server.workers == ((GPU7, frozenset({97, 225})),)
        assert server.result_cpu == 102 and server.setting == "auto"
        assert server.process_mask == MASK and server.uid == os.geteuid()
        assert os.path.getsize(lock_dir / f"cpupin-gpu-{GPU7}.lock") == registry.SLOT
    finally:
        plan.claim.close()
    # Released: the record stays in the file, stale, since nobody holds the lock.
    (server,) = read_registry(cpus=B300).records
    assert not server.live and "nobody holds its lock" in server.why_stale


HOLDER = """
import sys
from cpupin import plan_server
p = plan_server("auto", [{gpu!r}], root={root!r}, mask={mask!r}, environ={{}})
print(p.pinned, flush=True)
sys.stdin.read()
"""


def test_a_killed_holder_is_stale_and_a_second_server_names_the_holders_pid(b300_root, lock_dir):
    code = HOLDER.format(gpu=GPU7, root=str(b300_root), mask=sorted(MASK))
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        second = cpupin.plan_server("auto", [GPU7], root=b300_root, mask=MASK, environ={})
        assert not second.pinned and f"(pid {holder.pid})" in second.placement.reason
        (server,) = read_registry(cpus=B300).records
        assert server.live and server.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Nobody holds it now: stale, and not read (who wrote it cannot be told).
    (server,) = read_registry(cpus=B300).records
    assert not server.live and server.pid == 0 and "nobody holds" in server.why_stale


def test_a_record_whose_pid_now_names_another_process_is_stale(lock_dir):
    pid = os.getpid()
    started = cpupin.process.mask.start_time(pid)
    record = {
        "version": 1,
        "pid": pid,
        "start_time": started + 1,  # the pid's earlier owner
        "uid": os.geteuid(),
        "time": 1.0,
        "pins": [{"tid": pid, "name": "x", "cpus": [0], "role": "step"}],
    }
    (lock_dir / f"cpupin-proc-{pid}-{started + 1}.json").write_bytes(
        registry.encode(record, size=None)
    )
    (found,) = read_registry().records
    assert not found.live and "reused pid" in found.why_stale
    assert read_registry().pins_of(pid) == []


# --- processes ----------------------------------------------------------------


def test_pins_are_registered_with_their_roles_and_removed(lock_dir):
    box = {}
    ready, done = threading.Event(), threading.Event()

    def step():
        box["pin"] = cpupin.pin_current_thread(cpupin.process_cpus(), name="stepper", role="step")
        box["tid"] = threading.get_native_id()
        ready.set()
        done.wait()
        box["pin"].release()

    t = cpupin.Thread(target=step)
    t.start()
    ready.wait()
    try:
        pins = [p for p in read_registry().pins_of(os.getpid()) if p.tid == box["tid"]]
        assert [(p.name, p.role) for p in pins] == [("stepper", "step")]
        assert pins[0].cpus == cpupin.process_cpus()
    finally:
        done.set()
        t.join()
    tids = [p.tid for p in read_registry().pins_of(os.getpid())]
    assert box["tid"] not in tids


def test_a_process_record_goes_with_its_process(lock_dir):
    code = textwrap.dedent("""
        import glob, os, cpupin
        cpupin.pin_current_thread(cpupin.process_cpus(), role="result")
        mine = glob.glob(os.path.join(os.environ["CPUPIN_LOCK_DIR"], "cpupin-proc-*"))
        print(len(mine))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "1"  # it was there while the process lived
    assert read_registry().records == []


# --- hostile files ------------------------------------------------------------


@pytest.fixture
def sleepers():
    """Two live processes of this user, whose records a hostile file can
    pretend to be: (pid, start time) of each."""
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        yield [(c.pid, cpupin.process.mask.start_time(c.pid)) for c in children]
    finally:
        for c in children:
            c.kill()
            c.wait()


def hostile_dir(root, sleepers):
    """A lock directory holding every kind of bad record, each under a name
    of a live process of this user (so that it is opened and read)."""
    (a, a_start), (b, b_start) = sleepers
    na = [f"cpupin-proc-{a}-{a_start}{s}.json" for s in ("", "-1", "-2", "-3")]
    nb = [f"cpupin-proc-{b}-{b_start}{s}.json" for s in ("", "-1", "-2", "-3")]
    (root / na[0]).write_text("{not json")
    (root / na[1]).write_bytes(b"x" * (registry.MAX_SIZE + 10))
    os.mkfifo(root / na[2])
    os.symlink("/etc/passwd", root / na[3])
    common = {"version": 1, "start_time": b_start, "uid": os.geteuid(), "time": 1}
    (root / nb[0]).write_bytes(registry.encode({**common, "pid": "five"}))
    (root / nb[1]).write_bytes(registry.encode({**common, "pid": b, "pins": [{"tid": -1}]}))
    (root / nb[2]).write_bytes(registry.encode({**common, "pid": 2**64, "pins": []}))
    (root / "elsewhere").write_bytes(registry.encode({**common, "pid": b, "pins": []}))
    os.link(root / "elsewhere", root / nb[3])
    (root / "cpupin-gpu-0000:01:00.0.lock").write_bytes(b"\x00" * 10 + b"junk" * 100)
    (root / "unrelated.txt").write_text("not ours")


def test_hostile_records_are_ignored_with_a_reason_and_ps_lists_the_live_ones(
    lock_dir, sleepers, capsys
):
    hostile_dir(lock_dir, sleepers)
    claim = serve_here(lock_dir)
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), name=None, role="result")
    try:
        found = read_registry()
        reasons = dict(found.ignored)
        assert len(reasons) == 8, reasons
        text = " ".join(reasons.values())
        for says in (
            "no record",
            "larger than",
            "not a regular file",
            "symbolic link",
            "pid",
            "tid",
            "hard links",
        ):
            assert says in text, says
        assert all(len(r) < 200 for r in reasons.values())
        assert main(["ps", "--interval", "0.05"]) == 0
        out = capsys.readouterr().out
        assert out.count("\nignored  ") == 8 and "passwd" not in out.replace("passwd'", "")
    finally:
        pin.release()
        claim.close()


def test_ps_json_has_the_documented_shape_with_live_records(lock_dir, sleepers, capsys):
    hostile_dir(lock_dir, sleepers)
    claim = serve_here(lock_dir)
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="result")
    try:
        assert main(["ps", "--interval", "0.05", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        same_shape(SECTIONS["cpupin ps --interval 0.05 --json"], data)
        assert [s["pid"] for s in data["servers"] if s["live"]] == [os.getpid()]
        (me,) = [p for p in data["processes"] if p["live"]]
        assert me["threads"][0]["role"] == "result" and me["threads"][0]["on_its_pin"]
        assert len(data["ignored"]) == 8
        assert main(["ps", "--interval", "0.05"]) == 0
        out = capsys.readouterr().out
        assert "1 server(s), 1 process(es) with pins" in out and "ignored" in out
    finally:
        pin.release()
        claim.close()


# --- torn records -------------------------------------------------------------

WRITER = """
import os, sys, time
from cpupin.registry import writer as registry
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
records = [
    {"version": 1, "n": n, "fill": "x" * (n * 37 % 3000)} for n in range(50)
]
print("go", flush=True)
end = time.monotonic() + float(sys.argv[2])
i = 0
while time.monotonic() < end:
    os.pwrite(fd, registry.encode(records[i % 50]), 0)
    i += 1
print(i, flush=True)
"""


def test_a_reader_never_sees_a_torn_lock_record(tmp_path):
    """A writer rewrites a lock file's slot as fast as it can while this
    process reads it: every read is a whole record, or refused (checksum),
    never a mix that parses."""
    path = tmp_path / "cpupin-gpu-0000:01:00.0.lock"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), "1.0"], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "go"
    whole = refused = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while writer.poll() is None:
            try:
                record = registry.decode(os.pread(fd, registry.SLOT, 0))
            except ValueError:
                refused += 1
                continue
            assert record["fill"] == "x" * (record["n"] * 37 % 3000)
            whole += 1
    finally:
        os.close(fd)
    writes = int(writer.stdout.readline())
    assert whole > 100 and writes > 100, (whole, refused, writes)


def test_a_process_record_is_replaced_whole(lock_dir):
    """Many rewrites of this process's record while another thread reads the
    directory: the reader never finds a bad one."""
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            found = read_registry()
            bad.extend(found.ignored)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(300):
            registry.register_pins(
                [registry.Pinned(os.getpid(), "x" * (n % 60), frozenset({0}), "step")]
            )
    finally:
        stop.set()
        t.join()
        registry.register_pins([])
    assert bad == []


# --- metrics ------------------------------------------------------------------


def test_the_collector_parses_and_its_counters_only_grow():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from cpupin.measure.metrics import ThreadCollector

    collectors = prometheus_client.CollectorRegistry()
    collectors.register(ThreadCollector())
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="result")
    try:

        def scrape():
            text = prometheus_client.generate_latest(collectors).decode()
            return {f.name: f for f in text_string_to_metric_families(text)}

        first = scrape()
        end = time.monotonic() + 0.05
        while time.monotonic() < end:  # busy: the counter must move
            pass
        second = scrape()
    finally:
        pin.release()
    assert set(first) >= {
        "cpupin_thread_cpu_seconds",
        "cpupin_thread_runqueue_wait_seconds",
        "cpupin_process_threads",
        "cpupin_stray_threads",
        "cpupin_usable_cpus",
        "cpupin_pool_threads",
    }
    assert first["cpupin_thread_cpu_seconds"].type == "counter"
    mine = str(threading.get_native_id())

    def value(families, name):
        (sample,) = [
            s
            for s in families[name].samples
            if s.labels["tid"] == mine and s.name.endswith("_total")
        ]
        return sample

    a, b = value(first, "cpupin_thread_cpu_seconds"), value(second, "cpupin_thread_cpu_seconds")
    assert b.value > a.value and set(a.labels) == {"pid", "tid", "name", "role", "cpus"}
    assert a.labels["role"] == "result"
    assert (
        value(second, "cpupin_thread_runqueue_wait_seconds").value
        >= value(first, "cpupin_thread_runqueue_wait_seconds").value
    )
    assert first["cpupin_stray_threads"].samples[0].value == 0


def test_ps_prometheus_prints_every_registered_process(lock_dir, capsys):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    code = textwrap.dedent("""
        import sys, cpupin
        cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
        print("pinned", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "pinned"
        assert main(["ps", "--prometheus"]) == 0
        text = capsys.readouterr().out
        families = {f.name: f for f in text_string_to_metric_families(text)}
        roles = {
            s.labels["tid"]: s.labels["role"] for s in families["cpupin_thread_cpu_seconds"].samples
        }
        assert roles[str(child.pid)] == "step"
        assert families["cpupin_process_threads"].samples[0].labels["pid"] == str(child.pid)
    finally:
        child.stdin.close()
        child.wait()


HAMMER = """
import sys, threading, cpupin
cpus = cpupin.process_cpus()
stop = threading.Event()
def churn(role):
    while not stop.is_set():
        cpupin.pin_current_thread(cpus, role=role, name=role).release()
threads = [threading.Thread(target=churn, args=(f"r{i}" * (1 + 7 * i),)) for i in range(3)]
cpupin.pin_current_thread(cpus, role="main")  # the record exists before the churn
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
"""


def test_a_record_rewritten_in_place_is_never_read_torn(tmp_path):
    """Three threads pin and release as fast as they can, each a pwrite of
    the record's slot, while this process reads it 300 times: every read
    finds a whole record (a torn one is read again), never an ignored file."""
    child = ready_child(HAMMER, tmp_path)
    try:
        seen = set()
        for _ in range(300):
            found = read_registry(tmp_path)
            assert not found.ignored, found.ignored
            (record,) = [r for r in found.records if r.pid == child.pid]
            assert record.live
            seen.update(p.role for p in record.pins)
        assert "main" in seen and seen <= {"main", "r0", "r1" * 8, "r2" * 15}
    finally:
        child.communicate("\n", timeout=60)


def test_a_read_torn_inside_the_checksum_line_is_read_again(monkeypatch):
    """A pwrite racing a read can tear a record at any byte, inside its
    checksum line too: that read is no 'foreign file', it is read again. A
    file that reads the same twice and does not decode is refused then."""
    from cpupin.registry import _files
    from cpupin.registry._record import VERSION, frame

    good = frame(json.dumps({"version": VERSION, "pid": 1}).encode(), 4096)
    cut = good.index(b"crc32=") + 8
    torn = good[:cut] + b"0badf00d\n"  # a new head, an old tail, inside the line
    reads = iter([torn, good])
    calls = []

    def pread(fd, size, offset):
        calls.append(fd)
        return next(reads)

    monkeypatch.setattr(_files.os, "pread", pread)
    monkeypatch.setattr(_files.os, "close", lambda fd: None)
    assert _files.decode_file(-1)["pid"] == 1 and len(calls) == 2
    calls.clear()
    clock = FakeClock()
    monkeypatch.setattr(_files, "time", clock)
    monkeypatch.setattr(_files.os, "pread", lambda fd, size, offset: calls.append(fd) or b"junk\n")
    with pytest.raises(ValueError, match="no record"):
        _files.decode_file(-1)
    # the same bytes, read again after pauses, until they stood still long enough
    assert clock.now >= _files.STILL_S and 2 < len(calls) < 20


class FakeClock:
    """``time`` for :func:`decode_file`: a sleep moves the clock, no more."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_writer_preempted_mid_store_is_waited_for(monkeypatch):
    """A writer preempted in the middle of its store leaves the same torn
    bytes for as long as it waits for a CPU: two equal reads in a row once
    made the reader refuse the record ('an empty or foreign file'), a flake
    under load. Equal torn reads now pause, longer each time, and the record
    is read whole when the writer ends its store."""
    from cpupin.registry import _files
    from cpupin.registry._record import VERSION, frame

    good = frame(json.dumps({"version": VERSION, "pid": 1}).encode(), 4096)
    torn = good.replace(b'"pid": 1', b'"pid": 2', 1)  # a new head, the old checksum
    stalled = 8
    reads = iter([torn] * stalled + [good])
    clock = FakeClock()
    monkeypatch.setattr(_files, "time", clock)
    monkeypatch.setattr(_files.os, "pread", lambda fd, size, offset: next(reads))
    monkeypatch.setattr(_files.os, "close", lambda fd: None)
    assert _files.decode_file(-1)["pid"] == 1
    # no pause after the first torn read, then one after each equal one, doubling
    assert len(clock.sleeps) == stalled - 1
    assert clock.sleeps == sorted(clock.sleeps) and clock.sleeps[0] < clock.sleeps[-1]
    assert clock.now < _files.STILL_S


def test_a_file_whose_bytes_never_settle_is_refused(monkeypatch):
    """A file rewritten with garbage in a loop changes at every read: it is
    refused after READS reads, never read forever, and never paused on."""
    from cpupin.registry import _files

    count = iter(range(10**6))
    clock = FakeClock()
    monkeypatch.setattr(_files, "time", clock)
    monkeypatch.setattr(_files.os, "pread", lambda fd, size, offset: b"junk %d\n" % next(count))
    monkeypatch.setattr(_files.os, "close", lambda fd: None)
    with pytest.raises(ValueError):
        _files.decode_file(-1)
    assert next(count) == _files.READS and not clock.sleeps


def test_a_reading_waits_for_torn_records_a_bounded_time_in_all(tmp_path, monkeypatch):
    """A user who plants damaged records for many live processes of their
    own makes each wait for its bytes to settle: one reading waits
    PATIENCE_S in all, not STILL_S a file, and still refuses every one."""
    from cpupin.host._proc import start_time
    from cpupin.registry import _files

    count = int(_files.PATIENCE_S / _files.STILL_S) + 5
    clock = FakeClock()
    monkeypatch.setattr(_files, "time", clock)
    children = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    try:
        for child in children:
            started = start_time(child.pid)
            (tmp_path / f"cpupin-proc-{child.pid}-{started}.json").write_bytes(b"junk\n")
        found = read_registry(tmp_path)
        assert len(found.ignored) == count and not found.records
        assert all("no record" in why for _, why in found.ignored), found.ignored
        # without the shared bound: count * STILL_S, half again as long
        assert _files.PATIENCE_S <= clock.now < _files.PATIENCE_S + _files.STILL_S
    finally:
        for child in children:
            child.kill()
            child.wait()
