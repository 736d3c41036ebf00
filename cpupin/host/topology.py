"""The host as sysfs and procfs describe it, read under a root directory.

:func:`read_host` returns a frozen :class:`Host`: online CPUs, cores (groups of
SMT siblings), NUMA nodes, packages, GPUs by PCI address, idle states, SMT,
core classes (cores that report a higher performance than others: priority
cores, big cores), last-level cache domains, the cgroup's cpuset and CPU
quota. Tests pass the root of a fake tree (or of
a real machine's capture); ``"/"`` is this machine.

Nothing here raises on a missing or odd file: the part it describes becomes
unknown and :attr:`Host.reasons` says why, so that a plan can say why it pins
nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from cpupin._records import field, record, replace
from cpupin.cpulist import MAX_CPUS, cpus_phrase, format_cpulist, is_hex
from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader
from cpupin.host.cgroup import Quota, cgroup_path, read_cgroup

__all__ = [
    "GPU_VENDORS",
    "cuda_gpus",
    "Core",
    "CoreClass",
    "Gpu",
    "Host",
    "IdleState",
    "Node",
    "Quota",
    "parse_pci_address",
    "pci_sort_key",
    "read_host",
]

#: PCI vendor ids of the GPU makers, all ranked together.
GPU_VENDORS: Mapping[int, str] = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel"}


@record(frozen=True)
class Core:
    """One core: the online CPUs that are its hardware threads."""

    cpus: tuple[int, ...]
    package: int | None = None
    rank: int = 0
    """Its core class: 0 is the highest (see :class:`CoreClass`)."""


@record(frozen=True)
class CoreClass:
    """Cores that report alike performance: what sysfs says of them.

    ``values`` maps each source that every core reported (``highest_perf``,
    ``nominal_perf``, ``max_khz``, ``base_khz``, ``capacity``) to the
    highest value among the class's cores."""

    rank: int
    """0: the highest class."""
    cores: int
    values: Mapping[str, int] = field(default_factory=dict)

    def describe(self, keys: Iterable[str] | None = None) -> str:
        """``highest_perf 46, max 4.60 GHz``: its figures (of ``keys`` only,
        when given: those that set the classes apart)."""
        parts = []
        wanted = None if keys is None else set(keys)
        for key, value in self.values.items():
            if wanted is not None and key not in wanted:
                continue
            if key.endswith("_khz"):
                parts.append(f"{key[:-4]} {value / 1e6:.2f} GHz")
            else:
                parts.append(f"{key} {value}")
        return ", ".join(parts) or "no performance figures"


@record(frozen=True)
class Node:
    """A NUMA node; ``cpus`` is empty for a memory-only node (GPU memory)."""

    id: int
    cpus: frozenset[int]


@record(frozen=True)
class Gpu:
    """A display-class PCI function of a GPU vendor."""

    address: str
    """Canonical PCI address, lower case: ``0000:3b:00.0``."""
    vendor: str
    """``nvidia``, ``amd``, ``intel``, or ``unknown`` where sysfs has no vendor."""
    vendor_id: int | None
    class_code: int
    node: int | None
    """Its NUMA node; ``None`` when it has none (see docs/placement.md)."""
    local_cpus: frozenset[int] | None
    """``local_cpulist``, else ``local_cpus``, else its node's CPUs; ``None``
    when nothing says."""


@record(frozen=True)
class IdleState:
    """One cpuidle state of a CPU."""

    name: str
    latency_us: int
    disabled: bool = False


