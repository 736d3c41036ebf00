"""A census of a process's thread pools, each judged against the CPUs the
process can keep busy (:func:`cpupin.pools.limits.usable_cpus`): threads grouped
into pools by name and, in the process itself, the pools its libraries
configured (threadpoolctl, torch).

From outside, a process that keeps a record (it pins, or says what it is)
has its pools in it (:func:`recorded_pools`, written with each update of
the record and as cpupin's threads start), so the outside view names them
as the inside one does. Threads the record does not name are grouped by
their kernel names; those that only inherited the name of the thread that
started them (every thread of a Python before 3.14 that nothing named) are
grouped by what they wait in (``wchan``), and such a pool is marked a guess.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from cpupin._native import ThreadStat
from cpupin.cpulist import format_cpulist
from cpupin.host._sysfs import Reader
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.limits import cpu_plan
from cpupin.process.mask import own_pins, process_cpus, thread_masks
from cpupin.process.outside import process_mask_of, record_of
from cpupin.registry._pool_names import ONE_EACH, configured_pools, pool_name, recorded_pools
from cpupin.registry._torch_thread import note_pool_thread

if TYPE_CHECKING:
    from cpupin.registry._fields import RecordedPool

__all__ = [
    "FITS",
    "FROM_HOST",
    "OVERSUBSCRIBED",
    "Census",
    "Pool",
    "census",
    "host_sizes",
    "note_pool_thread",
    "recorded_pools",
    "pool_name",
    "remedy",
    "verdict",
]

FITS = "fits"
OVERSUBSCRIBED = "oversubscribed"
FROM_HOST = "sized from the host"


@dataclass(frozen=True)
class Pool:
    """Threads of one process that form a pool, or a library's configured one."""

    name: str
    threads: int
    usable_cpus: int
    verdict: str
    """``fits``, ``oversubscribed`` (more threads than usable CPUs) or
    ``sized from the host`` (as many as the host's or a node's CPUs, or
    ``os.cpu_count() + 4`` as ThreadPoolExecutor counts, while the process
    has fewer usable CPUs)."""
    kind: str = "threads"
    """``threads``: counted from the threads running; ``configured``: a
    library's setting (threadpoolctl, torch), whose threads start on use."""
    tids: tuple[int, ...] = ()
    """The pool's threads; for a configured pool, the thread its size was
    read on where that is not the caller (:func:`note_pool_thread`)."""
    stray: int = 0
    """Threads of the pool on a narrower mask that is not a registered pin:
    one started from a pinned thread inherited its pin."""
    idle: int = 0
    """Threads of the pool that did not run while the census's sample was
    taken (``cpupin ps``: over its interval); 0 without a sample. A pool
    larger than the usable CPUs whose other threads sleep (a ZMQ context's
    reaper, say) fits."""
    guess: bool = False
    """Grouped from outside by what the threads wait in, not by a name: they
    carry only the name of the thread that started them, and the process's
    record does not name them."""

    @property
    def remedy(self) -> str:
        """The one thing to do about this pool (empty when it fits and
        inherited no pin): :func:`remedy` of it."""
        return remedy(self)

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "threads": self.threads,
            "usable_cpus": self.usable_cpus,
            "verdict": self.verdict,
            "kind": self.kind,
            "tids": list(self.tids),
            "stray": self.stray,
            "idle": self.idle,
            "guess": self.guess,
            "remedy": self.remedy or None,
        }


#: The variable that sizes a pool, by the pool's name as the census gives it.
_POOL_VARIABLE = (
    ("torch intra-op", "OMP_NUM_THREADS"),
    ("openmp", "OMP_NUM_THREADS"),
    ("mkl", "MKL_NUM_THREADS"),
    ("openblas", "OPENBLAS_NUM_THREADS"),
    ("blis", "BLIS_NUM_THREADS"),
    ("rayon", "RAYON_NUM_THREADS"),
    ("tokenizers", "RAYON_NUM_THREADS"),
)


def remedy(pool: Pool) -> str:
    """What to do about a pool that does not fit or inherited a pin, in a
    line: the size to give it (its variable where one sizes it), or how to
    start its threads; empty for a pool that fits on its own mask. Pure."""
    usable = pool.usable_cpus
    name = pool.name.lower()
    variable = next((v for key, v in _POOL_VARIABLE if key in name), None)
    if "threadpoolexecutor" in name:
        size = f"max_workers={usable} (or cpupin.ThreadPool(), which counts the usable CPUs)"
    elif variable is not None:
        size = f"{variable}={usable} before it starts, or cpupin.limit_pools() in the process"
    else:
        size = f"{usable} thread(s), from cpupin.usable_cpus() rather than os.cpu_count()"
    parts = []
    if pool.verdict == OVERSUBSCRIBED:
        parts.append(f"run at most {usable} of its threads at once: {size}")
    elif pool.verdict == FROM_HOST:
        parts.append(f"size it from the {usable} usable CPU(s), not the host's count: {size}")
    if pool.stray:
        parts.append(
            f"{pool.stray} thread(s) inherited a pin: start them from an unpinned thread "
            "(cpupin.Thread, cpupin.ThreadPool and cpupin.Queue do)"
        )
    return "; ".join(parts)


