"""Hostile trees: every file read_host reads, replaced by what an attacker or a
broken capture could put there, never makes it raise, hang, read outside the
root, or quote at length; the same through openat2 and through the walk."""

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpupin.cli import main
from cpupin.cpulist import parse_cpulist
from cpupin.host import _sysfs
from cpupin.host.shapes import GpuSpec, HostSpec, build_tree
from cpupin.host.topology import read_host
from tests.support.helpers import in_forked_child
from tests.support.specs import spec_host

SENTINEL = "OUTSIDE-THE-ROOT"
NOBODY = 65534

SPEC = HostSpec(
    "hostile",
    sockets=2,
    cores_per_node=2,
    threads=2,
    gpus=(GpuSpec("0000:3b:00.0", 0), GpuSpec("0000:9b:00.0", 1, local_cpulist=False)),
    idle_states=(("POLL", 0), ("C6", 170)),
    cpu_max="150000 100000",
    cpuset="0-7",
    # Every figure a core class is read from, and a priority core, so that
    # each of those files is replaced below; an L3 a core, so that there are
    # several domains.
    perf=(
        ("highest_perf", 38),
        ("nominal_perf", 20),
        ("max_khz", 3_800_000),
        ("base_khz", 2_000_000),
        ("capacity", 1024),
    ),
    priority_cores=(0,),
    priority=(("highest_perf", 46),),
    llc_cores=1,
)


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Both ways of resolving a path in the root: the kernel's and the walk."""
    if request.param == "walk":
        monkeypatch.setattr(_sysfs, "_openat2", False)
    else:
        assert _sysfs._openat2 is not False, "openat2 is refused here: only the walk runs"
    return request.param


@pytest.fixture(scope="module")
def place():
    """(tree, outside): a tree of SPEC, and a folder beside it whose every file
    holds the sentinel; both reachable by nobody."""
    base = tempfile.mkdtemp(prefix="cpupin-hostile-")
    os.chmod(base, 0o755)
    tree = build_tree(SPEC, os.path.join(base, "tree"))
    outside = os.path.join(base, "outside")
    os.makedirs(outside)
    for name in ("file", "cpu.max", "class", "cpulist", "online"):
        with open(os.path.join(outside, name), "w") as f:
            f.write(SENTINEL + "\n")
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    yield tree, outside
    shutil.rmtree(base, ignore_errors=True)


class Hang(Exception):
    pass


