"""Real cgroups for tests that need a CPU quota: made fresh, emptied and removed after."""

import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from cpupin.host.throttle import parse_cpu_stat


def _cpu_mount():
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] == "cgroup" and "cpu" in parts[3].split(","):
                return "v1", parts[1]
    for line in open("/proc/self/mounts"):
        parts = line.split()
        if parts[2] == "cgroup2":
            try:
                controllers = Path(parts[1], "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" in controllers:
                return "v2", parts[1]
    return None, None


@contextmanager
def quota_cgroup(quota_us, period_us=100_000, weight=None):
    """A fresh cgroup (v1's cpu controller, else v2's) with a CPU quota
    (``None``: none) and a CPU weight (v2's units, 1-10000; v1 gets the
    same share in cpu.shares); yields (its folder, its cpu.stat reader).
    Processes put in it are moved back to the root cgroup and the folder
    removed after."""
    if os.geteuid() != 0:
        pytest.skip("a cgroup with a quota needs root")
    kind, mount = _cpu_mount()
    if kind is None:
        pytest.skip("no cgroup hierarchy with the cpu controller is mounted")
    path = f"{mount}/cpupin-test-{uuid.uuid4().hex[:8]}"
    if kind == "v2":
        Path(mount, "cgroup.subtree_control").write_text("+cpu")
    os.mkdir(path)
    try:
        if kind == "v1":
            Path(path, "cpu.cfs_period_us").write_text(str(period_us))
            if quota_us is not None:
                Path(path, "cpu.cfs_quota_us").write_text(str(quota_us))
            if weight is not None:
                Path(path, "cpu.shares").write_text(str(weight * 1024 // 100))
        else:
            if quota_us is not None:
                Path(path, "cpu.max").write_text(f"{quota_us} {period_us}")
            if weight is not None:
                Path(path, "cpu.weight").write_text(str(weight))

        def throttled_ns():
            stat = parse_cpu_stat(Path(path, "cpu.stat").read_text())
            return stat.throttled_ns, stat.throttled_periods

        yield path, throttled_ns
    finally:
        for pid in Path(path, "cgroup.procs").read_text().split():
            try:
                Path(mount, "cgroup.procs").write_text(pid)
            except OSError:
                pass
        os.rmdir(path)


def in_cgroup(path):
    def enter():
        Path(path, "cgroup.procs").write_text(str(os.getpid()))

    return enter


def throttle_file(path):
    """The file a step clock in the cgroup ``path`` (which has the quota)
    should read its throttled time from, by what the kernel shows there:
    ``cpu.stat.local`` when it holds the counter (Linux 6.6 on), else
    ``cpu.stat``."""
    try:
        text = Path(path, "cpu.stat.local").read_text()
    except OSError:
        return "cpu.stat"
    keys = {line.split(" ")[0] for line in text.splitlines()}
    return "cpu.stat.local" if keys & {"throttled_usec", "throttled_time"} else "cpu.stat"
