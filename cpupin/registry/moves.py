"""The IRQ journal's entries (:mod:`cpupin.registry.journal`): what each IRQ
cpupin moved had, what it was given, and, while the move is in flight, the
process making it. Checked as hostile input; shown by ``cpupin ps``."""

from __future__ import annotations

from typing import NamedTuple

from cpupin.host._proc import exited
from cpupin.registry.journal import journals, read_journal

__all__ = ["IrqEntry", "irq_entries", "still_moved"]

#: The most IRQs a journal names: more than any host has (16,384 at least).
MAX_IRQS = 65536
#: The longest CPU list an entry holds (every CPU of a large host, one by one).
MAX_LIST = 32768


class IrqEntry(NamedTuple):
    before: str
    """Its ``smp_affinity_list`` before cpupin's first move."""
    after: str
    """What cpupin wrote."""
    owner: tuple[int, int] | None
    """(pid, start time) of the apply making it; ``None`` once it is done."""
    since: float

    def as_entry(self) -> dict[str, object]:
        return {
            "before": self.before,
            "after": self.after,
            "owner": list(self.owner) if self.owner else None,
            "since": self.since,
        }


def _cpu_text(value: object) -> str | None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LIST:
        return None
    return value if all(c in "0123456789,-" for c in value) else None


def irq_entries(raw: dict[str, dict[str, object]]) -> dict[str, IrqEntry]:
    """The journal's well-formed entries, by IRQ number."""
    out: dict[str, IrqEntry] = {}
    for irq, e in list(raw.items())[:MAX_IRQS]:
        if not (irq.isascii() and irq.isdigit() and len(irq) <= 6):
            continue
        before, after = _cpu_text(e.get("before")), _cpu_text(e.get("after"))
        owner, since = e.get("owner"), e.get("since")
        if before is None or after is None or type(since) not in (int, float):
            continue
        assert isinstance(since, (int, float))
        if owner is not None:
            if (
                not isinstance(owner, list)
                or len(owner) != 2
                or not all(type(v) is int and 0 < v < 1 << 62 for v in owner)
            ):
                continue
            owner = (owner[0], owner[1])
        out[irq] = IrqEntry(before, after, owner, float(since))
    return out


def still_moved(directory: str | None = None) -> list[dict[str, object]]:
    """Every IRQ the journals say cpupin moved and has not put back, as
    ``cpupin ps`` shows them: those of an apply that died half way
    (``cpupin ps --prune`` puts them back), and those of a finished apply
    (``cpupin irqs --restore`` does)."""
    out: list[dict[str, object]] = []
    for root in journals("irq", directory):
        raw, _ = read_journal("irq", root, directory)
        for irq, e in sorted(irq_entries(raw).items(), key=lambda kv: int(kv[0])):
            dead = e.owner is not None and exited(*e.owner)
            out.append(
                {
                    "kind": "irq",
                    "root": root,
                    "irq": int(irq),
                    "before": e.before,
                    "after": e.after,
                    "since": e.since,
                    "owner_pid": e.owner[0] if e.owner else None,
                    "undo": "cpupin ps --prune" if dead else "cpupin irqs --restore",
                    "what": f"IRQ {irq} on {e.after}, was {e.before}"
                    + (
                        f" (moved by pid {e.owner[0]}, which died mid-apply)"
                        if dead and e.owner
                        else ""
                    ),
                }
            )
    return out
