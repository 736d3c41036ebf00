"""Wake-latency holds through sysfs as shared state of the host.

A CPU's ``pm_qos_resume_latency_us`` has one value, and it outlives the
process that wrote it. So the holds on a CPU share one entry in the wake
journal (:mod:`cpupin.registry.journal`): the value the host had before
the first hold (``original``, kept by whoever holds first and handed on),
each holder (pid, start time, its bound), and every value cpupin wrote
while the entry lived. While any holder lives the CPU holds the strictest
bound among the live ones; when the last lets go, or dies, the CPU goes
back to ``original`` (where it still holds a value cpupin wrote: a value
someone else set since is left, and said).

Every step is journaled before the write it stands for, under the
journal's lock, so a holder killed at any point leaves an entry that the
next one to take the lock (another hold, a release, ``cpupin ps --prune``)
settles: a dead holder counts for nothing, and a CPU with no live holder
goes back."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cpupin.errors import excerpt, printable
from cpupin.host._pmqos import MAX_US, SYSFS, format_resume_latency, parse_resume_latency, why
from cpupin.host._proc import exited, own_start
from cpupin.host._sysfs import Reader
from cpupin.registry.journal import Journal, journals, locked, read_journal

__all__ = [
    "Holder",
    "dead_holds",
    "settle",
    "settle_all",
    "settle_root",
    "still_applied",
    "strictest",
]

#: The most holders one CPU's entry keeps, and the most values it remembers.
MAX_HOLDERS = 64
MAX_VALUES = 32

#: Called at each step of a settle: ``journaled`` after the journal is
#: written, ``CPU N`` after each write to a CPU's file (tests kill the
#: process there).
checkpoint: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Holder:
    pid: int
    start: int
    hold: int
    """Which of its process's holds (a process may hold a CPU twice)."""
    max_us: int
    since: float

    def as_entry(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "start": self.start,
            "hold": self.hold,
            "max_us": self.max_us,
            "since": self.since,
        }

    @property
    def alive(self) -> bool:
        return not exited(self.pid, self.start)


def _holder(value: object) -> Holder | None:
    if not isinstance(value, dict):
        return None
    pid, start, hold = value.get("pid"), value.get("start"), value.get("hold")
    max_us, since = value.get("max_us"), value.get("since")
    if not all(type(v) is int for v in (pid, start, hold, max_us)):
        return None
    assert isinstance(pid, int) and isinstance(start, int) and isinstance(hold, int)
    assert isinstance(max_us, int)
    if not (0 < pid < 1 << 22 and 0 <= start < 1 << 62 and 0 <= hold < 1 << 62):
        return None
    if not 0 <= max_us <= MAX_US or type(since) not in (int, float):
        return None
    assert isinstance(since, (int, float))
    return Holder(pid, start, hold, max_us, float(since))


@dataclass
class Entry:
    """One CPU's shared state, checked."""

    original: str
    holders: list[Holder]
    values: list[str]

    def as_entry(self) -> dict[str, object]:
        return {
            "original": self.original,
            "holders": [h.as_entry() for h in self.holders],
            "values": self.values[-MAX_VALUES:],
        }

    def wrote(self, value: str) -> None:
        if value not in self.values:
            self.values.append(value)
            del self.values[:-MAX_VALUES]


def _valid_value(text: object) -> str | None:
    if not isinstance(text, str) or len(text) > 16:
        return None
    try:
        parse_resume_latency(text)
    except ValueError:
        return None
    return text


def entries(raw: dict[str, dict[str, object]]) -> dict[int, Entry]:
    """The journal's entries that are well formed, by CPU."""
    out: dict[int, Entry] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 5):
            continue
        original = _valid_value(value.get("original"))
        holders = value.get("holders")
        values = value.get("values")
        if original is None or not isinstance(holders, list) or not isinstance(values, list):
            continue
        checked = [h for h in map(_holder, holders[:MAX_HOLDERS]) if h is not None]
        kept = [v for v in map(_valid_value, values[:MAX_VALUES]) if v is not None]
        out[int(key)] = Entry(original, checked, kept)
    return out


def strictest(holders: Iterable[Holder]) -> str | None:
    """The value the live ``holders`` call for (the strictest bound), or
    ``None`` with none."""
    bounds = [h.max_us for h in holders]
    return format_resume_latency(min(bounds)) if bounds else None


