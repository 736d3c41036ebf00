"""Holding the wake latency of CPUs: the seed's loss, a handoff that waits
for an idle core to leave a deep idle state, removed without pinning.

The kernel's idle governor puts a CPU into no state whose exit latency
exceeds what PM QoS allows it. Two ways to say so, both files:

- ``/sys/devices/system/cpu/cpuN/power/pm_qos_resume_latency_us``, a CPU at
  a time (root). ``n/a`` accepts no latency at all (the CPU polls when
  idle), a number accepts that many µs, ``0`` lifts the limit. The value
  outlives the process that wrote it, so holds on a CPU are shared state
  in the host's wake journal (:mod:`cpupin.registry.holds`): the value
  the host had, kept by the first holder and handed on, each holder, and
  the strictest live bound written; journaled before each write, under one
  lock. The CPU goes back to the host's value when the last live holder
  lets go: on release, at exit, or, for holders that died, at the next
  hold, release or ``cpupin ps --prune``.
- ``/dev/cpu_dma_latency``, every CPU at once: a request that lasts while
  the descriptor is open, so the kernel drops it however the holder exits.
  The descriptor is closed on exec and in a forked child: nothing this
  process starts keeps a request alive after it (``cpupin exec
  --wake-latency`` holds it in a process that waits for the command).

A held CPU that idles polls instead of sleeping: it burns power and, on a
host with SMT, its sibling's share of the core. Hold the step and result
CPUs only, where the doctor says the hold pays.
"""

from __future__ import annotations

import atexit
import errno
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

from cpupin import _native
from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt
from cpupin.host._pmqos import (
    MAX_US,
    SYSFS,
    format_resume_latency,
    parse_resume_latency,
    why,
)
from cpupin.host._proc import own_start
from cpupin.host._sysfs import Reader

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cpupin.registry.holds import Holder

__all__ = [
    "DMA_LATENCY",
    "MAX_US",
    "HoldRefused",
    "WakeHold",
    "format_resume_latency",
    "hold_wake_latency",
    "holds",
    "parse_resume_latency",
    "resume_latencies",
]

#: The device of the every-CPU request.
DMA_LATENCY = "/dev/cpu_dma_latency"
_CPUIDLE = "sys/devices/system/cpu/cpuidle/current_driver"


class HoldRefused(OSError):
    """A hold this host or this process cannot take; the message says why
    and what to do instead."""


def _checked_us(max_us: object) -> int:
    if type(max_us) is not int or not 0 <= max_us <= MAX_US:
        raise ValueError(
            f"max_us {excerpt(max_us)} is not a whole number of µs from 0 to {MAX_US}: "
            "0 accepts no wake latency at all (an idle CPU polls)"
        )
    return max_us


@dataclass
class WakeHold:
    """A hold on the wake latency of some CPUs; :meth:`release` (or leaving
    its ``with`` block, or the process's exit) ends it."""

    cpus: frozenset[int]
    """The CPUs held (every online CPU for ``/dev/cpu_dma_latency``)."""
    max_us: int
    mechanism: str
    """``sysfs`` (``pm_qos_resume_latency_us`` a CPU) or ``dma``
    (``/dev/cpu_dma_latency``, every CPU)."""
    since: float
    """When it was taken (``time.time()``)."""
    previous: dict[int, str] = field(default_factory=dict)
    """For ``sysfs``: each CPU's value before the hold, put back on release."""
    root: str = "/"
    fd: int = -1
    """For ``dma``: the open request (``-1`` once released)."""
    released: bool = False
    notes: list[str] = field(default_factory=list)
    """What the hold shares, and what release could not put back, and why."""
    number: int = 0
    """Which of this process's holds it is (the journal's key, with the pid)."""
    warden: int | None = None
    """For ``sysfs``: the pid of the process that puts the CPUs back if this
    one dies holding them (:mod:`cpupin.registry.warden`), or ``None``."""

    def as_record(self) -> dict[str, object]:
        """What the process's record carries of it."""
        out: dict[str, object] = {
            "mechanism": self.mechanism,
            "cpus": sorted(self.cpus),
            "max_us": self.max_us,
            "since": round(self.since, 3),
        }
        if self.warden is not None:
            out["warden"] = self.warden
        return out

    def describe(self) -> str:
        what = "no wake latency" if self.max_us == 0 else f"wakes within {self.max_us} µs"
        where = (
            "pm_qos_resume_latency_us" if self.mechanism == "sysfs" else f"{DMA_LATENCY}, every CPU"
        )
        return f"CPUs {format_cpulist(self.cpus)}: {what} ({where})"

    def release(self) -> list[str]:
        """End the hold: close the request, or put back each CPU's value
        where it is still the one this hold wrote (a value someone changed
        since is left, with a note). Returns the notes; idempotent."""
        with _lock:
            if self.released:
                return self.notes
            self.released = True
            if self.mechanism == "dma":
                if self.fd >= 0:
                    try:
                        os.close(self.fd)
                    except OSError:
                        pass
                    self.fd = -1
            else:
                self.notes.extend(_let_go(self))
            if self in _held:
                _held.remove(self)
            _publish()
        return self.notes

    def __enter__(self) -> WakeHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_lock = threading.RLock()
