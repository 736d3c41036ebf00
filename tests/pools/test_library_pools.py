"""A process that names nothing: its threads join the pool of the library
they wait in, read from the kernel (its maps, each thread's stack), with the
variable that sizes each pool and its value in the process's environment;
pools are judged by what their threads wanted over a sample, not by count.

The oracle for which thread belongs to which library is the child itself:
it lists its tasks (``/proc/self/task``) before and after it starts each
library's pool, so the threads each library started are known without
cpupin.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.process.stacks import (
    follows_call,
    library_pool,
    owner,
    parse_maps,
    thread_libraries,
)
from tests.support.probe import build_probe

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading

    def tids():
        return {int(t) for t in os.listdir("/proc/self/task")}

    started, missing = {}, []

    def start(name, body):
        before = tids()
        try:
            body()
        except ImportError as exc:
            missing.append(f"{name}: {exc}")
            return
        started[name] = sorted(tids() - before)

    def openblas():
        import numpy
        a = numpy.ones((400, 400))
        for _ in range(3):
            a @ a

    def libgomp():
        import torch
        x = torch.rand(4_000_000)
        for _ in range(3):
            (x * x).sum()

    keep = []

    def zmq_io():
        import zmq
        ctx = zmq.Context(io_threads=8)  # eight IO threads, all idle
        keep.append((ctx, ctx.socket(zmq.PAIR)))

    def rayon():
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.encode_batch(["a a a b"] * 2000)

    stop = threading.Event()

    def named():
        for i in range(8):  # eight named threads that never run
            t = threading.Thread(target=stop.wait, daemon=True)
            t.start()
            with open(f"/proc/self/task/{t.native_id}/comm", "w") as f:
                f.write("sleepy")

    for name, body in (("openblas", openblas), ("libgomp", libgomp), ("zmq", zmq_io),
                       ("rayon", rayon), ("named", named)):
        start(name, body)
    print("ready", flush=True)
    print(json.dumps({"started": started, "missing": missing}), flush=True)
    sys.stdin.readline()
    """
)

# Each library's pool: its label, the variable that sizes it, and its value
# in the child's environment (as the census quotes it).
EXPECTED = {
    "openblas": ("OpenBLAS", "OPENBLAS_NUM_THREADS", "'2'"),
    "libgomp": ("OpenMP (libgomp)", "OMP_NUM_THREADS", "'2'"),
    "rayon": ("Rayon (tokenizers)", "RAYON_NUM_THREADS", "'2'"),
    "zmq": ("ZMQ", "zmq.Context(io_threads=N)", None),
}


# A word of the file each library's threads run in.
FILE = {"openblas": "openblas", "libgomp": "gomp", "rayon": "tokenizers", "zmq": "zmq"}


