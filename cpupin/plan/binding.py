"""Binding a worker process to its GPU's NUMA node: the decision, pure.

A worker runs best on the CPUs of its GPU's node, with its memory there.
:func:`decide_binding` is a function of the host, the process mask, the
target (a GPU or a node), the modes and the nodes the process may allocate
on (``Mems_allowed``). CPUs are chosen by the mode (the node, its package,
an exclusive share of the node, one last-level cache of it, or a list),
always within the process mask and never empty; memory goes only to nodes
that have memory and that the process may use. Applying it is
:func:`cpupin.act.binding.bind_process`'s.

Grace Hopper and GB200 hosts show GPU memory as extra NUMA nodes without
CPUs, while the GPU's PCI ``numa_node`` names its CPU node: the binding uses
the CPU node, and never binds memory to a node without CPUs. A GPU without a
node (``numa_node`` -1 on a host of several nodes) binds nothing, unless its
``local_cpus`` lie within one node, which is then its node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cpupin._records import record
from cpupin.cpulist import MAX_CPUS, cpus_phrase, format_cpulist, parse_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host.launcher import ASK_LAUNCHER
from cpupin.host.topology import Host

__all__ = [
    "CPU_MODES",
    "MEMORY_MODES",
    "Binding",
    "check_memory",
    "decide_binding",
    "gpu_node",
    "parse_cpus",
]


#: The CPU modes by name; any other text is read as a CPU list.
CPU_MODES: tuple[str, ...] = ("node", "socket", "exclusive", "cache", "keep")
MEMORY_MODES: tuple[str, ...] = ("preferred", "bind", "interleave", "none")
_CPUS_ACCEPTED = "node, socket, exclusive, cache, keep, or a CPU list such as 0-7,64-71"


@record(frozen=True)
class Binding:
    """Where a worker process runs and allocates: what was asked, as applied.

    :attr:`reason` is empty when everything asked for was applied, and says
    what was not, and why, otherwise.
    """

    device: str | None
    """The GPU's PCI address, when the target was a GPU."""
    node: int | None
    """The node bound to; ``None`` when there was none to bind to."""
    cpus: frozenset[int]
    """The process mask after the binding (never empty)."""
    memory_policy: str
    """``"preferred"``, ``"bind"``, ``"interleave"`` or ``"none"``: what is
    in force."""
    memory_nodes: frozenset[int]
    reason: str = ""
    mode: str = "node"
    """The CPU mode: ``node``, ``socket``, ``exclusive``, ``cache``, ``keep``,
    or ``list`` for an explicit CPU list."""

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "node": self.node,
            "mode": self.mode,
            "cpus": sorted(self.cpus),
            "memory": {"policy": self.memory_policy, "nodes": sorted(self.memory_nodes)},
            "reason": self.reason,
        }


def _brief(cpus: Iterable[int], size: int = 32) -> str:
    """A CPU list for a reason: whole up to ``size`` characters, else cut
    after a whole item, with ``,...`` (a reason stays a line, whatever the
    mask)."""
    text = format_cpulist(cpus)
    if len(text) <= size:
        return text
    return text[: text.rfind(",", 0, size) if "," in text[:size] else size] + ",..."


def gpu_node(host: Host, address: str) -> tuple[int | None, str]:
    """The CPU node of a GPU, and a note on how it was found (empty when its
    ``numa_node`` said so). :class:`PlanError` for a GPU the host lacks."""
    gpu = next((g for g in host.gpus if g.address == address), None)
    if gpu is None:
        known = ", ".join(g.address for g in host.gpus) or "none"
        raise PlanError(f"GPU {address} is not a GPU of this host (its GPUs: {known})")
    cpu_nodes = {n.id: n.cpus for n in host.nodes if n.cpus}
    if gpu.node is not None and gpu.node in cpu_nodes:
        return gpu.node, ""
    if gpu.node is not None:
        return None, (f"GPU {address} names node {gpu.node}, which has no CPUs: nothing to bind to")
    if gpu.local_cpus:
        homes = [nid for nid, cpus in cpu_nodes.items() if gpu.local_cpus <= cpus]
        if len(homes) == 1:
            return homes[0], (
                f"GPU {address} has no numa_node; its local CPUs lie in node {homes[0]}"
            )
    return None, (
        f"GPU {address} has no NUMA node (numa_node -1) and its local CPUs span nodes: "
        "nothing to bind to; name a node with node="
    )