@contextlib.contextmanager
def no_hang(seconds=10):
    """A guard, not a measure: fails the test instead of hanging forever."""

    def fire(signum, frame):
        raise Hang(f"read_host blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def files_read(tree):
    """The files read_host opens on the tree, found by watching it read."""
    seen = []
    original = _sysfs.Reader.text

    def spy(self, rel, *args, **kwargs):
        out = original(self, rel, *args, **kwargs)
        if out is not None:
            seen.append(rel.lstrip("/"))
        return out

    _sysfs.Reader.text = spy
    try:
        read_host(tree)
    finally:
        _sysfs.Reader.text = original
    return sorted(set(seen))


@pytest.fixture(scope="module")
def read_files(place):
    files = files_read(place[0])
    # Every kind of file: topology, nodes, GPUs, idle states, cgroup, procfs.
    for part in (
        "topology",
        "node0/cpulist",
        "numa_node",
        "cpuidle",
        "cpu.max",
        "mounts",
        "acpi_cppc/highest_perf",
        "acpi_cppc/nominal_perf",
        "cpufreq/cpuinfo_max_freq",
        "cpufreq/base_frequency",
        "cpu_capacity",
        "shared_cpu_list",
        "cache/index1/level",
        "proc/self/cgroup",
    ):
        assert any(part in rel for rel in files), part
    return files


def without_noise(host):
    return replace(host, reasons=())


@contextlib.contextmanager
def replaced(tree, rel, kind, outside):
    """The file ``rel`` of ``tree`` replaced by ``kind`` for the block."""
    path = os.path.join(tree, rel)
    saved = path + ".saved"
    os.rename(path, saved)
    try:
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink-out":
            os.symlink(os.path.join(outside, "file"), path)
        elif kind == "symlink-out-relative":
            os.symlink("../" * (rel.count("/") + 4) + os.path.relpath(outside, "/") + "/file", path)
        elif kind == "loop":
            os.symlink(os.path.basename(path), path)
        elif kind == "directory":
            os.mkdir(path)
        elif kind == "missing":
            pass
        else:
            content = {
                "huge": b"0," * (_sysfs.LIMIT // 2 + 8),
                "garbage": bytes(range(256)) * 3,
                "4000-digits": b"9" * 4000 + b"\n",
                "4000-hex-digits": b"0x" + b"f" * 4000 + b"\n",
                "empty": b"",
                "unreadable": open(saved, "rb").read(),
            }[kind]
            with open(path, "wb") as f:
                f.write(content)
            os.chmod(path, 0o000 if kind == "unreadable" else 0o644)
        yield path
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)
        os.rename(saved, path)


KINDS = [
    "fifo",
    "symlink-out",
    "symlink-out-relative",
    "loop",
    "directory",
    "huge",
    "garbage",
    "4000-digits",
    "4000-hex-digits",
    "empty",
]


def check_sane(host, rel=None):
    """Nothing from outside, nothing at length."""
    text = repr(host)
    assert SENTINEL not in text
    assert "9" * 100 not in text and "f" * 100 not in text and "0,0,0,0,0,0,0," not in text
    for reason in host.reasons:
        assert len(reason) < 400, reason


def test_every_read_file_replaced_by_each_hostile_kind(place, read_files, resolver, capsys):
    tree, outside = place
    for rel in read_files:
        with replaced(tree, rel, "missing", outside):
            absent = without_noise(read_host(tree))
        for kind in KINDS:
            with replaced(tree, rel, kind, outside), no_hang():
                host = read_host(tree)
                check_sane(host, rel)
                if kind in ("symlink-out", "symlink-out-relative"):
                    # Resolved inside the root, where no such file is: as if missing.
                    assert without_noise(host) == absent, (rel, kind)
                # cpuinfo is read for its first CPU's flags only: its head.
                long_ok = kind == "huge" and rel == "proc/cpuinfo"
                if kind in ("fifo", "directory", "huge", "loop") and not long_ok:
                    assert any(rel in r for r in host.reasons), (rel, kind, host.reasons)
                if kind == "fifo":
                    assert any("a FIFO" in r for r in host.reasons)
                if kind == "huge" and not long_ok:
                    assert any("longer than" in r for r in host.reasons)
            if kind in ("symlink-out", "garbage", "4000-digits"):
                assert main(["topo", "--root", tree]) == 0
                out = capsys.readouterr().out
                assert SENTINEL not in out and "9" * 100 not in out


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_an_unreadable_file_is_a_reason_naming_it(place, read_files, resolver):
    tree, outside = place
    # Files a non-root user may not read in a real /proc are fine to lose;
    # each unreadable one must be a reason, not an exception.
    for rel in read_files:
        with replaced(tree, rel, "unreadable", outside):

            def check(rel=rel):
                host = read_host(tree)
                check_sane(host)
                return any(rel in r and "ermission" in r for r in host.reasons)

            assert in_forked_child(check, uid=NOBODY), rel


@pytest.mark.parametrize(
    "rel",
    ["sys/devices/system/node", "sys/bus/pci/devices/0000:3b:00.0", "sys/devices/system/cpu"],
)
def test_a_folder_that_links_out_of_the_root_is_not_followed(place, resolver, rel):
    tree, outside = place
    path = os.path.join(tree, rel)
    os.rename(path, path + ".saved")
    try:
        absent = without_noise(read_host(tree))
        for target in (outside, "../" * 10 + os.path.relpath(outside, "/")):
            os.symlink(target, path)
            try:
                host = read_host(tree)
                check_sane(host)
                assert without_noise(host) == absent
            finally:
                os.unlink(path)
    finally:
        os.rename(path + ".saved", path)


def test_the_trees_own_relative_symlinks_keep_working(place, resolver):
    tree, _ = place
    link = os.path.join(tree, "sys/bus/pci/devices/0000:3b:00.0")
    assert os.path.islink(link) and not os.readlink(link).startswith("/")
    host = read_host(tree)
    assert [g.address for g in host.gpus] == ["0000:3b:00.0", "0000:9b:00.0"]
    truth = spec_host(SPEC)
    assert (host.cpus, host.cores, host.nodes, host.gpus) == (
        truth.cpus,
        truth.cores,
        truth.nodes,
        truth.gpus,
    )


@pytest.mark.parametrize(
    "mounts, cgroup",
    [
        ("cgroup2 /../../../../{outside} cgroup2 rw 0 0\n", "0::/\n"),
        ("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", "0::/../../../../../{outside}\n"),
        ("cgroup /{outside} cgroup rw,cpu 0 0\n", "1:cpu:/\n"),
    ],
)
def test_a_mount_point_or_cgroup_path_cannot_leave_the_root(place, resolver, mounts, cgroup):
    tree, outside = place
    rel_outside = os.path.relpath(outside, "/")
    saved = {}
    for rel, text in (("proc/self/mounts", mounts), ("proc/self/cgroup", cgroup)):
        path = os.path.join(tree, rel)
        saved[path] = open(path).read()
        with open(path, "w") as f:
            f.write(text.format(outside=rel_outside))
    try:
        host = read_host(tree)
        check_sane(host)
        # The cpu.max beside the tree says SENTINEL: had it been read, its
        # reason would quote it; the tree's own quota may be read.
        assert host.quota is None or host.quota.source.startswith("sys/fs/cgroup")
    finally:
        for path, text in saved.items():
            with open(path, "w") as f:
                f.write(text)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), content=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_content_in_any_read_file_never_raises(place, read_files, data, content):
    tree, _ = place
    rel = data.draw(st.sampled_from(read_files))
    path = os.path.join(tree, rel)
    saved = open(path, "rb").read()
    try:
        with open(path, "wb") as f:
            f.write(content)
        with no_hang():
            check_sane(read_host(tree))
    finally:
        with open(path, "wb") as f:
            f.write(saved)