def _store(journal: Journal, found: dict[int, Entry]) -> None:
    journal.entries = {str(c): e.as_entry() for c, e in sorted(found.items())}
    journal.save()
    if checkpoint is not None:
        checkpoint("journaled")


def _write(r: Reader, cpu: int, value: str) -> None:
    r.write(SYSFS.format(cpu), value)
    if checkpoint is not None:
        checkpoint(f"CPU {cpu}")


def _put_back(r: Reader, cpu: int, entry: Entry, notes: list[str]) -> None:
    """Give ``cpu`` its original value where it holds one cpupin wrote."""
    now = r.text(SYSFS.format(cpu), 32)
    if now is None:
        notes.append(f"CPU {cpu}: its resume latency is gone (offline?): nothing put back")
        return
    now = now.strip()
    if now == entry.original:
        return
    if now not in entry.values:
        notes.append(
            f"CPU {cpu}: changed since the hold (now {excerpt(now, 12)}, not a value cpupin "
            f"wrote): left as it is, not {entry.original}"
        )
        return
    try:
        _write(r, cpu, entry.original)
    except OSError as exc:
        notes.append(f"CPU {cpu}: {why(exc, 'cannot put back ' + entry.original)}")
        raise


def _apply(r: Reader, cpu: int, entry: Entry, notes: list[str]) -> None:
    """Give ``cpu`` what its live holders call for (journaled already)."""
    value = strictest(entry.holders)
    assert value is not None
    now = r.text(SYSFS.format(cpu), 32)
    if now is not None and now.strip() == value:
        return
    _write(r, cpu, value)


def settle(
    journal: Journal,
    r: Reader,
    *,
    leaving: tuple[int, int, int] | None = None,
    joining: Holder | None = None,
    cpus: frozenset[int] = frozenset(),
    read_original: Callable[[int], str] | None = None,
) -> tuple[list[str], list[int]]:
    """One step of the shared state, under ``journal``'s lock: ``leaving``
    (pid, start, hold) lets go of every CPU it holds, ``joining`` holds
    ``cpus`` (``read_original`` gives a CPU's value where no entry has one),
    and every dead holder is dropped. The new state is journaled first; then
    each CPU gets its live holders' strictest value, or its original when
    none is left (and its entry goes, journaled after). Returns notes, and
    the pids of the other live holders of ``cpus``. ``OSError`` from a write or
    from ``read_original`` leaves the journal naming what to undo: the
    caller lets go (``leaving``) in a second call."""
    found = entries(journal.entries)
    notes: list[str] = []
    others: set[int] = set()
    me = (os.getpid(), own_start())
    for entry in found.values():
        kept = []
        for h in entry.holders:
            if leaving is not None and (h.pid, h.start, h.hold) == leaving:
                continue
            if (h.pid, h.start) == me or h.alive:
                kept.append(h)
        entry.holders = kept
    if joining is not None:
        for cpu in sorted(cpus):
            if cpu not in found:
                assert read_original is not None
                found[cpu] = Entry(read_original(cpu), [], [])
            entry = found[cpu]
            others.update(h.pid for h in entry.holders)
            if len(entry.holders) >= MAX_HOLDERS:
                raise OSError(0, f"CPU {cpu} has {MAX_HOLDERS} holders already")
            entry.holders.append(joining)
    for entry in found.values():
        value = strictest(entry.holders)
        if value is not None:
            entry.wrote(value)
    _store(journal, found)  # the intent, before any write
    for cpu, entry in sorted(found.items()):
        if entry.holders:
            _apply(r, cpu, entry, notes)
    done = [cpu for cpu, entry in found.items() if not entry.holders]
    for cpu in sorted(done):
        try:
            _put_back(r, cpu, found[cpu], notes)
        except OSError:
            continue  # its entry stays, to be put back later
        del found[cpu]
    if done:
        _store(journal, found)
    return notes, sorted(others)


def settle_all(directory: str | None = None) -> list[str]:
    """Settle every wake journal in the lock directory (``cpupin ps
    --prune``): CPUs whose holders all died go back to their original
    values. A line for each CPU put back, and for each that could not be."""
    lines: list[str] = []
    for root in journals("wake", directory):
        if root != "/" and not os.path.isdir(root):
            continue
        lines += settle_root(root, directory)
    return lines


