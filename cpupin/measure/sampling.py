"""Per-thread CPU time and run-queue wait over an interval, from schedstat.

:func:`sample_threads` reads every thread of a process twice (one native call
each) and reports, per thread, CPU ms per second of wall time, run-queue wait
ms per second (the time it was runnable but not running: what queueing
behind a pinned thread costs), the CPU it last ran on, its mask and whether
that mask is the process mask, a registered pin, or neither.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cpupin import _native
from cpupin.cpulist import format_cpulist
from cpupin.host.throttle import ThrottleProbe, Throttling
from cpupin.measure.activity import TaskCounters, read_counters, spinning
from cpupin.process.mask import process_cpus, start_time, thread_masks
from cpupin.process.outside import process_mask_of, registry_of
from cpupin.registry.reader import Record, Registry
from cpupin.threads.pins import pinned_threads

__all__ = [
    "Audit",
    "Sampler",
    "ThreadSample",
    "audit",
    "host_view",
    "process_mask_of",
    "sample_threads",
]


#: A thread that waits this many ms a second (1%) for a CPU is stalled.
STALL_MS_PER_S = 10.0


def stall_of(wait_ms_per_s: float, throttling: Throttling | None) -> str | None:
    """``quota``, ``contention`` or ``None``: see :attr:`ThreadSample.stall`.
    Throttled time is also run-queue wait to the kernel, so the wait alone
    cannot tell them apart; the cgroup's counters can."""
    if wait_ms_per_s < STALL_MS_PER_S:
        return None
    if throttling is not None and throttling.throttled_periods:
        return "quota"
    return "contention"


@dataclass(frozen=True)
class ThreadSample:
    """One thread over one interval."""

    tid: int
    name: str
    cpu_ms_per_s: float
    wait_ms_per_s: float
    last_cpu: int | None
    mask: frozenset[int]
    state: str
    """``process mask``, ``pinned`` (a registered pin: this process's, or
    another's from its record in the lock directory), ``stray`` (neither, in
    this process), and for another process ``interloper`` (not registered,
    on CPUs the process pinned threads to) or ``narrower`` (not registered,
    elsewhere; without a record every narrower thread is one of these)."""
    stall: str | None = None
    """For a thread that waited at least :data:`STALL_MS_PER_S`: ``quota``
    when the process's cgroup was throttled by its quota in the interval,
    else ``contention`` (other threads held the CPUs); ``None`` otherwise."""
    spinning: bool = False
    """It burned a CPU doing nothing: busy, mostly in the kernel, never
    blocking, moving no data (:func:`cpupin.measure.activity.spinning`)."""

    @property
    def runnable_ms_per_s(self) -> float:
        """The time it wanted a CPU: ran or waited in the run queue."""
        return self.cpu_ms_per_s + self.wait_ms_per_s

    def as_dict(self) -> dict[str, object]:
        return {
            "tid": self.tid,
            "name": self.name,
            "cpu_ms_per_s": round(self.cpu_ms_per_s, 2),
            "wait_ms_per_s": round(self.wait_ms_per_s, 2),
            "last_cpu": self.last_cpu,
            "mask": sorted(self.mask),
            "mask_list": format_cpulist(self.mask),
            "state": self.state,
            "stall": self.stall,
            "spinning": self.spinning,
        }


