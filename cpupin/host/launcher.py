"""How the process got its CPUs, and whether they suit its GPU: the words
``cpupin doctor`` and ``cpupin exec`` say about the launcher.

A process's CPUs come from up to three places, narrowest last: the host's
online CPUs, its cgroup's cpuset (Kubernetes' static CPU manager, a Slurm
job step, ``docker --cpuset-cpus``), and its affinity mask (``taskset``,
``numactl``, a parent that pinned itself). A CPU quota (``cpu.max``,
``cpu.cfs_quota_us``) limits how much time its threads get without saying
where they run: under Kubernetes' default ``none`` policy a pod's threads
roam over every CPU of the node. :func:`explain_cpus` is pure: it takes
what :func:`~cpupin.host.topology.read_host` read and the process mask.

The Kubernetes QoS class is read from the cgroup path, where the kubelet
writes it: ``kubepods-besteffort`` or ``besteffort``, ``kubepods-burstable``
or ``burstable``, and a pod directly under ``kubepods`` is ``Guaranteed``.
"""

from __future__ import annotations

from collections.abc import Iterable

from cpupin._records import record
from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt
from cpupin.host.topology import Host

__all__ = ["ASK_LAUNCHER", "CpuOrigin", "explain_cpus", "launcher_of", "qos_class"]


@record(frozen=True)
class CpuOrigin:
    """Where the process's CPUs came from, in words, and what is wrong."""

    source: str
    """``host`` (every online CPU), ``cpuset`` (a cgroup narrower than the
    host), ``affinity`` (a mask narrower than the cpuset), or ``quota``
    (a quota and no narrower cpuset: threads roam)."""
    launcher: str | None
    """``kubernetes``, ``slurm``, ``docker``, ``systemd`` or ``None``."""
    qos: str | None
    """The Kubernetes QoS class, where the path says."""
    lines: tuple[str, ...]
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "launcher": self.launcher,
            "qos": self.qos,
            "lines": list(self.lines),
            "warnings": list(self.warnings),
        }


_POD = r"(?:^|/)kubepods(?:\.slice)?/(?:kubepods-)?pod[0-9a-f_-]+"  # compiled on first use


def qos_class(path: str | None) -> str | None:
    """A Kubernetes pod's QoS class from its cgroup path, else ``None``."""
    if not path or "kubepods" not in path:
        return None
    if "besteffort" in path:
        return "BestEffort"
    if "burstable" in path:
        return "Burstable"
    import re  # here, not at the top: exec's start does not pay for it

    if re.search(_POD, path, re.ASCII):
        return "Guaranteed"
    return None


def launcher_of(path: str | None) -> str | None:
    """Who made the cgroup, by its path: ``kubernetes``, ``slurm``,
    ``docker`` (or another container engine), ``systemd``; else ``None``."""
    if not path:
        return None
    if "kubepods" in path:
        return "kubernetes"
    import re

    if "slurm" in path or re.search(r"/job_\d+/step_", path):
        return "slurm"
    if re.search(r"(?:^|/)(?:docker|libpod|containerd|cri-containerd)[-/]", path):
        return "docker"
    if path.endswith((".service", ".scope")):
        return "systemd"
    return None


#: What to ask for when the launcher gave a process CPUs away from its GPU.
ASK_LAUNCHER = (
    "the launcher chose CPUs away from the GPU: Kubernetes' Topology Manager does not align "
    "DRA GPUs (use the device plugin, single-numa-node); Slurm: --gpu-bind=closest; "
    "docker: --cpuset-cpus of the GPU's node"
)

_WHO = {
    "kubernetes": "Kubernetes (the static CPU manager policy gives a Guaranteed pod's "
    "whole-CPU containers CPUs of their own)",
    "slurm": "Slurm (the job step's cpuset)",
    "docker": "a container engine (docker --cpuset-cpus)",
    "systemd": "systemd (AllowedCPUs=)",
}


def explain_cpus(
    host: Host, mask: frozenset[int], gpu_nodes: Iterable[tuple[str, int | None]] = ()
) -> CpuOrigin:
    """How a process with ``mask`` on ``host`` got its CPUs, and a warning for
    each GPU (``(address, node)``) whose node holds none of them."""
    online = host.cpus
    mask = mask & online
    path = host.cgroup
    launcher = launcher_of(path)
    qos = qos_class(path)
    where = f" (cgroup {excerpt(path, 60)})" if path and path != "/" else ""
    lines = []
    cpuset = host.cpuset & online if host.cpuset is not None else online
    source = "host"
    if cpuset and cpuset < online:
        source = "cpuset"
        who = _WHO.get(launcher or "", "its cgroup")
        lines.append(
            f"the cgroup's cpuset allows {len(cpuset)} of the host's {len(online)} CPUs "
            f"({format_cpulist(cpuset)}), set by {who}{where}"
        )
    if mask and mask < cpuset:
        source = "affinity"
        lines.append(
            f"the affinity mask is narrower still: {len(mask)} CPUs ({format_cpulist(mask)}), "
            "set by taskset, numactl, a parent process that pinned itself, or cpupin exec"
        )
    if host.quota is not None:
        if source == "host":
            source = "quota"
            lines.append(
                f"a CPU quota of {host.quota.cpus} CPU(s) ({host.quota.quota_us}/"
                f"{host.quota.period_us} µs) and no cpuset: the threads roam over all "
                f"{len(online)} CPUs and are throttled at the quota"
                + (
                    " (Kubernetes' default 'none' CPU manager policy)"
                    if launcher == "kubernetes"
                    else " (docker --cpus, or a systemd CPUQuota=)"
                )
                + where
            )
        else:
            lines.append(
                f"a CPU quota of {host.quota.cpus} CPU(s) caps the time its threads get as well"
            )
    if source == "host":
        lines.append(
            f"no cpuset, affinity or quota narrows it: all {len(online)} online CPUs" + where
        )
    if qos is not None:
        lines.append(
            f"a Kubernetes pod of QoS class {qos}"
            + (
                ""
                if qos == "Guaranteed"
                else ": only a Guaranteed pod's containers can get CPUs of their own"
            )
        )
    warnings = []
    for address, node in gpu_nodes:
        if node is None:
            continue
        node_cpus = next((n.cpus for n in host.nodes if n.id == node), frozenset())
        if node_cpus and not mask & node_cpus:
            homes = sorted({n for n in map(host.node_of, mask) if n is not None})
            warnings.append(
                f"GPU {address} is on node {node}, and none of the process's CPUs are "
                f"(they are on node {format_cpulist(homes) or '?'}): binding to the GPU's node "
                f"cannot happen within them; {ASK_LAUNCHER}"
            )
    return CpuOrigin(source, launcher, qos, tuple(lines), tuple(warnings))
