"""Where a process's memory lies: numa_maps sums against captures of
multi-node processes written here, a fuzzed reader, and this machine's own
processes against the kernel's other counts."""

import json
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpupin
from cpupin.host.numa_memory import MAX_LINES, NodeMemory, memory_by_node, parse_numa_maps
from tests.support.helpers import ready_child, run

# A worker bound to node 1 after it allocated: its heap stayed on node 0.
CAPTURE = b"""\
55d0c0000000 default file=/usr/bin/python3.11 mapped=300 mapmax=4 N0=300 kernelpagesize_kB=4
55d0c2000000 default heap anon=5120 dirty=5120 N0=4096 N1=1024 kernelpagesize_kB=4
7f0000000000 bind:1 anon=262144 dirty=262144 N1=262144 kernelpagesize_kB=4
7f4000000000 prefer:1 anon=8 dirty=8 N1=8 kernelpagesize_kB=2048
7f8000000000 default file=/dev/shm/x
7fff00000000 default stack anon=33 dirty=33 N0=33 kernelpagesize_kB=4
"""


def capture_root(tmp_path, text, nodes=((0, "0-3"), (1, "4-7"))):
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "numa_maps").write_bytes(text)
    for node, cpus in nodes:
        d = tmp_path / f"sys/devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return str(tmp_path)


def test_a_capture_sums_by_node_with_each_mappings_page_size(tmp_path):
    root = capture_root(tmp_path, CAPTURE)
    got = memory_by_node(4242, root=root, mask=frozenset({4, 5}))
    kib = 1024
    assert got.by_node == {
        0: (300 + 4096 + 33) * 4 * kib,
        1: (1024 + 262144) * 4 * kib + 8 * 2048 * kib,
    }
    assert got.local_nodes == {1} and got.mappings == 6 and not got.partial
    assert got.remote == got.by_node[0]
    assert 0 < got.remote_share < 0.05 and got.advice() == ""
    # Seen from node 0's CPUs, nearly all of it is remote: the advice names the node.
    far = memory_by_node(4242, root=root, mask=frozenset({0}))
    assert far.remote_share > 0.95
    assert "on node(s) 1" in far.advice() and "cpupin exec --node 0" in far.advice()


def test_a_huge_capture_is_cut_and_says_so(tmp_path):
    line = b"7f0000000000 default anon=1 N0=1 kernelpagesize_kB=4\n"
    root = capture_root(tmp_path, line * (MAX_LINES + 5))
    got = memory_by_node(4242, root=root)
    assert got.mappings == MAX_LINES and "mappings" in got.partial
    assert got.by_node == {0: MAX_LINES * 4096}


@pytest.mark.parametrize(
    "line",
    [
        b"x N99999=1",  # a node past any host's
        b"x N0=99999999999999999",  # more pages than a process can have
        b"x N0=1 kernelpagesize_kB=0",
        b"x N0=-1",
        b"x N=1 Nx=2 N0x=3",
        b"\xff\xfe N0=1\x00",
    ],
)
def test_a_hostile_line_counts_nothing_it_cannot_vouch_for(line):
    by_node, _, _ = parse_numa_maps([line])
    assert all(0 <= n <= 4095 for n in by_node)
    assert sum(by_node.values()) <= 4096  # at most the one sane count, in 4 KiB pages


@given(st.lists(st.binary(max_size=200), max_size=50))
def test_the_reader_never_raises_and_stays_bounded(lines):
    by_node, mappings, partial = parse_numa_maps(lines)
    assert mappings == len(lines) and not partial
    assert all(0 <= n <= 4095 and 0 <= b for n, b in by_node.items())


@given(st.dictionaries(st.integers(0, 7), st.integers(0, 10**12)), st.frozensets(st.integers(0, 7)))
def test_remote_is_what_lies_off_the_local_nodes(by_node, local):
    m = NodeMemory(by_node, local)
    assert m.remote + sum(b for n, b in by_node.items() if n in local) == m.total
    assert 0 <= m.remote_share <= 1


TOUCHER = """
import sys
block = bytearray(64 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
sys.stdin.readline()
"""


def test_this_machines_process_is_counted_against_the_kernels_rss(tmp_path):
    """The oracle: /proc/PID/status's VmRSS. numa_maps counts each mapping's
    present pages, as RSS does; both see the 64 MiB the child touched."""
    child = ready_child(TOUCHER, tmp_path)
    try:
        got = memory_by_node(child.pid, mask=cpupin.process_cpus())
        with open(f"/proc/{child.pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        out = run([sys.executable, "-m", "cpupin", "threads", str(child.pid), "--json"])
    finally:
        child.communicate("\n", timeout=30)
    assert got.total >= 64 << 20
    assert abs(got.total - rss) <= max(rss // 10, 8 << 20), (got.total, rss)
    nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit())
    assert set(got.by_node) <= set(nodes)
    if len(nodes) == 1:  # one node: everything is local
        assert got.remote == 0 and got.advice() == ""
    shown = json.loads(out.stdout)["memory"]
    assert shown["total_bytes"] >= 64 << 20 and shown["local_nodes"]


def test_a_process_that_is_gone_is_said_so():
    child = run([sys.executable, "-c", "import os; print(os.getpid())"])
    with pytest.raises(ProcessLookupError):
        memory_by_node(int(child.stdout))


def test_prometheus_exports_memory_only_when_asked(tmp_path):
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="pip install prometheus_client"
    )
    from cpupin.measure.metrics import ThreadCollector

    def families(**kw):
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(ThreadCollector(**kw))
        return prometheus_client.generate_latest(registry).decode()

    assert "cpupin_process_memory_bytes" not in families()
    text = families(memory=True)
    pid = os.getpid()
    lines = [x for x in text.splitlines() if x.startswith("cpupin_process_memory_bytes{")]
    assert lines and all(f'pid="{pid}"' in x for x in lines)
    assert f'cpupin_process_memory_remote_bytes{{pid="{pid}"}}' in text


@pytest.mark.parametrize("pid", ["x", 0, -3, True, 1 << 40])
def test_a_bad_pid_is_named(pid):
    with pytest.raises(ValueError, match="is not a process id"):
        memory_by_node(pid)
