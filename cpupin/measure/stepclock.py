"""The scheduling delay of each step: :class:`StepClock`.

Made in the step thread, a clock keeps that thread's ``schedstat`` open and,
when the process's cgroup has a quota, the ``cpu.stat.local`` beside it
(``cpu.stat`` on kernels before 6.6); each
mark is one call into C that reads the monotonic clock and both files. For
each step it records the wall time, the step thread's time on a CPU, its
time runnable but waiting for one, and the time the cgroup was held back by
its quota; it keeps the last steps for percentiles, a histogram of the wait
for Prometheus, and calls ``on_slow`` for a step whose wait passed a bound.

A step that begins within :data:`JOIN_NS` of the previous one's end starts
from that end's reading (a loop of steps costs one read a step, not two);
what falls between them is at most that long and is counted in the next
step.
"""

from __future__ import annotations

import errno
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cpupin import _native
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import read_cgroup
from cpupin.host.throttle import cpu_stat_file
from cpupin.registry._record import BUCKETS_S

__all__ = ["BUCKETS_S", "JOIN_NS", "Step", "StepClock", "clocks"]

_BOUNDS_NS = [round(b * 1e9) for b in BUCKETS_S]

#: A step that begins this soon after the previous one ended reuses that
#: end's reading as its start.
JOIN_NS = 5_000

_clocks: weakref.WeakSet[StepClock] = weakref.WeakSet()


def _throttle_counter(r: Reader, rel: str, version: int) -> tuple[int | None, str]:
    """A descriptor of the file a mark reads the group's throttled time
    from, and the file: ``cpu.stat.local`` beside ``cpu.stat`` where the
    kernel has it (Linux 6.6 on, v1 and v2) and it holds the counter, else
    ``cpu.stat``. For the group that has the quota both count the same
    time (the local one also counts any throttling of an ancestor's quota,
    which holds the step back as much); the local file holds that counter
    alone, so a mark reads it sooner (cpu.stat also sums the group's
    usage, over every CPU on v2; on a v1 VM, 0.65 µs a read against 0.96)."""
    local = r.open_file(f"{rel}.local")
    if local is not None:
        key = b"throttled_usec " if version == 2 else b"throttled_time "
        try:
            head = os.pread(local, 512, 0)
        except OSError:
            head = b""
        if head.startswith(key) or b"\n" + key in head:
            return local, f"{rel}.local"
        os.close(local)  # the controller is off there: no counter
    return r.open_file(rel), rel


def _unique(name: str) -> str:
    """``name``, or ``name-2`` (``-3``...) when a live clock of this process
    has it: two clocks never export the same series."""
    taken = {c.name for c in list(_clocks)}
    if name not in taken:
        return name
    n = 2
    while f"{name}-{n}" in taken:
        n += 1
    import logging

    logging.getLogger("cpupin").warning(
        "cpupin: a StepClock named %r exists in this process: this one is %r", name, f"{name}-{n}"
    )
    return f"{name}-{n}"


def clocks() -> list[StepClock]:
    """The clocks alive in this process (what the Prometheus collector exports)."""
    return sorted(_clocks, key=lambda c: c.name)


@dataclass(frozen=True)
class Step:
    """One step: wall time, the step thread's time on a CPU and waiting for
    one, and the time the cgroup was throttled (``None`` without a quota),
    all in nanoseconds."""

    wall_ns: int
    run_ns: int
    wait_ns: int
    throttled_ns: int | None

    def as_dict(self) -> dict[str, object]:
        return {
            "wall_us": round(self.wall_ns / 1000, 1),
            "run_us": round(self.run_ns / 1000, 1),
            "wait_us": round(self.wait_ns / 1000, 1),
            "throttled_us": None
            if self.throttled_ns is None
            else round(self.throttled_ns / 1000, 1),
        }


