"""Steering device interrupts off the CPUs that step and result threads use.

:func:`plan_moves` (pure) takes the IRQs that may land on those CPUs
(:func:`cpupin.host.irqs.read_irqs`) and gives each movable one a new
``smp_affinity_list``: its CPUs less the ones to keep clear, else its NUMA
node's, else every online CPU's; a managed IRQ (the kernel spreads a
multi-queue device and refuses the write with ``EIO``) is left, with a
reason. :func:`apply_moves` writes them (root) as a transaction, each
journaled before it is written (:mod:`cpupin.registry.journal`), and
:func:`restore_moves` puts back each one whose affinity is still the one
written. irqbalance, where it runs, would move
them again: :func:`cpupin.host.irqs.irqbalance_advice` gives the setting that
keeps it off those CPUs.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cpupin.cpulist import format_cpulist, parse_cpulist
from cpupin.errors import printable
from cpupin.host._proc import exited, own_start
from cpupin.host._sysfs import Reader
from cpupin.host.irqs import IrqOnPin
from cpupin.registry.journal import locked
from cpupin.registry.moves import IrqEntry, irq_entries

__all__ = ["IrqMove", "apply_moves", "plan_moves", "restore_moves"]


@dataclass(frozen=True)
class IrqMove:
    """What to do with one IRQ that may land on a CPU to keep clear."""

    irq: str
    name: str
    kind: str
    before: frozenset[int]
    """Its ``smp_affinity_list`` now."""
    after: frozenset[int] | None
    """What to write; ``None``: left where it is (see :attr:`reason`)."""
    reason: str
    """Where ``after`` came from, or why it is left."""

    def as_dict(self) -> dict[str, object]:
        return {
            "irq": self.irq,
            "name": self.name,
            "kind": self.kind,
            "before": sorted(self.before),
            "before_list": format_cpulist(self.before),
            "after": None if self.after is None else sorted(self.after),
            "after_list": None if self.after is None else format_cpulist(self.after),
            "reason": self.reason,
        }


def plan_moves(
    irqs: Iterable[IrqOnPin],
    keep_clear: frozenset[int],
    smp: dict[str, frozenset[int]],
    node_cpus: dict[str, frozenset[int]],
    online: frozenset[int],
) -> list[IrqMove]:
    """A move for each IRQ of ``irqs`` (those that may land on
    ``keep_clear``): ``smp`` is each IRQ's ``smp_affinity_list``,
    ``node_cpus`` the CPUs of its device's node where known. Pure."""
    moves = []
    for i in irqs:
        before = smp.get(i.irq, i.cpus)
        after, reason = _destination(i.managed, before, node_cpus.get(i.irq), online, keep_clear)
        moves.append(IrqMove(i.irq, i.name, i.kind, before, after, reason))
    return moves


def _destination(
    managed: bool,
    before: frozenset[int],
    node: frozenset[int] | None,
    online: frozenset[int],
    keep_clear: frozenset[int],
) -> tuple[frozenset[int] | None, str]:
    """Where one IRQ goes, and why (``None``: it stays)."""
    if managed:
        return None, (
            "managed by the kernel (a multi-queue device's queue): it cannot move; boot with "
            f"isolcpus=managed_irq,{format_cpulist(keep_clear)} to keep such queues off"
        )
    for where, cpus in (
        ("its CPUs", before),
        ("its device's node", node or frozenset()),
        ("the online CPUs", online),
    ):
        if cpus - keep_clear:
            return cpus - keep_clear, f"{where} less the kept"
    return None, "every online CPU is one to keep clear: nowhere else to go"


def read_context(
    root: str, irqs: Iterable[IrqOnPin]
) -> tuple[dict[str, frozenset[int]], dict[str, frozenset[int]], frozenset[int]]:
    """Each IRQ's ``smp_affinity_list``, its device node's CPUs, and the
    online CPUs, read under ``root`` (what :func:`plan_moves` needs)."""
    smp: dict[str, frozenset[int]] = {}
    nodes: dict[str, frozenset[int]] = {}
    with Reader(root) as r:
        online = r.cpus("sys/devices/system/cpu/online") or frozenset()
        node_cpus = r.node_cpus()
        for i in irqs:
            cpus = r.cpus(f"proc/irq/{i.irq}/smp_affinity_list")
            if cpus:
                smp[i.irq] = cpus
            node = r.integer(f"proc/irq/{i.irq}/node", -1, 4095)
            if node is not None and node in node_cpus:
                nodes[i.irq] = node_cpus[node]
    return smp, nodes, online


def _refusal(exc: OSError) -> str:
    if exc.errno == errno.EIO:
        return "the kernel refused it (EIO): a managed IRQ, it cannot move"
    if exc.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
        return f"not permitted ({exc.strerror}): moving IRQs needs root"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"the kernel refused it ({exc.strerror}): its chip or driver fixes its affinity"
    return printable(str(exc.strerror or exc), 160)


