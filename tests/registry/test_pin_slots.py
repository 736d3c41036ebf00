"""A process record's pin slots: a pin made or released is one store into
a shared mapping, with no system call; the record on disk always reads as
the writer holds it; a torn or hostile slot is refused, never parsed."""

import json
import os
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpupin
from cpupin.registry._record import MAX_SIZE, PIN_SLOT, SLOT, decode, frame
from tests.support.helpers import run


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    return tmp_path


def head_and_slots(pins_in_head, slots, head=SLOT, nslots=4):
    """A record's bytes: a head listing ``pins_in_head``, then ``nslots``
    slots with ``slots`` (index to bytes) in them."""
    body = json.dumps(
        {"version": 1, "pid": 7, "pins": pins_in_head, "slots": [head, PIN_SLOT, nslots]}
    ).encode()
    area = bytearray(b" " * (nslots * PIN_SLOT))
    for at, text in slots.items():
        area[at * PIN_SLOT : at * PIN_SLOT + len(text)] = text
    return frame(body, head) + bytes(area)


def pin(tid, role="step"):
    return {"tid": tid, "name": f"t{tid}", "cpus": "0", "role": role}


def slot(value):
    return frame(json.dumps(value).encode()).ljust(PIN_SLOT, b" ")


def test_the_slots_pins_join_the_heads_and_a_slot_is_the_newer():
    raw = head_and_slots([pin(1), pin(2, "old")], {0: slot(pin(2, "new")), 3: slot(pin(3))})
    got = decode(raw)
    assert sorted((p["tid"], p["role"]) for p in got["pins"]) == [
        (1, "step"),
        (2, "new"),
        (3, "step"),
    ]
    assert "slots" not in got


def test_a_torn_slot_is_refused_so_that_the_reader_reads_again():
    good = slot(pin(3))
    torn = good[:20] + slot(pin(4))[20:]  # a new pin's tail under an old head
    with pytest.raises(ValueError, match="checksum"):
        decode(head_and_slots([], {1: torn}))


@pytest.mark.parametrize(
    "layout",
    [
        "no list",
        [SLOT, PIN_SLOT],
        [SLOT, PIN_SLOT, 1.0],
        [SLOT, PIN_SLOT, True],
        [0, PIN_SLOT, 4],
        [SLOT, 8, 4],
        [SLOT, PIN_SLOT, 5],  # past the file's end
        [SLOT, SLOT * 2, 1],
        [MAX_SIZE, PIN_SLOT, 4],
        [SLOT, PIN_SLOT, 10**12],
    ],
)
def test_a_hostile_slot_layout_is_refused_with_why(layout):
    body = json.dumps({"version": 1, "pid": 7, "pins": [], "slots": layout}).encode()
    raw = frame(body, SLOT) + b" " * (4 * PIN_SLOT)
    with pytest.raises(ValueError, match="slots"):
        decode(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=PIN_SLOT))
def test_no_slot_bytes_raise_anything_but_a_value_error(junk):
    raw = head_and_slots([], {2: junk})
    try:
        got = decode(raw)
    except ValueError:
        return
    # Only bytes that frame a checked record parse: blank, or a CRC that holds.
    if junk.strip(b" \0"):
        body, _, rest = junk.partition(b"\n")
        assert rest.startswith(b"crc32=%08x" % zlib.crc32(body))
        assert len(got["pins"]) == 1
    else:
        assert got["pins"] == []


# --- the writer, against a reader of the file ---------------------------------

SEQUENCE = r"""
import json, os, random, sys, time
from cpupin.registry import writer
from cpupin.registry._record import decode
rng = random.Random(int(sys.argv[1]))
lock_dir = os.environ["CPUPIN_LOCK_DIR"]
names = ["w", "gpu-loop", "x" * 64, "\N{SNOWMAN}" * 64]
expected = {}
for step in range(int(sys.argv[2])):
    tid = rng.randrange(1, 120)
    if rng.random() < 0.6:
        cpus = frozenset(rng.sample(range(2), rng.randint(1, 2)))
        one = writer.Pinned(tid, rng.choice(names), cpus, rng.choice(["step", "r" * 32]))
        expected[tid] = one
    else:
        one = None
        expected.pop(tid, None)
    with writer._lock:  # as cpupin.threads.pins calls it
        if not writer.update_pin(tid, one, time.monotonic()):
            writer.register_pins(expected.values())
    files = [n for n in os.listdir(lock_dir) if n.startswith("cpupin-proc-")]
    if not files:  # no pin yet: no record
        assert not expected, step
        continue
    (name,) = files
    with open(os.path.join(lock_dir, name), "rb") as f:
        record = decode(f.read())
    got = {p["tid"]: (p["name"], p["role"]) for p in record["pins"]}
    want = {t: (p.name, p.role) for t, p in expected.items()}
    assert len(got) == len(record["pins"]), f"a tid twice at step {step}"
    assert got == want, f"step {step}: {sorted(set(got.items()) ^ set(want.items()))[:4]}"
print(json.dumps({"steps": step + 1, "size": os.path.getsize(os.path.join(lock_dir, name))}))
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_record_on_disk_always_reads_as_the_writer_holds_it(seed, lock_dir):
    """Random pins and releases of up to 119 threads (names that fit a slot
    and names that do not, so that some pins live in the head): after every
    one, the file read from outside lists exactly the pins the writer holds,
    each once, whether it went by one store or by a whole rewrite."""
    out = run([sys.executable, "-c", SEQUENCE, str(seed), "600"], timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["steps"] == 600 and got["size"] <= MAX_SIZE


NO_SYSCALLS = r"""
import json, os, cpupin
from cpupin.registry import writer
from cpupin.registry.reader import read_registry
from cpupin.threads import pins
writer.FULL_EVERY_S = pins.SWEEP_S = 1e9  # no whole-record check due meanwhile
cpus = cpupin.process_cpus()
cpupin.pin_current_thread(cpus).release()  # the record made, and mapped
def io():
    with open("/proc/thread-self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["syscr"]), int(fields["syscw"])
a, b = io(), io()  # b - a: what reading the counters costs
for _ in range(200):
    cpupin.pin_current_thread(cpus, role="step").release()
last = cpupin.pin_current_thread(cpus, role="last")
c = io()
print(json.dumps({"reading": [y - x for x, y in zip(a, b)], "pins": [y - x for x, y in zip(b, c)],
                  "roles": [p.role for p in read_registry().pins_of(os.getpid())]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/io"), reason="no per-thread io counters")
def test_a_pin_between_checks_reads_and_writes_nothing(lock_dir):
    """The kernel's own count of the thread's read and write calls
    (/proc/thread-self/io, the oracle) stays where it was over 201 pins and
    200 releases: each was a store into the mapping (the record written
    with pwrite counted one write each). A reader outside sees the last."""
    out = run([sys.executable, "-c", NO_SYSCALLS])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["pins"] == got["reading"], got
    assert got["roles"] == ["last"]


def test_a_forked_child_never_writes_its_parents_record(lock_dir):
    """A fork inherits the parent's shared mapping: the child drops it, and
    its own pins go to a record of its own."""
    cpus = cpupin.process_cpus()
    code = r"""
import json, os, cpupin
from cpupin.registry.reader import read_registry
cpus = cpupin.process_cpus()
parent = cpupin.pin_current_thread(cpus, role="parent")
pid = os.fork()
if pid == 0:
    cpupin.pin_current_thread(cpus, role="child")
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps([p.role for p in read_registry().pins_of(os.getpid())]))
"""
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["parent"]
    assert cpus == cpupin.process_cpus()
