"""Per-thread CPU time and run-queue wait for Prometheus (``cpupin[prometheus]``).

:class:`ThreadCollector` is a ``prometheus_client`` collector: register it,
and each scrape reads every thread of the process in one native call and
exports, per thread,

- ``cpupin_thread_cpu_seconds_total``: CPU time, from ``schedstat``;
- ``cpupin_thread_runqueue_wait_seconds_total``: time runnable but waiting for
  a CPU (what queueing behind a pinned thread costs);

both counters (Prometheus computes the rates), labelled ``pid``, ``tid``,
``name``, ``role`` (the registered role of a deliberate pin, else empty) and
``cpus`` (the thread's mask as a CPU list); and per process the gauges
``cpupin_process_threads`` and ``cpupin_stray_threads`` (threads on a mask
that is neither the process mask nor a registered pin), ``cpupin_usable_cpus``
(what its pools may use: :func:`cpupin.pools.limits.usable_cpus`),
``cpupin_process_wanted_cpus`` (its threads' run + run-queue wait between
the last two scrapes, in CPUs: the CPU request that covers it; absent at a
process's first scrape), ``cpupin_cgroup_cpu_weight`` (labelled ``file``:
``cpu.weight`` or ``cpu.shares``, the lowest along its cgroup chain),
``cpupin_pool_threads`` (labelled ``pool`` and ``verdict``: the census of
:func:`cpupin.pools.census.census`), and the counters
``cpupin_cgroup_throttled_seconds_total`` and
``cpupin_cgroup_throttled_periods_total`` of its cgroup's quota (absent
without one). For this process, each :class:`cpupin.StepClock` adds the
histogram ``cpupin_step_wait_seconds`` (run-queue wait a step, labelled
``clock``) and the counters ``cpupin_step_seconds_total`` and
``cpupin_step_throttled_seconds_total``. ``tid`` is the only label of high
cardinality. :class:`ProcessesCollector` exports the same
families for many processes at once (``cpupin ps --prometheus``): each
family once, every process's samples under it, as the exposition format
requires. ``prometheus_client`` is imported only when a collector is made.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from cpupin.cpulist import format_cpulist
from cpupin.host._proc import argv_of
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import Quota
from cpupin.host.numa_memory import memory_by_node
from cpupin.host.throttle import read_cpu_stat
from cpupin.measure.sampling import process_mask_of
from cpupin.pools.census import census
from cpupin.process.mask import process_cpus, thread_masks
from cpupin.registry.reader import Record, Registry, read_registry
from cpupin.threads.pins import pinned_roles

__all__ = ["ProcessesCollector", "ServerStepsCollector", "ThreadCollector"]

_LABELS = ["pid", "tid", "name", "role", "cpus"]


def _require() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ImportError(
            "cpupin.metrics needs prometheus_client: pip install 'cpupin[prometheus]'"
        ) from None


#: The families a collection fills for every process, by the key it fills
#: them under: (key, kind, name, help, labels), in the order they are given.
_FAMILIES = (
    ("cpu", "counter", "cpupin_thread_cpu_seconds", "CPU time of a thread (schedstat)", _LABELS),
    (
        "wait",
        "counter",
        "cpupin_thread_runqueue_wait_seconds",
        "Time a thread was runnable but waited for a CPU (schedstat)",
        _LABELS,
    ),
    ("count", "gauge", "cpupin_process_threads", "Threads of the process", ["pid"]),
    (
        "strays",
        "gauge",
        "cpupin_stray_threads",
        "Threads on a mask that is neither the process mask nor a registered pin",
        ["pid"],
    ),
    (
        "usable",
        "gauge",
        "cpupin_usable_cpus",
        "CPUs the process's pools may use: mask and cpuset, under the quota, less pinned CPUs",
        ["pid"],
    ),
    (
        "pool",
        "gauge",
        "cpupin_pool_threads",
        "Threads of a pool (threads of one name, or a library's configured pool)",
        ["pid", "pool", "kind", "verdict"],
    ),
    (
        "wanted",
        "gauge",
        "cpupin_process_wanted_cpus",
        "CPUs the process's threads wanted between the last two scrapes (run + run-queue "
        "wait): the CPU request that would let each run when ready",
        ["pid"],
    ),
    (
        "weight",
        "gauge",
        "cpupin_cgroup_cpu_weight",
        "The process's cgroup CPU weight, lowest along its chain (cpu.weight, or cpu.shares "
        "in v1): its share of contended CPU time",
        ["pid", "file"],
    ),
    (
        "throttled",
        "counter",
        "cpupin_cgroup_throttled_seconds",
        "Time the process's cgroup was held back by its CPU quota (cpu.stat)",
        ["pid"],
    ),
    (
        "periods",
        "counter",
        "cpupin_cgroup_throttled_periods",
        "Quota periods in which the process's cgroup ran out of quota (cpu.stat)",
        ["pid"],
    ),
    (
        "held",
        "gauge",
        "cpupin_wake_latency_hold_microseconds",
        "A wake-latency hold in force: the most µs a wake of its CPUs may take (0: they poll)",
        ["pid", "cpus", "mechanism"],
    ),
    (
        "held_since",
        "gauge",
        "cpupin_wake_latency_hold_since_seconds",
        "When a wake-latency hold in force was taken (Unix time)",
        ["pid", "cpus", "mechanism"],
    ),
    (
        "drift",
        "counter",
        "cpupin_pin_drift",
        "Times a pinned thread was found off its pin (cpupin.check_pins, guard_pins)",
        ["pid"],
    ),
    (
        "memory",
        "gauge",
        "cpupin_process_memory_bytes",
        "Resident memory of the process on a NUMA node (numa_maps)",
        ["pid", "node"],
    ),
    (
        "remote",
        "gauge",
        "cpupin_process_memory_remote_bytes",
        "Resident memory of the process on nodes none of its CPUs belong to",
        ["pid"],
    ),
)

#: The families given only when memory by node is asked for.
_MEMORY_FAMILIES = ("memory", "remote")


def _families() -> dict[str, Any]:
    """A new family of each of :data:`_FAMILIES`, by its key."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
    return {
        key: kinds[kind](name, text, labels=labels) for key, kind, name, text, labels in _FAMILIES
    }