def test_a_folder_of_too_many_entries_is_cut_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(_sysfs, "MAX_ENTRIES", 8)
    cpu = tmp_path / "sys/devices/system/cpu"
    for n in range(20):
        (cpu / f"cpu{n}/topology").mkdir(parents=True)
    host = read_host(tmp_path)
    assert any("more than 8 entries" in r for r in host.reasons)


def test_a_root_that_is_not_a_directory_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        read_host(tmp_path / "file")


def test_the_walk_and_openat2_agree_on_this_machine(monkeypatch):
    by_kernel = read_host("/")
    monkeypatch.setattr(_sysfs, "_openat2", False)
    assert read_host("/") == by_kernel


# --- linear work ----------------------------------------------------------


def test_parse_cpulist_work_follows_the_text_not_the_ranges(monkeypatch):
    """Counts the CPU numbers parse_cpulist materialises (the ranges it
    builds), not the clock: for 8,000 overlapping full ranges, 64 KB of text,
    at most the 65,536 CPUs of the answer, where the work used to be 8,000
    ranges of 65,536 (10.9 s in bench/topo.py's run)."""
    from cpupin import cpulist

    built = []

    def counting_range(*args):
        r = range(*args)
        built.append(len(r))
        return r

    monkeypatch.setattr(cpulist, "range", counting_range, raising=False)
    ranges = ",".join(["0-65535"] * 8000)
    assert len(parse_cpulist(ranges)) == 65536
    assert sum(built) == 65536
    built.clear()
    assert len(parse_cpulist(",".join(["0-9", "5-20", "3-7"] * 1000))) == 21
    assert sum(built) == 21  # overlaps cost nothing past the answer