def verdict(threads: int, usable: int, host_sizes: Iterable[int], idle: int = 0) -> str:
    """A pool's verdict: see :attr:`Pool.verdict`. A size that betrays a
    count of the host is a sizing fault even while the pool sleeps; beyond
    that, only the threads that run (not ``idle``) can oversubscribe."""
    if threads <= usable:
        return FITS
    if threads in set(host_sizes):
        return FROM_HOST
    return FITS if threads - idle <= usable else OVERSUBSCRIBED


def host_sizes(host_cpus: int, node_cpus: Iterable[int] = ()) -> frozenset[int]:
    """The pool sizes that betray a count of the host: its CPUs, each
    node's, and ThreadPoolExecutor's default ``min(32, CPUs + 4)``."""
    sizes = {host_cpus, min(32, host_cpus + 4)}
    sizes.update(n for n in node_cpus if n > 1)
    return frozenset(sizes)


@dataclass(frozen=True)
class Census:
    """A process's threads grouped into pools, against its usable CPUs."""

    pid: int
    plan: CpuPlan
    pools: tuple[Pool, ...]

    @property
    def usable_cpus(self) -> int:
        return self.plan.usable_cpus

    def as_dict(self) -> dict[str, object]:
        quota = self.plan.quota
        return {
            "pid": self.pid,
            "usable_cpus": self.usable_cpus,
            "mask": sorted(self.plan.mask),
            "mask_list": format_cpulist(self.plan.mask),
            "quota_cpus": None if quota is None else round(quota.quota_us / quota.period_us, 2),
            "pinned": sorted(self.plan.pinned),
            "pools": [p.as_dict() for p in self.pools],
        }


def _host_shape(root: str) -> tuple[int, list[int]]:
    with Reader(root) as r:
        online = r.cpus("sys/devices/system/cpu/online") or frozenset(range(os.cpu_count() or 1))
        nodes = [len(cpus) for cpus in r.node_cpus().values()]
    return len(online), nodes


def census(
    pid: int | None = None,
    *,
    root: str = "/",
    plan: CpuPlan | None = None,
    threads: list[tuple[ThreadStat, frozenset[int]]] | None = None,
    pins: Mapping[int, frozenset[int]] | None = None,
    ran: Iterable[int] | None = None,
    recorded: Iterable[RecordedPool] | None = None,
) -> Census:
    """Group a process's threads (``None``: this one) into pools by name and
    judge each against its usable CPUs.

    In this process a thread is named by its Python name where it has one (a
    ``multiprocessing.Queue`` feeder shows as ``QueueFeederThread``), and the
    pools the loaded libraries configured are listed too (threadpoolctl,
    torch's intra-op pool). From outside, the pools of the process's record
    come first (its threads by their Python names, and its configured pools:
    the inside view), then the kernel's names; threads that only inherited
    the name of the thread that started them are grouped by what they wait
    in, as a guess (:attr:`Pool.guess`); the main thread (tid = pid) stands
    alone. ``plan``, ``threads`` (as :func:`~cpupin.process.mask.thread_masks`
    gives them), ``pins`` (tid to its registered pin) and ``recorded`` (the
    record's pools) replace what would be read. ``ran``: the threads that
    ran during a sample (``cpupin ps`` gives its own); the others count as
    idle in each pool's verdict.
    """
    own = pid is None or pid == os.getpid()
    target = os.getpid() if own else int(pid or 0)
    if threads is None:
        threads = thread_masks(None if own else target)
    if own:
        view = _View(
            names={t.native_id: t.name for t in threading.enumerate() if t.native_id is not None},
            pins=own_pins() if pins is None else dict(pins),
            mask=process_cpus(),
        )
    else:
        view = _outside(target, threads, pins, recorded)
    if plan is None:
        pinned = frozenset().union(*view.pins.values())
        plan = cpu_plan(target, root=root, mask=view.mask, pinned=pinned)
    usable = plan.usable_cpus
    sizes = host_sizes(*_host_shape(root))
    groups = _group(target, threads, view, _unnamed_waits(root, target, threads, view, own))
    active = None if ran is None else frozenset(ran)
    pools = [
        _judge(name, guess, members, usable, sizes, active)
        for (name, guess), members in groups.items()
    ]
    if own:
        pools.extend(_configured(usable, sizes))
    else:
        pools.extend(
            Pool(
                rp.name,
                rp.threads,
                usable,
                verdict(rp.threads, usable, sizes),
                "configured",
                rp.tids,
            )
            for rp in view.configured
        )
    pools.sort(key=lambda p: (p.kind != "threads", -p.threads, p.name))
    return Census(target, plan, tuple(pools))