def _collect(
    pids: Iterable[int | None], registry: Registry | None, skip_gone: bool, memory_too: bool
) -> Iterator[Any]:
    """Every family, each once, with the samples of every process in
    ``pids`` (``None``: this one): one that has exited is left out with
    ``skip_gone``, else raises ``ProcessLookupError``."""
    families = _families()
    steps = _step_families()
    for target in pids:
        try:
            threads = thread_masks(target)
        except (OSError, ValueError):
            if skip_gone:
                continue  # exited since it was listed
            raise
        # When the threads' figures were read: what follows (the registry,
        # the stacks of a process's pools) may take a while, and a rate
        # over a wall time that is not the figures' own is wrong.
        read_at = time.monotonic_ns()
        if not _is_own(target) and registry is None:
            registry = read_registry()  # once, for every other process
        _collect_process(target, threads, read_at, registry, families, steps, memory_too)
    for key, *_ in _FAMILIES:
        if memory_too or key not in _MEMORY_FAMILIES:
            yield families[key]
    yield from steps


def _is_own(target: int | None) -> bool:
    return target is None or target == os.getpid()


def _collect_process(
    target: int | None,
    threads: list[Any],
    read_at: int,
    registry: Registry | None,
    families: dict[str, Any],
    steps: tuple[Any, Any, Any, Any],
    memory_too: bool,
) -> None:
    """One process's samples, added to ``families`` and ``steps``."""
    pid = str(os.getpid() if target is None else target)
    if _is_own(target):
        roles, mask = pinned_roles(), process_cpus()
    else:
        found = registry if registry is not None else read_registry()
        roles = {p.tid: (p.role, p.cpus) for p in found.pins_of(target or 0)}
        mask, _ = process_mask_of(target or 0, [m for _, m in threads])
    between = _between_scrapes(target, threads, read_at)
    if between is not None:
        families["wanted"].add_metric([pid], sum(b.runnable_ms_per_s for b in between) / 1000)
    _weight(target, pid, families["weight"])
    quota = _pools(target, threads, roles, pid, families["usable"], families["pool"], between)
    _throttling(quota, pid, families["throttled"], families["periods"])
    _holds_and_steps(target, pid, registry, families, steps)
    if memory_too:
        _memory(target, mask, pid, families["memory"], families["remote"])
    _threads(threads, roles, mask, pid, families)


