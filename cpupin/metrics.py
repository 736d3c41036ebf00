"""Per-thread CPU time and run-queue wait for Prometheus (``cpupin[prometheus]``).

:class:`ThreadCollector` is a ``prometheus_client`` collector: register it,
and each scrape reads every thread of the process in one native call and
exports, per thread,

- ``cpupin_thread_cpu_seconds_total``: CPU time, from ``schedstat``;
- ``cpupin_thread_runqueue_wait_seconds_total``: time runnable but waiting for
  a CPU (what queueing behind a pinned thread costs);

both counters (Prometheus computes the rates), labelled ``tid``, ``name``,
``role`` (the registered role of a deliberate pin, else empty) and ``cpus``
(the thread's mask as a CPU list); and per process the gauges
``cpupin_process_threads`` and ``cpupin_stray_threads`` (threads on a mask
that is neither the process mask nor a registered pin). ``tid`` is the only
label of high cardinality. ``prometheus_client`` is imported only when a
collector is made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .cpulist import format_cpulist
from .process import process_cpus, thread_masks
from .registry import Registry, read_registry
from .sampling import process_mask_of
from .threads import pinned_roles

__all__ = ["ThreadCollector"]


class ThreadCollector:
    """Exports the threads of ``pid`` (``None``: this process).

    For this process the deliberate pins are known exactly; for another they
    come from its record in the lock directory (``registry``, read at each
    scrape when not given).
    """

    def __init__(self, pid: int | None = None, registry: Registry | None = None) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ImportError(
                "cpupin.metrics needs prometheus_client: pip install 'cpupin[prometheus]'"
            ) from None
        self.pid = pid
        self.registry = registry

    def _roles(self) -> tuple[dict[int, tuple[str, frozenset[int]]], frozenset[int] | None]:
        own = self.pid is None or self.pid == os.getpid()
        if own:
            return pinned_roles(), process_cpus()
        registry = self.registry if self.registry is not None else read_registry()
        return {p.tid: (p.role, p.cpus) for p in registry.pins_of(self.pid or 0)}, None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        threads = thread_masks(self.pid)
        roles, mask = self._roles()
        if mask is None:
            mask, _ = process_mask_of(self.pid or 0, [m for _, m in threads])
        labels = ["tid", "name", "role", "cpus"]
        cpu = CounterMetricFamily(
            "cpupin_thread_cpu_seconds", "CPU time of a thread (schedstat)", labels=labels
        )
        wait = CounterMetricFamily(
            "cpupin_thread_runqueue_wait_seconds",
            "Time a thread was runnable but waited for a CPU (schedstat)",
            labels=labels,
        )
        stray = 0
        for st, cpus in threads:
            role, pinned = roles.get(st.tid, ("", frozenset()))
            if cpus != mask and cpus != pinned:
                stray += 1
            values = [str(st.tid), st.name, role if cpus == pinned else "", format_cpulist(cpus)]
            cpu.add_metric(values, st.run_ns / 1e9)
            wait.add_metric(values, st.wait_ns / 1e9)
        pid = str(self.pid or os.getpid())
        count = GaugeMetricFamily(
            "cpupin_process_threads", "Threads of the process", labels=["pid"]
        )
        count.add_metric([pid], len(threads))
        strays = GaugeMetricFamily(
            "cpupin_stray_threads",
            "Threads on a mask that is neither the process mask nor a registered pin",
            labels=["pid"],
        )
        strays.add_metric([pid], stray)
        yield from (cpu, wait, count, strays)