class Sampler:
    """Samples every thread of a process over a block of work.

    ``with Sampler(pid) as sampler: ...`` reads every thread on entry and on
    exit; :attr:`samples` then holds each thread's CPU and wait ms per
    second of the block. :func:`sample_threads` is the same over a sleep.
    """

    def __init__(
        self, pid: int | None = None, *, root: str = "/", registry: Registry | None = None
    ) -> None:
        self.pid = None if pid is None else _native.as_pid(pid)
        self.registry = registry
        """Where another process's registered pins are read (default: the
        registry that knows it, read at each stop)."""
        self.samples: list[ThreadSample] = []
        self.throttling: Throttling | None = None
        """The cgroup's throttling and CPU pressure over the last interval."""
        self.threads: list[tuple[_native.ThreadStat, frozenset[int]]] = []
        """Every thread and its mask as the last stop read them."""
        self._probe = ThrottleProbe(None if self.pid == os.getpid() else self.pid, root)
        self._first: dict[int, _native.ThreadStat] = {}
        self._counters: dict[int, TaskCounters] = {}
        self._start = 0
        self._started: int | None = None

    def _same_process(self) -> None:
        """Raise unless the pid still names the process first sampled: a pid
        is reused once its process is gone, and figures from two processes
        would be foreign or negative. Its start time tells them apart."""
        pid = self.pid
        if pid is None or pid == os.getpid():
            return
        started = start_time(pid)
        if self._started is None:
            if started is None:
                raise ProcessLookupError(errno.ESRCH, f"pid {pid}: no such process")
            self._started = started
        if started is None or started != self._started:
            raise ProcessLookupError(
                errno.ESRCH,
                f"pid {pid} exited"
                + (" and now names another process" if started is not None else "")
                + "; sampling stopped",
            )

    def _target(self) -> int:
        return os.getpid() if self.pid is None else self.pid

    def start(self) -> Sampler:
        self._same_process()
        # The clock is read before the first figures and after the last
        # (:meth:`stop`), so the wall interval holds every thread's: a thread
        # can then never show more than 1000 ms of CPU a second, whatever
        # delays the reads between (a busy host, the throttling probe).
        self._start = time.monotonic_ns()
        self._first = {st.tid: st for st in _native.thread_stats(self.pid)}
        self._counters = read_counters(self._target(), list(self._first))
        self._probe.start()
        return self

    def stop(self) -> list[ThreadSample]:
        pid = self.pid
        try:
            threads = thread_masks(pid, last_cpu=True)
        except ProcessLookupError:
            threads = []
        self._same_process()  # says that it exited, or now names another
        if not threads:
            raise ProcessLookupError(errno.ESRCH, f"pid {pid} exited; sampling stopped")
        counters = read_counters(self._target(), [st.tid for st, _ in threads])
        wall_ms = max(time.monotonic_ns() - self._start, 1) / 1e6
        self.threads = threads
        self.throttling = throttling = self._probe.stop()
        own = pid is None or pid == os.getpid()
        masks = {st.tid: cpus for st, cpus in threads}
        if own:
            mask, pins = process_cpus(), pinned_threads()
        else:
            mask, _ = process_mask_of(pid or 0, list(masks.values()))
            found = self.registry or registry_of(pid or 0, None)
            pins = {p.tid: p.cpus for p in found.pins_of(pid or 0)}
        pinned_cpus = frozenset().union(*pins.values())
        out = []
        for st, cpus in threads:
            before = self._first.get(st.tid)
            if before is None or st.run_ns < before.run_ns:
                continue  # new in the interval (a reused tid reads less than before)
            if cpus == mask:
                state = "process mask"
            elif pins.get(st.tid) == cpus:
                state = "pinned"
            elif own:
                state = "stray"
            else:  # from outside, its record tells a registered pin from the rest
                state = "interloper" if cpus <= pinned_cpus else "narrower"
            wait = (st.wait_ns - before.wait_ns) / 1e6 / wall_ms * 1000
            run = (st.run_ns - before.run_ns) / 1e6 / wall_ms * 1000
            was, now = self._counters.get(st.tid), counters.get(st.tid)
            spins = (
                was is not None
                and now is not None
                and spinning(was, now, (run + wait) / 1000, wall_ms / 1000)
            )
            out.append(
                ThreadSample(
                    st.tid,
                    st.name,
                    run,
                    wait,
                    st.last_cpu,
                    cpus,
                    state,
                    stall_of(wait, throttling),
                    spins,
                )
            )
        self.samples = sorted(out, key=lambda s: -s.cpu_ms_per_s)
        return self.samples

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sample_threads(pid: int | None = None, interval: float = 1.0) -> list[ThreadSample]:
    """Sample every thread of ``pid`` (default: this process) over
    ``interval`` seconds; sorted by CPU time, busiest first. Threads that
    start or exit during the interval are left out."""
    if interval <= 0:
        raise ValueError(f"interval {interval!r} must be positive (seconds)")
    sampler = Sampler(pid).start()
    time.sleep(interval)
    return sampler.stop()