class CountingTuple(tuple):
    iterations = 0

    def __iter__(self):
        CountingTuple.iterations += 1
        return super().__iter__()


def test_topo_and_plan_text_walk_the_cores_a_few_times_not_once_a_node(monkeypatch, capsys):
    """A 65,536-CPU, 2,048-node host: the text output passes over the cores a
    bounded number of times, as the JSON does, not once for each node."""
    from cpupin.cli import _args

    spec = HostSpec("huge", sockets=1024, nodes_per_socket=2, cores_per_node=16, threads=2)
    host = spec_host(spec)
    assert len(host.cpus) == 65536 and len(host.nodes) == 2048
    counted = replace(host, cores=CountingTuple(host.cores))
    monkeypatch.setattr(_args, "load_host", lambda args: (counted, "huge", counted.cpus))
    for argv in (["topo"], ["plan", "--gpu", "0000:01:00.0", "--setting", "auto"]):
        for json_flag in ([], ["--json"]):
            CountingTuple.iterations = 0
            assert main(argv + json_flag) == 0
            assert len(capsys.readouterr().out.splitlines()) > (0 if json_flag else 2048)
            assert CountingTuple.iterations < 20, (argv, json_flag, CountingTuple.iterations)


def test_a_fifo_root_file_is_never_opened_for_reading(tmp_path, resolver):
    """The FIFO is checked before it is opened: no writer ever appears, and
    the read would block without the O_PATH check (or O_NONBLOCK)."""
    cpu = tmp_path / "sys/devices/system/cpu"
    cpu.mkdir(parents=True)
    os.mkfifo(cpu / "online")
    with no_hang():
        host = read_host(tmp_path)
    assert any("a FIFO" in r for r in host.reasons)
    assert stat.S_ISFIFO(os.stat(cpu / "online").st_mode)


def test_a_rename_anywhere_on_the_host_never_loses_a_gpu(place):
    """openat2 answers EAGAIN when a rename anywhere on the host races a
    path with "..", as sysfs's own relative links have: a busy host renames
    all the time, and such a read is tried again (then walked), never taken
    for a missing device. Another process renames in a loop beside 300
    reads of the tree."""
    import subprocess
    import sys

    tree, _ = place
    want = [g.address for g in read_host(tree).gpus]
    assert len(want) == 2
    scratch = tempfile.mkdtemp(prefix="cpupin-renames-")
    renames = (
        "import os, sys\n"
        "a, b = sys.argv[1] + '/a', sys.argv[1] + '/b'\n"
        "open(a, 'w').close()\n"
        "while True:\n"
        "    os.rename(a, b); os.rename(b, a)\n"
    )
    renamer = subprocess.Popen([sys.executable, "-c", renames, scratch])  # another CPU's renames
    try:
        seen = [[g.address for g in read_host(tree).gpus] for _ in range(300)]
    finally:
        renamer.kill()
        renamer.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    assert all(gpus == want for gpus in seen), [g for g in seen if g != want][:3]


def test_eagain_is_tried_again_then_walked(place, monkeypatch):
    """The retry's bound: a path that keeps answering EAGAIN is resolved by
    the component walk, which gives the same file."""
    import errno

    tree, _ = place
    want = read_host(tree)
    calls = []

    def always_again(root_fd, rel, want_dir):
        calls.append(rel)
        return -errno.EAGAIN, 0

    monkeypatch.setattr(_sysfs._native, "open_in_root", always_again)
    assert read_host(tree) == want
    assert calls and len(calls) % _sysfs.AGAIN == 0