def parse_cpus(value: object) -> tuple[str, frozenset[int] | None]:
    """The CPU mode of ``value``: a mode name, or ``("list", CPUs)`` for a CPU
    list (``"0-7,64-71"`` or an iterable of CPU numbers). :class:`ValueError`
    names the value and the accepted forms."""
    if isinstance(value, str):
        text = value.strip()
        if text in CPU_MODES:
            return text, None
        try:
            listed = parse_cpulist(text)
        except ValueError as exc:
            if text[:1].isdigit():  # meant as a list: say what is wrong with it
                raise ValueError(f"cpus={excerpt(value)}: {exc}; use {_CPUS_ACCEPTED}") from None
            listed = frozenset()
        if listed:
            return "list", listed
        raise ValueError(f"cpus={excerpt(value)}: use {_CPUS_ACCEPTED}")
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        items = list(value)
        if items and all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in items
        ):
            return "list", frozenset(items)
    raise ValueError(f"cpus={excerpt(value)}: use {_CPUS_ACCEPTED}")


def check_memory(memory: object) -> None:
    if memory not in MEMORY_MODES:
        raise ValueError(
            f"memory={excerpt(memory)}: use 'preferred', 'bind', 'interleave' or 'none'"
        )


def decide_binding(
    host: Host,
    mask: frozenset[int],
    *,
    device: str | None = None,
    node: int | None = None,
    cpus: str | Iterable[int] = "node",
    memory: str = "preferred",
    mems_allowed: frozenset[int] | None = None,
) -> Binding:
    """The binding of a process with ``mask`` on ``host``: pure, no I/O.

    ``device`` is a canonical PCI address of one of the host's GPUs, or
    ``node`` a node id; exactly one, except that a CPU list needs neither.
    ``cpus`` is a mode of :data:`CPU_MODES` or a CPU list (see
    :func:`bind_process`). ``mems_allowed`` is the set of nodes the process
    may allocate on (``None``: unknown, every node).
    """
    mode, listed = parse_cpus(cpus)
    check_memory(memory)
    if listed is None and (device is None) == (node is None):
        raise ValueError("name exactly one of device and node")
    if device is not None and node is not None:
        raise ValueError("name at most one of device and node")
    if mode in ("exclusive", "cache") and device is None:
        raise ValueError(
            f"cpus={mode!r} shares a node among its GPUs: name the GPU (device=, --gpu, "
            "--device or --local-rank), or use cpus='node'"
        )
    if not mask:
        raise PlanError("an empty process mask: nothing to bind")
    reasons = []
    target: int | None = None
    if device is not None:
        target, note = gpu_node(host, device)
        if note:
            reasons.append(note)
    elif node is not None:
        ids = {n.id for n in host.nodes}
        if node not in ids:
            raise PlanError(
                f"node {node} is not a node of this host (its nodes: "
                f"{format_cpulist(ids) or 'none'})"
            )
        target = node
        if not _node_cpus(host, node):
            reasons.append(
                f"node {node} has no CPUs (memory only, such as a GPU's): nothing to bind to; "
                "name a node with CPUs"
            )
            target = None
    new = mask
    if listed is not None:
        new = _listed(host, mask, listed, reasons)
    elif mode != "keep" and target is not None:
        chosen = _mode_cpus(host, mask, target, mode, device, reasons)
        if chosen:
            new = chosen
    wanted = _memory_nodes(host, mode, target, new)
    policy, nodes = _memory(host, memory, target, wanted, mems_allowed, reasons)
    if policy != "none":
        homes = {n for n in map(host.node_of, new) if n is not None}
        if not homes & nodes:
            reasons.append(
                f"its CPUs (node {_brief(homes, 24) or '?'}) and its memory (node "
                f"{_brief(nodes, 24)}) are on different nodes, so every memory access crosses "
                f"between them: give it CPUs of node {_brief(nodes, 24)}, or pass memory='none' "
                "(--memory none) to keep memory with the CPUs"
            )
    return Binding(device, target, new, policy, nodes, "; ".join(reasons), mode)


def _listed(
    host: Host, mask: frozenset[int], listed: frozenset[int], reasons: list[str]
) -> frozenset[int]:
    """An explicit CPU list, within the online CPUs and the process mask."""
    offline = listed - host.cpus
    outside = (listed & host.cpus) - mask
    chosen = listed & mask & host.cpus
    if not chosen:
        raise PlanError(
            f"cpus={format_cpulist(listed)}: none of these CPUs is online and in the process "
            f"mask {format_cpulist(mask)}; name CPUs of the mask"
        )
    if offline:
        reasons.append(f"{cpus_phrase(offline, 'is')} not online: left out")
    if outside:
        reasons.append(
            f"{cpus_phrase(outside, 'is')} outside the process mask {format_cpulist(mask)}: "
            "left out (the launcher's CPU set wins)"
        )
    return chosen


