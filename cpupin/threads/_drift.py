"""A pin found off its CPUs, and what probably moved it: light (no threads,
no registry), so that :class:`cpupin.Pin` and :mod:`cpupin.threads.guard` share it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt, printable

__all__ = ["AFFINITY_VARS", "Drift", "likely_cause", "nccl_loaded"]


#: Variables with which a library in the process sets threads' masks itself.
AFFINITY_VARS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")


@dataclass(frozen=True)
class Drift:
    """A pinned thread found off its pin."""

    tid: int
    name: str
    role: str
    pinned: frozenset[int]
    now: frozenset[int]
    cause: str
    """The likely cause, from the process's environment and libraries."""
    reapplied: bool = False

    def describe(self) -> str:
        again = "; pin re-applied" if self.reapplied else ""
        return (
            f"tid {self.tid} ({excerpt(self.name, 24)}, {self.role}) pinned to "
            f"{format_cpulist(self.pinned)} is on {format_cpulist(self.now)}: {self.cause}{again}"
        )


def likely_cause(
    now: frozenset[int],
    process_mask: frozenset[int],
    environ: Mapping[str, str],
    nccl_loaded: bool = False,
) -> str:
    """What probably moved a pinned thread to ``now``: the affinity
    variables set, NCCL where it is loaded or configured, a move back to the
    process mask, else an unknown caller. Pure."""
    set_vars = [
        f"{name}={printable(environ[name], 24)}"
        for name in AFFINITY_VARS
        if environ.get(name, "").strip() and environ.get(name, "").strip().lower() != "false"
    ]
    if set_vars:
        return (
            f"{', '.join(set_vars)} set: the OpenMP runtime binds the thread that loads it or "
            "starts a team; unset it, or load the library (import torch) before pinning"
        )
    if nccl_loaded or any(k.startswith("NCCL_") for k in environ):
        return (
            "NCCL binds the thread that creates a communicator to its GPU's CPUs: "
            "NCCL_IGNORE_CPU_AFFINITY=1 stops it, or create the communicator before pinning"
        )
    if now == process_mask:
        return (
            "moved back to the process mask (a bind_process or set_process_cpus, or a "
            "framework resetting affinity)"
        )
    return "another library or tool set its mask (a framework's affinity code, taskset -p)"


def nccl_loaded() -> bool:
    """Whether a module of NCCL's is imported (torch.cuda.nccl, say)."""
    return any("nccl" in m.lower() for m in list(sys.modules))
