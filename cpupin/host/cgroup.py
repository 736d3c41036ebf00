"""The process's cgroup: its cpuset and the strictest CPU quota above it.

cgroup v2 (``cpu.max``, ``cpuset.cpus.effective``), cgroup v1
(``cpu.cfs_quota_us``/``cpu.cfs_period_us`` with ``cpu`` and ``cpuacct``
mounted together or apart, ``cpuset.effective_cpus``) and hybrid hierarchies,
found through ``proc/self/mounts`` and ``proc/self/cgroup`` under a root.
Whatever cannot be parsed means no limit, with a reason; never an exception.
"""

from __future__ import annotations

import math
import os

from cpupin._records import record
from cpupin.cpulist import parse_cpulist
from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader

__all__ = ["Quota", "Weight", "parse_cpu_max", "read_cgroup", "read_cgroup_cpuset", "read_weight"]


@record(frozen=True)
class Quota:
    """A CFS quota: ``quota_us`` of CPU time every ``period_us``."""

    quota_us: int
    period_us: int
    source: str
    """The file it came from, under the root."""

    @property
    def cpus(self) -> int:
        """The CPUs' worth of time the quota allows, rounded up, at least 1."""
        return max(1, math.ceil(self.quota_us / self.period_us))


_DEFAULT_PERIOD_US = 100_000
_MAX_US = (1 << 63) - 1
#: Cgroup folders deeper than this are not walked (systemd nests a few).
_MAX_DEPTH = 64


def parse_cpu_max(text: str) -> tuple[int, int] | None:
    """``(quota_us, period_us)`` from cgroup v2 ``cpu.max``; ``None`` for no
    quota (``max``). :class:`ValueError` saying what is wrong when it cannot
    be parsed, like every other parser here."""
    fields = text.split()
    if not fields:
        raise ValueError("empty")
    if len(fields) > 2:
        raise ValueError(f"{excerpt(text.strip())} has {len(fields)} fields, not 'QUOTA PERIOD'")
    if fields[0] == "max":
        return None
    if any(len(f) > 19 or not f.isascii() or not f.isdigit() for f in fields):
        raise ValueError(f"{excerpt(text.strip())} is not 'QUOTA PERIOD' in whole microseconds")
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) == 2 else _DEFAULT_PERIOD_US
    if quota <= 0 or period <= 0:
        raise ValueError(f"{excerpt(text.strip())} has a quota or period that is not positive")
    return quota, period


def _mounts(r: Reader) -> tuple[str | None, dict[str, str]]:
    """The cgroup v2 mount point and the v1 mount point of each controller."""
    text = r.text("proc/self/mounts") or r.text("proc/mounts")
    unified: str | None = None
    v1: dict[str, str] = {}
    if text is None:
        if r.is_file("sys/fs/cgroup/cgroup.controllers"):
            return "/sys/fs/cgroup", v1
        for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
            if r.is_dir(f"sys/fs/cgroup/{name}"):
                v1["cpu"] = f"/sys/fs/cgroup/{name}"
                break
        if r.is_dir("sys/fs/cgroup/cpuset"):
            v1["cpuset"] = "/sys/fs/cgroup/cpuset"
        return None, v1
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point, kind, options = parts[1], parts[2], parts[3].split(",")
        if kind == "cgroup2" and unified is None:
            unified = point
        elif kind == "cgroup":
            for controller in ("cpu", "cpuset"):
                if controller in options:
                    v1.setdefault(controller, point)
    return unified, v1


def _membership(r: Reader, proc: str = "self") -> tuple[str | None, dict[str, str]]:
    """The process's v2 cgroup path and its v1 path of each controller
    (``proc``: ``self`` or a pid, whose membership is read against this
    process's mounts, as the kernel shows it to a reader)."""
    unified: str | None = None
    v1: dict[str, str] = {}
    text = r.text(f"proc/{proc}/cgroup")
    if text is not None:
        for line in text.splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, path = parts
            if controllers == "":
                unified = path
            for controller in controllers.split(","):
                if controller in ("cpu", "cpuset"):
                    v1[controller] = path
    else:
        cpuset = r.text(f"proc/{proc}/cpuset")
        if cpuset is not None and cpuset.strip():
            unified = cpuset.strip()
            v1["cpuset"] = cpuset.strip()
    return unified, v1


#: The longest cgroup path kept (the kernel's PATH_MAX).
_MAX_PATH = 4096


def cgroup_path(r: Reader, proc: str = "self") -> str | None:
    """The process's cgroup path: its v2 path, else its v1 cpuset or cpu
    controller's, whichever is not the root (a process moved into a cgroup
    of the cpu controller alone keeps the cpuset root); ``None`` when
    ``proc/<proc>/cgroup`` does not say."""
    unified, v1 = _membership(r, proc)
    if unified not in (None, "/") or not v1:
        path = unified
    else:
        found = [v1.get("cpuset"), v1.get("cpu")]
        path = next((p for p in found if p and p != "/"), found[0] or found[1])
    if path is None:
        return None
    path = "".join(c for c in path.strip() if c.isprintable())
    return path[:_MAX_PATH] or None


