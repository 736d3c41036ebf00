"""The process mask: the CPUs this process may use as a whole.

A thread's own mask changes when it is pinned; the process mask does not. It
is recorded once, at import, from the main thread (whose tid is the pid), so
that importing cpupin from a thread that is already pinned, or pinning any
thread later, never changes it. A child started with :func:`cpupin.child_env`
takes it from ``CPUPIN_PROCESS_CPUS`` instead.
"""

from __future__ import annotations

import os
from _thread import allocate_lock
from collections.abc import Callable, Iterable, Mapping

from cpupin import _native
from cpupin.cpulist import cpus_phrase, format_cpulist, parse_cpulist
from cpupin.errors import excerpt
from cpupin.host._proc import start_time

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any


def _log() -> Any:
    import logging  # on the rare paths that log: importing it costs 4 ms

    return logging.getLogger("cpupin")


__all__ = [
    "ENV_PROCESS_CPUS",
    "own_pinned_cpus",
    "own_pins",
    "process_cpus",
    "set_process_cpus",
    "start_time",
    "thread_masks",
    "to_process_mask",
]

_lock = allocate_lock()


def _record() -> frozenset[int] | None:
    if not _native.HAVE_AFFINITY:
        return None
    try:
        return _native.get_affinity(os.getpid())
    except OSError:
        # The main thread has exited (a zombie leader): the caller's mask.
        return _native.get_affinity(0)


#: The environment variable that carries the process mask to a child.
ENV_PROCESS_CPUS = "CPUPIN_PROCESS_CPUS"


def _inherit() -> frozenset[int] | None:
    """The mask a parent passed in ``CPUPIN_PROCESS_CPUS``, when it applies.

    It never widens the mask a launcher gave: it applies when the main
    thread's mask is that mask already, or when the main thread's mask is
    exactly a pin that the parent process registered (a child started from
    a pinned thread inherits the pin, and would otherwise take it for its
    whole mask): the main thread then moves to it. A mask set by
    ``taskset``, ``numactl``, a container or a scheduler wins; the variable
    is then set aside, with a note at debug level."""
    text = os.environ.get(ENV_PROCESS_CPUS)
    if text is None or not _native.HAVE_AFFINITY:
        return None
    try:
        cpus = parse_cpulist(text)
        current = _native.get_affinity(os.getpid())
    except (ValueError, OSError) as exc:
        _log().warning("cpupin: %s=%s not used: %s", ENV_PROCESS_CPUS, excerpt(text), exc)
        return None
    if current == cpus:
        return cpus
    from cpupin.registry.reader import parent_pinned_to

    if not (current < cpus and parent_pinned_to(current)):
        _log().debug(
            "cpupin: %s=%s set aside: this process was started on CPU %s, which is not a pin "
            "of its parent's; the launcher's mask wins",
            ENV_PROCESS_CPUS,
            excerpt(text),
            format_cpulist(current),
        )
        return None
    try:
        _native.set_affinity(cpus, os.getpid())
    except (ValueError, OSError) as exc:
        _log().warning("cpupin: %s=%s not used: %s", ENV_PROCESS_CPUS, excerpt(text), exc)
        return None
    return cpus


_process_cpus: frozenset[int] | None = _inherit() or _record()


def _words_of(cpus: frozenset[int] | None) -> object:
    try:
        return None if cpus is None else _native.mask_words(cpus)
    except ValueError:  # a CPU of it went offline: new threads take the checked way
        return None


#: The process mask as the words C takes (:func:`cpupin._native.mask_words`),
#: kept beside it: a new ``cpupin.Thread``'s one C call reads it without a
#: Python call. ``None`` while there is none (new threads then take the
#: checked way).
process_words: object = _words_of(_process_cpus)


# This process's registered pins (tid to CPUs): cpupin.threads.pins, which keeps
# them, installs its reader here, so that the modules that size pools read
# them without importing it (it imports them).
_own_pins: Callable[[], Mapping[int, frozenset[int]]] = dict


def own_pins() -> dict[int, frozenset[int]]:
    """This process's registered pins: each pinned thread's tid to its CPUs."""
    return dict(_own_pins())