@pytest.fixture(scope="module")
def child():
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "2",
        "OPENBLAS_NUM_THREADS": "2",
        "RAYON_NUM_THREADS": "2",
    }
    env.pop("CPUPIN_LOCK_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        said = json.loads(proc.stdout.readline())
        yield proc.pid, said["started"], said["missing"]
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def census_of(child):
    """``cpupin threads PID --json`` over a sample, once for the module."""
    pid = child[0]
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", "threads", str(pid), "--json", "--interval", "0.3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _needs(child, library):
    _, started, missing = child
    if library not in started:
        pytest.skip(f"{library} is not installed here: {missing}")
    if not started[library]:
        pytest.skip(f"{library} started no thread of its own here (one CPU?)")
    return started[library]


@pytest.mark.parametrize("library", sorted(EXPECTED))
def test_each_librarys_threads_join_its_pool_with_the_variable_that_sizes_it(
    child, census_of, library
):
    tids = set(_needs(child, library))
    label, variable, setting = EXPECTED[library]
    pools = [p for p in census_of["pools"] if tids & set(p["tids"])]
    assert pools, (library, tids, census_of["pools"])
    for pool in pools:
        assert set(pool["tids"]) <= tids, (library, pool)  # no thread of another library
        assert pool["variable"] == variable and not pool["guess"], pool
        assert pool["library"] and FILE[library] in pool["library"].lower(), pool
        if setting is not None:
            assert pool["setting"] == setting, pool
        if library != "zmq":  # ZMQ names its threads: the name leads
            assert pool["name"] == label, pool
    # Every thread the library started is in one of its pools.
    assert tids == {t for p in pools for t in p["tids"]}


def test_the_kernel_reads_each_blocked_thread_to_its_library(child):
    pid, started, _ = child
    found = thread_libraries(pid, [t for tids in started.values() for t in tids])
    for library, tids in started.items():
        if library == "named":
            # Python's own threads wait in the interpreter: no library pool
            assert all(library_pool(found[t]) is None for t in tids if t in found)
            continue
        for tid in tids:
            if tid in found:  # a thread running at the read shows no stack
                pool = library_pool(found[tid])
                assert pool is not None and pool.label.startswith(EXPECTED[library][0]), (
                    library,
                    found[tid],
                )


def test_idle_pools_are_idle_not_oversubscribed_in_threads_and_ps(child, census_of):
    """Eight idle ZMQ IO threads and eight named threads that never run are
    more threads than usable CPUs: idle, with no remedy; ``ps --all`` says
    nothing of them either."""
    pid, started, _ = child
    usable = census_of["usable_cpus"]
    named = next(p for p in census_of["pools"] if p["name"] == "sleepy")
    assert named["threads"] == 8 > usable
    assert named["verdict"] == "idle" and named["remedy"] is None, named
    if "zmq" in started:
        io = next(p for p in census_of["pools"] if p["name"] == "ZMQbg/IO")
        assert io["threads"] == 8 and io["verdict"] == "idle" and io["remedy"] is None, io
    out = subprocess.run(
        [sys.executable, "-m", "cpupin", "ps", "--all", "--json", "--interval", "0.3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    listed = [p for p in json.loads(out.stdout)["unrecorded"] if p["pid"] == pid]
    for p in listed:
        assert not any("pool" in f for f in p["findings"]), p


def test_a_pool_whose_threads_run_more_than_the_cpus_is_oversubscribed(tmp_path):
    """The other side: four threads that compute, in a process of one CPU,
    want four CPUs: oversubscribed, with a remedy; the kernel's run-queue
    wait (schedstat) is the oracle for what they wanted."""
    probe = build_probe(tmp_path)
    cpu = min(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [probe, "compute", "compute", "compute", "compute"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n"
        out = subprocess.run(
            [sys.executable, "-m", "cpupin", "threads", str(proc.pid), "--json", "--interval",
             "0.5"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        pool = next(p for p in data["pools"] if p["name"] == "compute")
        assert data["usable_cpus"] == 1 and pool["threads"] == 4
        assert pool["runnable_cpus"] >= 3, pool  # each ran or waited the whole sample
        assert pool["verdict"] == "oversubscribed" and "at most 1" in pool["remedy"], pool
    finally:
        proc.kill()
        proc.wait()


# The pure parts -----------------------------------------------------------


def test_the_maps_parse_agrees_with_psutil_on_this_process():
    psutil = pytest.importorskip("psutil")
    with open("/proc/self/maps") as f:
        areas = parse_maps(f.read())
    theirs = {
        (int(m.addr.split("-")[0], 16), int(m.addr.split("-")[1], 16), os.path.basename(m.path))
        for m in psutil.Process().memory_maps(grouped=False)
        if "x" in m.perms and m.path and os.path.basename(m.path)
    }
    mine = {(a.lo, a.hi, a.name) for a in areas}
    # psutil reads the maps a moment later: a library loaded between may add.
    assert mine and len(mine & theirs) >= 0.9 * len(mine), mine ^ theirs
    assert any("libc" in a.name for a in areas)


def test_a_stack_names_the_first_library_past_the_plumbing():
    areas = parse_maps(
        "1000-2000 r-xp 0 0:0 1 /usr/lib/libc.so.6\n"
        "3000-4000 r-xp 0 0:0 1 /opt/x/libgomp.so.1\n"
        "5000-6000 r-xp 0 0:0 1 /opt/x/libzmq.so.5 (deleted)\n"
        "7000-8000 rw-p 0 0:0 1 /opt/x/libdata.so\n"
    )
    stack = b"".join(x.to_bytes(8, "little") for x in (0x10, 0x1500, 0x7500, 0x3100, 0x5100))
    assert owner(areas, 0x1800, stack) == "libgomp.so.1"  # libc made the call
    assert owner(areas, 0x5800, b"") == "libzmq.so.5"  # the call came from libzmq
    assert owner(areas, 0x1800, b"\x00" * 64) is None
    assert owner(areas, 0x1800, stack[:7]) is None  # a torn word is not read


def _call_rel32(at: int, target: int) -> bytes:
    """The 8 bytes before ``at`` ending in ``call target``."""
    return b"\x90\x90\x90\xe8" + (target - at).to_bytes(4, "little", signed=True)


def test_a_word_counts_only_where_a_call_precedes_it():
    """Locals between return addresses can fall in a big library's code
    (``0x7f..00000189`` in libtorch's 400 MB): a word counts only where the
    instruction before it is a call."""
    areas = parse_maps(
        "1000-2000 r-xp 0 0:0 1 /usr/lib/libc.so.6\n"
        "10000-90000 r-xp 0 0:0 1 /opt/x/libtorch_cpu.so\n"
        "a0000-a1000 r-xp 0 0:0 1 /usr/bin/python3.11\n"
    )
    code = {
        0x10189: b"\x48\x89\xc7\x48\x8b\x45\xf8\x90",  # mov; mov: no call
        0xA0100: _call_rel32(0xA0100, 0xA0800),  # python calls into python
        0x20000: _call_rel32(0x20000, 0x5000000),  # target outside the file
    }
    stack = b"".join(x.to_bytes(8, "little") for x in (0x10189, 0x20000, 0xA0100, 0x10189))
    assert owner(areas, 0x1800, stack) == "libtorch_cpu.so"  # unchecked: the local wins
    checked = owner(areas, 0x1800, stack, lambda a: code.get(a, b""), "x86_64")
    assert checked == "python3.11" and library_pool(checked) is None
    # An architecture it cannot check takes the first word, as before.
    assert owner(areas, 0x1800, stack, lambda a: b"", "riscv64") == "libtorch_cpu.so"


@pytest.mark.parametrize(
    "before",
    [
        b"\x90\x90\x90\x90\x90\x90\xff\xd0",  # call *%rax
        b"\x90\x90\x90\x90\x90\x41\xff\xd3",  # call *%r11
        b"\x90\x90\xff\x15\x10\x20\x30\x00",  # call *0x302010(%rip)
        b"\x90\x90\x90\x90\x90\xff\x50\x08",  # call *0x8(%rax)
        b"\x90\x90\x90\x90\xff\x54\x24\x08",  # call *0x8(%rsp)
        b"\x90\x90\xff\x90\x00\x01\x00\x00",  # call *0x100(%rax)
    ],
)
def test_each_x86_indirect_call_form_is_read_to_its_end(before):
    areas = parse_maps("1000-2000 r-xp 0 0:0 1 /opt/x/libgomp.so.1\n")
    assert follows_call(areas, 0x1100, before, "x86_64")
    # The same bytes one place earlier end before the address: not a call there.
    assert not follows_call(areas, 0x1100, before[1:] + b"\x90", "x86_64")


def test_arm64_bl_and_blr_are_calls():
    areas = parse_maps("10000-20000 r-xp 0 0:0 1 /opt/x/libgomp.so.1\n")
    bl_back = (0x94000000 | ((-0x100 >> 2) & 0x03FFFFFF)).to_bytes(4, "little")
    assert follows_call(areas, 0x10400, b"\0" * 4 + bl_back, "aarch64")
    assert follows_call(
        areas, 0x10400, b"\0" * 4 + (0xD63F0000 | 3 << 5).to_bytes(4, "little"), "aarch64"
    )
    far = (0x94000000 | 0x01000000).to_bytes(4, "little")  # 64 MiB on: another file
    assert not follows_call(areas, 0x10400, b"\0" * 4 + far, "aarch64")
    assert not follows_call(areas, 0x10402, b"\0" * 4 + bl_back, "aarch64")  # unaligned
    assert not follows_call(areas, 0x10400, b"\0" * 8, "aarch64")


maps_line = st.one_of(
    st.text(max_size=120),
    st.builds(
        lambda lo, size, perms, path: f"{lo:x}-{lo + size:x} {perms} 0 0:0 1 {path}",
        st.integers(0, 1 << 48),
        st.integers(-10, 1 << 20),
        st.sampled_from(["r-xp", "rw-p", "--xp", "r-x"]),
        st.text(max_size=80),
    ),
)


@given(st.lists(maps_line, max_size=40), st.integers(0, 1 << 49), st.binary(max_size=256))
def test_any_maps_and_stack_give_a_library_or_none(lines, pc, stack):
    areas = parse_maps("\n".join(lines))
    assert areas == sorted(areas)
    for a in areas:
        assert a.lo < a.hi and a.name and "/" not in a.name and len(a.name) <= 64
    found = owner(areas, pc, stack)
    assert found is None or found in {a.name for a in areas}
    checked = owner(areas, pc, stack, lambda a: stack[:8], "x86_64")
    assert checked is None or checked in {a.name for a in areas}