def apply_moves(
    moves: Iterable[IrqMove], *, root: str = "/", directory: str | None = None
) -> tuple[list[IrqMove], list[str]]:
    """Write each planned move as a transaction: under the IRQ journal's
    lock, every move is journaled (what the IRQ had, what it gets, and
    this process as the one making it) before the first write; then the
    writes; then each move made is journaled as done (kept until
    :func:`restore_moves`) and each refused is dropped. A process killed
    between any two steps leaves its moves named in the journal, with the
    value to put back (``cpupin ps`` shows them, ``ps --prune`` and
    ``irqs --restore`` put them back). Returns the moves made and a line for
    each left, with why (``EIO``: the kernel manages it; ``EACCES``: root
    only). :class:`ValueError` before any write when the journal would
    outgrow what a reader reads; ``OSError`` when it cannot be written."""
    wanted = list(moves)
    notes = [f"IRQ {m.irq} ({m.name}) left: {m.reason}" for m in wanted if m.after is None]
    wanted = [m for m in wanted if m.after is not None]
    done: list[IrqMove] = []
    if not wanted:
        return done, notes
    owner = (os.getpid(), own_start())
    with locked("irq", root, directory) as journal:
        found = irq_entries(journal.entries)
        kept = dict(found)
        now = round(time.time(), 3)
        for m in wanted:
            # An IRQ moved twice goes back to what it had before the first move.
            first = found.get(m.irq)
            kept[m.irq] = IrqEntry(
                first.before if first else format_cpulist(m.before),
                format_cpulist(m.after or ()),
                owner,
                first.since if first else now,
            )
        journal.entries = {k: e.as_entry() for k, e in sorted(kept.items(), key=_by_number)}
        journal.save(journal.encoded())  # ValueError, before anything is moved
        if checkpoint is not None:
            checkpoint("journaled")
        with Reader(root) as r:
            for m in wanted:
                try:
                    r.write(f"proc/irq/{m.irq}/smp_affinity_list", format_cpulist(m.after or ()))
                except OSError as exc:
                    notes.append(f"IRQ {m.irq} ({m.name}) left: {_refusal(exc)}")
                    if m.irq in found:
                        kept[m.irq] = found[m.irq]  # as it was: moved by an earlier run
                    else:
                        del kept[m.irq]
                    continue
                done.append(m)
                if checkpoint is not None:
                    checkpoint(f"IRQ {m.irq}")
        for m in done:
            kept[m.irq] = kept[m.irq]._replace(owner=None)
        journal.entries = {k: e.as_entry() for k, e in sorted(kept.items(), key=_by_number)}
        journal.save()
    return done, notes


#: Called at each step of :func:`apply_moves` (tests kill the process there).
checkpoint: Callable[[str], None] | None = None


def _by_number(item: tuple[str, object]) -> int:
    return int(item[0])


def restore_moves(
    *, root: str = "/", directory: str | None = None, dead_only: bool = False
) -> list[str]:
    """Put back each IRQ that cpupin moved (this boot), where its affinity
    is still what cpupin wrote: a line for each. Each entry stays in the
    journal until its IRQ is back (a write refused keeps it, and says so);
    one whose IRQ is gone, or was moved since by someone else, goes with a
    line. ``dead_only``: only the moves of an apply whose process died
    before it finished (``cpupin ps --prune``)."""
    try:
        with locked("irq", root, directory) as journal:
            found = irq_entries(journal.entries)
            if not found:
                if dead_only:
                    return []
                return [journal.why_empty or "no IRQ moved by cpupin is recorded there"]
            lines: list[str] = []
            kept = dict(found)
            with Reader(root) as r:
                for irq, e in sorted(found.items(), key=_by_number):
                    if dead_only and (e.owner is None or not exited(*e.owner)):
                        continue
                    line, keep = _put_back(r, irq, e)
                    lines.append(line)
                    if not keep:
                        del kept[irq]
            journal.entries = {k: e.as_entry() for k, e in sorted(kept.items(), key=_by_number)}
            journal.save()
    except OSError as exc:
        return [f"the IRQ journal: {exc.strerror or exc}"]
    if kept and not dead_only:
        lines.append(
            f"{len(kept)} IRQ(s) still recorded as moved: cpupin irqs --restore tries them again"
        )
    return lines


def _put_back(r: Reader, irq: str, e: IrqEntry) -> tuple[str, bool]:
    """Put one IRQ back; its line, and whether its entry stays."""
    rel = f"proc/irq/{irq}/smp_affinity_list"
    try:
        before, after = parse_cpulist(e.before), parse_cpulist(e.after)
    except ValueError:
        return f"IRQ {irq}: its record is not a CPU list; left", False
    now = r.cpus(rel)
    if now is None:
        return f"IRQ {irq}: gone (its device removed?); nothing put back", False
    if now == before:
        return f"IRQ {irq}: on {format_cpulist(before)} already", False
    if now != after:
        return (
            f"IRQ {irq}: changed since ({format_cpulist(now)}, not {format_cpulist(after)}): "
            "left as it is",
            False,
        )
    try:
        r.write(rel, format_cpulist(before))
    except OSError as exc:
        return f"IRQ {irq}: cannot put back on {format_cpulist(before)}: {_refusal(exc)}", True
    return f"IRQ {irq}: back on {format_cpulist(before)}", False