def own_pinned_cpus() -> frozenset[int]:
    """The CPUs this process's registered pins hold."""
    return frozenset().union(*_own_pins().values())


def process_cpus() -> frozenset[int]:
    """The CPUs this process may use as a whole (recorded at import).

    New threads started through cpupin return here; plans and pools are
    sized from it. :func:`set_process_cpus` overrides it.
    """
    cpus = _process_cpus
    if cpus is None:
        raise _native.UnsupportedPlatform("process_cpus()")
    return cpus


def set_process_cpus(cpus: Iterable[int] | str) -> frozenset[int]:
    """Override the recorded process mask, for a runtime that knows better.

    Takes CPU numbers or a list such as ``"0-15"``; each must be online.
    Affects what cpupin treats as the whole process, not any thread's mask.
    The process's record says so, so that ``cpupin threads`` and ``audit``
    see the same mask from outside. Returns the new mask.
    """
    wanted = _native.cpu_set(cpus)
    if not wanted:
        raise ValueError("an empty process mask: give at least one online CPU")
    online = _native.online_cpus(refresh=True)
    if not wanted <= online:
        raise ValueError(
            f"{cpus_phrase(wanted - online, 'is')} not online: the online CPUs are "
            f"{format_cpulist(online)}"
        )
    global _process_cpus, process_words
    with _lock:
        _process_cpus = wanted
        process_words = _words_of(wanted)
    from cpupin.registry.writer import describe_process

    describe_process(mask=wanted)  # so that the outside view agrees
    return wanted


def thread_masks(
    pid: int | None = None, *, last_cpu: bool = False
) -> list[tuple[_native.ThreadStat, frozenset[int]]]:
    """Every thread of a process (``None``: this one) with its CPU mask, in
    tid order. A thread that exits between the two reads is left out
    (``ProcessLookupError`` for it alone); any other error is raised."""
    out = []
    for st in _native.thread_stats(pid, last_cpu=last_cpu):
        try:
            out.append((st, _native.get_affinity(st.tid)))
        except ProcessLookupError:
            continue
    return out


def to_process_mask() -> None:
    """Move the calling thread to the process mask, unless it is there.

    Reading the mask costs about a third of setting it, so a thread already
    on the process mask (the common case) pays only the read. Never raises
    for a process mask the kernel no longer allows whole: see
    :func:`_fit_process_mask`.
    """
    cpus = process_cpus()
    try:
        if not _native.on_mask(cpus):
            _native.set_affinity(cpus)
    except ValueError:  # a CPU of the mask went offline, or left the cpuset
        _fit_process_mask(cpus)


# Process masks already warned about: the warning is logged once each.
_warned: set[frozenset[int]] = set()
_warned_lock = allocate_lock()


def _after_fork_in_child() -> None:
    # The child has one thread: a lock another thread held at the fork
    # would never be released.
    global _lock, _warned_lock
    _lock = allocate_lock()
    _warned_lock = allocate_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _fit_process_mask(cpus: frozenset[int]) -> None:
    """The cpuset shrank, or CPUs went offline, since the process mask was
    recorded: the calling thread takes what the kernel still allows of the
    process mask, or, when that is nothing, keeps the mask it inherited.
    Logged once for each process mask; the work runs either way."""
    usable = cpus & _native.online_cpus(refresh=True)
    if usable:
        try:
            _native.set_affinity(usable)
        except ValueError:
            pass  # the kernel set what it allows of it, or left the mask alone
    now = _native.get_affinity()
    with _warned_lock:
        if cpus in _warned:
            return
        _warned.add(cpus)
    if now <= cpus:
        what = f"new threads run on what is left of it, CPU {format_cpulist(now)}"
    else:
        what = f"new threads keep their creator's mask, CPU {format_cpulist(now)}"
    _log().warning(
        "cpupin: the kernel no longer allows the whole process mask %s (the cpuset or "
        "the online CPUs changed); %s; call cpupin.refresh_process_cpus() after a cpuset "
        "change",
        format_cpulist(cpus),
        what,
    )