#: The holds this process took and still has.
_held: list[WakeHold] = []
_atexit = False


def holds() -> list[WakeHold]:
    """The holds this process has in force."""
    with _lock:
        return [h for h in _held if not h.released]


def _cpuidle(reader: Reader) -> str | None:
    """Why a hold would do nothing here (no idle driver), or ``None``."""
    driver = reader.text(_CPUIDLE, 64)
    if driver is None or driver.strip() in ("", "none"):
        return (
            "this host lists no cpuidle driver: its CPUs enter no idle state a hold "
            "could keep them out of, so there is nothing to hold"
        )
    return None


def resume_latencies(cpus: Iterable[int] | None = None, root: str = "/") -> dict[int, str | None]:
    """Each CPU's ``pm_qos_resume_latency_us`` as text (``None``: not
    exposed or not a valid value), for ``cpus`` (``None``: the online ones)."""
    out: dict[int, str | None] = {}
    with Reader(root) as r:
        wanted = (
            sorted(set(cpus))
            if cpus is not None
            else sorted(r.cpus("sys/devices/system/cpu/online") or ())
        )
        for cpu in wanted:
            text = r.text(SYSFS.format(cpu), 32)
            out[cpu] = None
            if text is not None:
                try:
                    parse_resume_latency(text)
                    out[cpu] = text.strip()
                except ValueError:
                    pass
    return out


def hold_wake_latency(
    cpus: Iterable[int] | str | None = None,
    max_us: int = 0,
    *,
    mechanism: str = "auto",
    root: str = "/",
) -> WakeHold:
    """Keep ``cpus`` out of idle states slower to leave than ``max_us``
    (0: out of every idle state but polling), until released.

    ``mechanism``: ``sysfs`` holds the named CPUs through their
    ``pm_qos_resume_latency_us`` (root; the value each had is recorded and
    put back); ``dma`` holds every CPU through ``/dev/cpu_dma_latency``
    (released by the kernel however the process exits); ``auto`` is
    ``sysfs`` for named CPUs and ``dma`` for ``cpus=None``. Raises
    :class:`HoldRefused`, saying why, on a host without cpuidle, without
    root, and where a container hides or mounts the files read-only;
    ``ValueError`` for a bad argument. A CPU another hold has already (of
    this process or another) is shared: the stricter bound holds while both
    live, and :attr:`WakeHold.notes` names the other holder.
    ``root``: a tree standing for ``/`` (tests)."""
    max_us = _checked_us(max_us)
    if mechanism not in ("auto", "sysfs", "dma"):
        raise ValueError(f"mechanism {excerpt(mechanism)} is not auto, sysfs or dma")
    with Reader(root) as r:
        online = r.cpus("sys/devices/system/cpu/online") or frozenset(range(os.cpu_count() or 1))
        if cpus is None:
            wanted = frozenset(online)
        else:
            wanted = _native.cpu_set(cpus)  # ValueError naming what is not a CPU
            if not wanted:
                raise ValueError("no CPU named: name the step and result CPUs to hold")
            if not wanted <= online:
                raise ValueError(
                    f"CPUs {format_cpulist(wanted - online)} are not online "
                    f"(online: {format_cpulist(online)})"
                )
        kind = mechanism if mechanism != "auto" else ("dma" if cpus is None else "sysfs")
        if kind == "dma" and cpus is not None and wanted != online:
            raise ValueError(
                f"{DMA_LATENCY} holds every CPU, not {format_cpulist(wanted)}: use "
                "mechanism='sysfs' for some CPUs"
            )
        why = _cpuidle(r)
        if why:
            raise HoldRefused(errno.EOPNOTSUPP, why)
        if kind == "dma":
            hold = _hold_dma(wanted, max_us)
        else:
            hold = _hold_sysfs(r, root, wanted, max_us)
    with _lock:
        global _atexit
        _held.append(hold)
        if not _atexit:
            atexit.register(_release_all)
            _atexit = True
        _publish()
    return hold


