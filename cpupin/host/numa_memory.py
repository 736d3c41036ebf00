"""Where a process's memory lies: its resident pages per NUMA node, from
``/proc/PID/numa_maps``, against the nodes of the CPUs it runs on.

A worker bound to its GPU's node after it allocated, or one whose memory
policy the kernel refused, keeps pages on another node: every access to
them crosses the interconnect. ``numa_maps`` lists each mapping's pages per
node (``N1=512``) and the page size (``kernelpagesize_kB=4``); the sums are
what this module reports. Everything in it is hostile: the reading stops
after :data:`MAX_BYTES` and :data:`MAX_LINES`, and says so, and each number
is bounded. Reading it walks the process's page tables, which for a
process of hundreds of GiB costs the kernel a while: it is read on demand
(``cpupin threads``, ``ps``, a scrape), never in a step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cpupin._native import as_pid
from cpupin.host._sysfs import Reader

__all__ = [
    "MAX_BYTES",
    "MAX_LINES",
    "NodeMemory",
    "memory_by_node",
    "memory_summary",
    "parse_numa_maps",
]

#: The most of ``numa_maps`` read, and the most mappings counted.
MAX_BYTES = 32 << 20
MAX_LINES = 200_000
#: The most NUMA nodes a count may name, and the largest page (16 GiB).
MAX_NODE = 4095
MAX_PAGE_KB = 16 << 20
_MAX_PAGES = 1 << 40

_NODE = re.compile(rb"\AN(\d{1,4})=(\d{1,13})\Z")
_PAGE = re.compile(rb"\Akernelpagesize_kB=(\d{1,9})\Z")


@dataclass(frozen=True)
class NodeMemory:
    """A process's resident memory by node, and the nodes it runs on."""

    by_node: dict[int, int]
    """Node to bytes resident there."""
    local_nodes: frozenset[int] = frozenset()
    """The nodes of the CPUs the process runs on (its mask's)."""
    partial: str = ""
    """Why the counts stop short (a huge or hostile file), or empty."""
    mappings: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_node.values())

    @property
    def remote(self) -> int:
        """Bytes on nodes none of its CPUs belong to."""
        return sum(b for n, b in self.by_node.items() if n not in self.local_nodes)

    @property
    def remote_share(self) -> float:
        return self.remote / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "bytes_by_node": {str(n): b for n, b in sorted(self.by_node.items())},
            "total_bytes": self.total,
            "local_nodes": sorted(self.local_nodes),
            "remote_bytes": self.remote,
            "remote_share": round(self.remote_share, 4),
            "partial": self.partial or None,
            "advice": self.advice() or None,
        }

    def advice(self, threshold: float = 0.1) -> str:
        """What to do when at least ``threshold`` of the memory is remote;
        empty otherwise."""
        if not self.local_nodes or self.remote_share < threshold:
            return ""
        far = sorted(n for n in self.by_node if n not in self.local_nodes and self.by_node[n])
        near = ",".join(map(str, sorted(self.local_nodes)))
        return (
            f"{self.remote_share:.0%} of its memory lies on node(s) "
            f"{','.join(map(str, far))}, away from the CPUs it runs on (node {near}): bind it "
            f"before it allocates (cpupin exec --node {min(self.local_nodes)}, or "
            "cpupin.bind_process() first thing in the worker)"
        )


def parse_numa_maps(lines: Iterable[bytes]) -> tuple[dict[int, int], int, str]:
    """Bytes per node over ``numa_maps`` lines, the mappings counted, and
    why it stopped short (empty when it did not). Pure; never raises: a
    line that is not one is skipped."""
    by_node: dict[int, int] = {}
    mappings = 0
    for line in lines:
        if mappings >= MAX_LINES:
            return by_node, mappings, f"more than {MAX_LINES} mappings: the rest not counted"
        mappings += 1
        _add(line, by_node)
    return by_node, mappings, ""


def _add(line: bytes, by_node: dict[int, int]) -> None:
    page_kb = 4
    counts = []
    for word in line.split()[1:]:
        if word[:1] == b"N":
            m = _NODE.match(word)
            if m and int(m.group(1)) <= MAX_NODE and int(m.group(2)) <= _MAX_PAGES:
                counts.append((int(m.group(1)), int(m.group(2))))
        elif word[:1] == b"k":
            m = _PAGE.match(word)
            if m and 0 < int(m.group(1)) <= MAX_PAGE_KB:
                page_kb = int(m.group(1))
    for node, pages in counts:
        by_node[node] = by_node.get(node, 0) + pages * page_kb * 1024


def _lines(fd: int, limit: int) -> Iterator[bytes]:
    rest = b""
    read = 0
    while read < limit:
        chunk = os.read(fd, min(1 << 20, limit - read))
        if not chunk:
            break
        read += len(chunk)
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        if len(rest) > 1 << 16:  # no line of numa_maps is this long: cut it
            rest = b""
        yield from parts
    if rest:
        yield rest


def memory_by_node(
    pid: int | None = None,
    *,
    root: str = "/",
    node_cpus: dict[int, frozenset[int]] | None = None,
    mask: frozenset[int] | None = None,
) -> NodeMemory:
    """A process's (``None``: this one) resident memory per node, with the
    nodes of ``mask`` (its CPUs) as the local ones, given ``node_cpus``
    (node to CPUs; read from ``root`` when not given). Raises
    ``ProcessLookupError`` for a process that is gone, ``OSError`` where
    ``numa_maps`` cannot be read (another user's process, a kernel without
    NUMA)."""
    target = "self" if pid is None else str(as_pid(pid))
    with Reader(root) as r:
        if node_cpus is None:
            node_cpus = r.node_cpus()
        fd = r.open_file(f"proc/{target}/numa_maps")
        if fd is None:
            if not r.is_dir(f"proc/{target}"):
                raise ProcessLookupError(f"pid {target}: no such process")
            why = r.reasons[-1] if r.reasons else "no numa_maps (a kernel without NUMA)"
            raise OSError(f"pid {target}: {why}")
    try:
        by_node, mappings, partial = parse_numa_maps(_lines(fd, MAX_BYTES))
        if not partial and os.read(fd, 1):
            partial = f"longer than {MAX_BYTES >> 20} MiB: the rest not counted"
    except OSError as exc:
        raise OSError(f"pid {target}: numa_maps: {exc.strerror}") from None
    finally:
        os.close(fd)
    local = frozenset(n for n, cpus in node_cpus.items() if mask is None or cpus & mask)
    return NodeMemory(by_node, local, partial, mappings)


def memory_summary(pid: int | None, mask: frozenset[int] | None) -> dict[str, object] | None:
    """:meth:`NodeMemory.as_dict` of a process on its ``mask``, or ``None``
    where its ``numa_maps`` cannot be read (gone, another user's, no NUMA)."""
    try:
        return memory_by_node(pid, mask=mask).as_dict()
    except OSError:
        return None
