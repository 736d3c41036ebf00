"""Host shapes as data, and a builder that writes them as fake sysfs trees.

A :class:`HostSpec` is a compact description (sockets, nodes, cores, threads
and their numbering, GPUs and other PCI functions, idle states, cgroup);
:func:`build_tree` writes the ``sys/`` and ``proc/`` files a kernel would show
for it under a root, so that :func:`cpupin.host.topology.read_host` can read it.
The shipped hosts (:data:`HOSTS`) let a user look at a machine they do not
own: ``cpupin topo --host dgx-h100``. Tests build random hosts the same way.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache

from cpupin.cpulist import format_cpulist, format_cpumask
from cpupin.host.topology import PERF_SOURCES, Host, parse_pci_address, read_host

__all__ = ["HOSTS", "GpuSpec", "HostSpec", "PciSpec", "build_tree", "host_named"]

NVIDIA, AMD, INTEL = 0x10DE, 0x1002, 0x8086


@dataclass(frozen=True)
class GpuSpec:
    """A GPU: a display-class PCI function of a GPU vendor."""

    address: str
    node: int
    """Its ``numa_node``; -1 as a kernel writes it for 'unknown'."""
    vendor: int = NVIDIA
    class_code: int = 0x030200
    local_cpulist: bool = True
    """Whether sysfs lists its local CPUs (else they come from its node)."""


@dataclass(frozen=True)
class PciSpec:
    """Any other PCI function: a bridge, NIC, NVSwitch or BMC's VGA."""

    address: str
    vendor: int
    class_code: int
    node: int = -1


