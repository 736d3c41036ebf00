"""Threads that start on the process mask, and pinning a step thread.

A thread starts with its creator's CPU mask. Once a runtime pins its step
thread to one core, every pool, helper and library thread started from it
lands on that core too and queues behind it. :class:`Thread` and
:class:`ThreadPool` are drop-in replacements for ``threading.Thread`` and
``ThreadPoolExecutor`` whose threads move to :func:`~cpupin.process_cpus`
before any user code runs; :func:`pin_step_thread` pins a step thread after
warming the intra-op pools so that their threads start unpinned;
:func:`stray_threads` finds the threads that slipped through.

This is the one module under ``cpupin/`` allowed a bare ``threading.Thread``
or ``ThreadPoolExecutor`` (ruff's TID251 refuses them elsewhere).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from _thread import get_ident
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from cpupin import _native
from cpupin.cpulist import cpus_phrase, format_cpulist
from cpupin.errors import excerpt
from cpupin.process import mask as _process_module
from cpupin.process.mask import process_cpus, set_process_cpus, start_time, thread_masks
from cpupin.registry import writer as registry

__all__ = [
    "Pin",
    "Thread",
    "ThreadInfo",
    "Queue",
    "ThreadPool",
    "pin_current_thread",
    "pin_step_thread",
    "pinned_roles",
    "pinned_threads",
    "refresh_process_cpus",
    "register_warmup",
    "stray_threads",
]


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
_warned_lock = threading.Lock()


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
    import logging  # here alone: importing it costs ``import cpupin`` 4 ms

    logging.getLogger("cpupin").warning(
        "cpupin: the kernel no longer allows the whole process mask %s (the cpuset or "
        "the online CPUs changed); %s; call cpupin.refresh_process_cpus() after a cpuset "
        "change",
        format_cpulist(cpus),
        what,
    )


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


class Thread(threading.Thread):
    """A ``threading.Thread`` that starts on the process mask, whatever its
    creator's mask.

    Used exactly like ``threading.Thread``. The new thread moves to
    :func:`~cpupin.process_cpus` before any user code runs, whatever ``run``
    resolves to (a ``target``, a subclass's or a mixin's ``run``, one
    assigned on the instance); a direct ``t.run()`` call runs on the
    caller's thread and mask, as it would with ``threading.Thread``.

    The new thread also takes :attr:`name` as its kernel name (the first 15
    bytes), so that ``top -H``, ``ps -L``, ``perf``, ``py-spy`` and
    ``cpupin top`` show it; Python before 3.14 leaves every thread named
    after the process. :class:`ThreadPool` workers are named the same way,
    from ``thread_name_prefix``.

    How: a thread starts with its creator's mask, so :meth:`start` reads
    the creator's (warm, one C call) and the new thread, first thing in
    CPython's ``_bootstrap_inner``, moves only when that mask was not the
    process mask, and names itself (one C call either way). Where Python
    has no ``_bootstrap_inner``, ``run`` is wrapped instead. (A creator
    whose mask another thread changes between its ``start()`` and the new
    thread's birth, a window of microseconds, hands over the old answer.)
    """

    _moves_to_mask = True
    _kernel_name: bytes | None = None

    def start(self) -> None:
        if not _BOOTSTRAP:
            self._start_wrapped()
            return
        # Everything the new thread needs is made here, in the warm creator:
        # whether it must move, and its name as the kernel takes it.
        try:
            self._moves_to_mask = not _native.on_mask(process_cpus())
            self._kernel_name = _kernel_name_of(self.name)
        except Exception:  # noqa: BLE001 - the new thread then takes the slow, checked way
            self._moves_to_mask = True
        super().start()
        registry.threads_changed()  # a process with a record names it there

    def _bootstrap_inner(self) -> None:
        try:
            if self._moves_to_mask:
                _enter(self._kernel_name)
            elif self._kernel_name is not None:
                _set_name(self._kernel_name)
        except Exception:  # noqa: BLE001 - never keep start() waiting for a thread that died
            pass
        super()._bootstrap_inner()  # type: ignore[misc]

    def _start_wrapped(self) -> None:
        own = self.__dict__.get("run")
        run = self.run  # what the thread would run, however it resolves

        def restore() -> None:
            # Drop the wrapper (and with it the reference to self), as
            # Thread.run drops its target; an instance's own run comes back.
            # A run assigned while the thread ran is kept, as in threading.
            if self.__dict__.get("run") is not run_on_process_mask:
                return
            if own is None:
                del self.__dict__["run"]
            else:
                self.__dict__["run"] = own

        def run_on_process_mask() -> None:
            try:
                if get_ident() == self.ident:  # not a direct run() from another thread
                    _enter(_kernel_name_of(self.name))
                run()
            finally:
                restore()

        self.__dict__["run"] = run_on_process_mask
        try:
            super().start()
        except BaseException:
            restore()
            raise


_set_name = _native.set_thread_name_bytes

#: Whether this Python's Thread has ``_bootstrap_inner`` (CPython 3.10-3.14
#: do), where the new thread's first step goes; else ``run`` is wrapped.
_BOOTSTRAP = hasattr(threading.Thread, "_bootstrap_inner")


#: Whether cpupin names its threads in the kernel: CPython does from 3.14 on.
_NAME_THREADS = sys.version_info < (3, 14)


def _kernel_name_of(name: str) -> bytes | None:
    """The kernel name a thread of ``name`` takes (``None``: Python names it)."""
    return _native.thread_name_bytes(name) if _NAME_THREADS else None


def _enter(kernel_name: bytes | None) -> None:
    """A new thread's first step: onto the process mask and named, in one
    native call; the slow way when the kernel refuses the mask."""
    try:
        rc = _native.enter_thread(process_cpus(), kernel_name)
    except ValueError:  # a CPU of the process mask is no longer online
        rc = -1
    if rc < 0:
        to_process_mask()
        if kernel_name is not None:
            _set_name(kernel_name)


class _Initializer:
    """A pool's initializer: the move to the process mask, then the user's."""

    __slots__ = ("user",)

    def __init__(self, user: Callable[..., object] | None) -> None:
        self.user = user

    def __call__(self, *args: object) -> None:
        _enter(_kernel_name_of(threading.current_thread().name))
        registry.threads_changed()
        if self.user is not None:
            self.user(*args)


def _define_thread_pool() -> type:
    """The ThreadPool class, made on first use: concurrent.futures imports
    logging, which costs ``import cpupin`` 5 ms that a process that only pins
    should not pay."""
    from concurrent.futures import ThreadPoolExecutor

    class ThreadPool(ThreadPoolExecutor):
        """A ``ThreadPoolExecutor`` whose worker threads start on the process mask.

        Same signature; a user ``initializer`` still runs in each worker (after
        the move), and one that fails breaks the pool as in the standard library
        (``BrokenThreadPool``). Without ``max_workers`` it has one worker a
        usable CPU (:func:`cpupin.usable_cpus`: the mask, the quota, less
        the pinned CPUs), not the standard library's ``os.cpu_count() + 4``,
        which counts the host: the census would call that pool sized from
        the host. Pass ``max_workers`` for a pool that mostly waits (I/O).
        """

        def __init__(
            self,
            max_workers: int | None = None,
            thread_name_prefix: str = "",
            initializer: Callable[..., object] | None = None,
            initargs: tuple[Any, ...] = (),
            **kwargs: Any,
        ) -> None:
            if initializer is not None and not callable(initializer):
                raise TypeError("initializer must be a callable")
            if max_workers is None:
                from cpupin.pools.limits import usable_cpus

                try:
                    max_workers = max(1, usable_cpus())
                except OSError:  # no affinity here: the standard library's count
                    max_workers = None
            super().__init__(
                max_workers, thread_name_prefix, _Initializer(initializer), initargs, **kwargs
            )

    ThreadPool.__module__ = __name__
    ThreadPool.__qualname__ = "ThreadPool"
    return ThreadPool


def _define_feeder_queue() -> type:
    import multiprocessing.queues

    class FeederQueue(multiprocessing.queues.Queue):  # type: ignore[type-arg]
        """A ``multiprocessing.Queue`` whose feeder thread runs on the
        process mask (see :func:`Queue`)."""

        def _start_thread(self) -> None:
            super()._start_thread()  # type: ignore[misc]
            feeder = getattr(self, "_thread", None)
            tid = getattr(feeder, "native_id", None)
            if tid:
                try:
                    _native.set_affinity(process_cpus(), tid)
                except (OSError, ValueError):
                    pass  # it ended already, or the mask went offline: left as it was
                _name_thread_of(tid, str(getattr(feeder, "name", "QueueFeederThread")))
                registry.threads_changed()

    FeederQueue.__module__ = __name__
    FeederQueue.__qualname__ = "FeederQueue"
    return FeederQueue


def _name_thread_of(tid: int, name: str) -> None:
    """Give another thread of this process its kernel name (the feeder
    started from a named thread would keep that thread's name, and the
    census from outside would count it in that thread's pool)."""
    kernel_name = _kernel_name_of(name)
    if kernel_name is None:
        return
    try:
        fd = os.open(f"/proc/self/task/{tid}/comm", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # it ended already
    try:
        os.write(fd, kernel_name)
    except OSError:
        pass
    finally:
        os.close(fd)


def Queue(maxsize: int = 0, *, ctx: Any = None) -> Any:  # noqa: N802 - as multiprocessing's
    """A ``multiprocessing.Queue`` (of ``ctx``, default the default context)
    whose feeder thread runs on the process mask.

    The standard queue starts its feeder thread at the first ``put()``, from
    the thread that puts, and a pinned step thread usually does: the feeder
    then inherits the pin and competes with the step on its core (a stray
    the census finds). Here the feeder is moved to the process mask as it
    starts. The queue passes to child processes as the standard one does."""
    import multiprocessing

    return _feeder_queue_class()(maxsize, ctx=ctx or multiprocessing.get_context())


def _feeder_queue_class() -> type:
    cls = globals().get("FeederQueue")
    if cls is None:
        cls = globals()["FeederQueue"] = _define_feeder_queue()
    return cls


if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor as ThreadPool

    from cpupin.threads._drift import Drift
else:

    def __getattr__(name: str) -> Any:
        if name == "ThreadPool":
            pool = globals()["ThreadPool"] = _define_thread_pool()
            return pool
        if name == "FeederQueue":  # a queue unpickled in a child names its class
            return _feeder_queue_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- pins ------------------------------------------------------------------

# The registered pins: tid to (CPUs, role, name, start time).
_pins: dict[int, tuple[frozenset[int], str, str, int | None]] = {}
# Re-entrant: a signal handler (a runtime's SIGTERM handler releasing its
# pins) runs in the thread it interrupted, which may hold it.
_pins_lock = threading.RLock()
_warmups: list[Callable[[], object]] = []
# Whether this thread is publishing (a signal handler's publish inside it
# leaves the writing to the outer loop) and whether the pins changed since.
_publishing = False
_dirty = False
# Threads that pinned leave a sentinel in their thread-local storage; when a
# thread ends, Python frees it and its (tid, start time) lands here, so a
# publish drops the pin of a thread gone without a read of /proc.
_gone: list[tuple[int, int | None]] = []
_sentinels = threading.local()
# When the pins of the other threads were last checked against /proc (for a
# thread whose end Python did not see: one killed from C).
_last_sweep = 0.0
#: How often a publish checks every other pin's thread in /proc, in seconds.
SWEEP_S = 1.0


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
    global _pins_lock, _warned_lock, _publishing, _dirty
    _pins_lock = threading.RLock()
    _warned_lock = threading.Lock()
    _pins.clear()
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
        with _pins_lock:
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
                if self.tid in _pins and _pins[self.tid][0] == self.cpus:
                    del _pins[self.tid]
                    _publish()

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


def _checked(cpus: Iterable[int] | str) -> frozenset[int]:
    wanted = _native.cpu_set(cpus)
    mask = process_cpus()
    if not wanted:
        raise ValueError(
            f"an empty set of CPUs to pin to: name CPUs of the process mask {format_cpulist(mask)}"
        )
    if not wanted <= mask:
        raise ValueError(
            f"{cpus_phrase(wanted - mask, 'is')} outside the process mask "
            f"{format_cpulist(mask)}: pin to CPUs of cpupin.process_cpus()"
        )
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
    if not isinstance(role, str) or not role or len(role) > 32:
        raise ValueError(f"role={excerpt(role)}: give a short word such as 'step' or 'result'")
    if name is not None:
        _name_current_thread(name)
    tid = _native.gettid()
    started = _native.thread_start_time()
    # The name Python knows (a thread started from C or _thread gets a
    # placeholder), else the kernel's.
    label = threading.current_thread().name
    kept = getattr(_sentinels, "by_tid", None)
    if kept is None:
        kept = _sentinels.by_tid = {}
    if tid not in kept:
        kept[tid] = _ThreadGone((tid, started))
    # Pinned and registered under the lock stray_threads() reads under.
    with _pins_lock:
        previous = _native.get_affinity()
        _native.set_affinity(wanted)
        _pins[tid] = (wanted, role, label, started)
        _publish()
    return Pin(tid, wanted, previous, _started=started)


def _alive(tid: int, started: int | None) -> bool:
    return started is not None and start_time(0, tid) == started


def _publish() -> None:
    """This process's record of its pins in the lock directory (called with
    _pins_lock held): what ``cpupin ps`` and audits read from outside.

    Only threads still running count: a pinned thread that ended without
    releasing its pin leaves the record at the next publish (Python frees
    its sentinel when it ends), and at most every :data:`SWEEP_S` seconds
    the others are checked in ``/proc/self/task`` with their start times
    (for threads started from C or ``_thread``). A
    publish inside another (a signal handler's) leaves the writing to the
    outer one, which writes again with what changed."""
    global _publishing, _dirty, _last_sweep
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
    threading.current_thread().name = name
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
