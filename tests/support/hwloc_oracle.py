"""hwloc's own answer for a capture: its cores and NUMA nodes, parsed from the
``.console`` (``lstopo`` text) or ``.xml`` beside the capture. The oracle for
the topology reader; written without any of cpupin's code."""

import re
import xml.etree.ElementTree as ET

_KIND = re.compile(r"^(\s*)([A-Za-z0-9]+)")
_NUMBER = re.compile(r"\(P#(\d+)")


def _bitmap(text):
    """hwloc's bitmap: comma-separated 0x words, most significant first; an
    empty word (``0x1,,,0x2``) is a zero one."""
    value = 0
    for word in text.split(","):
        value = (value << 32) | (int(word, 16) if word else 0)
    return {i for i in range(value.bit_length()) if value >> i & 1}


def _rows(text):
    """The lstopo text's objects, in order: (indent, kind, P# number)."""
    rows = []
    for line in text.splitlines():
        if re.match(r"^\s*(depth \d+:|Special depth)", line):
            break
        kind = _KIND.match(line)
        if kind is None:
            continue
        number = _NUMBER.search(line)
        rows.append((len(kind.group(1)), kind.group(2), int(number.group(1)) if number else None))
    return rows


def _pus_under(rows, i):
    """The PU numbers of the objects nested under row ``i``."""
    indent = rows[i][0]
    pus = set()
    for deeper_indent, kind, number in rows[i + 1 :]:
        if deeper_indent <= indent:
            break
        if kind == "PU":
            pus.add(number)
    return pus


def from_console(text):
    """(cores, nodes): cores a set of frozensets of PU numbers, nodes a dict
    of node number to its PUs (those of the object the node hangs under)."""
    rows = _rows(text)
    pus_under = [_pus_under(rows, i) for i in range(len(rows))]
    cores = {frozenset(pus_under[i]) for i, row in enumerate(rows) if row[1] == "Core"}
    nodes = {}
    for i, (indent, kind, number) in enumerate(rows):
        if kind != "NUMANode":
            continue
        # A node hangs under the object whose CPUs it serves, perhaps through
        # a memory-side cache, which has no PUs of its own.
        parent, depth = i, indent
        while True:
            parent = next(j for j in range(parent - 1, -1, -1) if rows[j][0] < depth)
            depth = rows[parent][0]
            if pus_under[parent] or rows[parent][1] != "MemCache":
                break
        nodes[number] = frozenset(pus_under[parent])
    pus = {number for _, kind, number in rows if kind == "PU"}
    return cores, nodes, pus


def from_xml(text):
    root = ET.fromstring(text)
    cores = set()
    pus = set()
    nodes = {}
    for obj in root.iter("object"):
        kind = obj.get("type")
        if kind == "Core":
            cores.add(
                frozenset(
                    int(pu.get("os_index")) for pu in obj.iter("object") if pu.get("type") == "PU"
                )
            )
        elif kind == "PU":
            pus.add(int(obj.get("os_index")))
        elif kind == "NUMANode":
            nodes[int(obj.get("os_index"))] = frozenset(_bitmap(obj.get("cpuset")))
    return cores, nodes, pus


def caches_from_console(text):
    """The PUs under each cache object of the highest level that hwloc shows
    (``L3Cache``, else ``L2Cache``...), as a set of frozensets."""
    rows = _rows(text)
    levels = [int(kind[1]) for _, kind, _ in rows if re.fullmatch(r"L\d(d|u)?Cache", kind)]
    if not levels:
        return set()
    top = f"L{max(levels)}"
    out = set()
    for i, (_, kind, _) in enumerate(rows):
        if kind.startswith(top) and not kind.endswith("iCache"):
            out.add(frozenset(_pus_under(rows, i)))
    return out


def kinds_from_console(text):
    """hwloc's CPU kinds: the PUs of the cores of each ``cpukind=N``, most
    efficient (highest N) first."""
    kinds = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^\s*(depth \d+:|Special depth)", line):
            break
        m = re.search(r"Core L#\d+ \(P#\d+ cpukind=(\d+)", line)
        if m:
            current = int(m.group(1))
            continue
        if "PU L#" in line and current is not None:
            kinds.setdefault(current, set()).add(int(_NUMBER.search(line).group(1)))
        elif "Core L#" in line:
            current = None
    return [frozenset(kinds[k]) for k in sorted(kinds, reverse=True)]


def caches_from_xml(text):
    root = ET.fromstring(text)
    caches = {}
    for obj in root.iter("object"):
        kind = obj.get("type", "")
        if re.fullmatch(r"L\dCache", kind) and obj.get("cache_type") != "2":
            caches.setdefault(int(kind[1]), set()).add(frozenset(_bitmap(obj.get("cpuset"))))
    return caches[max(caches)] if caches else set()


def kinds_from_xml(text):
    """hwloc's CPU kinds, most efficient first: hwloc lists them from the
    least efficient up, with an efficiency where it knows one."""
    root = ET.fromstring(text)
    kinds = [
        (int(k.get("forced_efficiency", k.get("efficiency", "0"))), i, _bitmap(k.get("cpuset")))
        for i, k in enumerate(root.iter("cpukind"))
    ]
    return [frozenset(cpus) for _, _, cpus in sorted(kinds, key=lambda k: k[:2], reverse=True)]