@dataclass(frozen=True)
class HostSpec:
    """A host shape. Core ``c`` lies on node ``c // cores_per_node``; its
    hardware thread ``t`` is CPU ``c + t * cores`` (``siblings="offset"``, as
    x86 servers number them) or ``c * threads + t`` (``"adjacent"``)."""

    name: str
    description: str = ""
    sockets: int = 1
    nodes_per_socket: int = 1
    cores_per_node: int = 4
    threads: int = 1
    siblings: str = "offset"
    numa: bool = True
    """Whether node folders exist (a VM may have none)."""
    memory_nodes: tuple[int, ...] = ()
    """Node ids of nodes without CPUs, such as GPU memory."""
    gpus: tuple[GpuSpec, ...] = ()
    pci: tuple[PciSpec, ...] = ()
    offline: frozenset[int] = frozenset()
    idle_states: tuple[tuple[str, int], ...] = (("POLL", 0),)
    hypervisor: bool = False
    cpu_max: str | None = None
    """The cgroup v2 ``cpu.max`` text, if any."""
    cpuset: str | None = None
    """The cgroup's ``cpuset.cpus.effective``, if any."""
    cgroup_path: str = "/cpupin.slice"
    """The process's cgroup (v2), as ``proc/self/cgroup`` names it."""
    llc_cores: int = 0
    """Cores a last-level cache domain within a node (an AMD core complex:
    8); 0: one domain a node."""
    perf: tuple[tuple[str, int], ...] = ()
    """What every core reports of its speed, by the names of
    :data:`cpupin.host.topology.PERF_SOURCES` (``highest_perf``, ``max_khz``...)."""
    priority_cores: tuple[int, ...] = ()
    """Cores, numbered within their package, that report ``priority`` instead."""
    priority: tuple[tuple[str, int], ...] = ()

    def cache_of(self, core: int) -> int:
        """The last-level cache domain of ``core``, numbered across the host."""
        within = self.llc_cores or self.cores_per_node
        per_node = -(-self.cores_per_node // within)
        return (core // self.cores_per_node) * per_node + (core % self.cores_per_node) // within

    def perf_of(self, core: int) -> dict[str, int]:
        """What ``core`` reports of its speed."""
        per_package = self.cores_per_node * self.nodes_per_socket
        values = dict(self.perf)
        if core % per_package in self.priority_cores:
            values.update(self.priority)
        return values

    @property
    def nodes_count(self) -> int:
        return self.sockets * self.nodes_per_socket

    @property
    def cores_count(self) -> int:
        return self.nodes_count * self.cores_per_node

    def cpu(self, core: int, thread: int) -> int:
        if self.siblings == "adjacent":
            return core * self.threads + thread
        return core + thread * self.cores_count

    def online(self) -> frozenset[int]:
        every = {self.cpu(c, t) for c in range(self.cores_count) for t in range(self.threads)}
        return frozenset(every - self.offline)

    def node_cpus(self) -> dict[int, frozenset[int]]:
        online = self.online()
        nodes: dict[int, set[int]] = {n: set() for n in range(self.nodes_count)}
        for c in range(self.cores_count):
            for t in range(self.threads):
                if self.cpu(c, t) in online:
                    nodes[c // self.cores_per_node].add(self.cpu(c, t))
        if not self.numa:
            return {0: online}
        out = {n: frozenset(cpus) for n, cpus in nodes.items()}
        out.update({n: frozenset() for n in self.memory_nodes})
        return out

    def package_of_node(self, node: int) -> int:
        return node // self.nodes_per_socket


def _write(root: str, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _pci_device(root: str, address: str) -> str:
    """A PCI function's folder, where sysfs keeps it (under its root bus in
    ``sys/devices``), with the relative symlink ``sys/bus/pci/devices``
    holds; returns the folder's path under the root."""
    address = parse_pci_address(address)
    folder = f"sys/devices/pci{address[:7]}/{address}"
    os.makedirs(os.path.join(root, folder), exist_ok=True)
    link = os.path.join(root, "sys/bus/pci/devices", address)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if not os.path.lexists(link):
        os.symlink(f"../../../devices/pci{address[:7]}/{address}", link)
    return folder


_CPU_DIR = "sys/devices/system/cpu"


def build_tree(spec: HostSpec, root: str | os.PathLike[str]) -> str:
    """Write the sysfs and procfs files of ``spec`` under ``root``."""
    root = os.fspath(root)
    online = spec.online()
    every = frozenset(spec.cpu(c, t) for c in range(spec.cores_count) for t in range(spec.threads))
    _write(root, f"{_CPU_DIR}/online", format_cpulist(online) + "\n")
    _write(root, f"{_CPU_DIR}/possible", format_cpulist(every) + "\n")
    _write(root, f"{_CPU_DIR}/present", format_cpulist(every) + "\n")
    _write(root, f"{_CPU_DIR}/smt/active", "1\n" if spec.threads > 1 else "0\n")
    words = len(every) and (max(every) // 32 + 1)
    _write_cpus(spec, root, online, words)
    nodes = spec.node_cpus()
    if spec.numa:
        _write_nodes(root, nodes, words)
    _write_devices(spec, root, nodes, online)
    _write_proc_and_cgroup(spec, root, online)
    return root


def _write_cpus(spec: HostSpec, root: str, online: frozenset[int], words: int) -> None:
    """Each CPU's folder: online, topology, performance, caches, idle states."""
    packages: dict[int, set[int]] = {}
    domains: dict[int, list[int]] = {}
    for c in range(spec.cores_count):
        for t in range(spec.threads):
            if (cpu := spec.cpu(c, t)) in online:
                packages.setdefault(spec.package_of_node(c // spec.cores_per_node), set()).add(cpu)
                domains.setdefault(spec.cache_of(c), []).append(cpu)
    for c in range(spec.cores_count):
        package = spec.package_of_node(c // spec.cores_per_node)
        siblings = [spec.cpu(c, t) for t in range(spec.threads) if spec.cpu(c, t) in online]
        for t in range(spec.threads):
            cpu = spec.cpu(c, t)
            base = f"{_CPU_DIR}/cpu{cpu}"
            _write(root, f"{base}/online", "1\n" if cpu in online else "0\n")
            if cpu not in online:
                continue
            topo = f"{base}/topology"
            for name, cpus in (
                ("core_cpus", siblings),
                ("thread_siblings", siblings),
                ("package_cpus", packages[package]),
                ("core_siblings", packages[package]),
            ):
                _write(root, f"{topo}/{name}_list", format_cpulist(cpus) + "\n")
                _write(root, f"{topo}/{name}", format_cpumask(cpus, words) + "\n")
            _write(root, f"{topo}/core_id", f"{c % spec.cores_per_node}\n")
            _write(root, f"{topo}/physical_package_id", f"{package}\n")
            _write_cpu_extras(spec, root, c, base, siblings, domains[spec.cache_of(c)], words)


def _write_cpu_extras(
    spec: HostSpec,
    root: str,
    core: int,
    base: str,
    siblings: list[int],
    domain: list[int],
    words: int,
) -> None:
    """One online CPU's performance figures, its two caches and its idle states."""
    sources = {name: rel for name, rel, _ in PERF_SOURCES}
    for name, value in spec.perf_of(core).items():
        _write(root, f"{base}/{sources[name]}", f"{value}\n")
    for index, (kind, level, shared) in enumerate((("Data", 1, siblings), ("Unified", 3, domain))):
        folder = f"{base}/cache/index{index}"
        _write(root, f"{folder}/type", f"{kind}\n")
        _write(root, f"{folder}/level", f"{level}\n")
        _write(root, f"{folder}/shared_cpu_list", format_cpulist(shared) + "\n")
        _write(root, f"{folder}/shared_cpu_map", format_cpumask(shared, words) + "\n")
        _write(root, f"{folder}/size", "48K\n" if level == 1 else "32768K\n")
        _write(root, f"{folder}/coherency_line_size", "64\n")
    for i, (name, latency) in enumerate(spec.idle_states):
        _write(root, f"{base}/cpuidle/state{i}/name", f"{name}\n")
        _write(root, f"{base}/cpuidle/state{i}/latency", f"{latency}\n")
        _write(root, f"{base}/cpuidle/state{i}/disable", "0\n")


def _write_nodes(root: str, nodes: dict[int, frozenset[int]], words: int) -> None:
    folder = "sys/devices/system/node"
    for n, node_cpus in nodes.items():
        _write(root, f"{folder}/node{n}/cpulist", format_cpulist(node_cpus) + "\n")
        _write(root, f"{folder}/node{n}/cpumap", format_cpumask(node_cpus, words) + "\n")
    _write(root, f"{folder}/online", format_cpulist(nodes) + "\n")
    _write(root, f"{folder}/possible", format_cpulist(nodes) + "\n")
    with_cpus = [n for n, cpus in nodes.items() if cpus]
    _write(root, f"{folder}/has_cpu", format_cpulist(with_cpus) + "\n")
    _write(root, f"{folder}/has_memory", format_cpulist(nodes) + "\n")


def _write_devices(
    spec: HostSpec, root: str, nodes: dict[int, frozenset[int]], online: frozenset[int]
) -> None:
    """The GPUs' and the other PCI devices' folders."""
    for gpu in spec.gpus:
        base = _pci_device(root, gpu.address)
        _write(root, f"{base}/class", f"{gpu.class_code:#08x}\n")
        _write(root, f"{base}/vendor", f"{gpu.vendor:#06x}\n")
        _write(root, f"{base}/numa_node", f"{gpu.node}\n")
        if gpu.local_cpulist:
            local = nodes.get(gpu.node, online) if spec.numa else online
            _write(root, f"{base}/local_cpulist", format_cpulist(local) + "\n")
    for dev in spec.pci:
        base = _pci_device(root, dev.address)
        _write(root, f"{base}/class", f"{dev.class_code:#08x}\n")
        _write(root, f"{base}/vendor", f"{dev.vendor:#06x}\n")
        _write(root, f"{base}/numa_node", f"{dev.node}\n")


def _write_proc_and_cgroup(spec: HostSpec, root: str, online: frozenset[int]) -> None:
    """``/proc``'s cpuinfo, mounts and cgroup, and the process's cgroup v2 folder."""
    flags = "fpu vme de pse tsc msr" + (" hypervisor" if spec.hypervisor else "")
    _write(
        root,
        "proc/cpuinfo",
        "".join(f"processor\t: {cpu}\nflags\t\t: {flags}\n\n" for cpu in sorted(online)),
    )
    _write(root, "proc/self/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev 0 0\n")
    _write(root, "proc/self/cgroup", f"0::{spec.cgroup_path}\n")
    _write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    folder = "sys/fs/cgroup" + spec.cgroup_path
    _write(root, f"{folder}/cpu.max", (spec.cpu_max or "max 100000") + "\n")
    cpuset = spec.cpuset if spec.cpuset is not None else format_cpulist(online)
    _write(root, f"{folder}/cpuset.cpus.effective", cpuset + "\n")


def _gpus(
    addresses: Mapping[int, list[str]], vendor: int = NVIDIA, class_code: int = 0x030200
) -> tuple[GpuSpec, ...]:
    return tuple(
        GpuSpec(a, node, vendor, class_code) for node, group in addresses.items() for a in group
    )


#: The host of docs/placement.md's worked examples; xeon6-pct is it with
#: priority cores.
_B300 = HostSpec(
    "xeon6-b300",
    "The host of docs/placement.md's worked examples: 2x Xeon 6767P, four NUMA nodes "
    "of 32 cores, "
    "siblings at +128, 8 GPUs two a node (one at 0000:fa:00.0), C6 at 170 µs",
    sockets=2,
    nodes_per_socket=2,
    cores_per_node=32,
    threads=2,
    gpus=_gpus(
        {
            0: ["0000:17:00.0", "0000:3d:00.0"],
            1: ["0000:5f:00.0", "0000:71:00.0"],
            2: ["0000:9b:00.0", "0000:ad:00.0"],
            3: ["0000:e4:00.0", "0000:fa:00.0"],
        }
    ),
    pci=(
        PciSpec("0000:00:00.0", INTEL, 0x060000, 0),
        PciSpec("0000:02:00.0", 0x1A03, 0x030000, 0),
    ),
    idle_states=(("POLL", 0), ("C1", 1), ("C1E", 2), ("C6", 170)),
)


#: Hosts a user can look at without owning one (``--host NAME``).
HOSTS: dict[str, HostSpec] = {
    spec.name: spec
    for spec in (
        HostSpec(
            "dgx-h100",
            "NVIDIA DGX H100: 2x Xeon Platinum 8480C (56 cores a socket, SMT, siblings "
            "at +112), 8 H100 four a socket, 4 NVSwitches, ConnectX-7 NICs, an ASPEED BMC",
            sockets=2,
            cores_per_node=56,
            threads=2,
            gpus=_gpus(
                {
                    0: ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"],
                    1: ["0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"],
                }
            ),
            pci=(
                # NVSwitches: NVIDIA, but a bridge (class 0x0680), not a GPU.
                *(
                    PciSpec(f"0000:{bus:02x}:00.0", NVIDIA, 0x068000, 1)
                    for bus in (0xC9, 0xCA, 0xCB, 0xCC)
                ),
                *(
                    PciSpec(f"0000:{bus:02x}:00.0", 0x15B3, 0x020700, 0 if bus < 0x80 else 1)
                    for bus in (0x19, 0x2B, 0x3B, 0x5E, 0x9B, 0xAC, 0xBB, 0xDC)
                ),
                PciSpec("0000:17:00.0", INTEL, 0x060400, 0),  # a root port
                PciSpec("0000:97:00.0", INTEL, 0x060400, 1),
                PciSpec("0000:e1:00.0", 0x1A03, 0x030000, 1),  # the BMC's VGA
            ),
            idle_states=(("POLL", 0), ("C1", 1), ("C1E", 2), ("C6", 290)),
        ),
        _B300,
        replace(
            _B300,
            name="xeon6-pct",
            description="2x Xeon 6 6776P (the DGX B300's CPU) in xeon6-b300's shape, Priority "
            "Core Turbo on: as Intel announced the part, eight cores a socket reach 4.6 GHz "
            "while the rest stop at 3.9 GHz, base 2.3 GHz; here the firmware's eight are cores "
            "4, 12, 20, 28 of each node (CPPC highest_perf 46 against 39); L3 a node (SNC2)",
            perf=(
                ("highest_perf", 39),
                ("nominal_perf", 23),
                ("max_khz", 3_900_000),
                ("base_khz", 2_300_000),
            ),
            priority_cores=(4, 12, 20, 28, 36, 44, 52, 60),
            priority=(("highest_perf", 46), ("max_khz", 4_600_000)),
        ),
        HostSpec(
            "xeon-sst-bf",
            "2x Xeon with Speed Select base frequency on: 24 cores a socket, SMT at +48, one "
            "node a socket, 4 GPUs two a socket; eight cores a socket (every third) run at a "
            "base of 2.6 GHz, the rest at 2.1 GHz, all up to 3.5 GHz; no CPPC",
            sockets=2,
            cores_per_node=24,
            threads=2,
            gpus=_gpus({0: ["0000:1a:00.0", "0000:3b:00.0"], 1: ["0000:86:00.0", "0000:af:00.0"]}),
            idle_states=(("POLL", 0), ("C1", 2), ("C6", 133)),
            perf=(("max_khz", 3_500_000), ("base_khz", 2_100_000)),
            priority_cores=(0, 3, 6, 9, 12, 15, 18, 21),
            priority=(("base_khz", 2_600_000),),
        ),
        HostSpec(
            "h100-vm",
            "A cloud VM with one H100: 40 vCPUs (20 cores, siblings adjacent), no NUMA "
            "information, no idle state deeper than 1 µs",
            cores_per_node=20,
            threads=2,
            siblings="adjacent",
            numa=False,
            gpus=(GpuSpec("0001:00:00.0", -1, local_cpulist=False),),
            idle_states=(("POLL", 0), ("C1", 1)),
            hypervisor=True,
        ),
        HostSpec(
            "amd-8gpu",
            "2x EPYC 9654 (96 cores a socket, SMT, siblings at +192, one node a socket), "
            "8 AMD Instinct GPUs four a socket",
            sockets=2,
            cores_per_node=96,
            threads=2,
            gpus=_gpus(
                {
                    0: ["0000:05:00.0", "0000:26:00.0", "0000:46:00.0", "0000:65:00.0"],
                    1: ["0000:85:00.0", "0000:a6:00.0", "0000:c6:00.0", "0000:e5:00.0"],
                },
                vendor=AMD,
                class_code=0x038000,
            ),
            pci=(
                PciSpec("0000:04:00.0", AMD, 0x060400, 0),  # an AMD bridge, not a GPU
                PciSpec("0000:c2:00.0", 0x1A03, 0x030000, 1),
            ),
            idle_states=(("POLL", 0), ("C1", 1), ("C2", 400)),
            llc_cores=8,
        ),
        HostSpec(
            "gh200",
            "NVIDIA Grace Hopper: 72 Arm cores, no SMT, one CPU node and eight nodes "
            "without CPUs (the GPU's memory)",
            cores_per_node=72,
            memory_nodes=(1, 2, 3, 4, 5, 6, 7, 8),
            gpus=(GpuSpec("0009:01:00.0", 0),),
            idle_states=(("WFI", 1),),
        ),
    )
}


@cache
def _built(name: str) -> str:
    # In memory where possible: a 224-CPU tree is 4,500 small files.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix=f"cpupin-host-{name}-", dir=shm)
    atexit.register(shutil.rmtree, root, True)
    return build_tree(HOSTS[name], root)


def host_named(name: str) -> Host:
    """A shipped host, read back from its fake tree (built once a process)."""
    if name not in HOSTS:
        raise ValueError(f"no shipped host {name!r}: choose one of {', '.join(sorted(HOSTS))}")
    return read_host(_built(name))
