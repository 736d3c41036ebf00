"""The process mask: the CPUs this process may use as a whole.

A thread's own mask changes when it is pinned; the process mask does not. It
is recorded once, at import, from the main thread (whose tid is the pid), so
that importing cpupin from a thread that is already pinned, or pinning any
thread later, never changes it. A child started with :func:`cpupin.child_env`
takes it from ``CPUPIN_PROCESS_CPUS`` instead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

from . import _native
from .cpulist import cpus_phrase, format_cpulist, parse_cpulist
from .errors import excerpt

log = logging.getLogger("cpupin")

__all__ = ["ENV_PROCESS_CPUS", "process_cpus", "set_process_cpus", "start_time", "thread_masks"]

_lock = threading.Lock()


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
    """The mask a parent passed in ``CPUPIN_PROCESS_CPUS``, with the main
    thread moved onto it: a process started from a pinned thread inherits
    the pin, and would otherwise record it as its process mask."""
    text = os.environ.get(ENV_PROCESS_CPUS)
    if text is None or not _native.HAVE_AFFINITY:
        return None
    try:
        cpus = parse_cpulist(text)
        _native.set_affinity(cpus, os.getpid())
    except (ValueError, OSError) as exc:
        log.warning("cpupin: %s=%s not used: %s", ENV_PROCESS_CPUS, excerpt(text), exc)
        return None
    return cpus


_process_cpus: frozenset[int] | None = _inherit() or _record()


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
    Returns the new mask.
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
    global _process_cpus
    with _lock:
        _process_cpus = wanted
    return wanted


def start_time(pid: int, tid: int | None = None) -> int | None:
    """When a process (or, with ``tid``, a thread of it) started, in clock
    ticks since boot (field 22 of ``stat``); ``None`` when it is gone.

    A pid or tid is reused once its task is gone; the pair (id, start time)
    is not, so comparing it tells a task from a later one of the same id.
    ``pid`` 0 is this process (``/proc/self``), whose ``task`` folder holds
    only its own threads.
    """
    where = "self" if pid == 0 else str(pid)
    path = f"/proc/{where}/stat" if tid is None else f"/proc/{where}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            text = f.read(4096)
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


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