def _cores_of(host: Host, cpus: frozenset[int]) -> list[frozenset[int]]:
    """``cpus`` grouped by core (SMT siblings together), in the order of each
    core's lowest CPU, allowed or not (as torch keys a core)."""
    cores = [frozenset(core.cpus) & cpus for core in host.cores]
    return [c for c in cores if c]


def _peers(host: Host, target: int) -> list[str]:
    """The host's GPUs whose node is ``target``, in PCI address order."""
    return [g.address for g in host.gpus if gpu_node(host, g.address)[0] == target]


def _mode_cpus(
    host: Host,
    mask: frozenset[int],
    target: int,
    mode: str,
    device: str | None,
    reasons: list[str],
) -> frozenset[int]:
    """The CPUs ``mode`` chooses on ``target``'s node within ``mask``, or an
    empty set (the mask is kept) with the reason in ``reasons``."""
    node_cpus = _node_cpus(host, target)
    local = mask & node_cpus
    if not local:
        reasons.append(
            f"node {target}'s CPUs {_brief(node_cpus)} are all outside the "
            f"process mask {_brief(mask)}: the mask is kept"
            + (f" ({ASK_LAUNCHER})" if device is not None else "")
        )
        return frozenset()
    if mode == "node":
        return local
    if mode == "socket":
        packages = {c.package for c in host.cores if node_cpus.intersection(c.cpus)}
        if None in packages or len(packages) != 1:
            reasons.append(f"node {target}'s package is unknown: bound to the node alone")
            return local
        within = frozenset(cpu for c in host.cores if c.package in packages for cpu in c.cpus)
        nodes = {n.id for n in host.cpu_nodes if n.cpus & within}
        return mask & frozenset(cpu for n in host.cpu_nodes if n.id in nodes for cpu in n.cpus)
    assert device is not None
    peers = _peers(host, target)
    rank = peers.index(device)
    if mode == "exclusive":
        cores = _cores_of(host, local)
        if len(cores) < len(peers):
            reasons.append(
                f"node {target} has {len(cores)} core(s) in the process mask for "
                f"{len(peers)} GPU(s): exclusive cannot give each GPU a core of its own; "
                "the mask is kept"
            )
            return frozenset()
        share, extra = divmod(len(cores), len(peers))
        start = rank * share + min(rank, extra)
        end = start + share + (1 if rank < extra else 0)
        return frozenset(cpu for core in cores[start:end] for cpu in core)
    # cache: one last-level cache domain, the fullest first, a GPU each while
    # they last (the rank wraps round when the node has more GPUs).
    if not host.caches:
        reasons.append("the host's cache domains are unknown: bound to the node instead")
        return local
    domains: dict[int, set[int]] = {}
    for cpu in local:
        index = host.cache_of(cpu)
        domains.setdefault(-1 if index is None else index, set()).add(cpu)
    ordered = sorted(domains.items(), key=lambda item: (-len(item[1]), item[0]))
    return frozenset(ordered[rank % len(ordered)][1])


def _memory_nodes(host: Host, mode: str, target: int | None, cpus: frozenset[int]) -> list[int]:
    """The nodes the memory policy names, before checks: the target's node,
    the nodes of the package under ``socket``, the nodes of the CPUs of a
    list; the target's first, then by id."""
    if mode != "list" and target is None:
        return []
    if mode not in ("list", "socket"):
        return [target] if target is not None else []
    homes = {n for n in map(host.node_of, cpus) if n is not None}
    if target is not None and mode == "socket":
        homes.add(target)
    return sorted(homes, key=lambda n: (n != target, n))


def _memory(
    host: Host,
    memory: str,
    target: int | None,
    wanted: list[int],
    mems_allowed: frozenset[int] | None,
    reasons: list[str],
) -> tuple[str, frozenset[int]]:
    """The policy and its nodes: ``wanted`` less the nodes without memory and
    those the process may not allocate on, each named in ``reasons``."""
    if memory == "none" or not wanted:
        return "none", frozenset()
    kept = []
    for n in wanted:
        if host.memory_nodes is not None and n not in host.memory_nodes:
            reasons.append(f"node {n} has no memory: no memory policy there")
        elif mems_allowed is not None and n not in mems_allowed:
            reasons.append(
                f"node {n} is not among the nodes this process may allocate on "
                f"(Mems_allowed {format_cpulist(mems_allowed) or 'none'}): no memory policy there"
            )
        else:
            kept.append(n)
    if not kept:
        return "none", frozenset()
    if memory == "preferred":
        # MPOL_PREFERRED names one node: the target's, else the first kept.
        return memory, frozenset(kept[:1])
    return memory, frozenset(kept)


def _node_cpus(host: Host, node: int) -> frozenset[int]:
    return next((n.cpus for n in host.nodes if n.id == node), frozenset())