class StepClock:
    """Times each step of the thread that makes it.

    ``clock = StepClock()`` in the step thread, then ``with clock.step():``
    around each step (or ``clock.begin()`` / ``clock.end()``). The last
    ``keep`` steps are kept for :meth:`percentiles`; ``on_slow(step)`` is
    called for a step whose run-queue wait reached ``slow_wait_us``.
    ``throttle=False`` skips the cgroup's counters; ``root`` is where the
    cgroup is read. The on-CPU time is the kernel's ``schedstat``, which it
    brings up to date at each tick and each switch: a step shorter than a
    tick reads none or a whole tick, and the sum over many steps is right.
    The wait is exact. The throttled time is the quota's cgroup's
    (``throttled_usec`` on v2, ``throttled_time`` on v1, from
    :attr:`throttle_source`: ``cpu.stat.local`` where the kernel has it,
    else ``cpu.stat``), which sum
    over the group's run queues, one a CPU, so it can pass the step's wall
    time: a step's figure is capped at its wall time (the step was held back
    at most all of it), and is the group's, not the thread's.

    A clock times the thread that made it: a mark made from another thread
    records nothing and raises ``RuntimeError`` (the check is in C, without
    a system call). Its own bookkeeping never
    fails a step: a ``cpu.stat`` that goes away (the process moved to
    another cgroup) leaves the throttled time unknown
    (:attr:`throttle_lost`), descriptors closed under it are opened afresh
    (never closed again: the number may be the application's by then), and
    neither it nor ``on_slow`` replaces the exception a step raised. A
    second live clock of the same name is named ``name-2``.
    """

    def __init__(
        self,
        name: str = "step",
        *,
        keep: int = 4096,
        slow_wait_us: float | None = None,
        on_slow: Callable[[Step], object] | None = None,
        throttle: bool = True,
        root: str = "/",
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= 1 << 22:
            raise ValueError(f"keep={keep!r}: a whole number of steps from 1 to {1 << 22}")
        if slow_wait_us is not None and not (
            isinstance(slow_wait_us, (int, float)) and 0 <= slow_wait_us < 1e12
        ):
            raise ValueError(f"slow_wait_us={slow_wait_us!r}: microseconds, 0 or more")
        if on_slow is not None and not callable(on_slow):
            raise TypeError(f"on_slow={on_slow!r} is not callable")
        self.name = _unique(str(name))
        self.keep = keep
        self.on_slow = on_slow
        self._slow_ns = None if slow_wait_us is None else int(slow_wait_us * 1000)
        self.throttle_source: str | None = None
        self._root = root
        self._want_throttle = throttle
        self._forked_away = False
        self._sched_fd = self._stat_fd = -1
        self._keys = (0, 0)
        self._begin, self._end, self._state = _native.step_marker(
            keep,
            bounds_ns=_BOUNDS_NS,
            slow_ns=-1 if self._slow_ns is None or on_slow is None else self._slow_ns,
        )
        self._open()
        _clocks.add(self)
        if "torch" in sys.modules:
            # The thread that steps runs torch's pool: the census reads the
            # pool's size here, where libgomp keeps it.
            from cpupin.registry._torch_thread import note_pool_thread

            note_pool_thread()

    # --- the descriptors ---------------------------------------------------

    def _open(self) -> None:
        self.tid = _native.gettid()
        _native.step_own(self._state)
        self._sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        self._stat_fd, kind = -1, 0
        if self._want_throttle:
            with Reader(self._root) as r:
                quota = read_cgroup(r)[1]
                if quota is not None:
                    rel, version = cpu_stat_file(quota)
                    fd, rel = _throttle_counter(r, rel, version)
                    if fd is not None:
                        self._stat_fd, kind, self.throttle_source = fd, version, rel
        _native.step_files(self._state, self._sched_fd, self._stat_fd, kind, JOIN_NS)
        self._keys = (
            int(self._state[_native.STEP_SCHED_KEY]),
            int(self._state[_native.STEP_STAT_KEY]),
        )

    def close(self) -> None:
        """Close the descriptors; the steps recorded stay readable. A
        descriptor that no longer names the clock's file (the application
        closed it and opened one of its own under the number) is forgotten,
        never closed."""
        for fd, key in zip((self._sched_fd, self._stat_fd), self._keys):
            if fd >= 0 and key and _native.file_key(fd) == key:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._sched_fd = self._stat_fd = -1
        self._keys = (0, 0)
        _native.step_files(self._state, -1)

    def __del__(self) -> None:
        if "_state" in self.__dict__:  # not when __init__ refused its arguments
            self.close()

    def _recover(self, rc: int) -> bool:
        """After a mark failed: reopen the files when the schedstat
        descriptor is not ours any more (True: try the mark again); raise
        for what the caller must hear of (a closed clock, a clock of a
        thread that exited or of a parent process)."""
        if self._forked_away:
            raise RuntimeError(
                "this StepClock was made in a thread of the parent process that the "
                "child does not have: make one in the child's step thread"
            )
        if rc == _native.STEP_OTHER_THREAD:
            raise RuntimeError(
                f"StepClock {self.name!r} times tid {self.tid}, the thread that made it; "
                f"this is tid {_native.gettid()}: make a clock in each thread that steps"
            )
        if self._sched_fd < 0:
            raise RuntimeError(f"StepClock {self.name!r} is closed")
        if rc == -errno.EBADF:
            # Closed under us: forget the numbers (they may be the
            # application's now) and open the files afresh.
            self._sched_fd = self._stat_fd = -1
            self._keys = (0, 0)
            self._open()
            return True
        if rc == -errno.ESRCH:
            raise ProcessLookupError(
                errno.ESRCH, f"tid {self.tid}, the thread this StepClock times, has exited"
            )
        _native.raise_oserror(rc, f"the step clock of tid {self.tid}")
        return False  # pragma: no cover - raise_oserror raises

    @property
    def throttle_lost(self) -> str | None:
        """Why the cgroup's throttled time stopped being read mid-run (its
        ``cpu.stat`` went away when the process moved to another cgroup, or
        its descriptor was closed under the clock): from then on a step's
        throttled time is unknown. ``None`` while it is read."""
        err = int(self._state[_native.STEP_STAT_ERR])
        return None if not err else f"{self.throttle_source}: {os.strerror(err)}"

    # --- a step ----------------------------------------------------------

    # begin() and end() are written out again in __enter__ and __exit__: a
    # Python call less a mark (bench/stepclock.py).

    def begin(self) -> None:
        """Start a step (in the thread that made the clock)."""
        rc = self._begin()
        if rc < 0:
            self._begin_again(rc)

    def _begin_again(self, rc: int) -> None:
        if self._recover(rc):
            rc = self._begin()
            if rc < 0:
                self._recover(rc)

    def end(self) -> None:
        """End the step begun last, and record it. A step whose figures
        could not be read (its files were closed under the clock) is not
        recorded; the clock reopens them for the next."""
        rc = self._end()
        if rc:
            self._ended(rc)

    def _ended(self, rc: int) -> None:
        # 2: a slow step (its wait reached slow_wait_us); < 0: an error.
        if rc < 0:
            self._recover(rc)
        elif self.on_slow is not None:
            self.on_slow(self._step_at(_native.STEP_LAST))

    def step(self) -> StepClock:
        """``with clock.step(): ...``: the clock is its own context manager."""
        return self

    def __enter__(self) -> StepClock:
        rc = self._begin()
        if rc < 0:
            self._begin_again(rc)
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            rc = self._end()
            if rc:
                self._ended(rc)
            return
        # The step's own exception goes on: the clock's bookkeeping, and
        # on_slow, never replace it.
        try:
            self.end()
        except Exception as own:  # noqa: BLE001
            add_note = getattr(exc, "add_note", None)  # Python 3.11
            if add_note is not None:
                add_note(f"(StepClock {self.name!r} could not record this step: {own!r})")

    # --- what was recorded ---------------------------------------------------

    @property
    def wait_counts(self) -> list[int]:
        """Steps a bucket of the wait histogram (:data:`BUCKETS_S`, then
        those above the last bound)."""
        at = _native.STEP_COUNTS
        return [int(self._state[at + i]) for i in range(len(_BOUNDS_NS) + 1)]

    @property
    def steps(self) -> int:
        """Steps ended so far."""
        return int(self._state[_native.STEP_COUNT])

    @property
    def wall_sum_ns(self) -> int:
        return int(self._state[_native.STEP_SUMS])

    @property
    def wait_sum_ns(self) -> int:
        return int(self._state[_native.STEP_SUMS + 1])

    @property
    def throttled_sum_ns(self) -> int:
        return int(self._state[_native.STEP_SUMS + 2])

    def _step_at(self, at: int) -> Step:
        s = self._state
        t = s[at + 3]
        return Step(s[at], s[at + 1], s[at + 2], None if t < 0 else t)

    def recent(self) -> list[Step]:
        """The steps kept (the last ``keep``), oldest first. Read from
        another thread while steps run, the newest may be half stored."""
        steps = self.steps
        n = min(steps, self.keep)
        return [
            self._step_at(_native.STEP_RING + 4 * ((steps - n + k) % self.keep)) for k in range(n)
        ]

    @property
    def last(self) -> Step | None:
        """The step ended last."""
        return self._step_at(_native.STEP_LAST) if self.steps else None

    def percentiles(self, qs: tuple[float, ...] = (50, 99)) -> dict[str, dict[str, float]]:
        """Percentiles (nearest rank) of the kept steps' wall, run, wait and
        throttled time, in microseconds: ``{"wait_us": {"p50": ..}, ..}``."""
        steps = self.recent()
        out: dict[str, dict[str, float]] = {}
        for key in ("wall", "run", "wait", "throttled"):
            values = sorted(v for v in (getattr(s, f"{key}_ns") for s in steps) if v is not None)
            out[f"{key}_us"] = (
                {f"p{q:g}": round(_rank(values, q) / 1000, 1) for q in qs} if values else {}
            )
        return out

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        """The wait histogram as Prometheus wants it: cumulative counts a
        bucket (``le`` as text, ``+Inf`` last) and the sum in seconds."""
        counts = self.wait_counts
        out, running = [], 0
        for bound, count in zip([*BUCKETS_S, None], counts):
            running += count
            out.append(("+Inf" if bound is None else repr(bound), running))
        return out, self.wait_sum_ns / 1e9

    def summary(self) -> dict[str, object]:
        """Steps counted, totals and the percentiles of the kept steps."""
        return {
            "name": self.name,
            "tid": self.tid,
            "steps": self.steps,
            "wall_s": round(self.wall_sum_ns / 1e9, 6),
            "wait_s": round(self.wait_sum_ns / 1e9, 6),
            "throttled_s": round(self.throttled_sum_ns / 1e9, 6),
            "throttle_source": self.throttle_source,
            **self.percentiles(),
        }

    def __iter__(self) -> Iterator[Step]:
        return iter(self.recent())


def _rank(values: list[int], q: float) -> int:
    k = max(0, min(len(values) - 1, -(-len(values) * q // 100) - 1))
    return values[int(k)]


_forking_tid = 0


def _before_fork() -> None:
    global _forking_tid
    _forking_tid = _native.gettid()


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in the child: its clocks go on
    reading its new schedstat; any other thread's clock refuses to read."""
    for clock in list(_clocks):
        opened = clock._sched_fd >= 0
        clock.close()
        if clock.tid == _forking_tid and opened:
            clock._open()
        else:
            clock._forked_away = True


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