def _holds_and_steps(
    target: int | None,
    pid: str,
    registry: Registry | None,
    families: dict[str, Any],
    steps: tuple[Any, Any, Any, Any],
) -> None:
    """The wake-latency holds in force, the pins' drift and the step
    clocks: this process's as it keeps them, another's as its records say."""
    step_wait, step_wall, step_throttled, info = steps
    if _is_own(target):
        _steps(pid, step_wait, step_wall, step_throttled)
        from cpupin.act.wake import holds
        from cpupin.threads.guard import drift_total

        in_force = [(h.mechanism, h.cpus, h.max_us, h.since) for h in holds()]
        families["drift"].add_metric([pid], drift_total())
    else:
        in_force = []
        drifted = 0
        for record in _records_of(registry, target or 0):
            if record.role:
                info.add_metric([pid, record.role], 1)
            _record_steps(record, step_wait, step_wall, step_throttled, [pid])
            in_force += [(h.mechanism, h.cpus, h.max_us, h.since) for h in record.wake_holds]
            drifted += record.pin_drift[0]
        families["drift"].add_metric([pid], drifted)
    for mechanism, cpus, max_us, since in in_force:
        labels = [pid, format_cpulist(cpus), mechanism]
        families["held"].add_metric(labels, max_us)
        families["held_since"].add_metric(labels, since)


def _memory(target: int | None, mask: frozenset[int], pid: str, memory: Any, remote: Any) -> None:
    """The process's resident memory by node, where it can be read."""
    try:
        where = memory_by_node(target, mask=mask)
    except OSError:
        return
    for node, size in sorted(where.by_node.items()):
        memory.add_metric([pid, str(node)], size)
    remote.add_metric([pid], where.remote)


def _threads(
    threads: list[Any],
    roles: dict[int, tuple[str, frozenset[int]]],
    mask: frozenset[int],
    pid: str,
    families: dict[str, Any],
) -> None:
    """Each thread's CPU time and run-queue wait, and the process's counts."""
    stray = 0
    for st, cpus in threads:
        role, pinned = roles.get(st.tid, ("", frozenset()))
        if cpus != mask and cpus != pinned:
            stray += 1
        values = [pid, str(st.tid), st.name, role if cpus == pinned else "", format_cpulist(cpus)]
        families["cpu"].add_metric(values, st.run_ns / 1e9)
        families["wait"].add_metric(values, st.wait_ns / 1e9)
    families["count"].add_metric([pid], len(threads))
    families["strays"].add_metric([pid], stray)