class _View(NamedTuple):
    """What the census knows of a process's threads before it groups them."""

    pins: dict[int, frozenset[int]]
    """Each pinned thread's tid to its registered pin."""
    mask: frozenset[int]
    """The process mask."""
    names: Mapping[int, str] = {}
    """Threads by their Python names (this process)."""
    named: Mapping[int, str] = {}
    """Threads already in a pool by the record (another process)."""
    configured: tuple[RecordedPool, ...] = ()
    """The pools the record says its libraries configured."""


def _outside(
    target: int,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    pins: Mapping[int, frozenset[int]] | None,
    recorded: Iterable[RecordedPool] | None,
) -> _View:
    """Another process, as its record (where it keeps one) and the kernel show it."""
    if pins is None or recorded is None:
        record = record_of(target)
        if pins is None:
            pins = {p.tid: p.cpus for p in record.pins} if record else {}
        if recorded is None:
            recorded = record.pools if record else ()
    alive = {st.tid for st, _ in threads}
    named: dict[int, str] = {}
    configured = []
    for rp in recorded:
        if rp.kind == "configured":
            configured.append(rp)
        else:
            named.update((tid, rp.name) for tid in rp.tids if tid in alive)
    mask = process_mask_of(target, [m for _, m in threads])[0]
    return _View(dict(pins), mask, named=named, configured=tuple(configured))


def _unnamed_waits(
    root: str,
    target: int,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    view: _View,
    own: bool,
) -> dict[int, str | None]:
    """From outside, a thread nothing named carries the process's name (its
    main thread's): what each such thread waits in, to group them by, as a
    guess. Nothing for this process, which knows its threads' names."""
    if own:
        return {}
    main_name = next((st.name for st, _ in threads if st.tid == target), None)
    unnamed = [
        st.tid
        for st, _ in threads
        if st.tid != target and st.tid not in view.named and st.name == main_name
    ]
    return _wchans(root, target, unnamed) if unnamed else {}


def _group(
    target: int,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    view: _View,
    waits: Mapping[int, str | None],
) -> dict[tuple[str, bool], list[tuple[int, bool]]]:
    """The threads by pool name (and whether the name is a guess): each
    member's tid, and whether it strays off the process mask and its pin."""
    groups: dict[tuple[str, bool], list[tuple[int, bool]]] = {}
    for st, cpus in threads:
        guess = st.tid in waits
        if st.tid == target:
            group = "main thread"
        elif st.tid in view.named:
            group = view.named[st.tid]
        elif st.tid in view.names:
            group = pool_name(view.names[st.tid])
        elif guess:
            group = f"{pool_name(st.name)} [{waits[st.tid] or '?'}]"
        else:
            group = pool_name(st.name)
        stray = cpus != view.mask and view.pins.get(st.tid) != cpus
        groups.setdefault((group, guess), []).append((st.tid, stray))
    return groups


def _judge(
    name: str,
    guess: bool,
    members: list[tuple[int, bool]],
    usable: int,
    sizes: frozenset[int],
    active: frozenset[int] | None,
) -> Pool:
    """One pool of threads and its verdict: the threads that did not run
    during the sample (``active``) count as idle."""
    idle = 0 if active is None else sum(t not in active for t, _ in members)
    # Threads one a queue (feeders) are as many as the queues, each as busy
    # as its queue: not a pool that any size could fit.
    judged = FITS if name in ONE_EACH else verdict(len(members), usable, sizes, idle)
    tids = tuple(t for t, _ in members)
    strays = sum(s for _, s in members)
    return Pool(name, len(members), usable, judged, "threads", tids, strays, idle, guess)


_WCHAN = re.compile(r"[A-Za-z0-9_.]{1,48}")


def _wchans(root: str, pid: int, tids: Iterable[int]) -> dict[int, str | None]:
    """What each thread waits in (``running`` while it runs; ``None``: not
    known), from its ``wchan``, all under one reader: hostile, so only a
    short symbol name is taken."""
    out: dict[int, str | None] = {}
    with Reader(root) as r:
        for tid in tids:
            text = (r.text(f"proc/{pid}/task/{tid}/wchan", 128) or "").strip()
            out[tid] = "running" if text == "0" else text if _WCHAN.fullmatch(text) else None
    return out


def _configured(usable: int, sizes: frozenset[int]) -> list[Pool]:
    scan = "threadpoolctl" in sys.modules or _any_pool_library()
    return [
        Pool(name, n, usable, verdict(n, usable, sizes), "configured", tids)
        for name, n, tids in configured_pools(scan=scan)
    ]


def _any_pool_library() -> bool:
    """Whether a BLAS or OpenMP library may be loaded: threadpoolctl's scan
    of the loaded libraries costs milliseconds, so skip it for a process
    that imported none of the packages that bring one."""
    return any(m in sys.modules for m in ("numpy", "scipy", "torch", "sklearn", "numexpr"))
