"""Pinning a thread, and the table of this process's pins.

:func:`pin_current_thread` pins the calling thread and registers the pin;
:func:`pin_step_thread` does so after warming the intra-op pools, so that
their threads start on the process mask, not on the pin. The table (tid to
CPUs, role, name and start time) is what this process publishes in the
host's registry, what :func:`stray_threads` judges threads against, and what
the pin guard (:mod:`cpupin.threads.guard`) checks; a pin and its record
change together under one lock.
"""

from __future__ import annotations

import os
import sys
import time
from _thread import _local
from collections.abc import Callable, Iterable

from cpupin import _native
from cpupin._records import NamedTuple
from cpupin.cpulist import cpus_phrase, format_cpulist
from cpupin.errors import excerpt
from cpupin.process import mask as _process_module
from cpupin.process.mask import (
    process_cpus,
    set_process_cpus,
    start_time,
    thread_masks,
    to_process_mask,
)
from cpupin.registry import writer as registry

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any

    from cpupin.threads._drift import Drift

__all__ = [
    "Pin",
    "ThreadInfo",
    "pin_current_thread",
    "pin_step_thread",
    "pinned_roles",
    "pinned_threads",
    "refresh_process_cpus",
    "register_warmup",
    "stray_threads",
]

# The registered pins: tid to (CPUs, role, name, start time).
_pins: dict[int, tuple[frozenset[int], str, str, int | None]] = {}
# Re-entrant: a signal handler (a runtime's SIGTERM handler releasing its
# pins) runs in the thread it interrupted, which may hold it. The record's
# lock: a pin and its record change together, with one lock taken.
_pins_lock = registry._lock
_warmups: list[Callable[[], object]] = []
# Whether this thread is publishing (a signal handler's publish inside it
# leaves the writing to the outer loop) and whether the pins changed since.
_publishing = False
_dirty = False
# Threads that pinned leave a sentinel in their thread-local storage; when a
# thread ends, Python frees it and its (tid, start time) lands here, so a
# publish drops the pin of a thread gone without a read of /proc.
_gone: list[tuple[int, int | None]] = []
_sentinels = _local()
# When the pins of the other threads were last checked against /proc (for a
# thread whose end Python did not see: one killed from C).
_last_sweep = 0.0
#: How often a publish checks every other pin's thread in /proc, in seconds.
SWEEP_S = 1.0
_monotonic = time.monotonic
# A Pinned from its four fields, without its constructor's keyword handling.
_new_pinned = registry.Pinned._make


class _ThreadGone:
    __slots__ = ("key",)

    def __init__(self, key: tuple[int, int | None]) -> None:
        self.key = key

    def __del__(self, gone: list[tuple[int, int | None]] = _gone) -> None:
        # A list append: safe at any point of a thread's end. The list is
        # bound here, since at interpreter exit the module's names are gone.
        gone.append(self.key)


def _after_fork_in_child() -> None:
    # The child is a new process with one thread: a lock another thread held
    # at the fork would never be released, and the parent's pins are not
    # the child's (its one thread has a new tid).
    global _pins_lock, _publishing, _dirty, _sentinels
    _pins_lock = registry._lock  # the record's, made anew in the child first
    _pins.clear()
    _sentinels = _local()  # the thread's tid is the child's own
    _gone.clear()
    _publishing = _dirty = False


os.register_at_fork(after_in_child=_after_fork_in_child)

#: Bytes per intra-op thread in the torch warm-up: at::internal::GRAIN_SIZE,
#: below which torch runs an op on one thread.
_TORCH_GRAIN = 32768


def register_warmup(fn: Callable[[], object]) -> Callable[[], object]:
    """Run ``fn`` in :func:`pin_step_thread` before the pin, so that the pool
    it starts (a BLAS or OpenMP pool other than torch's) starts on the
    process mask. Returns ``fn``, so it works as a decorator."""
    with _pins_lock:
        _warmups.append(fn)
    return fn


def _warm_up() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        # One parallel op sized to the pool: OpenMP creates its threads now,
        # from a thread on the process mask.
        torch.empty(torch.get_num_threads() * _TORCH_GRAIN, dtype=torch.uint8).fill_(0)
    with _pins_lock:
        warmups = list(_warmups)
    for fn in warmups:
        fn()