@record(frozen=True)
class Host:
    """A machine's CPUs, cores, nodes and GPUs, as read under ``root``."""

    root: str
    cpus: frozenset[int]
    """The online CPUs."""
    cores: tuple[Core, ...]
    """Ordered by their lowest CPU."""
    nodes: tuple[Node, ...]
    """Ordered by id; memory-only nodes included."""
    gpus: tuple[Gpu, ...]
    """In numeric PCI address order."""
    idle_states: Mapping[int, tuple[IdleState, ...]] = field(default_factory=dict)
    """Idle states by package, from its first online CPU (``-1``: no package)."""
    smt: bool | None = None
    cpuset: frozenset[int] | None = None
    """The CPUs the process's cgroup cpuset allows, when the tree says."""
    quota: Quota | None = None
    """The strictest CPU quota of the process's cgroup and its ancestors."""
    hypervisor: bool = False
    memory_nodes: frozenset[int] | None = None
    """The nodes with memory (``has_memory``), CPU-less GPU memory nodes
    included; ``None`` when sysfs does not say."""
    classes: tuple[CoreClass, ...] = ()
    """The core classes, highest first; one class (or none, when sysfs gives
    no figures) where every core is alike."""
    caches: tuple[frozenset[int], ...] = ()
    """The last-level cache domains (``cache_level``): the online CPUs that
    share one, ordered by lowest CPU; empty when sysfs does not say."""
    cache_level: int | None = None
    cgroup: str | None = None
    """The process's cgroup path (``proc/self/cgroup``), where it says."""
    reasons: tuple[str, ...] = ()
    """What could not be read, and what was assumed instead."""

    def as_dict(self) -> dict[str, object]:
        """The host as JSON-ready data (what ``cpupin topo --json`` prints,
        with the process's mask and CPU plan beside it)."""
        deepest = self.deepest_idle_state()
        quota = self.quota
        return {
            "cpus": sorted(self.cpus),
            "cores": [list(core.cpus) for core in self.cores],
            "nodes": {str(node.id): sorted(node.cpus) for node in self.nodes},
            "gpus": [
                {
                    "address": g.address,
                    "vendor": g.vendor,
                    "class": f"{g.class_code:#08x}",
                    "node": g.node,
                    "local_cpus": sorted(g.local_cpus) if g.local_cpus is not None else None,
                }
                for g in self.gpus
            ],
            "idle_states": [
                {
                    "package": package,
                    "name": s.name,
                    "latency_us": s.latency_us,
                    "disabled": s.disabled,
                }
                for package, states in sorted(self.idle_states.items())
                for s in states
            ],
            "deepest_idle_state": (
                {"name": deepest.name, "latency_us": deepest.latency_us} if deepest else None
            ),
            "smt": self.smt,
            "hypervisor": self.hypervisor,
            "cpuset": sorted(self.cpuset) if self.cpuset is not None else None,
            "memory_nodes": (sorted(self.memory_nodes) if self.memory_nodes is not None else None),
            "quota": (
                {
                    "quota_us": quota.quota_us,
                    "period_us": quota.period_us,
                    "cpus": quota.cpus,
                    "source": quota.source,
                }
                if quota
                else None
            ),
            "classes": [
                {
                    "rank": c.rank,
                    "cores": c.cores,
                    "values": dict(c.values),
                    "cpus": sorted(
                        cpu for core in self.cores if core.rank == c.rank for cpu in core.cpus
                    ),
                }
                for c in self.classes
            ],
            "cache_level": self.cache_level,
            "caches": [sorted(domain) for domain in self.caches],
            "reasons": list(self.reasons),
        }

    def class_keys(self) -> list[str]:
        """The figures in which the classes differ."""
        keys = [k for c in self.classes for k in c.values]
        return [k for k in dict.fromkeys(keys) if len({c.values.get(k) for c in self.classes}) > 1]

    def cache_of(self, cpu: int) -> int | None:
        """The index in :attr:`caches` of ``cpu``'s last-level cache domain."""
        for index, domain in enumerate(self.caches):
            if cpu in domain:
                return index
        return None

    def core_of(self, cpu: int) -> Core | None:
        for core in self.cores:
            if cpu in core.cpus:
                return core
        return None

    def node_of(self, cpu: int) -> int | None:
        for node in self.nodes:
            if cpu in node.cpus:
                return node.id
        return None

    @property
    def cpu_nodes(self) -> tuple[Node, ...]:
        """The nodes that have CPUs."""
        return tuple(node for node in self.nodes if node.cpus)

    def deepest_idle_state(self) -> IdleState | None:
        """The enabled idle state with the longest exit latency, any package."""
        states = [s for group in self.idle_states.values() for s in group if not s.disabled]
        return max(states, key=lambda s: s.latency_us, default=None)

    def default_mask(self) -> frozenset[int]:
        """What a process on this host may use: the cgroup's cpuset, else every
        online CPU."""
        if self.cpuset:
            return self.cpuset & self.cpus or self.cpus
        return self.cpus


# --- PCI addresses ---------------------------------------------------------


