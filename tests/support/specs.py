"""What a host spec must read back as: the truth the topology tests (and the
benchmarks that need a host without a tree) compare with. Built from the
spec's arithmetic, never from a tree."""

from __future__ import annotations

from cpupin.host.shapes import HostSpec
from cpupin.host.topology import (
    GPU_VENDORS,
    Core,
    CoreClass,
    Gpu,
    Host,
    IdleState,
    Node,
    parse_pci_address,
    pci_sort_key,
)


def _cores(spec: HostSpec) -> list[tuple[int, tuple[int, ...]]]:
    """(core index, its online CPUs) of every core with one online, in
    order of their lowest CPU."""
    online = spec.online()
    cores = []
    for c in range(spec.cores_count):
        cpus = tuple(
            sorted(spec.cpu(c, t) for t in range(spec.threads) if spec.cpu(c, t) in online)
        )
        if cpus:
            cores.append((c, cpus))
    return sorted(cores, key=lambda core: core[1])


def spec_cores(spec: HostSpec) -> list[tuple[int, ...]]:
    """The CPUs of each core with one online, in order of their lowest CPU."""
    return [cpus for _, cpus in _cores(spec)]


def spec_host(spec: HostSpec) -> Host:
    """The :class:`Host` this spec describes, built in memory: what
    ``read_host`` of its tree must return (but ``root`` and ``reasons``)."""
    nodes = spec.node_cpus()
    cpu_nodes = [n for n, cpus in nodes.items() if cpus]
    online = spec.online()
    gpus = []
    for g in spec.gpus:
        node = (
            g.node if g.node >= 0 and spec.numa else (cpu_nodes[0] if len(cpu_nodes) == 1 else None)
        )
        if g.local_cpulist:
            local: frozenset[int] | None = nodes.get(g.node, online) if spec.numa else online
        else:
            local = nodes.get(node) or None if node is not None else None
        gpus.append(
            Gpu(
                parse_pci_address(g.address),
                GPU_VENDORS[g.vendor],
                g.vendor,
                g.class_code,
                node,
                local,
            )
        )
    states = tuple(IdleState(name, latency) for name, latency in spec.idle_states)
    present = _cores(spec)
    # Classes: none without figures; else the priority cores (whose figures
    # the strategies only ever raise) above the others, where both exist.
    figures = [spec.perf_of(c) for c, _ in present]
    kinds = sorted({tuple(sorted(f.items())) for f in figures}, key=lambda k: k != _top(spec))
    rank = {kind: i for i, kind in enumerate(kinds)} if spec.perf else {}
    cores = tuple(
        Core(cpus, spec.package_of_node(c // spec.cores_per_node), rank.get(kind, 0))
        for (c, cpus), kind in zip(present, (tuple(sorted(f.items())) for f in figures))
    )
    classes = tuple(
        CoreClass(i, sum(core.rank == i for core in cores), dict(kind)) for kind, i in rank.items()
    )
    domains: dict[int, set[int]] = {}
    for c, cpus in present:
        domains.setdefault(spec.cache_of(c), set()).update(cpus)
    caches = tuple(sorted((frozenset(d) for d in domains.values()), key=min))
    return Host(
        root="",
        cpus=online,
        cores=cores,
        nodes=tuple(Node(n, cpus) for n, cpus in sorted(nodes.items())),
        gpus=tuple(sorted(gpus, key=lambda g: pci_sort_key(g.address))),
        # A package whose first CPU lists no state is left out, as read_host does.
        idle_states={(-1 if p is None else p): states for p in {c.package for c in cores}}
        if states
        else {},
        smt=spec.threads > 1,
        cpuset=online if spec.cpuset is None else None,
        hypervisor=spec.hypervisor,
        memory_nodes=frozenset(nodes) if spec.numa else None,
        classes=classes,
        caches=caches,
        cache_level=3 if caches else None,
        cgroup=spec.cgroup_path,
    )


def _top(spec: HostSpec) -> tuple[tuple[str, int], ...]:
    """The figures of the highest class: a priority core's."""
    return tuple(sorted({**dict(spec.perf), **dict(spec.priority)}.items()))
