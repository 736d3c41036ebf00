"""How the commands print a census of pools and a cgroup's throttling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cpupin.errors import printable


def throttle_text(throttling: Mapping[str, object] | None) -> str:
    """One phrase: the time the cgroup's quota held it back, beside the CPU
    pressure, per second of the interval."""
    if not throttling:
        return "throttling unknown"
    parts = []
    throttled = throttling.get("throttled_ms_per_s")
    if throttled is None:
        parts.append("no quota")
    else:
        parts.append(
            f"throttled {throttled:.1f} ms/s by the quota "
            f"({throttling.get('throttled_periods')} of {throttling.get('periods')} periods)"
        )
    pressure = throttling.get("pressure_ms_per_s")
    if pressure is not None:
        parts.append(f"CPU pressure {pressure:.1f} ms/s")
    return ", ".join(parts)


def pool_lines(pools: Sequence[Mapping[str, object]], indent: str = "  ") -> list[str]:
    """A line for each pool of two or more threads, each configured pool and
    each pool that does not fit; one line counting the single threads."""
    lines = []
    single = 0
    guessed = False
    for p in pools:
        threads = p["threads"]
        assert isinstance(threads, int)
        if (
            threads < 2
            and p["kind"] == "threads"
            and p["verdict"] == "fits"
            and not p.get("spinning")
            and not p.get("library")
        ):
            single += 1
            continue
        stray = f", {p['stray']} inherited a pin" if p.get("stray") else ""
        stray += f", {p['idle']} idle" if p.get("idle") and p["verdict"] != "idle" else ""
        if p.get("runnable_cpus"):
            stray += f", wanting {p['runnable_cpus']:.2g} CPU(s)"
        stray += f", {p['spinning']} spinning" if p.get("spinning") else ""
        if p.get("library") or p.get("variable"):
            sized = ""
            if p.get("variable"):
                sized = printable(str(p["variable"]), 40)
                if p.get("setting") is not None:
                    sized += f" {printable(str(p['setting']), 24)}"
            where = printable(str(p["library"]), 40) if p.get("library") else ""
            stray += f" [{'; '.join(x for x in (where, sized) if x)}]"
        kind = " (configured)" if p["kind"] == "configured" else ""
        if p.get("guess"):
            kind = " (guessed)"
            guessed = True
        lines.append(
            f"{indent}{printable(str(p['name']), 40):40} {threads:>4} thread(s){kind}  "
            f"{p['verdict']}{stray}"
        )
        if p.get("remedy"):
            lines.append(f"{indent}  -> {p['remedy']}")
    if single:
        lines.append(f"{indent}and {single} thread(s) on their own")
    if guessed:
        lines.append(
            f"{indent}guessed: threads that only carry the name of the thread that started "
            "them, grouped by what they wait in [wchan]; a process that uses cpupin names "
            "its pools in its record"
        )
    return lines


def _size(n: object) -> str:
    """Bytes in the unit that keeps the figure under 1024 (TiB at most)."""
    value = float(n) if isinstance(n, (int, float)) else 0.0
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def memory_lines(memory: Mapping[str, object] | None, indent: str = "") -> list[str]:
    """Where the process's resident memory lies, node by node, and what to
    do when much of it is away from its CPUs."""
    if not memory:
        return [f"{indent}memory: numa_maps not readable (another user's process, or no NUMA)"]
    by_node = memory.get("bytes_by_node")
    total = memory.get("total_bytes")
    assert isinstance(by_node, dict) and isinstance(total, int)
    local = memory.get("local_nodes") or []
    assert isinstance(local, list)
    parts = [
        f"node {n} {_size(b)} ({b / total:.0%})" if total else f"node {n} {_size(b)}"
        for n, b in by_node.items()
    ]
    line = f"{indent}memory: {_size(total)} resident: {', '.join(parts) or 'none'}"
    line += f"; its CPUs are on node {','.join(map(str, local))}" if local else ""
    if memory.get("partial"):
        line += f" ({memory['partial']})"
    out = [line]
    if memory.get("advice"):
        out.append(f"{indent}  -> {memory['advice']}")
    return out