def _hold_dma(cpus: frozenset[int], max_us: int) -> WakeHold:
    try:
        fd = os.open(DMA_LATENCY, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HoldRefused(
            exc.errno or errno.EIO,
            why(exc, DMA_LATENCY) + "; a container needs the device passed in",
        ) from None
    try:
        os.write(fd, struct.pack("=i", max_us))
    except OSError as exc:
        os.close(fd)
        raise HoldRefused(exc.errno or errno.EIO, why(exc, DMA_LATENCY)) from None
    return WakeHold(cpus, max_us, "dma", time.time(), fd=fd)


def _original(r: Reader, cpu: int) -> str:
    """A CPU's value before any hold, checked: what goes back at the end."""
    text = r.text(SYSFS.format(cpu), 32)
    if text is None:
        raise HoldRefused(
            errno.ENOENT,
            f"CPU {cpu} exposes no power/pm_qos_resume_latency_us here (a container may "
            f"hide it): hold every CPU through {DMA_LATENCY} instead (mechanism='dma')",
        )
    try:
        parse_resume_latency(text)
    except ValueError as exc:
        raise HoldRefused(errno.EINVAL, f"CPU {cpu}'s resume latency: {exc}") from None
    return text.strip()


def _refused(exc: OSError, what: str) -> HoldRefused:
    return HoldRefused(
        exc.errno or errno.EIO,
        why(exc, f"{what}'s pm_qos_resume_latency_us")
        + f"; or hold every CPU through {DMA_LATENCY} (mechanism='dma')",
    )


def _check_writable(root: str, cpus: frozenset[int]) -> None:
    """Refuse, before the journal is touched, where no write could succeed
    (not root, sysfs read-only): a user's failed hold leaves nothing in the
    lock directory that would stand in root's way."""
    for cpu in sorted(cpus):
        path = os.path.join(root, SYSFS.format(cpu))
        if os.path.exists(path) and not os.access(path, os.W_OK):
            try:  # access() says no; open() says why
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            except OSError as exc:
                raise _refused(exc, f"CPU {cpu}") from None


def _hold_sysfs(r: Reader, root: str, cpus: frozenset[int], max_us: int) -> WakeHold:
    """Hold ``cpus`` through sysfs as a share of their journaled state
    (:mod:`cpupin.registry.holds`): journaled under the journal's lock
    before any write, all or nothing."""
    from cpupin.registry import holds as shared
    from cpupin.registry import warden

    global _count
    with _lock:
        _count += 1
        me = shared.Holder(os.getpid(), own_start(), _count, max_us, round(time.time(), 3))
    _check_writable(root, cpus)
    # The warden first (started with this process's first hold on root): a
    # holder killed at any step of the hold from here on is put back as it dies.
    guard = warden.watch(root)
    try:
        hold = _journaled_hold(r, root, cpus, max_us, me)
    except BaseException:
        if guard is not None:
            warden.release(guard)  # one hold fewer for it; after its last, it exits
        raise
    hold.warden = guard
    return hold


def _journaled_hold(
    r: Reader, root: str, cpus: frozenset[int], max_us: int, me: Holder
) -> WakeHold:
    from cpupin.registry import holds as shared
    from cpupin.registry.journal import locked

    try:
        with locked("wake", root) as journal:
            try:
                notes, others = shared.settle(
                    journal, r, joining=me, cpus=cpus, read_original=partial(_original, r)
                )
            except OSError as exc:
                # Undo from the journal: what this hold wrote goes back.
                try:
                    shared.settle(journal, r, leaving=(me.pid, me.start, me.hold))
                except OSError:
                    pass  # left in the journal: the next settle puts it back
                if isinstance(exc, HoldRefused):
                    raise
                raise _refused(exc, f"CPUs {format_cpulist(cpus)}") from None
            found = shared.entries(journal.entries)
    except HoldRefused:
        raise
    except OSError as exc:
        raise HoldRefused(
            exc.errno or errno.EIO,
            f"the wake journal: {exc.strerror or exc}: a hold through sysfs is journaled "
            "before it is written",
        ) from None
    hold = WakeHold(cpus, max_us, "sysfs", me.since, {c: found[c].original for c in cpus}, root)
    hold.number = me.hold
    hold.notes.extend(notes)
    if others:
        mine = others == [os.getpid()]
        who = "this process's holds" if mine else "pid " + ", ".join(map(str, others))
        hold.notes.append(
            f"CPUs {format_cpulist(cpus)} shared with {who}: the strictest bound holds while "
            "more than one lives, and each CPU goes back when the last lets go"
        )
    return hold


_count = 0


def _publish() -> None:
    """The holds in force, in this process's record (``ps`` shows them,
    ``ps --prune`` puts back those of a process that died)."""
    from cpupin.registry import writer as registry

    registry.describe_process(wake_holds=[h.as_record() for h in holds()])


def _let_go(hold: WakeHold) -> list[str]:
    """A sysfs hold's share given up, from the journal: each CPU gets the
    bound of the holders still living, or its original value."""
    from cpupin.registry import holds as shared
    from cpupin.registry.journal import locked

    try:
        with locked("wake", hold.root) as journal, Reader(hold.root) as r:
            notes, _ = shared.settle(journal, r, leaving=(os.getpid(), own_start(), hold.number))
    except OSError as exc:
        return [
            f"CPUs {format_cpulist(hold.cpus)}: {exc.strerror or exc}: left in the wake journal; "
            "cpupin ps --prune puts them back"
        ]
    if hold.warden is not None:
        from cpupin.registry import warden

        warden.release(hold.warden)
    return notes


def _release_all() -> None:
    for hold in holds():
        if hold.root == "/" or os.path.isdir(hold.root):
            hold.release()


def _after_fork_in_child() -> None:
    # The parent's holds are the parent's: a child neither releases nor
    # records them, and closes its copy of a dma request, which would
    # otherwise hold every CPU for as long as the child lives.
    global _lock
    _lock = threading.RLock()
    for hold in _held:
        if hold.fd >= 0:
            try:
                os.close(hold.fd)
            except OSError:
                pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