@dataclass(frozen=True)
class Audit:
    """Another process's threads grouped by CPU mask, seen from outside, and
    which narrower ones its record in the lock directory declares."""

    pid: int
    process_mask: frozenset[int]
    process_mask_from: str
    groups: dict[frozenset[int], list[tuple[int, str]]]
    """Mask to its threads' (tid, name), widest mask first."""
    registered: bool = False
    """Whether the process (or its server) has a live record: only then can a
    deliberate pin be told from a stray."""
    deliberate: frozenset[int] = frozenset()
    """The tids whose mask is a registered pin of theirs."""
    off_pin: tuple[tuple[int, str, frozenset[int], frozenset[int]], ...] = ()
    """Registered pins whose thread runs elsewhere now: (tid, name, pin, mask)."""
    pin_drift: int = 0
    """The drifts the process's own checks counted (its record's)."""

    @property
    def threads(self) -> int:
        return sum(len(members) for members in self.groups.values())

    @property
    def narrower(self) -> dict[frozenset[int], list[tuple[int, str]]]:
        """The groups on a mask other than the process mask."""
        return {m: t for m, t in self.groups.items() if m != self.process_mask}

    @property
    def strays(self) -> list[tuple[int, str, frozenset[int]]]:
        """Narrower threads that are not registered pins: (tid, name, mask)."""
        return [
            (tid, name, mask)
            for mask, members in self.narrower.items()
            for tid, name in members
            if tid not in self.deliberate
        ]

    def as_dict(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "process_mask": sorted(self.process_mask),
            "process_mask_list": format_cpulist(self.process_mask),
            "process_mask_from": self.process_mask_from,
            "registered": self.registered,
            "groups": [
                {
                    "mask": sorted(cpus),
                    "mask_list": format_cpulist(cpus),
                    "narrower": cpus != self.process_mask,
                    "threads": [
                        {"tid": tid, "name": name, "deliberate": tid in self.deliberate}
                        for tid, name in members
                    ],
                }
                for cpus, members in self.groups.items()
            ],
            "off_pin": [
                {
                    "tid": tid,
                    "name": name,
                    "pinned": sorted(pinned),
                    "pinned_list": format_cpulist(pinned),
                    "mask": sorted(now),
                    "mask_list": format_cpulist(now),
                }
                for tid, name, pinned, now in self.off_pin
            ],
            "pin_drift": self.pin_drift,
        }


def audit(pid: int, registry: Registry | None = None, lock_dirs: list[str] | None = None) -> Audit:
    """Group another process's threads by mask, against its process mask
    (:func:`process_mask_of`), and tell its registered pins from the rest:
    from ``registry``, else from the first of ``lock_dirs`` that holds a
    live record of the process (default: its ``CPUPIN_LOCK_DIR`` as it
    started, this process's, and ``/tmp``: a process may set the variable
    at run time, after it started). ``ProcessLookupError`` when it is gone."""
    threads = thread_masks(_native.as_pid(pid))
    if not threads:
        raise ProcessLookupError(errno.ESRCH, f"pid {pid}: no such process")
    mask, source = process_mask_of(pid, [m for _, m in threads])
    groups: dict[frozenset[int], list[tuple[int, str]]] = {}
    for st, cpus in threads:
        groups.setdefault(cpus, []).append((st.tid, st.name))
    ordered = dict(sorted(groups.items(), key=lambda kv: (-len(kv[0]), sorted(kv[0]))))
    found = registry if registry is not None else registry_of(pid, lock_dirs)
    pins = {p.tid: p.cpus for p in found.pins_of(pid)}
    deliberate = frozenset(st.tid for st, cpus in threads if pins.get(st.tid) == cpus)
    off_pin = tuple(
        (st.tid, st.name, pins[st.tid], cpus)
        for st, cpus in threads
        if st.tid in pins and pins[st.tid] != cpus
    )
    drifted = sum(
        r.pin_drift[0] for r in found.records if r.kind == "process" and r.live and r.pid == pid
    )
    return Audit(pid, mask, source, ordered, found.knows(pid), deliberate, off_pin, drifted)


def _sample(
    processes: list[Record], interval: float, registry: Registry
) -> tuple[dict[int, Sampler | str], float]:
    """Each live process sampled over the same interval (its sampler, or a
    reason for one that exited meanwhile), and how long that really took."""
    samplers: dict[int, Sampler | str] = {}
    started = time.monotonic()
    for record in processes:
        try:
            samplers[record.pid] = Sampler(record.pid, registry=registry).start()
        except (OSError, ValueError) as exc:
            samplers[record.pid] = str(exc)
    time.sleep(interval)
    for pid, sampler in samplers.items():
        if isinstance(sampler, Sampler):
            try:
                sampler.stop()
            except (OSError, ValueError) as exc:
                samplers[pid] = str(exc)
    return samplers, time.monotonic() - started