def _step_families() -> tuple[Any, Any, Any, Any]:
    """The step clocks' families, and the role's, each once a collection."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    return (
        HistogramMetricFamily(
            "cpupin_step_wait_seconds",
            "Run-queue wait of the step thread during each step (cpupin.StepClock)",
            labels=["pid", "clock"],
        ),
        CounterMetricFamily(
            "cpupin_step_seconds",
            "Wall time of the steps (cpupin.StepClock)",
            labels=["pid", "clock"],
        ),
        CounterMetricFamily(
            "cpupin_step_throttled_seconds",
            "Time the cgroup was throttled during steps (cpupin.StepClock)",
            labels=["pid", "clock"],
        ),
        GaugeMetricFamily(
            "cpupin_process_role",
            "The role a process gives itself in its record (1 for each process that names one)",
            labels=["pid", "role"],
        ),
    )


def _records_of(registry: Registry | None, pid: int) -> list[Record]:
    if registry is None:
        return []
    return [r for r in registry.records if r.kind == "process" and r.live and r.pid == pid]


def _record_steps(
    record: Record, step_wait: Any, step_wall: Any, step_throttled: Any, labels: list[str]
) -> None:
    """Another process's step figures, as its record carries them, under
    ``labels`` (its pid in a host's view; vLLM's labels in a server's)."""
    from cpupin.measure.stepclock import BUCKETS_S

    for fig in record.steps:
        counts = fig["counts"]
        assert isinstance(counts, list)
        buckets, running = [], 0
        for bound, n in zip([*BUCKETS_S, None], counts):
            running += n
            buckets.append(("+Inf" if bound is None else repr(bound), running))
        clock = str(fig["clock"])
        step_wait.add_metric([*labels, clock], buckets, fig["wait_s"])
        step_wall.add_metric([*labels, clock], fig["wall_s"])
        step_throttled.add_metric([*labels, clock], fig["throttled_s"])


#: The parts of a vLLM process title that place it (``VLLM::Worker_DP1_TP0``).
_TITLE_PARTS = re.compile(r"_(DP|PP|PCP|TP|DCP|EP)(\d{1,5})")


def vllm_labels(title: str) -> tuple[str, str]:
    """vLLM's ``engine`` label (the data-parallel rank, ``0`` without one)
    and a ``rank`` label (the other parallel ranks, ``TP1`` or
    ``PP1_TP0``; ``0`` without any) from a vLLM process title. Pure."""
    parts = _TITLE_PARTS.findall(title[:256])
    engine = next((n for kind, n in parts if kind == "DP"), "0")
    rank = "_".join(f"{kind}{n}" for kind, n in parts if kind != "DP") or "0"
    return str(int(engine)), rank


_SERVER_LABELS = ["model_name", "engine", "role", "rank"]


def _server_families() -> dict[str, Any]:
    """The families of a vLLM server's ``/metrics``, labelled as vLLM's
    own (``model_name``, ``engine``) and by the process's ``role`` and
    parallel ``rank``: bounded by the server's shape, never by pid or
    thread."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    clock = [*_SERVER_LABELS, "clock"]
    return {
        "wait": HistogramMetricFamily(
            "cpupin_step_wait_seconds",
            "Run-queue wait of the step thread during each step (cpupin.StepClock)",
            labels=clock,
        ),
        "wall": CounterMetricFamily(
            "cpupin_step_seconds", "Wall time of the steps (cpupin.StepClock)", labels=clock
        ),
        "throttled": CounterMetricFamily(
            "cpupin_step_throttled_seconds",
            "Time the cgroup was throttled during steps (cpupin.StepClock)",
            labels=clock,
        ),
        "moved": GaugeMetricFamily(
            "cpupin_vllm_moved_threads",
            "Threads the plugin's auto moved off the OpenMP CPUs in this process",
            labels=_SERVER_LABELS,
        ),
        "confined": GaugeMetricFamily(
            "cpupin_vllm_confined_cpus",
            "CPUs the threads auto moved are confined to (0: none, or widened)",
            labels=_SERVER_LABELS,
        ),
        "widened": GaugeMetricFamily(
            "cpupin_vllm_confinement_widened",
            "1 while auto has given the threads it confined the launcher's CPUs back "
            "(the CPUs were full of work from outside the server)",
            labels=_SERVER_LABELS,
        ),
        "holds": GaugeMetricFamily(
            "cpupin_wake_latency_holds",
            "Wake-latency holds the process has in force",
            labels=_SERVER_LABELS,
        ),
    }


def _ancestors(pid: int, depth: int = 16) -> list[int]:
    """A process's parent, grandparent, ... (at most ``depth``)."""
    out = []
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read(4096)
        except OSError:
            break
        fields = text[text.rfind(b")") + 2 :].split()
        if len(fields) < 2 or not fields[1].isdigit():
            break
        pid = int(fields[1])
        if pid <= 1:
            break
        out.append(pid)
    return out


class ServerStepsCollector:
    """Exports what the records of ``pid`` and of its descendants (a vLLM
    server's API server, engine cores and workers) carry, read at each
    scrape: their step figures and what ``auto`` did in each (threads
    moved, CPUs confined to, widened, wake-latency holds). What the vLLM
    plugin adds to vLLM's own ``/metrics``, labelled as vLLM labels its
    own: ``model_name`` (given) and ``engine`` (the data-parallel rank),
    with ``role`` (``api-server``, ``engine-core``, ``worker``) and
    ``rank`` (a worker's other parallel ranks, from its title): no label
    per pid or thread, so a restart makes no new series. Cheap: one read
    of the lock directory a scrape."""

    def __init__(self, pid: int, lock_dir: str | None = None, model_name: str = "") -> None:
        _require()
        self.pid = pid
        self.lock_dir = lock_dir
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        families = _server_families()
        registry = read_registry(self.lock_dir)
        seen: set[tuple[str, ...]] = set()
        for record in sorted(registry.records, key=lambda r: r.pid):
            if record.kind != "process" or not record.live:
                continue
            if record.pid != self.pid and self.pid not in _ancestors(record.pid):
                continue
            engine, rank = vllm_labels((argv_of(record.pid, 256) or [""])[0])
            role = record.role.removeprefix("vllm-") or "process"
            labels = [self.model_name, engine, role, rank]
            if tuple(labels) in seen:
                continue  # one series a label set, the oldest pid's
            seen.add(tuple(labels))
            _record_steps(record, families["wait"], families["wall"], families["throttled"], labels)
            families["moved"].add_metric(labels, record.auto.moved)
            families["confined"].add_metric(labels, len(record.auto.confined))
            families["widened"].add_metric(labels, int(record.auto.widened))
            families["holds"].add_metric(labels, len(record.wake_holds))
        yield from families.values()


def _pools(
    target: int | None,
    threads: list[Any],
    roles: dict[int, tuple[str, frozenset[int]]],
    pid: str,
    usable: Any,
    pool: Any,
    between: list[_Between] | None,
) -> Quota | None:
    """The census's samples; returns the quota its plan read (for the
    throttling counters, so that the cgroup is read once a process)."""
    try:
        found = census(
            target,
            threads=threads,
            pins={t: c for t, (_, c) in roles.items()},
            samples=between,
        )
    except (OSError, ValueError):
        return None  # exited meanwhile
    usable.add_metric([pid], found.usable_cpus)
    for p in found.pools:
        pool.add_metric([pid, p.name, p.kind, p.verdict], p.threads)
    return found.plan.quota


def _weight(target: int | None, pid: str, weight: Any) -> None:
    """The process's cgroup CPU weight, where it has one."""
    from cpupin.host.cgroup import read_weight

    try:
        with Reader("/") as r:
            found = read_weight(r, "self" if _is_own(target) else str(target))
    except (OSError, ValueError):
        return  # exited meanwhile
    if found is not None:
        weight.add_metric([pid, found.source.rsplit("/", 1)[-1]], found.value)


class _Between(NamedTuple):
    """A thread between two scrapes, as the census reads a sample."""

    tid: int
    runnable_ms_per_s: float
    spinning: bool = False


#: Each process's threads at the last scrape: when, and each tid's run and
#: wait, so that the next scrape judges pools by what their threads wanted
#: in between (as ``threads`` and ``ps`` do over their samples).
_last_scrape: dict[int, tuple[int, dict[int, tuple[int, int]]]] = {}
_MAX_REMEMBERED = 1024


def _between_scrapes(target: int | None, threads: list[Any], now: int) -> list[_Between] | None:
    """Each thread's run and run-queue wait since the last scrape, in ms a
    second (``now``: when ``threads`` were read); ``None`` at a process's
    first scrape (its pools are then judged by count)."""
    key = os.getpid() if target is None else target
    figures = {st.tid: (st.run_ns, st.wait_ns) for st, _ in threads}
    last = _last_scrape.get(key)
    if len(_last_scrape) >= _MAX_REMEMBERED and key not in _last_scrape:
        _last_scrape.clear()  # processes come and go: forget them all, rarely
    _last_scrape[key] = (now, figures)
    if last is None or now <= last[0]:
        return None
    wall_ms = (now - last[0]) / 1e6
    out = []
    for tid, (run, wait) in figures.items():
        before = last[1].get(tid)
        if before is None or run < before[0] or wait < before[1]:
            continue  # new since, or a reused tid
        out.append(_Between(tid, (run - before[0] + wait - before[1]) / 1e6 / wall_ms * 1000))
    return out


def _throttling(quota: Quota | None, pid: str, throttled: Any, periods: Any) -> None:
    with Reader("/") as r:
        stat = read_cpu_stat(r, quota)
    if stat is not None:
        throttled.add_metric([pid], stat.throttled_ns / 1e9)
        periods.add_metric([pid], stat.throttled_periods)


def _steps(pid: str, step_wait: Any, step_wall: Any, step_throttled: Any) -> None:
    from cpupin.measure.stepclock import clocks

    for clock in clocks():
        buckets, total = clock.histogram()
        step_wait.add_metric([pid, clock.name], buckets, total)
        step_wall.add_metric([pid, clock.name], clock.wall_sum_ns / 1e9)
        step_throttled.add_metric([pid, clock.name], clock.throttled_sum_ns / 1e9)


class ThreadCollector:
    """Exports the threads of ``pid`` (``None``: this process).

    For this process the deliberate pins are known exactly; for another they
    come from its record in the lock directory (``registry``, read at each
    scrape when not given). ``memory=True`` adds where its memory lies
    (``cpupin_process_memory_bytes``, ``..._remote_bytes``): reading
    ``numa_maps`` walks the process's page tables under its memory map's
    lock, which a process of hundreds of GiB pays for at each scrape, so
    it is asked for, not given.
    """

    def __init__(
        self, pid: int | None = None, registry: Registry | None = None, *, memory: bool = False
    ) -> None:
        _require()
        self.pid = pid
        self.registry = registry
        self.memory = memory

    def collect(self) -> Iterator[Any]:
        yield from _collect([self.pid], self.registry, skip_gone=False, memory_too=self.memory)


class ProcessesCollector:
    """Exports the threads of every live process with a record in
    ``registry``: one family each, all processes' samples under it; a
    process that exits meanwhile is left out."""

    def __init__(self, registry: Registry, *, memory: bool = False) -> None:
        _require()
        self.registry = registry
        self.memory = memory

    def collect(self) -> Iterator[Any]:
        pids = sorted({r.pid for r in self.registry.records if r.kind == "process" and r.live})
        yield from _collect(pids, self.registry, skip_gone=True, memory_too=self.memory)