class Pin:
    """A registered pin of one thread; a context manager that restores the
    thread's previous mask and unregisters the pin on exit. ``_started`` is
    the thread's start time, which tells it from a later thread that reuses
    its tid. (A plain class: ``import cpupin`` does not pay for dataclasses.)"""

    __slots__ = ("tid", "cpus", "previous", "_released", "_started")

    def __init__(
        self,
        tid: int,
        cpus: frozenset[int],
        previous: frozenset[int],
        _released: bool = False,
        _started: int | None = None,
    ) -> None:
        self.tid = tid
        self.cpus = cpus
        self.previous = previous
        self._released = _released
        self._started = _started

    def __repr__(self) -> str:
        return (
            f"Pin(tid={self.tid}, cpus={format_cpulist(self.cpus)!r}, "
            f"previous={format_cpulist(self.previous)!r}, released={self._released})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pin):
            return NotImplemented
        return (self.tid, self.cpus, self.previous, self._released, self._started) == (
            other.tid,
            other.cpus,
            other.previous,
            other._released,
            other._started,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def release(self) -> None:
        """Put the thread back on its previous mask and forget the pin.

        Acts only on the pinned thread itself: from that thread directly;
        from another, only while ``/proc/self/task`` still lists the tid with
        the start time it had when pinned. A thread that exited (its tid
        perhaps reused, by this process or another) is left alone.
        """
        if self._released:
            return
        self._released = True
        # The mask and the registry change under the lock that
        # stray_threads() reads them under: it never sees one without the other.
        # (acquire and release, not ``with``: a third of the cost here.)
        _pins_lock.acquire()
        try:
            if self.tid == _native.gettid():
                _native.set_affinity(self.previous)
            elif _alive(self.tid, self._started):
                try:
                    _native.set_affinity(self.previous, self.tid)
                except ProcessLookupError:
                    pass  # exited just now
            # else: the thread is gone; the tid may name another task now
        finally:
            pinned = _pins.get(self.tid)
            if pinned is not None and pinned[0] == self.cpus:
                _pins.pop(self.tid, None)  # a signal handler's release may be first
                _publish(self.tid)
            _pins_lock.release()

    def check(self) -> Drift | None:
        """Whether the thread is still on its pin: ``None``, else the
        :class:`~cpupin.threads.guard.Drift` with its likely cause (not counted, not
        re-applied: :func:`cpupin.check_pins` does both for every pin)."""
        from cpupin.threads._drift import nccl_loaded

        if self._released:
            return None
        with _pins_lock:
            _, role, name, _ = _pins.get(self.tid, (self.cpus, "pinned", "", None))
        return _drift(self.tid, self.cpus, role, name, self._started, process_cpus(), nccl_loaded())

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _drift(
    tid: int,
    cpus: frozenset[int],
    role: str,
    name: str,
    started: int | None,
    mask: frozenset[int],
    nccl: bool,
) -> Drift | None:
    """A pinned thread off its pin now, with the likely cause (``None``: on
    it, or exited, or its tid names another thread now). One native call."""
    from cpupin.threads._drift import Drift, likely_cause

    try:
        now = _native.get_affinity(0 if tid == _native.gettid() else tid)
    except OSError:  # ProcessLookupError among them: it exited
        return None
    if now == cpus or not _alive(tid, started):
        return None
    return Drift(tid, name, role, cpus, now, likely_cause(now, mask, os.environ, nccl))


# Sets of CPUs already checked, and the process mask they were checked within.
_within: dict[frozenset[int], frozenset[int]] = {}


def _checked(cpus: Iterable[int] | str) -> frozenset[int]:
    mask = process_cpus()
    if type(cpus) is frozenset and _within.get(cpus) is mask:
        return cpus  # checked before, within this same process mask
    wanted = _native.cpu_set(cpus)
    if not wanted:
        raise ValueError(
            f"an empty set of CPUs to pin to: name CPUs of the process mask {format_cpulist(mask)}"
        )
    if not wanted <= mask:
        raise ValueError(
            f"{cpus_phrase(wanted - mask, 'is')} outside the process mask "
            f"{format_cpulist(mask)}: pin to CPUs of cpupin.process_cpus()"
        )
    if type(cpus) is frozenset:
        if len(_within) >= 256:
            _within.clear()
        _within[cpus] = mask
    return wanted


def pin_current_thread(
    cpus: Iterable[int] | str, name: str | None = None, role: str = "pinned"
) -> Pin:
    """Pin the calling thread to ``cpus`` (within the process mask) and
    register the pin, so that :func:`stray_threads` knows it is deliberate.
    Affects the calling thread only. ``name``, when given, becomes its
    kernel name (15 bytes at most; never given by default, since naming the
    main thread renames the process in ``ps``). ``role`` (``"step"``,
    ``"result"``, or the runtime's own word) goes into the host's registry,
    where ``cpupin ps`` and ``cpupin audit`` find the pin."""
    wanted = _checked(cpus)
    if type(role) is not str or not 0 < len(role) <= 32:
        if not isinstance(role, str) or not role or len(role) > 32:
            raise ValueError(f"role={excerpt(role)}: give a short word such as 'step' or 'result'")
    if name is not None:
        _name_current_thread(name)
    try:
        tid, started, thread = _sentinels.me
    except AttributeError:
        tid = _native.gettid()
        started = _native.thread_start_time()
        thread = _python_thread()
        _sentinels.me = (tid, started, thread)
        _sentinels.gone = _ThreadGone((tid, started))
    # The name Python knows (a thread started from C or _thread gets a
    # placeholder), else the kernel's.
    label = thread.name if thread is not None else f"tid {tid}"
    # Pinned and registered under the lock stray_threads() reads under.
    _pins_lock.acquire()
    try:
        previous = _native.swap_affinity(wanted)
        _pins[tid] = (wanted, role, label, started)
        _publish(tid)
    finally:
        _pins_lock.release()
    return Pin(tid, wanted, previous, False, started)


def _python_thread() -> Any:
    """The calling thread's ``threading.Thread``. ``threading`` is imported
    here, not with cpupin: ``cpupin exec`` and ``import cpupin`` need none
    of it (3 ms with functools and collections). ``None`` only for a
    signal handler that ran while the main thread was half way through its
    own first import of ``threading``."""
    try:
        import threading

        return threading.current_thread()
    except (AttributeError, ImportError):
        return None


def _alive(tid: int, started: int | None) -> bool:
    return started is not None and start_time(0, tid) == started


def _publish(changed: int | None = None) -> None:
    """This process's record of its pins in the lock directory (called with
    _pins_lock held): what ``cpupin ps`` and audits read from outside.

    Only threads still running count: a pinned thread that ended without
    releasing its pin leaves the record at the next publish (Python frees
    its sentinel when it ends), and at most every :data:`SWEEP_S` seconds
    the others are checked in ``/proc/self/task`` with their start times
    (for threads started from C or ``_thread``). A
    publish inside another (a signal handler's) leaves the writing to the
    outer one, which writes again with what changed.

    ``changed``: the one thread whose pin changed, when that is all: its
    slot in the record is then one store (:func:`cpupin.registry.writer.update_pin`)."""
    global _publishing, _dirty, _last_sweep
    if changed is not None and not _publishing and not _gone:
        # The common case: one pin changed, nothing else to do but store it.
        now = _monotonic()
        if now - _last_sweep < SWEEP_S:
            if registry._disabled:
                return
            # Publishing from here: a signal handler's change of the pins
            # from now on marks them dirty, and the whole record follows.
            _publishing = True
            _dirty = False
            try:
                entry = _pins.get(changed)
                one = (
                    None if entry is None else _new_pinned((changed, entry[2], entry[0], entry[1]))
                )
                if registry.update_pin(changed, one, now) and not _dirty:
                    return
            finally:
                _publishing = False
    _dirty = True
    if _publishing:
        return
    _publishing = True
    try:
        while _dirty:
            _dirty = False
            # Snapshots: a signal handler may change the pins between two steps.
            while _gone:
                tid, started = _gone.pop()
                pin = _pins.get(tid)
                if pin is not None and pin[3] == started:
                    del _pins[tid]
            now = time.monotonic()
            if now - _last_sweep >= SWEEP_S:
                # The calling thread runs: only the others' start times are read.
                _last_sweep = now
                me = _native.gettid()
                for tid, pin in list(_pins.items()):
                    if tid != me and not _alive(tid, pin[3]):
                        _pins.pop(tid, None)
            if registry._disabled:
                break
            registry.register_pins(
                [
                    registry.Pinned(tid, name, cpus, role)
                    for tid, (cpus, role, name, _) in list(_pins.items())
                ]
            )
    finally:
        _publishing = False


def _name_current_thread(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={excerpt(name)}: give a thread name such as 'gpu-loop'")
    thread = _python_thread()
    if thread is not None:
        thread.name = name
    rc = _native.set_thread_name(name)
    if rc < 0:
        _native.raise_oserror(rc, "naming the calling thread")


def pin_step_thread(cpus: Iterable[int] | str, name: str | None = None, role: str = "step") -> Pin:
    """Pin a worker's main, GPU or plan thread to ``cpus``, its pools first.

    Moves the calling thread to the process mask, warms the intra-op pools
    so that their threads are created there (torch's OpenMP pool when torch
    is imported, with one small parallel op sized to
    ``torch.get_num_threads()``; others through :func:`register_warmup`),
    then pins the calling thread and registers the pin. Validates ``cpus``
    against the process mask first. Affects the calling thread only;
    ``name`` as for :func:`pin_current_thread`.
    """
    wanted = _checked(cpus)
    previous = _native.get_affinity()
    to_process_mask()
    _warm_up()
    pin = pin_current_thread(wanted, name, role)
    pin.previous = previous
    return pin


def pinned_roles() -> dict[int, tuple[str, frozenset[int]]]:
    """The registered pins with their roles: tid to (role, CPUs)."""
    with _pins_lock:
        return {tid: (role, cpus) for tid, (cpus, role, _, _) in list(_pins.items())}


def pinned_threads() -> dict[int, frozenset[int]]:
    """The registered pins: tid to CPUs."""
    with _pins_lock:
        return {tid: cpus for tid, (cpus, _, _, _) in list(_pins.items())}


_process_module._own_pins = pinned_threads  # what pools and plans read of the pins


def _drop_pins(tids: Iterable[int]) -> None:
    """Forget the registered pins of ``tids`` (moved off their pins by a
    binding of the whole process), and say so in the record."""
    with _pins_lock:
        dropped = [tid for tid in tids if _pins.pop(tid, None) is not None]
        if dropped:
            _publish()


class ThreadInfo(NamedTuple):
    """A thread and its mask."""

    tid: int
    name: str
    mask: frozenset[int]


def stray_threads() -> list[ThreadInfo]:
    """This process's threads whose mask is neither the process mask nor a
    registered pin: threads that inherited a pinned creator's mask, or that
    someone pinned behind cpupin's back. Exact, since the process knows its
    own pins. A runtime's tests call it."""
    mask = process_cpus()
    with _pins_lock:  # a pin and its record change together under it
        threads = thread_masks()
        alive = {st.tid for st, _ in threads}
        for tid in [t for t in list(_pins) if t not in alive]:
            _pins.pop(tid, None)  # its thread is gone; the tid may come back
        pins = {tid: cpus for tid, (cpus, _, _, _) in list(_pins.items())}
    return [
        ThreadInfo(st.tid, st.name, cpus)
        for st, cpus in threads
        if cpus != mask and cpus != pins.get(st.tid)
    ]


def refresh_process_cpus() -> frozenset[int]:
    """Read the process mask again, after the process's cpuset changed
    (a Kubernetes CPU manager, an operator writing the cgroup), and return it.

    The kernel moves every thread when a cpuset changes, so the new mask is
    the main thread's, unless the main thread is pinned through cpupin: then
    it is the old mask within the cgroup's cpuset and the online CPUs (the
    whole cpuset when nothing of the old mask is left). Threads started
    afterwards through cpupin start there; threads already running keep
    their masks, and pins are not revalidated.
    """
    pid = os.getpid()
    with _pins_lock:
        main_pinned = pid in _pins
    if not main_pinned:
        try:
            return set_process_cpus(_native.get_affinity(pid))
        except (ProcessLookupError, ValueError):
            pass  # the main thread has exited, or its mask is not online

    from cpupin.host.cgroup import read_cgroup_cpuset

    online = _native.online_cpus(refresh=True)
    allowed = (read_cgroup_cpuset("/") or online) & online
    return set_process_cpus(process_cpus() & allowed or allowed)