def settle_root(root: str, directory: str | None = None) -> list[str]:
    """Settle the wake journal of ``root`` (what :func:`settle_all` does for
    each): a line for each CPU put back, and for each that could not be."""
    lines: list[str] = []
    try:
        with locked("wake", root, directory) as journal:
            before = entries(journal.entries)
            dead = {
                cpu: sorted({h.pid for h in e.holders if not h.alive}) or None
                for cpu, e in before.items()
                if not any(h.alive for h in e.holders)
            }
            with Reader(root) as r:
                notes, _ = settle(journal, r)
            after = entries(journal.entries)
    except OSError as exc:
        return [f"wake journal of {root}: {exc.strerror or exc}"]
    back = sorted(c for c in dead if c not in after)
    for cpu in back:
        pids = dead[cpu]
        who = f"pid {', '.join(map(str, pids))}" if pids else "a holder that died"
        lines.append(
            f"{who}: wake latency of CPU {cpu} put back to {before[cpu].original}"
            + ("" if root == "/" else f" (under {root})")
        )
    return lines + notes


def still_applied(directory: str | None = None) -> list[dict[str, object]]:
    """The CPUs whose value cpupin changed and that no live holder holds
    (each holder died before it could let go), from every wake journal in
    the lock directory, as ``ps`` shows them; read without the lock."""
    out: list[dict[str, object]] = []
    for root in journals("wake", directory):
        raw, _ = read_journal("wake", root, directory)
        for cpu, entry in sorted(entries(raw).items()):
            if any(h.alive for h in entry.holders):
                continue
            who = ", ".join(f"pid {h.pid}" for h in entry.holders) or "a holder that let go"
            out.append(
                {
                    "kind": "wake",
                    "root": root,
                    "cpu": cpu,
                    "original": entry.original,
                    "holders": [
                        {"pid": h.pid, "start_time": h.start, "max_us": h.max_us}
                        for h in entry.holders
                    ],
                    "undo": "cpupin ps --prune",
                    "what": f"CPU {cpu}'s wake latency, held by {who} (exited); the host had "
                    f"{entry.original}",
                }
            )
    return out


def dead_holds(directory: str | None = None) -> dict[tuple[int, int], list[tuple[int, Holder]]]:
    """Each dead holder's holds that the wake journals still name, by
    (pid, start time): each CPU with the holder's entry on it."""
    out: dict[tuple[int, int], list[tuple[int, Holder]]] = {}
    for root in journals("wake", directory):
        raw, _ = read_journal("wake", root, directory)
        for cpu, entry in sorted(entries(raw).items()):
            for h in entry.holders:
                if not h.alive:
                    out.setdefault((h.pid, h.start), []).append((cpu, h))
    return out


def left_applied(online: Iterable[int], directory: str | None = None, root: str = "/") -> list[str]:
    """A line for each CPU of ``online`` whose PM QoS resume latency is not
    what the host had, with no live holder to answer for it (``cpupin
    doctor``): a value a dead holder left (the journal knows the host's,
    and ``cpupin ps --prune`` puts it back), or one set by something other
    than a live cpupin hold (the kernel's default is ``0``, no limit)."""
    raw, _ = read_journal("wake", root, directory)
    known = entries(raw)
    lines = []
    with Reader(root) as r:
        for cpu in sorted(online):
            text = r.text(SYSFS.format(cpu), 32)
            if text is None:
                continue
            now = text.strip()
            entry = known.get(cpu)
            if entry is not None:
                if any(h.alive for h in entry.holders) or now == entry.original:
                    continue
                who = ", ".join(f"pid {h.pid}" for h in entry.holders) or "a holder"
                lines.append(
                    f"CPU {cpu}'s wake latency is {printable(now, 12)}, not the host's "
                    f"{entry.original}: {who} held it and exited; cpupin ps --prune puts it back"
                )
            elif now != "0":
                lines.append(
                    f"CPU {cpu}'s wake latency is {printable(now, 12)} (pm_qos_resume_latency_us), "
                    "and no live cpupin hold answers for it: set by another tool or by hand; "
                    "write 0 to it where nothing should hold it"
                )
    return lines