def host_view(registry: Registry, interval: float) -> dict[str, object]:
    """The host's view (what ``cpupin ps`` shows) as one JSON-ready document:
    the registry's servers and processes, each live process's registered pins
    sampled over ``interval`` seconds (``sampled_s``: how long sampling every
    process really took, 0 when none was live), the unregistered threads found on a
    pinned CPU (interlopers), and the files ignored with why."""
    live = [r for r in registry.records if r.kind == "process" and r.live]
    samples, sampled = _sample(live, interval, registry) if live else ({}, 0.0)
    processes = []
    for record in (r for r in registry.records if r.kind == "process"):
        entry = record.as_dict()
        entry.update(
            threads=[],
            interlopers=[],
            spinning=[],
            sample_error=None,
            usable_cpus=None,
            throttling=None,
        )
        entry["pools"] = []
        entry["memory"] = None
        result = samples.get(record.pid)
        if record.live and isinstance(result, Sampler):
            got, throttling = result.samples, result.throttling
            entry["throttling"] = throttling.as_dict() if throttling else None
            entry.update(_pools_of(record, result.threads, got))
            by_tid = {s.tid: s for s in got}
            threads = []
            for pin in record.pins:
                s = by_tid.get(pin.tid)
                threads.append(
                    {
                        "tid": pin.tid,
                        "name": s.name if s else pin.name,
                        "role": pin.role,
                        "cpus": sorted(pin.cpus),
                        "cpus_list": format_cpulist(pin.cpus),
                        "alive": s is not None,
                        "on_its_pin": s is not None and s.mask == pin.cpus,
                        "cpu_ms_per_s": round(s.cpu_ms_per_s, 2) if s else None,
                        "wait_ms_per_s": round(s.wait_ms_per_s, 2) if s else None,
                        "stall": s.stall if s else None,
                        "spinning": s.spinning if s else None,
                    }
                )
            interlopers = _interlopers(record, got, by_tid)
            spinning = [{"tid": s.tid, "name": s.name} for s in got if s.spinning]
            entry.update(threads=threads, interlopers=interlopers, spinning=spinning)
        elif record.live:
            entry["sample_error"] = result
        processes.append(entry)
    return {
        "lock_dir": registry.directory,
        "interval_s": interval,
        "sampled_s": round(sampled, 3),
        "servers": [
            r.as_dict()
            for r in sorted(registry.records, key=lambda r: (not r.live, r.path))
            if r.kind == "server"
        ],
        "processes": processes,
        "ignored": [{"path": path, "reason": reason} for path, reason in registry.ignored],
        "not_listed": registry.not_listed,
        "still_applied": registry.still_applied,
    }


def _interlopers(
    record: Record, got: Iterable[ThreadSample], by_tid: dict[int, ThreadSample]
) -> list[dict[str, object]]:
    """A process's threads narrowed onto pinned CPUs without a registered
    pin. As top tells them, a thread on the process mask is not one even
    where the plan pins every CPU of it. A vLLM worker's OpenMP team
    carries its main thread's name and runs where vLLM bound it, the step
    thread's CPUs: vLLM's own, not an interloper."""
    pinned = {p.tid for p in record.pins}
    team = (
        {
            (by_tid[p.tid].name if p.tid in by_tid else p.name, p.cpus)
            for p in record.pins
            if p.role == "step"
        }
        if record.role == "vllm-worker"
        else set()
    )
    return [
        {"tid": s.tid, "name": s.name, "mask": sorted(s.mask), "mask_list": format_cpulist(s.mask)}
        for s in got
        if s.tid not in pinned
        and s.state == "interloper"
        and not any(s.name == n and s.mask <= c for n, c in team)
    ]


def _pools_of(
    record: Record,
    threads: list[tuple[_native.ThreadStat, frozenset[int]]],
    samples: Iterable[ThreadSample] | None = None,
) -> dict[str, object]:
    """A process's usable CPUs, its census of pools and where its memory
    lies (against the nodes of the mask the census found), seen from
    outside, from the threads its sample read and the pins its record
    lists; nothing when it exits meanwhile."""
    from cpupin.host.numa_memory import memory_summary
    from cpupin.pools.census import census

    try:
        pins = {p.tid: p.cpus for p in record.pins}
        found = census(
            record.pid, threads=threads, pins=pins, samples=samples, recorded=record.pools
        )
    except (OSError, ValueError):
        return {}
    pools = [p.as_dict() for p in found.pools]
    if record.role.startswith("vllm-"):
        from cpupin.pools.census import vllm_remedy

        for pool in pools:
            pool["remedy"] = vllm_remedy(pool["remedy"])  # type: ignore[arg-type]
    return {
        "usable_cpus": found.usable_cpus,
        "pools": pools,
        "memory": memory_summary(record.pid, found.plan.mask),
    }
