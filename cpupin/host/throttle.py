"""What a process's cgroup loses to its CPU quota, and the CPU pressure
beside it: the counters of ``cpu.stat`` (v2's ``throttled_usec``, v1's
``throttled_time``) of the cgroup whose quota is the strictest, and PSI's
``cpu.pressure`` (the cgroup's, else ``/proc/pressure/cpu``), read under a
root with the hostile-safe reader, and the difference between two reads.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import Quota, _chain, _membership, _mounts, read_cgroup

__all__ = [
    "CpuStat",
    "ThrottleProbe",
    "cpu_stat_file",
    "Throttling",
    "parse_cpu_stat",
    "parse_pressure",
    "read_cpu_stat",
    "read_pressure",
]

_STAT_KEYS = {
    # v2: cpu.stat of the cgroup, microseconds
    "nr_periods": "periods",
    "nr_throttled": "throttled_periods",
    "throttled_usec": "throttled_us",
    # v1: the cpu controller's cpu.stat, nanoseconds
    "throttled_time": "throttled_ns",
}


@dataclass(frozen=True)
class CpuStat:
    """A cgroup's throttling counters: periods with runnable tasks, periods
    in which the quota ran out, and the time its tasks were held back."""

    periods: int
    throttled_periods: int
    throttled_ns: int
    source: str


def parse_cpu_stat(text: str, source: str = "cpu.stat") -> CpuStat:
    """The throttling counters of a ``cpu.stat`` (v2's ``throttled_usec`` or
    v1's ``throttled_time``). :class:`ValueError` saying what is wrong when
    a counter is missing or not a number of at most 20 digits."""
    found: dict[str, int] = {}
    for line in text.splitlines()[:64]:
        fields = line.split()
        if len(fields) != 2 or fields[0] not in _STAT_KEYS:
            continue
        value = fields[1]
        if len(value) > 20 or not value.isascii() or not value.isdigit():
            raise ValueError(f"{fields[0]} {excerpt(value)} is not a count")
        found[_STAT_KEYS[fields[0]]] = int(value)
    if "throttled_us" in found:
        found["throttled_ns"] = found.pop("throttled_us") * 1000
    missing = [k for k in ("periods", "throttled_periods", "throttled_ns") if k not in found]
    if missing:
        raise ValueError(f"no {', '.join(missing)} counter(s)")
    return CpuStat(found["periods"], found["throttled_periods"], found["throttled_ns"], source)


def parse_pressure(text: str) -> int:
    """The ``some`` total of a PSI file (``cpu.pressure``, ``/proc/pressure/cpu``)
    in microseconds: the time at least one task waited for a CPU."""
    for line in text.splitlines()[:4]:
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key == "total":
                    if len(value) > 20 or not value.isascii() or not value.isdigit():
                        raise ValueError(f"total={excerpt(value)} is not a count")
                    return int(value)
    raise ValueError("no 'some ... total=' line")


def cpu_stat_file(quota: Quota) -> tuple[str, int]:
    """The ``cpu.stat`` beside the strictest quota, where the throttling is
    counted (under the root), and its cgroup version: 2 or 1."""
    return f"{os.path.dirname(quota.source)}/cpu.stat", 2 if quota.source.endswith("cpu.max") else 1


def read_cpu_stat(r: Reader, quota: Quota | None) -> CpuStat | None:
    """The throttling counters of the cgroup whose quota is the strictest
    (``None`` without a quota: nothing throttles, or when unreadable, with a
    reason in ``r.reasons``)."""
    if quota is None:
        return None
    rel = cpu_stat_file(quota)[0]
    text = r.text(rel, limit=4096)
    if text is None:
        return None
    try:
        return parse_cpu_stat(text, rel)
    except ValueError as exc:
        r.reasons.append(f"{rel}: {exc}; left out")
        return None


def _pressure_file(r: Reader, proc: str) -> str | None:
    """The cgroup's ``cpu.pressure`` (cgroup v2), else the host's."""
    unified_mount, _ = _mounts(r)
    unified_path, _ = _membership(r, proc)
    if unified_mount is not None and unified_path:
        folder = _chain(r, unified_mount, unified_path)[0]
        if r.is_file(f"{folder}/cpu.pressure"):
            return f"{folder}/cpu.pressure"
    return "proc/pressure/cpu" if r.is_file("proc/pressure/cpu") else None


def read_pressure(r: Reader, proc: str = "self", rel: str | None = None) -> tuple[int, str] | None:
    """CPU pressure (``some`` total, microseconds) of ``proc``'s cgroup, else
    of the host, and the file it came from; ``None`` where the kernel has no
    PSI. ``rel`` reads a file found before."""
    rel = rel or _pressure_file(r, proc)
    if rel is None:
        return None
    text = r.text(rel, limit=4096)
    if text is None:
        return None
    try:
        return parse_pressure(text), rel
    except ValueError as exc:
        r.reasons.append(f"{rel}: {exc}; left out")
        return None


@dataclass(frozen=True)
class Throttling:
    """What a process's cgroup lost to its quota over an interval, beside
    the host's (or cgroup's) CPU pressure."""

    interval_s: float
    throttled_ms_per_s: float | None
    """Time the cgroup was held back by its quota, per second of wall time
    (summed over CPUs, as the kernel counts it); ``None`` without a quota."""
    throttled_periods: int | None
    periods: int | None
    pressure_ms_per_s: float | None
    """CPU pressure (PSI ``some``): time at least one task waited for a CPU;
    ``None`` without PSI."""
    source: str | None

    def as_dict(self) -> dict[str, object]:
        def r2(v: float | None) -> float | None:
            return None if v is None else round(v, 2)

        return {
            "throttled_ms_per_s": r2(self.throttled_ms_per_s),
            "throttled_periods": self.throttled_periods,
            "periods": self.periods,
            "pressure_ms_per_s": r2(self.pressure_ms_per_s),
            "source": self.source,
        }


class ThrottleProbe:
    """Reads a process's throttling and pressure counters at two moments
    (under ``root``; ``pid`` ``None``: this process) and gives the
    :class:`Throttling` between them. Never raises for what it reads."""

    def __init__(self, pid: int | None = None, root: str = "/") -> None:
        self.proc = "self" if pid is None else str(pid)
        self.root = root
        self.reasons: list[str] = []
        self._quota: Quota | None = None
        self._pressure_file: str | None = None
        self._first: tuple[int, CpuStat | None, tuple[int, str] | None] | None = None

    def _read(self) -> tuple[int, CpuStat | None, tuple[int, str] | None]:
        with Reader(self.root) as r:
            if self._first is None:
                self._quota = read_cgroup(r, self.proc)[1]
                self._pressure_file = _pressure_file(r, self.proc)
            stat = read_cpu_stat(r, self._quota)
            pressure = (
                read_pressure(r, self.proc, self._pressure_file) if self._pressure_file else None
            )
            self.reasons.extend(x for x in r.reasons if x not in self.reasons)
        return time.monotonic_ns(), stat, pressure

    def start(self) -> ThrottleProbe:
        self._first = self._read()
        return self

    def stop(self) -> Throttling:
        if self._first is None:
            self.start()
        assert self._first is not None
        t0, s0, p0 = self._first
        t1, s1, p1 = self._read()
        wall_s = max(t1 - t0, 1) / 1e9
        throttled = periods = nr = None
        source = None
        if s0 is not None and s1 is not None:
            throttled = max(0, s1.throttled_ns - s0.throttled_ns) / 1e6 / wall_s
            nr = max(0, s1.throttled_periods - s0.throttled_periods)
            periods = max(0, s1.periods - s0.periods)
            source = s1.source
        pressure = None
        if p0 is not None and p1 is not None:
            pressure = max(0, p1[0] - p0[0]) / 1000 / wall_s
        self._first = (t1, s1, p1)
        return Throttling(wall_s, throttled, nr, periods, pressure, source)
