"""Threads that start on the process mask.

A thread starts with its creator's CPU mask. Once a runtime pins its step
thread to one core, every pool, helper and library thread started from it
lands on that core too and queues behind it. :class:`Thread`,
:class:`ThreadPool` and :func:`Queue` are drop-in replacements for
``threading.Thread``, ``ThreadPoolExecutor`` and ``multiprocessing.Queue``
whose threads move to :func:`~cpupin.process_cpus` before any user code
runs. Pinning a thread is :mod:`cpupin.threads.pins`.

This is the one module under ``cpupin/`` allowed a bare ``threading.Thread``
or ``ThreadPoolExecutor`` (ruff's TID251 refuses them elsewhere).
"""

from __future__ import annotations

import os
import sys
import threading
from _thread import get_ident
from collections.abc import Callable

from cpupin import _native
from cpupin.process import mask as _mask
from cpupin.process.mask import process_cpus, to_process_mask
from cpupin.registry import writer as registry

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Queue", "Thread", "ThreadPool", "to_process_mask"]


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

    How: first thing in CPython's ``_bootstrap_inner``, the new thread
    makes one C call that reads its mask (its creator's), moves onto the
    process mask only when it is not there, and names itself. :meth:`start`
    encodes the name in UTF-8 (C cuts it for the kernel), and the process
    mask waits as C's words beside :func:`~cpupin.process_cpus`. Where
    Python has no ``_bootstrap_inner``, ``run`` is wrapped instead.
    """

    _kernel_name: bytes | None = None

    def start(self) -> None:
        if not _BOOTSTRAP:
            self._start_wrapped()
            return
        # In a loop of starts, every line here and in the new thread runs
        # cold, at about ten times its warm cost, and Python in the new
        # thread before its start event costs most (bench/threads.py
        # --parts): the new thread makes one C call and calls no Python function.
        if _NAME_THREADS:
            name: str = self._name  # type: ignore[attr-defined] # what .name returns
            try:
                self._kernel_name = name.encode()
            except UnicodeEncodeError:  # a lone surrogate: cut the slow way
                self._kernel_name = _native.thread_name_bytes(name)
        super().start()
        registry.threads_changed()  # a process with a record names it there

    def _bootstrap_inner(self) -> None:
        try:
            name, words = self._kernel_name, _mask.process_words
            if words is None:  # no mask as C's words: the checked way
                rc = -1
            elif name is None:  # Python names the thread (3.14 on)
                rc = _enter_words(words, _NO_NAME, 0)
            else:
                rc = _enter_words(words, name, len(name))
            if rc < 0:
                _enter(name)
            if _LIMITS in _modules:
                _apply_limits()
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
                    _apply_limits()
                run()
            finally:
                restore()

        self.__dict__["run"] = run_on_process_mask
        try:
            super().start()
        except BaseException:
            restore()
            raise


#: Whether this Python's Thread has ``_bootstrap_inner`` (CPython 3.10-3.14
#: do), where the new thread's first step goes; else ``run`` is wrapped.
_BOOTSTRAP = hasattr(threading.Thread, "_bootstrap_inner")


#: Whether cpupin names its threads in the kernel: CPython does from 3.14 on.
_NAME_THREADS = sys.version_info < (3, 14)

#: The C call of :func:`cpupin._native.enter_thread`, which a new thread
#: makes directly: (the mask's words, its name in UTF-8, the name's length).
_enter_words = _native.enter_thread_words
_NO_NAME = _native.NO_NAME
_modules = sys.modules
_LIMITS = "cpupin.pools.limits"


def _kernel_name_of(name: str) -> bytes | None:
    """The kernel name a thread of ``name`` takes (``None``: Python names it)."""
    return _native.thread_name_bytes(name) if _NAME_THREADS else None


def _apply_limits() -> None:
    """The OpenMP limits :func:`cpupin.limit_pools` set, applied in this new
    thread: OpenMP keeps them per thread. Nothing unless ``limit_pools``
    ran (its module is loaded only then, so ``import cpupin`` stays small)."""
    limits = sys.modules.get(_LIMITS)
    if limits is not None:
        limits.apply_thread_limits()  # returns at once when no limit was set


def _enter(kernel_name: bytes | None) -> None:
    """A new thread's first step: onto the process mask and named (from its
    name in UTF-8, cut in C), in one native call; the slow way when the
    kernel refuses the mask."""
    try:
        rc = _native.enter_thread(process_cpus(), kernel_name)
    except ValueError:  # a CPU of the process mask is no longer online
        rc = -1
    if rc < 0:
        to_process_mask()
        if kernel_name is not None:
            _native.set_thread_name_bytes(_native.thread_name_cut(kernel_name))


class _Initializer:
    """A pool's initializer: the move to the process mask, then the user's."""

    __slots__ = ("user",)

    def __init__(self, user: Callable[..., object] | None) -> None:
        self.user = user

    def __call__(self, *args: object) -> None:
        _enter(_kernel_name_of(threading.current_thread().name))
        _apply_limits()
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
else:

    def __getattr__(name: str) -> Any:
        if name == "ThreadPool":
            pool = globals()["ThreadPool"] = _define_thread_pool()
            return pool
        if name == "FeederQueue":  # a queue unpickled in a child names its class
            return _feeder_queue_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
