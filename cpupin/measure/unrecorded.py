"""The host's processes that keep no record but show a finding: what
``cpupin ps --all`` lists beside the registry.

A newcomer points ``cpupin ps`` at their plain runtime, which never imported
cpupin: it has no record, and the registry alone would show nothing. Every
process of the host (at most :data:`MAX_PROCESSES`; kernel threads, this
command and the recorded processes aside) is sampled over the same
interval, and listed when it shows one of:

- a thread on a narrower mask than its process's, or a process mask
  narrower than the CPUs its cgroup allows;
- a CPU quota on its cgroup;
- a spinning thread (:func:`cpupin.measure.activity.spinning`);
- a pool that oversubscribes its usable CPUs, or is sized from the host's
  count (:func:`cpupin.pools.census.census`, judged by what its threads
  wanted over the sample);
- a GPU device open (``/dev/nvidia*``, ``/dev/dri/*``, ``/dev/accel/*``,
  ``/dev/kfd``).

Each is read from outside as hostile input; a process that exits meanwhile
is left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import read_cgroup
from cpupin.measure.sampling import Sampler

__all__ = ["MAX_PROCESSES", "unrecorded"]

#: The most processes sampled.
MAX_PROCESSES = 4096
#: The most descriptors of one process looked at for a GPU device.
MAX_FDS = 4096
#: The device paths that are a GPU or an accelerator.
_GPU_DEVICES = ("/dev/nvidia", "/dev/dri/", "/dev/accel/", "/dev/kfd")


def _candidates(skip: Iterable[int]) -> list[int]:
    """The host's user-space processes, but ``skip`` and this one."""
    left = set(skip) | {os.getpid()}
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or len(entry) > 10:
            continue
        pid = int(entry)
        if pid in left or pid == 2:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                text = f.read(4096)
            fields = text[text.rfind(b")") + 2 :].split()
            if fields[0] == b"Z" or int(fields[1]) == 2 or int(fields[6]) & 0x00200000:
                continue  # a zombie, or a kernel thread (its parent kthreadd, PF_KTHREAD)
        except (OSError, ValueError, IndexError):
            continue
        out.append(pid)
        if len(out) >= MAX_PROCESSES:
            break
    return sorted(out)


def _gpu_devices(pid: int) -> list[str]:
    """The GPU device files the process holds open (short names)."""
    found: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")[:MAX_FDS]
    except OSError:
        return []
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith(_GPU_DEVICES):
            found.add(printable(target, 40))
    return sorted(found)[:8]


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(512).split(b"\0")
    except OSError:
        return "?"
    return printable(b" ".join(w for w in words if w).decode("utf-8", "replace"), 60) or "?"


def _findings(pid: int, sampler: Sampler, root: str) -> list[str]:
    """What is wrong with one sampled process, a phrase each."""
    from cpupin.pools.census import FITS, IDLE, census
    from cpupin.process.outside import openmp_collapse, process_mask_of, read_environ

    threads = sampler.threads
    samples = sampler.samples
    mask, _ = process_mask_of(pid, [m for _, m in threads])
    out = []
    with Reader(root) as r:
        cpuset, quota = read_cgroup(r, str(pid))
        online = r.cpus("sys/devices/system/cpu/online") or mask
    allowed = (cpuset or online) & online
    if mask and allowed and mask < allowed:
        out.append(
            f"its mask {format_cpulist(mask)} is narrower than the CPUs its cgroup allows "
            f"({format_cpulist(allowed)})"
        )
    narrower = sum(1 for _, m in threads if m != mask)
    collapse = openmp_collapse(pid, read_environ(pid)[0], [(st.tid, m) for st, m in threads], mask)
    if collapse is not None:
        out.append(str(collapse["what"]))
    elif narrower:
        out.append(f"{narrower} of {len(threads)} thread(s) on a narrower mask than its own")
    if quota is not None:
        out.append(f"a CPU quota of {quota.quota_us / quota.period_us:g} CPU(s)")
    spinning = [s for s in samples if s.spinning]
    if spinning:
        names = ", ".join(f"{printable(s.name, 16)} ({s.tid})" for s in spinning[:3])
        out.append(f"{len(spinning)} thread(s) spinning: {names}")
    if len(threads) > len(mask or online):
        try:
            found = census(pid, root=root, threads=threads, samples=samples)
        except (OSError, ValueError):
            found = None
        for p in found.pools if found else ():
            if p.kind == "threads" and p.verdict not in (FITS, IDLE):
                out.append(
                    f"pool {printable(p.name, 40)} of {p.threads} thread(s) {p.verdict} "
                    f"({p.usable_cpus} usable CPU(s))"
                )
    devices = _gpu_devices(pid)
    if devices:
        out.append(f"a GPU device open ({', '.join(devices)})")
    return out


def unrecorded(skip: Iterable[int], interval: float, root: str = "/") -> list[dict[str, object]]:
    """Every process of the host without a record (not in ``skip``) that
    shows a finding over a sample of ``interval`` seconds: its pid, command
    and findings, pid order."""
    samplers: dict[int, Sampler] = {}
    for pid in _candidates(skip):
        try:
            samplers[pid] = Sampler(pid).start()
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    time.sleep(interval)
    out = []
    for pid, sampler in samplers.items():
        try:
            sampler.stop()
            findings = _findings(pid, sampler, root)
        except (OSError, ValueError):
            continue
        if findings:
            out.append(
                {
                    "pid": pid,
                    "command": _command(pid),
                    "findings": findings,
                    "details": f"cpupin threads {pid}",
                }
            )
    return out