def parse_pci_address(text: str) -> str:
    """The canonical form of a PCI address: ``0000:3b:00.0``.

    Takes sysfs's ``0000:3b:00.0``, NVML's ``00000000:3B:00.0``, a domain of
    five or more hex digits, or ``3b:00.0`` (domain 0). Anything else raises
    :class:`ValueError` quoting it. (Read with str's methods: a regular
    expression's compile cost every start half a millisecond.)
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a PCI address such as 0000:3b:00.0")
    head, dot, function = text.strip().rpartition(".")
    parts = head.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if not (
        dot
        and len(function) == 1
        and function in "01234567"
        and len(parts) == 3
        and is_hex(parts[0], 8)
        and is_hex(parts[1], 2)
        and is_hex(parts[2], 2)
    ):
        raise ValueError(f"{text!r} is not a PCI address such as 0000:3b:00.0")
    domain, bus, device = (int(part, 16) for part in parts)
    if device > 0x1F:
        raise ValueError(f"{text!r} is not a PCI address: device {device:#x} is past 0x1f")
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def pci_sort_key(address: str) -> tuple[int, int, int, int]:
    """(domain, bus, device, function) of a canonical address."""
    domain, bus, rest = address.split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


# --- reading ---------------------------------------------------------------


_CPU = "sys/devices/system/cpu"
_NODE = "sys/devices/system/node"
_PCI_DEVICES = "sys/bus/pci/devices"


#: The highest node or package id accepted (the kernel allows 1,024 nodes).
_MAX_ID = MAX_CPUS
#: The longest idle-state exit latency accepted: a second.
_MAX_LATENCY_US = 1_000_000
#: How much of /proc/cpuinfo is read (1.5 KB a CPU: the first CPU's flags).
_CPUINFO_HEAD = 64 << 10


def _numbered(names: Iterable[str], prefix: str) -> list[int]:
    """The numbers N of the names ``<prefix>N``, below :data:`MAX_CPUS`."""
    out = []
    size = len(prefix)
    for name in names:
        number = name[size:]
        if (
            name.startswith(prefix)
            and 0 < len(number) <= 6
            and number.isdigit()
            and number.isascii()
            and int(number) < MAX_CPUS
        ):
            out.append(int(number))
    return sorted(out)


def _name(text: str | None, default: str) -> str:
    """A name read from the tree, as it may be shown: printable, at most 32
    characters; ``default`` when there is none."""
    body = "".join(c for c in (text or "").strip() if c.isprintable())[:32]
    return body or default


def _online_cpus(r: Reader) -> frozenset[int]:
    online = r.cpus(f"{_CPU}/online")
    if online is not None:
        return online
    # No online file: a CPU is online when it says so, or, without an online
    # file of its own, when it has a topology folder (offline CPUs have none).
    found = set()
    for cpu in _numbered(r.listdir(_CPU) or [], "cpu"):
        flag = r.text(f"{_CPU}/cpu{cpu}/online")
        if flag is not None:
            if flag.strip() == "1":
                found.add(cpu)
        elif r.is_dir(f"{_CPU}/cpu{cpu}/topology"):
            found.add(cpu)
    if found:
        r.reasons.append(f"no {_CPU}/online: took the CPUs with a topology folder")
    else:
        r.reasons.append(f"no CPUs found under {_CPU}")
    return frozenset(found)


def _siblings(r: Reader, cpu: int) -> frozenset[int] | None:
    base = f"{_CPU}/cpu{cpu}/topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        cpus = r.cpus(f"{base}/{name}")
        if cpus is not None:
            return cpus
    for name in ("core_cpus", "thread_siblings"):
        cpus = r.cpus(f"{base}/{name}", mask=True)
        if cpus is not None:
            return cpus
    return None


def _cores(r: Reader, online: frozenset[int]) -> tuple[Core, ...]:
    seen: dict[int, int] = {}  # cpu -> index in groups
    groups: list[set[int]] = []
    packages: list[int | None] = []
    missing = []
    for cpu in sorted(online):
        if cpu in seen:
            continue
        siblings = _siblings(r, cpu)
        if siblings is None or cpu not in siblings:
            missing.append(cpu)
            siblings = frozenset({cpu})
        members = {c for c in siblings & online if c not in seen} | {cpu}
        for c in members:
            seen[c] = len(groups)
        groups.append(members)
        packages.append(r.integer(f"{_CPU}/cpu{cpu}/topology/physical_package_id", -1, _MAX_ID))
    if missing:
        r.reasons.append(
            f"no SMT siblings listed for CPU {format_cpulist(missing)}: each taken as a core"
        )
    cores = [
        Core(tuple(sorted(g)), p if p is not None and p >= 0 else None)
        for g, p in zip(groups, packages)
    ]
    return tuple(sorted(cores, key=lambda c: c.cpus[0]))


def _nodes(r: Reader, online: frozenset[int]) -> tuple[Node, ...]:
    ids = _numbered(r.listdir(_NODE) or [], "node")
    if not ids:
        r.reasons.append("no NUMA nodes listed: one node, node 0, holds every CPU")
        return (Node(0, online),)
    nodes = []
    for nid in ids:
        cpus = r.cpus(f"{_NODE}/node{nid}/cpulist")
        if cpus is None:
            cpus = r.cpus(f"{_NODE}/node{nid}/cpumap", mask=True)
        if cpus is None:
            r.reasons.append(f"node {nid} lists no CPUs: taken as a node without CPUs")
            cpus = frozenset()
        nodes.append(Node(nid, cpus & online))
    claimed: dict[int, int] = {}
    for node in nodes:
        for cpu in node.cpus:
            if cpu in claimed:
                r.reasons.append(
                    f"CPU {cpu} is in both node {claimed[cpu]} and node {node.id}: the NUMA "
                    "information is inconsistent, so one node, node 0, holds every CPU"
                )
                return (Node(0, online),)
            claimed[cpu] = node.id
    homeless = online - claimed.keys()
    if homeless:
        r.reasons.append(f"{cpus_phrase(homeless, 'is')} in no NUMA node")
    return tuple(nodes)


def _gpus(r: Reader, nodes: tuple[Node, ...]) -> tuple[Gpu, ...]:
    names = r.listdir(_PCI_DEVICES)
    if names is None:
        r.reasons.append(f"no {_PCI_DEVICES}: no GPUs known")
        return ()
    cpu_nodes = [n for n in nodes if n.cpus]
    node_cpus = {n.id: n.cpus for n in nodes}
    gpus = []
    for name in names:
        # Only a name that is a PCI address becomes part of a path or a reason.
        try:
            address = parse_pci_address(name)
        except ValueError:
            r.reasons.append(f"{_PCI_DEVICES}/{excerpt(name)}: not a PCI address, left out")
            continue
        base = f"{_PCI_DEVICES}/{name}"
        class_code = r.integer(f"{base}/class", 0, 0xFFFFFF)
        if class_code is None or class_code >> 16 != 0x03:
            continue
        vendor_id = r.integer(f"{base}/vendor", 0, 0xFFFF)
        if vendor_id is None:
            r.reasons.append(f"{base}: a display device with no vendor; taken as a GPU")
        elif vendor_id not in GPU_VENDORS:
            continue
        node: int | None = r.integer(f"{base}/numa_node", -1, _MAX_ID)
        if node is None or node < 0:
            # docs/placement.md: -1 (or no file) means the only node on a host with
            # one node or none, and no node on a host with several.
            node = cpu_nodes[0].id if len(cpu_nodes) == 1 else None
        elif node not in node_cpus:
            r.reasons.append(f"GPU {address} names node {node}, which is not listed")
        local = r.cpus(f"{base}/local_cpulist")
        if local is None:
            local = r.cpus(f"{base}/local_cpus", mask=True)
        if local is None and node is not None and node_cpus.get(node):
            local = node_cpus[node]
        vendor = GPU_VENDORS[vendor_id] if vendor_id is not None else "unknown"
        gpus.append(Gpu(address, vendor, vendor_id, class_code, node, local))
    return tuple(sorted(gpus, key=lambda g: pci_sort_key(g.address)))


def _idle_states(r: Reader, cores: tuple[Core, ...]) -> dict[int, tuple[IdleState, ...]]:
    # One CPU a package: every CPU of a package has the same cpuidle driver,
    # and reading each CPU's would cost thousands of files on a large host.
    firsts: dict[int, int] = {}
    for core in cores:
        key = core.package if core.package is not None else -1
        firsts.setdefault(key, core.cpus[0])
    out: dict[int, tuple[IdleState, ...]] = {}
    for package, cpu in sorted(firsts.items()):
        base = f"{_CPU}/cpu{cpu}/cpuidle"
        states = []
        for index in _numbered(r.listdir(base) or [], "state"):
            name = _name(r.text(f"{base}/state{index}/name"), f"state{index}")
            latency = r.integer(f"{base}/state{index}/latency", 0, _MAX_LATENCY_US)
            if latency is None:
                continue
            disabled = (r.text(f"{base}/state{index}/disable") or "0").strip() not in ("0", "")
            states.append(IdleState(name, latency, disabled))
        if states:
            out[package] = tuple(states)
    if not out:
        r.reasons.append("no cpuidle states listed")
    return out


#: What a core's own files say of its speed, in the order they rank cores:
#: (name, file under ``cpuN``, the largest value accepted). ACPI CPPC's
#: highest and nominal performance (Intel's priority and favoured cores, AMD's
#: preferred cores, Arm big and little cores); cpufreq's top and base
#: frequency in kHz (Intel SST-BF gives its high-priority cores a higher
#: base); Arm's scheduler capacity (of 1024).
PERF_SOURCES: tuple[tuple[str, str, int], ...] = (
    ("highest_perf", "acpi_cppc/highest_perf", 1 << 20),
    ("nominal_perf", "acpi_cppc/nominal_perf", 1 << 20),
    ("max_khz", "cpufreq/cpuinfo_max_freq", 100_000_000),
    ("base_khz", "cpufreq/base_frequency", 100_000_000),
    ("capacity", "cpu_capacity", 1 << 20),
)

#: Two values of one source fall in different classes only where the sorted
#: values of all cores jump by more than this fraction: AMD's preferred-core
#: ranking (a few per cent between neighbours) and an Arm capacity of 1017
#: against 1024 stay one class; 4.6 GHz against 3.9 GHz does not.
CLASS_GAP = 0.05


def _levels(column: list[int]) -> list[int]:
    """Each value's level: 0 for the lowest group, one more at every jump of
    more than :data:`CLASS_GAP` between neighbouring distinct values."""
    level: dict[int, int] = {}
    current, previous = 0, None
    for value in sorted(set(column)):
        if previous is not None and value > previous * (1 + CLASS_GAP):
            current += 1
        level[value] = current
        previous = value
    return [level[v] for v in column]


def _classes(r: Reader, cores: tuple[Core, ...]) -> tuple[tuple[Core, ...], tuple[CoreClass, ...]]:
    """The cores with their class rank, and the classes, highest first.

    Each core is read at its first CPU (SMT siblings share a core's speed).
    A source is used only when every core reports it: a source the first
    core lacks is not read at all (a host without CPPC costs no file per
    core), and one some core lacks is dropped with a reason."""
    if not cores:
        return cores, ()
    columns: dict[str, list[int]] = {}
    for key, rel, hi in PERF_SOURCES:
        first = r.integer(f"{_CPU}/cpu{cores[0].cpus[0]}/{rel}", 1, hi)
        if first is None:
            continue
        column = [first]
        for core in cores[1:]:
            value = r.integer(f"{_CPU}/cpu{core.cpus[0]}/{rel}", 1, hi)
            if value is None:
                r.reasons.append(
                    f"cpu{core.cpus[0]}/{rel} is missing or unreadable while "
                    f"cpu{cores[0].cpus[0]} has one: {key} does not rank cores"
                )
                break
            column.append(value)
        else:
            columns[key] = column
    if not columns:
        return cores, ()
    levels = [_levels(column) for column in columns.values()]
    keys = [tuple(level[i] for level in levels) for i in range(len(cores))]
    rank_of = {k: rank for rank, k in enumerate(sorted(set(keys), reverse=True))}
    ranked = tuple(replace(core, rank=rank_of[k]) for core, k in zip(cores, keys))
    # One pass over the cores (not one a class: a capture with thousands of
    # classes stays linear).
    members: dict[tuple[int, ...], list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    classes = []
    for level_key, rank in rank_of.items():
        mine = members[level_key]
        values = {name: max(column[i] for i in mine) for name, column in columns.items()}
        classes.append(CoreClass(rank, len(mine), values))
    return ranked, tuple(sorted(classes, key=lambda c: c.rank))


#: The deepest cache level accepted.
_MAX_CACHE_LEVEL = 9


def _caches(r: Reader, online: frozenset[int]) -> tuple[tuple[frozenset[int], ...], int | None]:
    """The last-level cache domains: the highest-level data or unified cache
    of the first online CPU, then that cache's ``shared_cpu_list`` read once a
    domain, at its lowest CPU. Unknown (no domains, a reason) when a CPU does
    not list itself or two domains overlap."""
    if not online:
        return (), None
    first = min(online)
    base = f"{_CPU}/cpu{first}/cache"
    index, level = None, 0
    for number in _numbered(r.listdir(base) or [], "index"):
        kind = (r.text(f"{base}/index{number}/type") or "").strip()
        if kind not in ("Unified", "Data"):
            continue
        found = r.integer(f"{base}/index{number}/level", 1, _MAX_CACHE_LEVEL)
        if found is not None and found > level:
            index, level = number, found
    if index is None:
        r.reasons.append("no data or unified cache listed: cache domains unknown")
        return (), None
    domains: list[frozenset[int]] = []
    covered: set[int] = set()
    for cpu in sorted(online):
        if cpu in covered:
            continue
        folder = f"{_CPU}/cpu{cpu}/cache/index{index}"
        shared = r.cpus(f"{folder}/shared_cpu_list")
        if shared is None:
            shared = r.cpus(f"{folder}/shared_cpu_map", mask=True)
        if shared is None or cpu not in shared:
            r.reasons.append(
                f"CPU {cpu} lists no level-{level} cache of its own: cache domains unknown"
            )
            return (), None
        members = shared & online
        if not members.isdisjoint(covered):
            r.reasons.append(
                f"{cpus_phrase(members & covered, 'is')} in two level-{level} caches: "
                "cache domains unknown"
            )
            return (), None
        covered.update(members)
        domains.append(frozenset(members))
    return tuple(domains), level


def _hypervisor(r: Reader) -> bool:
    if r.is_file("sys/hypervisor/type"):
        return bool((r.text("sys/hypervisor/type") or "").strip())
    # The first CPU's flags are enough: read the head of the file only.
    text = r.text("proc/cpuinfo", limit=_CPUINFO_HEAD, head=True) or ""
    for line in text.splitlines():
        name, colon, flags = line.partition(":")
        if colon and name.startswith("flags") and not name[5:].strip():
            return "hypervisor" in flags.split()
    return False


def read_host(root: str | os.PathLike[str] = "/") -> Host:
    """Read the host under ``root`` (``"/"``: this machine).

    Never raises for a missing or malformed file; see :attr:`Host.reasons`.
    """

    with Reader(os.fspath(root)) as r:
        return _read(r)


def read_host_for_binding(root: str | os.PathLike[str] = "/", *, caches: bool) -> Host:
    """The host as a binding reads it (:func:`cpupin.bind_process`, ``cpupin
    exec``): what :func:`read_host` reads but the idle states, the core
    classes and the hypervisor flag, and the cache domains unless
    ``caches``. No binding looks at them, and a worker's start pays for
    every file (bench/RESULTS.md); the host read here never leaves the
    binding."""
    with Reader(os.fspath(root)) as r:
        return _read(r, whole=False, caches=caches)


def _read(r: Reader, *, whole: bool = True, caches: bool = True) -> Host:
    online = _online_cpus(r)
    cores = _cores(r, online)
    nodes = _nodes(r, online)
    gpus = _gpus(r, nodes)
    smt_text = r.text(f"{_CPU}/smt/active")
    if smt_text is not None and smt_text.strip() in ("0", "1"):
        smt: bool | None = smt_text.strip() == "1"
    else:
        smt = any(len(core.cpus) > 1 for core in cores) if cores else None
    cpuset, quota = read_cgroup(r)
    classes: tuple[CoreClass, ...] = ()
    if whole:
        cores, classes = _classes(r, cores)
    domains, cache_level = _caches(r, online) if whole or caches else ((), None)
    return Host(
        root=r.root,
        cpus=online,
        cores=cores,
        nodes=nodes,
        gpus=gpus,
        idle_states=_idle_states(r, cores) if whole else {},
        smt=smt,
        cpuset=cpuset,
        quota=quota,
        hypervisor=_hypervisor(r) if whole else False,
        memory_nodes=r.cpus(f"{_NODE}/has_memory"),
        classes=classes,
        caches=domains,
        cache_level=cache_level,
        cgroup=cgroup_path(r),
        reasons=tuple(r.reasons),
    )


def cuda_gpus(host: Host) -> tuple[Gpu, ...]:
    """The GPUs a CUDA device index counts: NVIDIA's, in PCI order (as
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``nvidia-smi`` number them); an
    integrated Intel GPU or an AMD one is not a CUDA device. On a host with
    no NVIDIA GPU, AMD's (ROCm's HIP counts them, through
    ``HIP_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``, which it also
    honours); else every GPU found."""
    for vendor in ("nvidia", "amd"):
        found = tuple(g for g in host.gpus if g.vendor == vendor)
        if found:
            return found
    return host.gpus
