"""The cost of one thread waking another, on the same CPU, its SMT sibling,
another core or another node: what pinning saves or costs on a host.

The numbers come from C (:func:`handoff`): two threads pinned to CPUs A and
B pass a token through a futex, the primitive a condition variable sleeps
on; the one-way latency is half the round trip. ``idle_us`` makes the sender
wait before each handoff so that the receiver's core falls into its idle
states: that is where a deep C-state shows, and there the direct time from
the handoff to the receiver running (``wake``) is reported too, since the
way back finds a core that has just been busy. ``spin`` passes the token
through a shared cache line without sleeping: the hardware floor.
:func:`handoff_python` measures what a Python runtime sees, with two
:class:`cpupin.Thread` and ``threading.Event`` or ``queue.SimpleQueue``.
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from cpupin import _native
from cpupin.cpulist import format_cpulist
from cpupin.host.topology import Host
from cpupin.process.mask import process_cpus
from cpupin.threads.pins import pin_current_thread
from cpupin.threads.thread import Thread

__all__ = ["HandoffResult", "handoff", "handoff_matrix", "handoff_python", "pair_kinds"]


@dataclass(frozen=True)
class HandoffResult:
    """One pair's handoff latency; ``cpus`` holds ``None`` for an unpinned
    side. Nanoseconds, one way."""

    cpus: tuple[int | None, int | None]
    mode: str
    idle_us: int
    rounds: int
    median_ns: float
    p90_ns: float
    p99_ns: float
    wake_median_ns: float | None = None
    wake_p99_ns: float | None = None

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["cpus"] = list(self.cpus)
        return out


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _result(
    cpus: tuple[int | None, int | None],
    mode: str,
    idle_us: int,
    one_way: list[float],
    wake: list[float] | None,
) -> HandoffResult:
    one_way = sorted(one_way)
    woke = sorted(wake) if wake else None
    return HandoffResult(
        cpus,
        mode,
        idle_us,
        len(one_way),
        statistics.median(one_way),
        _quantile(one_way, 0.90),
        _quantile(one_way, 0.99),
        statistics.median(woke) if woke else None,
        _quantile(woke, 0.99) if woke else None,
    )


def _check_cpus(a: int | None, b: int | None) -> None:
    mask = process_cpus()
    for cpu in (a, b):
        if cpu is not None and cpu not in mask:
            raise ValueError(
                f"CPU {cpu} is outside the process mask {format_cpulist(mask)}: "
                "choose CPUs this process may use"
            )


def handoff(
    cpus: tuple[int | None, int | None] = (None, None),
    *,
    rounds: int = 2000,
    warmup: int = 200,
    idle_us: int = 0,
    spin: bool = False,
) -> HandoffResult:
    """Measure one pair in C: median, p90 and p99 of the one-way latency.

    ``cpus`` is (A, B), ``None`` leaving a side unpinned; both must be in the
    process mask. ``spin`` on one CPU is refused (the two spinners would wait
    on each other).
    """
    a, b = cpus
    _check_cpus(a, b)
    if spin and (a is None or b is None or a == b):
        raise ValueError(
            f"spin=True needs two different CPUs in cpus, not ({format_pair(cpus)}): two "
            "spinners on one CPU, or unpinned, wait on each other"
        )
    if rounds <= 0 or warmup < 0 or idle_us < 0:
        raise ValueError("rounds must be positive, warmup and idle_us not negative")
    rtt, wake = _native.handoff_rounds(
        -1 if a is None else a, -1 if b is None else b, rounds, warmup, idle_us, spin
    )
    mode = "spin" if spin else "futex"
    return _result(cpus, mode, idle_us, [t / 2 for t in rtt], list(map(float, wake)))


def format_pair(cpus: tuple[int | None, int | None]) -> str:
    return ",".join("any" if c is None else str(c) for c in cpus)


def handoff_python(
    cpus: tuple[int | None, int | None] = (None, None), *, rounds: int = 2000, kind: str = "event"
) -> HandoffResult:
    """The same handoff between two :class:`cpupin.Thread` in Python, through
    ``threading.Event`` (``kind="event"``) or ``queue.SimpleQueue``."""

    a, b = cpus
    _check_cpus(a, b)
    times: list[float] = []
    if kind == "event":
        ping, pong = threading.Event(), threading.Event()

        def send_a() -> None:
            ping.set()
            pong.wait()
            pong.clear()

        def serve_b() -> None:
            ping.wait()
            ping.clear()
            pong.set()
    elif kind == "queue":
        q_ab: queue.SimpleQueue[int] = queue.SimpleQueue()
        q_ba: queue.SimpleQueue[int] = queue.SimpleQueue()

        def send_a() -> None:
            q_ab.put(1)
            q_ba.get()

        def serve_b() -> None:
            q_ab.get()
            q_ba.put(1)
    else:
        raise ValueError(f"kind {kind!r}: choose 'event' or 'queue'")
    total = rounds + rounds // 10

    def side(cpu: int | None, body: Callable[[], None], timed: bool) -> None:
        if cpu is not None:
            pin_current_thread({cpu})
        clock = time.perf_counter_ns
        for i in range(total):
            t0 = clock()
            body()
            if timed and i >= total - rounds:
                times.append((clock() - t0) / 2)

    threads = [
        Thread(target=side, args=(b, serve_b, False), name="handoff-b"),
        Thread(target=side, args=(a, send_a, True), name="handoff-a"),
    ]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # let the waiting thread take the GIL promptly
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    return _result(cpus, f"python-{kind}", 0, times, None)


def pair_kinds(host: Host, mask: Iterable[int]) -> dict[str, tuple[int | None, int | None]]:
    """One pair of CPUs of each kind the mask allows: ``same CPU``, ``SMT
    sibling``, ``other core`` (same node), ``other node``, and ``unpinned``.

    Where the mask spans more than one last-level cache of the first CPU's
    node, ``other core`` is split in two: ``same L3`` (another core sharing
    the first CPU's last-level cache) and ``other L3`` (a core of the same
    node under another one)."""
    allowed = sorted(frozenset(mask) & host.cpus)
    out: dict[str, tuple[int | None, int | None]] = {}
    if not allowed:
        return out
    a = allowed[0]
    out["same CPU"] = (a, a)
    core = host.core_of(a)
    node = host.node_of(a)
    sibling = next((c for c in (core.cpus if core else ()) if c != a and c in allowed), None)
    if sibling is not None:
        out["SMT sibling"] = (a, sibling)
    others = [c for c in allowed if core is None or c not in core.cpus]
    same_node = [c for c in others if host.node_of(c) == node]
    cache = host.cache_of(a)
    apart = next((c for c in same_node if host.cache_of(c) != cache), None)
    if cache is not None and apart is not None:
        shared = next((c for c in same_node if host.cache_of(c) == cache), None)
        if shared is not None:
            out["same L3"] = (a, shared)
        out["other L3"] = (a, apart)
    elif same_node:
        out["other core"] = (a, same_node[0])
    other_node = next((c for c in others if host.node_of(c) != node), None)
    if other_node is not None:
        out["other node"] = (a, other_node)
    out["unpinned"] = (None, None)
    return out


def handoff_matrix(
    cpus: Iterable[int],
    *,
    rounds: int = 500,
    idle_us: int = 0,
    spin: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[tuple[int, int], float]:
    """The median one-way latency of every ordered pair of ``cpus``."""
    cpus = sorted(cpus)
    pairs = [(a, b) for a in cpus for b in cpus if not (spin and a == b)]
    out = {}
    for i, (a, b) in enumerate(pairs):
        out[(a, b)] = handoff(
            (a, b), rounds=rounds, warmup=rounds // 10, idle_us=idle_us, spin=spin
        ).median_ns
        if progress is not None:
            progress(i + 1, len(pairs))
    return out
