"""Steering device interrupts off the CPUs that step and result threads use.

:func:`plan_moves` (pure) takes the IRQs that may land on those CPUs
(:func:`cpupin.host.irqs.read_irqs`) and gives each movable one a new
``smp_affinity_list``: its CPUs less the ones to keep clear, else its NUMA
node's, else every online CPU's; a managed IRQ (the kernel spreads a
multi-queue device and refuses the write with ``EIO``) is left, with a
reason. :func:`apply_moves` writes them (root), records what each IRQ had
in the lock directory, and :func:`restore_moves` puts back each one whose
affinity is still the one written. irqbalance, where it runs, would move
them again: :func:`cpupin.host.irqs.irqbalance_advice` gives the setting that
keeps it off those CPUs.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cpupin.cpulist import format_cpulist, parse_cpulist
from cpupin.errors import excerpt, printable
from cpupin.host._sysfs import Reader
from cpupin.host.irqs import IrqOnPin
from cpupin.registry._record import VERSION, encode, lock_dir, open_lock_dir

__all__ = ["MOVES_FILE", "IrqMove", "apply_moves", "plan_moves", "restore_moves"]

#: The file in the lock directory that records the IRQs moved, and from where.
MOVES_FILE = "cpupin-irq-moves.json"
#: The most IRQs one record holds.
MAX_MOVES = 4096


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


def _boot_id(root: str) -> str:
    with Reader(root) as r:
        text = r.text("proc/sys/kernel/random/boot_id", 64) or ""
    text = text.strip()
    return text if len(text) <= 40 and all(c in "0123456789abcdef-" for c in text) else ""


def apply_moves(
    moves: Iterable[IrqMove], *, root: str = "/", directory: str | None = None
) -> tuple[list[IrqMove], list[str]]:
    """Write each planned move, and record what each IRQ had (in
    ``directory``'s :data:`MOVES_FILE`, added to what an earlier run moved).
    Returns the moves made and a line for each left, with why (``EIO``: the
    kernel manages it; ``EACCES``: root only)."""
    done: list[IrqMove] = []
    notes: list[str] = []
    with Reader(root) as r:
        for m in moves:
            if m.after is None:
                notes.append(f"IRQ {m.irq} ({m.name}) left: {m.reason}")
                continue
            try:
                r.write(f"proc/irq/{m.irq}/smp_affinity_list", format_cpulist(m.after))
            except OSError as exc:
                if exc.errno == errno.EIO:
                    why = "the kernel refused it (EIO): a managed IRQ, it cannot move"
                elif exc.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
                    why = f"not permitted ({exc.strerror}): moving IRQs needs root"
                elif exc.errno in (errno.EACCES, errno.EPERM):
                    why = (
                        f"the kernel refused it ({exc.strerror}): its chip or driver fixes "
                        "its affinity"
                    )
                else:
                    why = printable(str(exc.strerror or exc), 160)
                notes.append(f"IRQ {m.irq} ({m.name}) left: {why}")
                continue
            done.append(m)
    if done:
        _record(done, root, directory)
    return done, notes


def _record(done: list[IrqMove], root: str, directory: str | None) -> None:
    where = lock_dir(directory)
    old = _read(where, root)[0]
    kept = {e["irq"]: e for e in old}
    for m in done:
        # An IRQ moved twice goes back to what it had before the first move.
        first = kept.get(m.irq, {"before": format_cpulist(m.before)})
        kept[m.irq] = {
            "irq": m.irq,
            "before": first["before"],
            "after": format_cpulist(m.after or ()),
        }
    body = encode(
        {
            "boot_id": _boot_id(root),
            "root": os.path.abspath(root),
            "time": round(time.time(), 3),
            "moves": list(kept.values())[:MAX_MOVES],
            "version": VERSION,
        },
        None,
    )
    dir_fd = open_lock_dir(where)
    try:
        tmp = f"cpupin-tmp-{os.getpid()}-{os.urandom(8).hex()}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, MOVES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _read(where: str, root: str) -> tuple[list[dict[str, str]], str]:
    """The moves recorded in ``where`` (hostile, opened and checked as a
    registry record is: regular, one link, bounded, this user's, its
    checksum), and why none where there are none."""
    from cpupin.registry._files import decode_file, open_record, reason

    try:
        dir_fd = open_lock_dir(where)
    except OSError as exc:
        return [], f"{where}: {exc.strerror}"
    try:
        fd, info = open_record(dir_fd, MOVES_FILE)
    except FileNotFoundError:
        return [], "no IRQ moved by cpupin is recorded there"
    except (OSError, ValueError) as exc:
        return [], f"{MOVES_FILE}: {reason(exc)}"
    finally:
        os.close(dir_fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        return [], f"{MOVES_FILE}: owned by uid {info.st_uid}, not this user"
    try:
        record = decode_file(fd)
    except (OSError, ValueError) as exc:
        return [], f"{MOVES_FILE}: {excerpt(reason(exc), 80)}"
    if record is None:
        return [], f"{MOVES_FILE}: empty"
    if record.get("boot_id") != _boot_id(root):
        return [], f"{MOVES_FILE} was written before the last boot: its IRQs are as booted"
    moves = record.get("moves")
    if not isinstance(moves, list) or len(moves) > MAX_MOVES:
        return [], f"{MOVES_FILE}: moves is not a list"
    out = []
    for e in moves:
        if (
            isinstance(e, dict)
            and isinstance(e.get("irq"), str)
            and e["irq"].isdigit()
            and len(e["irq"]) <= 6
            and isinstance(e.get("before"), str)
            and isinstance(e.get("after"), str)
        ):
            out.append({"irq": e["irq"], "before": e["before"], "after": e["after"]})
    return out, ""


def restore_moves(*, root: str = "/", directory: str | None = None) -> list[str]:
    """Put back each IRQ that cpupin moved (this boot), where its affinity
    is still what cpupin wrote; a line for each, and the record goes once
    nothing is left to put back."""
    where = lock_dir(directory)
    moves, why = _read(where, root)
    if not moves:
        return [why]
    lines = []
    with Reader(root) as r:
        for e in moves:
            rel = f"proc/irq/{e['irq']}/smp_affinity_list"
            try:
                before, after = parse_cpulist(e["before"]), parse_cpulist(e["after"])
            except ValueError:
                lines.append(f"IRQ {e['irq']}: its record is not a CPU list; left")
                continue
            now = r.cpus(rel)
            if now is None:
                lines.append(f"IRQ {e['irq']}: gone (its device removed?); nothing put back")
                continue
            if now != after:
                lines.append(
                    f"IRQ {e['irq']}: changed since ({format_cpulist(now)}, not "
                    f"{format_cpulist(after)}): left as it is"
                )
                continue
            try:
                r.write(rel, format_cpulist(before))
            except OSError as exc:
                lines.append(f"IRQ {e['irq']}: cannot put back: {exc.strerror}")
                continue
            lines.append(f"IRQ {e['irq']}: back on {format_cpulist(before)}")
    dir_fd = open_lock_dir(where)
    try:
        os.unlink(MOVES_FILE, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return lines