def _chain(r: Reader, mount: str, path: str) -> list[str]:
    """The cgroup's folder and its ancestors up to the mount, leaf first.
    Where the path is not there (a cgroup namespace), the mount itself."""
    rel = os.path.normpath("/" + path.strip()).lstrip("/")
    if rel.count("/") >= _MAX_DEPTH:
        r.reasons.append(
            f"the cgroup path {excerpt(path)} is more than {_MAX_DEPTH} folders deep; "
            "read at the mount only"
        )
        rel = ""
    chain = []
    while True:
        folder = os.path.join(mount, rel) if rel else mount
        if r.is_dir(folder):
            chain.append(folder)
        if not rel:
            break
        rel = os.path.dirname(rel)
    return chain or [mount]


def _quota_v2(r: Reader, chain: list[str]) -> tuple[int, int, str] | None:
    best = None
    for folder in chain:
        rel = f"{folder}/cpu.max"
        text = r.text(rel)
        if text is None:
            continue
        try:
            parsed = parse_cpu_max(text)
        except ValueError as exc:
            r.reasons.append(f"{rel}: {exc}; taken as no quota")
            continue
        if parsed is not None and (best is None or parsed[0] * best[1] < best[0] * parsed[1]):
            best = (parsed[0], parsed[1], rel)
    return best


def _quota_v1(r: Reader, chain: list[str]) -> tuple[int, int, str] | None:
    best = None
    for folder in chain:
        quota_text = r.text(f"{folder}/cpu.cfs_quota_us")
        if quota_text is None:
            continue
        period_text = r.text(f"{folder}/cpu.cfs_period_us")
        quota = r.number(f"{folder}/cpu.cfs_quota_us", quota_text, -1, _MAX_US)
        period = (
            r.number(f"{folder}/cpu.cfs_period_us", period_text, 1, _MAX_US)
            if period_text is not None
            else _DEFAULT_PERIOD_US
        )
        if quota is None or period is None:
            continue  # the reason says which; taken as no quota
        if quota <= 0 or period <= 0:
            continue  # -1: no quota
        if best is None or quota * best[1] < best[0] * period:
            best = (quota, period, f"{folder}/cpu.cfs_quota_us")
    return best


def _cpuset(r: Reader, chain: list[str], names: tuple[str, ...]) -> frozenset[int] | None:
    for folder in chain:
        for name in names:
            text = r.text(f"{folder}/{name}")
            if text is None or not text.strip():
                continue
            try:
                return parse_cpulist(text)
            except ValueError as exc:
                r.reasons.append(f"{folder}/{name}: {exc}")
                return None
    return None


def read_cgroup(r: Reader, proc: str = "self") -> tuple[frozenset[int] | None, Quota | None]:
    """The cgroup cpuset (``None`` when unknown) and the strictest quota of
    ``proc`` (``self`` or a pid)."""
    unified_mount, v1_mounts = _mounts(r)
    unified_path, v1_paths = _membership(r, proc)
    quota = None
    cpuset = None
    if "cpu" in v1_mounts:
        chain = _chain(r, v1_mounts["cpu"], v1_paths.get("cpu", "/"))
        quota = _quota_v1(r, chain)
    elif unified_mount is not None:
        quota = _quota_v2(r, _chain(r, unified_mount, unified_path or "/"))
    if "cpuset" in v1_mounts:
        chain = _chain(r, v1_mounts["cpuset"], v1_paths.get("cpuset", "/"))
        cpuset = _cpuset(r, chain, ("cpuset.effective_cpus", "cpuset.cpus"))
    if cpuset is None and unified_mount is not None:
        chain = _chain(r, unified_mount, unified_path or "/")
        cpuset = _cpuset(r, chain, ("cpuset.cpus.effective",))
    return cpuset, Quota(*quota) if quota else None


@record(frozen=True)
class Weight:
    """A cgroup's CPU weight against its siblings: the share of contended
    CPU time it gets (not a limit: an uncontended cgroup takes any idle CPU)."""

    value: int
    default: int
    """The kernel's default: ``cpu.weight`` 100 (v2), ``cpu.shares`` 1024 (v1)."""
    source: str
    """The file it came from, under the root."""

    @property
    def relative(self) -> float:
        """The weight against the default: 0.5 gets half a default sibling's share."""
        return self.value / self.default

    def as_dict(self) -> dict[str, object]:
        return {"value": self.value, "default": self.default, "source": self.source}


def read_weight(r: Reader, proc: str = "self") -> Weight | None:
    """The lowest CPU weight, against the default, of ``proc``'s cgroup and
    its ancestors (``cpu.weight`` in v2, ``cpu.shares`` in v1): the one that
    limits it most when its siblings are busy. ``None`` where no weight is
    readable (the root cgroup has none)."""
    unified_mount, v1_mounts = _mounts(r)
    unified_path, v1_paths = _membership(r, proc)
    if "cpu" in v1_mounts:
        chain = _chain(r, v1_mounts["cpu"], v1_paths.get("cpu", "/"))
        name, lo, hi, default = "cpu.shares", 2, 262144, 1024
    elif unified_mount is not None:
        chain = _chain(r, unified_mount, unified_path or "/")
        name, lo, hi, default = "cpu.weight", 1, 10000, 100
    else:
        return None
    best: Weight | None = None
    for folder in chain:
        rel = f"{folder}/{name}"
        text = r.text(rel)
        if text is None:
            continue
        value = r.number(rel, text, lo, hi)
        if value is not None and (best is None or value < best.value):
            best = Weight(value, default, rel)
    return best


def read_cgroup_cpuset(root: str = "/") -> frozenset[int] | None:
    """The CPUs the cgroup cpuset of the process allows now, read under
    ``root``; ``None`` when no cpuset says."""
    with Reader(root) as r:
        return read_cgroup(r)[0]
