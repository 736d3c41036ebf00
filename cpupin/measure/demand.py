"""What a process's threads wanted of the CPUs over a sample, and what would cover it.

A container with only a CPU request (a cgroup weight, no quota) is never
throttled: when its neighbours are busy its threads simply wait in the run
queue. Throttling counters then read zero and the cause goes unseen; the
threads' own run and run-queue wait (``schedstat``) show it. A thread's
*want* is its run plus its wait, in CPUs (ms a second / 1000); the sum over
the process is the CPU request that would have let every thread run when it
was ready. Pure: it judges samples it is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cpupin.host.cgroup import Weight

__all__ = ["CONTENDED_MS_PER_S", "Demand", "demand_of"]

#: Run-queue wait, summed over the process's threads, from which it is
#: contended: 50 ms a second, 5% of one CPU.
CONTENDED_MS_PER_S = 50.0

#: Wanting this many CPUs more than it may use is wanting too many (a
#: thread more than there are CPUs), as a pool oversubscribes.
OVER_BY = 0.5

#: What Kubernetes (and most runtimes) set as ``cpu.shares`` for one CPU of
#: request: ``shares = millicpu * 1024 / 1000`` (kubelet's MilliCPUToShares).
SHARES_PER_CPU = 1024


class _Sample(Protocol):
    """What :func:`demand_of` reads of a thread's sample."""

    @property
    def tid(self) -> int: ...

    @property
    def cpu_ms_per_s(self) -> float: ...

    @property
    def wait_ms_per_s(self) -> float: ...


@dataclass(frozen=True)
class Demand:
    """A process's threads over a sample, in CPUs."""

    ran_cpus: float
    waited_cpus: float
    throttled: bool
    """Its cgroup's quota throttled it in the sample: the wait is the quota's."""
    weight: Weight | None
    """Its cgroup's CPU weight (the lowest along its chain), if it has one."""
    usable_cpus: int | None
    """The CPUs it may use at once (mask, cpuset, quota)."""
    step: tuple[int, float, float] | None = None
    """Its step thread, where known: tid, ran and waited in CPUs."""

    @property
    def wanted_cpus(self) -> float:
        """Run plus run-queue wait: the CPUs that would have let every
        thread run whenever it was ready."""
        return self.ran_cpus + self.waited_cpus

    @property
    def contended(self) -> bool:
        """It waited for CPUs no quota withheld: its neighbours held them."""
        return not self.throttled and self.waited_cpus * 1000 >= CONTENDED_MS_PER_S

    @property
    def request_cpus(self) -> float:
        """The CPU request that covers what it wanted, in tenths of a CPU,
        and no more than the CPUs it may use (a sample's edges can add a
        few ms to a thread that wanted its one CPU throughout)."""
        wanted = math.ceil(round(self.wanted_cpus * 10, 6)) / 10
        return wanted if self.usable_cpus is None else min(wanted, float(self.usable_cpus))

    def weight_text(self) -> str | None:
        """Its weight in words: a v1 ``cpu.shares`` is a request (1,024 a
        CPU); a v2 ``cpu.weight`` maps to one by the runtime's own formula,
        which changed (runc 1.3.2, crun 1.23), so it is quoted as it is."""
        w = self.weight
        if w is None:
            return None
        if w.value == w.default:
            return f"{w.source.rsplit('/', 1)[-1]} {w.value}, the default"
        if w.default == SHARES_PER_CPU:
            cpus = w.value / SHARES_PER_CPU
            return f"cpu.shares {w.value}, what a request of {cpus:.3g} CPU(s) sets"
        return f"cpu.weight {w.value} (the default is {w.default})"

    def remedy(self) -> str | None:
        """What to change, in a line; ``None`` when it is not contended."""
        if not self.contended:
            return None
        wanted = self.wanted_cpus
        head = (
            f"its threads wanted {wanted:.2f} CPU(s) (ran {self.ran_cpus:.2f}, waited "
            f"{self.waited_cpus:.2f} in the run queue) and no quota throttled them: its "
            "neighbours held the CPUs"
        )
        if self.step is not None:
            tid, ran, waited = self.step
            head += (
                f"; its step thread ({tid}) wanted {ran + waited:.2f} (ran {ran:.2f}, "
                f"waited {waited:.2f})"
            )
        if self.usable_cpus is not None and wanted >= self.usable_cpus + OVER_BY:
            return (
                f"{head}; that is more than the {self.usable_cpus} CPU(s) it may use, so no "
                "request covers it: run fewer busy threads (cpupin.limit_pools(), or cpupin "
                "exec)"
            )
        weight = self.weight_text()
        w = self.weight
        if w is not None and w.default == SHARES_PER_CPU and w.value != w.default:
            if w.value / SHARES_PER_CPU >= wanted - 0.05:
                return (
                    f"{head}; its cgroup's {weight} already covers that, so what held its CPUs "
                    "is outside its share: its own threads on the same CPUs, or work outside "
                    "the cgroups the shares divide; a step thread pinned apart "
                    "(CPUPIN_STEP_THREAD_CORE) keeps its core"
                )
        millis = int(round(self.request_cpus * 1000))
        shares = millis * SHARES_PER_CPU // 1000
        return (
            f"{head}; a CPU request of {self.request_cpus:g} (Kubernetes "
            f"resources.requests.cpu: {millis}m"
            + (f", cpu.shares {shares}" if weight and "shares" in weight else "")
            + ") covers it"
            + (f", where its cgroup has {weight}" if weight else "")
            + "; or pin its step thread apart (CPUPIN_STEP_THREAD_CORE)"
        )

    def as_dict(self) -> dict[str, object]:
        w = self.weight
        return {
            "ran_cpus": round(self.ran_cpus, 3),
            "waited_cpus": round(self.waited_cpus, 3),
            "wanted_cpus": round(self.wanted_cpus, 3),
            "throttled": self.throttled,
            "contended": self.contended,
            "request_cpus": self.request_cpus,
            "weight": None if w is None else w.as_dict(),
            "step": None
            if self.step is None
            else {
                "tid": self.step[0],
                "ran_cpus": round(self.step[1], 3),
                "waited_cpus": round(self.step[2], 3),
            },
            "remedy": self.remedy(),
        }


def demand_of(
    samples: Iterable[_Sample],
    *,
    throttled: bool,
    weight: Weight | None = None,
    usable_cpus: int | None = None,
    step_tid: int | None = None,
) -> Demand:
    """The process's demand over ``samples``: each thread's run and wait
    summed, and its step thread's (``step_tid``) on its own."""
    ran = waited = 0.0
    step = None
    for s in samples:
        ran += max(0.0, s.cpu_ms_per_s) / 1000
        waited += max(0.0, s.wait_ms_per_s) / 1000
        if s.tid == step_tid:
            step = (s.tid, max(0.0, s.cpu_ms_per_s) / 1000, max(0.0, s.wait_ms_per_s) / 1000)
    return Demand(ran, waited, throttled, weight, usable_cpus, step)
