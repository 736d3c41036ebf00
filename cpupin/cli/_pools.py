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
        if threads < 2 and p["kind"] == "threads" and p["verdict"] == "fits":
            single += 1
            continue
        stray = f", {p['stray']} inherited a pin" if p.get("stray") else ""
        stray += f", {p['idle']} idle" if p.get("idle") else ""
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
