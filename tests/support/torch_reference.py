"""The CPUs torch's ``--numa-binding`` modes choose, written from their
definitions in ``torch.numa.binding`` (``AffinityMode``), over plain data:
the oracle for cpupin's ``bind_process(cpus=...)``. No cpupin code here.

- ``node``: the allowed CPUs of the GPU's node.
- ``socket``: the allowed CPUs of every node of the GPU's node's socket; a
  node's socket is that of its lowest allowed CPU.
- ``exclusive``: the allowed cores of the node (a core stands for its
  allowed CPUs, keyed by its lowest CPU) divided evenly among the node's
  GPUs in index order, the lowest GPUs taking one extra core each where they
  do not divide; ``None`` where there are fewer cores than GPUs (torch
  raises).
- ``core-complex``: the node's allowed CPUs grouped by their last-level
  cache (keyed by its lowest CPU), sorted fullest first then by key; the GPU
  of rank r on the node takes group ``r % len(groups)``.

A GPU's node is its ``numa_node``, ``-1`` read as 0.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    node_cpus: dict  # node -> every CPU of the node
    core_of: dict  # cpu -> the CPUs of its core (thread_siblings_list)
    llc_of: dict  # cpu -> the CPUs sharing its last-level cache
    package_of: dict  # cpu -> physical_package_id
    gpu_nodes: list  # GPU index (PCI order) -> numa_node


def _node(m, gpu):
    return max(m.gpu_nodes[gpu], 0)


def _allowed_on(m, node, allowed):
    return set(m.node_cpus.get(node, ())) & set(allowed)


def node_mode(m, gpu, allowed):
    return _allowed_on(m, _node(m, gpu), allowed)


def socket_mode(m, gpu, allowed):
    here = _allowed_on(m, _node(m, gpu), allowed)
    if not here:
        return set()
    socket = m.package_of[min(here)]
    out = set()
    for node in m.node_cpus:
        cpus = _allowed_on(m, node, allowed)
        if cpus and m.package_of[min(cpus)] == socket:
            out |= cpus
    return out


def _rank(m, gpu):
    node = _node(m, gpu)
    peers = sorted(i for i in range(len(m.gpu_nodes)) if max(m.gpu_nodes[i], 0) == node)
    return peers.index(gpu), len(peers)


def exclusive_mode(m, gpu, allowed):
    rank, count = _rank(m, gpu)
    cpus = node_mode(m, gpu, allowed)
    groups = {}
    for cpu in cpus:
        groups.setdefault(min(m.core_of[cpu]), set()).add(cpu)
    cores = [groups[k] for k in sorted(groups)]
    per, extra = divmod(len(cores), count)
    if per < 1:
        return None
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    return set().union(*cores[start:end])


def core_complex_mode(m, gpu, allowed):
    rank, _ = _rank(m, gpu)
    groups = {}
    for cpu in node_mode(m, gpu, allowed):
        groups.setdefault(min(m.llc_of[cpu]), set()).add(cpu)
    if not groups:
        return set()
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return ordered[rank % len(ordered)][1]


MODES = {
    "node": node_mode,
    "socket": socket_mode,
    "exclusive": exclusive_mode,
    "cache": core_complex_mode,
}
