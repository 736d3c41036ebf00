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
from typing import TYPE_CHECKING, NamedTuple, Protocol

from cpupin._native import ThreadStat
from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.limits import cpu_plan
from cpupin.process.mask import own_pins, process_cpus, thread_masks
from cpupin.process.outside import binding_in, process_mask_of, read_environ, record_of
from cpupin.process.stacks import LibraryPool, library_pool, thread_libraries
from cpupin.registry._pool_names import ONE_EACH, configured_pools, pool_name, recorded_pools
from cpupin.registry._torch_thread import note_pool_thread

if TYPE_CHECKING:
    from cpupin.registry._fields import RecordedPool


class ThreadSample(Protocol):
    """A thread over a sample, as the census reads it
    (:class:`cpupin.measure.sampling.ThreadSample` is one)."""

    @property
    def tid(self) -> int: ...
    @property
    def spinning(self) -> bool: ...
    @property
    def runnable_ms_per_s(self) -> float: ...


__all__ = [
    "FITS",
    "FROM_HOST",
    "IDLE",
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
IDLE = "idle"


@dataclass(frozen=True)
class Pool:
    """Threads of one process that form a pool, or a library's configured one."""

    name: str
    threads: int
    usable_cpus: int
    verdict: str
    """``fits``; ``oversubscribed`` (more of its threads want a CPU than
    there are usable CPUs: over a sample, their run and run-queue time adds
    up to more CPUs; without one, more threads than CPUs); ``idle`` (larger
    than the usable CPUs, but none of its threads wanted a CPU during the
    sample); or ``sized from the host`` (as many as the host's or a node's
    CPUs, or ``os.cpu_count() + 4`` as ThreadPoolExecutor counts, while the
    process has fewer usable CPUs: a sizing fault even while it sleeps)."""
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
    runnable: float | None = None
    """The CPUs its threads wanted over the sample (run and run-queue time,
    in CPUs); ``None`` without a sample."""
    spinning: int = 0
    """Threads of the pool that spun during the sample (busy, in the
    kernel, never blocking: :func:`cpupin.measure.activity.spinning`)."""
    library: str | None = None
    """The library its threads wait in, read from their stacks
    (:mod:`cpupin.process.stacks`): ``libgomp.so.1``."""
    variable: str | None = None
    """What sizes the pool: the environment variable (``OMP_NUM_THREADS``)
    or the call (``zmq.Context(io_threads=N)``)."""
    setting: str | None = None
    """The variable's value in the process's environment as it started
    (``unset`` when absent; ``None`` when not read)."""
    stray_cause: str | None = None
    """What narrowed the stray threads where it is known: the OpenMP binding
    variable (``OMP_PROC_BIND=TRUE``) that bound the main thread as OpenMP
    loaded, whose CPUs every later thread inherited."""

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
            "runnable_cpus": None if self.runnable is None else round(self.runnable, 2),
            "spinning": self.spinning,
            "library": self.library,
            "variable": self.variable,
            "setting": self.setting,
            "stray_cause": self.stray_cause,
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
    """What to do about a pool that does not fit, spins or inherited a pin,
    in a line: the size to give it (what sizes it, where known), or how to
    start its threads; empty for a pool that fits on its own mask. Pure."""
    usable = pool.usable_cpus
    name = pool.name.lower()
    variable = pool.variable or next((v for key, v in _POOL_VARIABLE if key in name), None)
    if "threadpoolexecutor" in name:
        size = f"max_workers={usable} (or cpupin.ThreadPool(), which counts the usable CPUs)"
    elif variable is not None and "(" in variable:
        size = variable.replace("=N", f"={usable}")
    elif variable is not None:
        now = f" (now {pool.setting})" if pool.setting else ""
        size = f"{variable}={usable}{now} before it starts, or cpupin.limit_pools() in the process"
    else:
        size = f"{usable} thread(s), from cpupin.usable_cpus() rather than os.cpu_count()"
    parts = []
    if pool.name.endswith(NOT_LIMITED) and pool.verdict != FITS:
        return (
            f"OpenMP keeps limit_pools()'s limit per thread (limited in {len(pool.tids)} "
            f"thread(s)): any other thread that runs OpenMP starts a team of {pool.threads}; "
            "start such threads as cpupin.Thread, or call cpupin.apply_thread_limits() "
            "first in them"
        )
    if pool.verdict == OVERSUBSCRIBED:
        parts.append(f"run at most {usable} of its threads at once: {size}")
    elif pool.verdict == FROM_HOST:
        parts.append(f"size it from the {usable} usable CPU(s), not the host's count: {size}")
    if pool.spinning:
        parts.append(f"{pool.spinning} thread(s) spin, each holding a CPU: {_spin_knob(pool)}")
    if pool.stray and pool.stray_cause:
        parts.append(
            f"{pool.stray} thread(s) inherited the CPUs {pool.stray_cause} bound the main "
            "thread to: unset it, or set OMP_PROC_BIND=false"
        )
    elif pool.stray:
        parts.append(
            f"{pool.stray} thread(s) inherited a pin: start them from an unpinned thread "
            "(cpupin.Thread, cpupin.ThreadPool and cpupin.Queue do)"
        )
    return "; ".join(parts)


#: cpupin's own remedies, and what a vLLM operator sets instead.
_VLLM_REMEDIES = (
    (" before it starts, or cpupin.limit_pools() in the process", " where vllm serve starts"),
    (" (or cpupin.ThreadPool(), which counts the usable CPUs)", ""),
    (
        ", from cpupin.usable_cpus() rather than os.cpu_count()",
        " (a library vLLM loads sized it from the host's CPUs)",
    ),
    (
        ": unset it, or set OMP_PROC_BIND=false",
        ": CPUPIN_VLLM=auto moves them to the CPUs vLLM reserves "
        "(VLLM_CPU_OMP_THREADS_BIND=auto reserves VLLM_CPU_NUM_OF_RESERVED_CPU of them)",
    ),
    (
        ": start them from an unpinned thread (cpupin.Thread, cpupin.ThreadPool and "
        "cpupin.Queue do)",
        ": CPUPIN_VLLM=auto moves them to the CPUs vLLM reserves "
        "(VLLM_CPU_OMP_THREADS_BIND=auto reserves VLLM_CPU_NUM_OF_RESERVED_CPU of them)",
    ),
)


def vllm_remedy(text: str | None) -> str | None:
    """A pool's remedy in a vLLM operator's terms: the variables of the
    environment the server starts with and vLLM's own settings, not
    cpupin's Python API, which vLLM's code does not call."""
    if not text:
        return text
    for ours, theirs in _VLLM_REMEDIES:
        text = text.replace(ours, theirs)
    return text


def _spin_knob(pool: Pool) -> str:
    """What makes a pool's threads stop spinning, where it is known."""
    library = (pool.library or pool.name).lower()
    if "libgomp" in library:
        return "OMP_WAIT_POLICY=passive makes libgomp's idle threads sleep instead"
    if "libiomp5" in library or "libomp" in library:
        return "KMP_BLOCKTIME=0 makes the OpenMP runtime's idle threads sleep at once"
    return (
        "it busy-waits (sched_yield or a zero-timeout poll): a blocking wait, or a sleep "
        "between checks, frees the CPU"
    )


#: Under this many CPUs wanted over a sample, a pool is idle.
IDLE_CPUS = 0.01
#: A pool oversubscribes when its threads want more than the usable CPUs by
#: at least this much (half a CPU: one thread more than there are CPUs).
OVER_BY = 0.5


def verdict(
    threads: int,
    usable: int,
    host_sizes: Iterable[int],
    idle: int = 0,
    runnable: float | None = None,
) -> str:
    """A pool's verdict: see :attr:`Pool.verdict`. A size that betrays a
    count of the host is a sizing fault even while the pool sleeps; beyond
    that, only what its threads want of a CPU can oversubscribe: with a
    sample (``runnable``: their run and run-queue time, in CPUs), that;
    without one, its threads that ran (not ``idle``)."""
    if threads <= usable:
        return FITS
    if threads in set(host_sizes):
        return FROM_HOST
    if runnable is not None:
        if runnable < IDLE_CPUS:
            return IDLE
        return OVERSUBSCRIBED if runnable >= usable + OVER_BY else FITS
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
    spinning: tuple[int, ...] = ()
    """Threads that spun during the sample (none without one)."""

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
            "spinning": list(self.spinning),
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
    samples: Iterable[ThreadSample] | None = None,
    recorded: Iterable[RecordedPool] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Census:
    """Group a process's threads (``None``: this one) into pools and judge
    each against its usable CPUs.

    In this process a thread is named by its Python name where it has one (a
    ``multiprocessing.Queue`` feeder shows as ``QueueFeederThread``), and the
    pools the loaded libraries configured are listed too (threadpoolctl,
    torch's intra-op pool). From outside, the pools of the process's record
    come first (its threads by their Python names, and its configured pools:
    the inside view), then the kernel's names. A thread nothing named (it
    carries the name of the thread that started it) joins the pool of the
    library it waits in, read from its stack (:mod:`cpupin.process.stacks`:
    libgomp's team, OpenBLAS's, a Rayon pool), else is grouped by what it
    waits in (``wchan``), as a guess (:attr:`Pool.guess`); the main thread
    (tid = pid) stands alone. Each pool names what sizes it and its value
    in the process's environment (``environ`` replaces the one read).

    ``plan``, ``threads`` (as :func:`~cpupin.process.mask.thread_masks`
    gives them), ``pins`` (tid to its registered pin) and ``recorded`` (the
    record's pools) replace what would be read. ``samples``: each thread
    over an interval (:class:`~cpupin.measure.sampling.Sampler`); a pool is
    then judged by the CPUs its threads wanted, not by how many exist, and
    its spinning threads are counted (each holds a CPU the other pools
    cannot use).
    """
    own = pid is None or pid == os.getpid()
    target = os.getpid() if own else int(pid or 0)
    if threads is None:
        threads = thread_masks(None if own else target)
    view, env = _view_of(target, own, threads, pins, recorded, environ)
    if plan is None:
        pinned = frozenset().union(*view.pins.values())
        plan = cpu_plan(target, root=root, mask=view.mask, pinned=pinned)
    usable = plan.usable_cpus
    sizes = host_sizes(*_host_shape(root))
    libraries = _libraries(target, threads, view)
    main = next((m for st, m in threads if st.tid == target), None)
    cause = binding_in(dict(env or {})) if main is not None and main < view.mask else ""
    waits = _unnamed_waits(root, target, threads, view, own, libraries)
    groups = _group(target, threads, view, waits, libraries)
    sampled = None if samples is None else {s.tid: s for s in samples}
    spinners = frozenset(t for t, s in (sampled or {}).items() if s.spinning)
    pools = [
        _judge(
            name,
            guess,
            members,
            _Sizing(usable, sizes, sampled, spinners, cause or None),
            libraries,
            env,
        )
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
    return Census(target, plan, tuple(pools), tuple(sorted(spinners)))


def _view_of(
    target: int,
    own: bool,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    pins: Mapping[int, frozenset[int]] | None,
    recorded: Iterable[RecordedPool] | None,
    environ: Mapping[str, str] | None,
) -> tuple[_View, Mapping[str, str] | None]:
    """What the census knows of the process's threads before it groups
    them, and the environment its pools were sized from: this process's
    own, or another's, from its record and the kernel."""
    if own:
        view = _View(
            names={t.native_id: t.name for t in threading.enumerate() if t.native_id is not None},
            pins=own_pins() if pins is None else dict(pins),
            mask=process_cpus(),
        )
        return view, os.environ if environ is None else environ
    view = _outside(target, threads, pins, recorded)
    return view, read_environ(target)[0] if environ is None else environ


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


def _libraries(
    target: int, threads: list[tuple[ThreadStat, frozenset[int]]], view: _View
) -> dict[int, str]:
    """The library each thread that neither the record nor Python names
    waits in, read from its stack (the main thread stands alone)."""
    tids = [
        st.tid
        for st, _ in threads
        if st.tid != target and st.tid not in view.named and st.tid not in view.names
    ]
    try:
        return thread_libraries(target, tids)
    except OSError:
        return {}


def _unnamed_waits(
    root: str,
    target: int,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    view: _View,
    own: bool,
    libraries: Mapping[int, str],
) -> dict[int, str | None]:
    """From outside, a thread nothing named carries the process's name (its
    main thread's): what each such thread whose library is not known waits
    in, to group them by, as a guess. Nothing for this process, which knows
    its threads' names."""
    if own:
        return {}
    main_name = next((st.name for st, _ in threads if st.tid == target), None)
    unnamed = [
        st.tid
        for st, _ in threads
        if st.tid != target
        and st.tid not in view.named
        and st.name == main_name
        and library_pool(libraries.get(st.tid, "")) is None
    ]
    return _wchans(root, target, unnamed) if unnamed else {}


def _group(
    target: int,
    threads: list[tuple[ThreadStat, frozenset[int]]],
    view: _View,
    waits: Mapping[int, str | None],
    libraries: Mapping[int, str],
) -> dict[tuple[str, bool], list[tuple[int, bool]]]:
    """The threads by pool name (and whether the name is a guess): each
    member's tid, and whether it strays off the process mask and its pin."""
    main_name = next((st.name for st, _ in threads if st.tid == target), None)
    groups: dict[tuple[str, bool], list[tuple[int, bool]]] = {}
    for st, cpus in threads:
        guess = st.tid in waits
        known = library_pool(libraries.get(st.tid, ""))
        if st.tid == target:
            group = "main thread"
        elif st.tid in view.named:
            group = view.named[st.tid]
        elif st.tid in view.names:
            group = pool_name(view.names[st.tid])
        elif known is not None and st.name == main_name:
            # the kernel's name is the starter's: the library says which pool
            group = known.label
        elif guess:
            group = f"{pool_name(st.name)} [{waits[st.tid] or '?'}]"
        else:
            group = pool_name(st.name)
        stray = cpus != view.mask and view.pins.get(st.tid) != cpus
        groups.setdefault((group, guess), []).append((st.tid, stray))
    return groups


class _Sizing(NamedTuple):
    """What every pool is judged against."""

    usable: int
    sizes: frozenset[int]
    sampled: Mapping[int, ThreadSample] | None
    spinners: frozenset[int]
    stray_cause: str | None = None


def _judge(
    name: str,
    guess: bool,
    members: list[tuple[int, bool]],
    sizing: _Sizing,
    libraries: Mapping[int, str],
    env: Mapping[str, str] | None,
) -> Pool:
    """One pool of threads and its verdict. With a sample, the CPUs its
    threads wanted decide, and spinning threads of other pools each take a
    CPU from it (not below one)."""
    tids = tuple(t for t, _ in members)
    usable = sizing.usable
    runnable: float | None = None
    idle = 0
    spinning = sum(t in sizing.spinners for t in tids)
    if sizing.sampled is not None:
        got = [sizing.sampled[t] for t in tids if t in sizing.sampled]
        runnable = sum(s.runnable_ms_per_s for s in got) / 1000
        idle = sum(s.runnable_ms_per_s <= 0 for s in got) + len(tids) - len(got)
        usable = max(1, usable - (len(sizing.spinners) - spinning))
    # Threads one a queue (feeders) are as many as the queues, each as busy
    # as its queue: not a pool that any size could fit.
    if name in ONE_EACH:
        judged = FITS
    else:
        judged = verdict(len(members), usable, sizing.sizes, idle, runnable)
    library, known = _library_of(tids, libraries)
    variable = None if known is None else (known.variable or known.knob)
    if variable is None:
        variable = next((v for key, v in _POOL_VARIABLE if key in name.lower()), None)
    setting = None
    if variable is not None and "(" not in variable and env is not None:
        setting = excerpt(env[variable], 24) if variable in env else "unset"
    strays = sum(s for _, s in members)
    return Pool(
        name,
        len(members),
        usable,
        judged,
        "threads",
        tids,
        strays,
        idle,
        guess,
        runnable,
        spinning,
        library,
        variable,
        setting,
        sizing.stray_cause if strays else None,
    )


def _library_of(
    tids: tuple[int, ...], libraries: Mapping[int, str]
) -> tuple[str | None, LibraryPool | None]:
    """The library most of a pool's threads wait in, and its pool."""
    counts: dict[str, int] = {}
    for tid in tids:
        if tid in libraries:
            counts[libraries[tid]] = counts.get(libraries[tid], 0) + 1
    if not counts:
        return None, None
    library = max(counts, key=lambda k: counts[k])
    return library, library_pool(library)


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


#: The suffix of a configured pool that counts the OpenMP team of threads
#: limit_pools() did not limit (OpenMP keeps the limit per thread).
NOT_LIMITED = " in threads not limited"


def _configured(usable: int, sizes: frozenset[int]) -> list[Pool]:
    scan = "threadpoolctl" in sys.modules or _any_pool_library()
    out = [
        Pool(name, n, usable, verdict(n, usable, sizes), "configured", tids)
        for name, n, tids in configured_pools(scan=scan)
    ]
    limits = sys.modules.get("cpupin.pools.limits")
    for limit, tids in limits.thread_limits() if limits is not None else ():
        if limit.default > limit.size:
            out.append(
                Pool(
                    f"{limit.label}{NOT_LIMITED}",
                    limit.default,
                    usable,
                    verdict(limit.default, usable, sizes),
                    "configured",
                    tuple(sorted(tids)),
                )
            )
    return out


def _any_pool_library() -> bool:
    """Whether a BLAS or OpenMP library may be loaded: threadpoolctl's scan
    of the loaded libraries costs milliseconds, so skip it for a process
    that imported none of the packages that bring one."""
    return any(m in sys.modules for m in ("numpy", "scipy", "torch", "sklearn", "numexpr"))
