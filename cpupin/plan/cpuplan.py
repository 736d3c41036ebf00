"""One CPU plan for a process: its mask, what the cgroup quota lets run, the
CPUs it has pinned, and the sizes of its pools from what is left.

Pure: built from a :class:`~cpupin.host.topology.Host` (or a quota) and a mask; the
runtime asks it how many threads each pool gets, so that CPUs reserved for
pinned step threads are not counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from cpupin._records import record, replace
from cpupin.host.topology import Host, Quota

__all__ = ["POOLS", "CpuPlan"]

#: What each pool gets of the CPUs left: (share, at most). The intra-op pool
#: takes them all; an encode pool, which runs beside decoding, half; copy
#: threads, bound by memory bandwidth rather than CPUs, four at most.
POOLS: dict[str, tuple[float, int | None]] = {
    "intra_op": (1.0, None),
    "encode": (0.5, None),
    "copy": (1.0, 4),
}


@record(frozen=True)
class CpuPlan:
    """The process mask, its quota, its pinned CPUs and its pool sizes."""

    mask: frozenset[int]
    quota: Quota | None = None
    pinned: frozenset[int] = frozenset()

    @classmethod
    def for_host(
        cls, host: Host, mask: Iterable[int] | None = None, pinned: Iterable[int] = ()
    ) -> CpuPlan:
        """The plan of a process on ``host`` under ``mask`` (default: what the
        host's cgroup allows), with the host's quota."""
        allowed = host.cpus & frozenset(mask) if mask is not None else host.default_mask()
        return cls(allowed, host.quota, frozenset(pinned) & allowed)

    @property
    def capacity(self) -> int:
        """CPUs' worth of time the process has: the mask, capped by the
        quota (``ceil(quota / period)``), at least 1."""
        n = len(self.mask)
        if self.quota is not None:
            n = min(n, self.quota.cpus)
        return max(1, n)

    @property
    def free_cpus(self) -> frozenset[int]:
        """The mask without the pinned CPUs."""
        return self.mask - self.pinned

    @property
    def usable_cpus(self) -> int:
        """The CPUs the process can keep busy with its pools: the mask,
        capped by the quota, less the CPUs pinned for step and result
        threads; at least 1. The one number every pool is sized from."""
        return max(1, self.capacity - len(self.pinned & self.mask))

    @property
    def cpus_left(self) -> int:
        """The same as :attr:`usable_cpus` (its earlier name)."""
        return self.usable_cpus

    def with_pinned(self, cpus: Iterable[int]) -> CpuPlan:
        """This plan with ``cpus`` pinned as well (those in the mask)."""
        return replace(self, pinned=self.pinned | (frozenset(cpus) & self.mask))

    def pool_size(self, pool: str = "intra_op", *, at_most: int | None = None) -> int:
        """Threads for ``pool`` (``"intra_op"``, ``"encode"`` or ``"copy"``,
        see :data:`POOLS`) from the usable CPUs; never below 1."""
        if pool not in POOLS:
            raise ValueError(f"no pool {pool!r}: choose one of {', '.join(POOLS)}")
        share, cap = POOLS[pool]
        size = int(self.usable_cpus * share)
        if cap is not None:
            size = min(size, cap)
        if at_most is not None:
            size = min(size, at_most)
        return max(1, size)
