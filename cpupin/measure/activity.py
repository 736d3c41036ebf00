"""What a thread does with the CPU it takes: the counters beside schedstat
that tell a spinning thread from a busy one, and the verdict.

A thread that loops on ``sched_yield()`` or on a poll with a zero timeout
burns a CPU while doing nothing. schedstat shows it busy, as busy as a
thread that computes; what tells them apart is where its time goes and
whether it ever blocks:

- it spends most of its CPU time in the kernel (``stime`` of its ``stat``:
  each turn of its loop is a system call), where a computing thread spends
  almost none;
- it never blocks: its voluntary context switches (``status``) stay few,
  where a thread that does I/O or waits on a lock blocks on every turn;
- it moves no data and touches no new memory: its read and written bytes
  (``io``) and its minor page faults (``stat``) barely move, where a thread
  that copies a file from the page cache, or maps and unmaps memory, also
  spends its time in the kernel.

Counters are read as hostile text (a thread's files under ``/proc``, bounded,
numbers in range). :func:`spinning` is pure: a verdict over two readings.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from cpupin.host._sysfs import Reader

__all__ = [
    "MIN_BUSY",
    "TaskCounters",
    "read_counters",
    "spinning",
]

#: A thread spins only if it wanted a CPU (ran, or waited in the run queue)
#: at least this share of the interval.
MIN_BUSY = 0.5
#: ... and spent at least this share of the CPU time it got in the kernel
#: (a computing thread: under 5%; a sched_yield or poll(0) loop in C: 80-90%;
#: in Python, whose interpreter runs between the calls: about half).
MIN_KERNEL_SHARE = 0.3
#: ... and blocked at most this many times a second (a thread waking on a
#: 1 ms timer blocks 1,000 times a second and hardly runs).
MAX_BLOCKS_PER_S = 50.0
#: ... and read or wrote at most this many bytes a second through system
#: calls (a copy from the page cache runs in the kernel too, and moves data).
MAX_IO_BYTES_PER_S = 1 << 20
#: ... and took at most this many minor page faults a second (mapping and
#: unmapping memory in a loop is kernel time too).
MAX_FAULTS_PER_S = 1000.0
#: Clock ticks of CPU time below which utime and stime are too coarse to
#: give a share (they count in 1/CLK_TCK s).
MIN_TICKS = 5

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX = (1 << 63) - 1


class TaskCounters(NamedTuple):
    """A thread's counters beside schedstat at one moment; ``None`` for a
    counter that could not be read (``io`` needs the right to trace it)."""

    utime: int
    """Clock ticks of CPU time in user space."""
    stime: int
    """Clock ticks of CPU time in the kernel."""
    minflt: int
    voluntary: int | None
    """Voluntary context switches: times it blocked."""
    io_bytes: int | None
    """Bytes read and written through system calls (``rchar + wchar``)."""


def _number(text: str) -> int | None:
    if not text.isdigit() or len(text) > 20:
        return None
    value = int(text)
    return value if value <= _MAX else None


def parse_counters(stat: str, status: str | None, io: str | None) -> TaskCounters | None:
    """The counters from a thread's ``stat``, ``status`` and ``io`` texts
    (``None`` when ``stat`` does not parse). Pure."""
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 13:
        return None
    minflt, utime, stime = (_number(fields[i]) for i in (7, 11, 12))
    if minflt is None or utime is None or stime is None:
        return None
    voluntary = None
    for line in (status or "").splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            voluntary = _number(line.partition(":")[2].strip())
            break
    io_bytes: int | None = None
    if io:
        values = {}
        for line in io.splitlines():
            key, _, value = line.partition(":")
            if key in ("rchar", "wchar"):
                values[key] = _number(value.strip())
        if values.get("rchar") is not None and values.get("wchar") is not None:
            io_bytes = int(values["rchar"] or 0) + int(values["wchar"] or 0)
    return TaskCounters(utime, stime, minflt, voluntary, io_bytes)


def read_counters(
    pid: int, tids: list[int], reader: Reader | None = None
) -> dict[int, TaskCounters]:
    """Each thread's counters (a thread gone, or unreadable, is left out)."""
    own = reader is None
    r = reader or Reader("/")
    try:
        out = {}
        for tid in tids:
            base = f"proc/{pid}/task/{tid}"
            stat = r.text(f"{base}/stat", 4096)
            if stat is None:
                continue
            found = parse_counters(
                stat, r.text(f"{base}/status", 16384), r.text(f"{base}/io", 4096)
            )
            if found is not None:
                out[tid] = found
        return out
    finally:
        if own:
            r.close()


def spinning(before: TaskCounters, after: TaskCounters, busy: float, interval_s: float) -> bool:
    """Whether a thread spun over an interval: it wanted a CPU (``busy``:
    its run and run-queue wait, as a share of the interval) at least
    :data:`MIN_BUSY`, spent at least :data:`MIN_KERNEL_SHARE` of its CPU
    time in the kernel, hardly blocked, and moved no data and touched no
    new memory. Pure."""
    if busy < MIN_BUSY or interval_s <= 0:
        return False
    user = after.utime - before.utime
    kernel = after.stime - before.stime
    if user < 0 or kernel < 0 or user + kernel < max(MIN_TICKS, 0.1 * interval_s * _CLK_TCK):
        return False
    if kernel / (user + kernel) < MIN_KERNEL_SHARE:
        return False
    if before.voluntary is not None and after.voluntary is not None:
        if (after.voluntary - before.voluntary) / interval_s > MAX_BLOCKS_PER_S:
            return False
    if before.io_bytes is not None and after.io_bytes is not None:
        if (after.io_bytes - before.io_bytes) / interval_s > MAX_IO_BYTES_PER_S:
            return False
    return (after.minflt - before.minflt) / interval_s <= MAX_FAULTS_PER_S
