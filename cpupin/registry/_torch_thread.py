"""Which thread runs torch's intra-op pool, and the pool's size read there.

torch's OpenMP count is kept per thread (libgomp's ``nthreads-var``), so
the census reads it on the thread that runs the pool, not on the thread
that asks. A module of its own: :mod:`cpupin.measure.stepclock` notes its thread
here, and :mod:`cpupin.pools.census` reads it, without importing each other.
"""

from __future__ import annotations

import os
import sys

from cpupin import _native

__all__ = ["note_pool_thread", "torch_reading"]

#: torch's intra-op size as read on the thread that runs its pool, with that
#: thread's id (``note_pool_thread``); ``None``: none said so.
_pool_thread: tuple[int, int, int] | None = None


def note_pool_thread() -> int | None:
    """Say that the calling thread runs torch's intra-op pool (a step
    thread), and read the pool's size there.

    torch's OpenMP count is kept per thread (libgomp's ``nthreads-var``):
    ``torch.set_num_threads(1)`` on a step thread leaves the main thread,
    and a thread started before, at the old count. The census of this
    process then gives the size read here, named by this thread's id,
    instead of the size seen by whichever thread asks. A
    :class:`~cpupin.StepClock` calls it when made; call it again after
    changing the count. Returns the size, ``None`` without torch."""
    global _pool_thread
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_num_threads"):
        return None
    n = int(torch.get_num_threads())
    _pool_thread = (os.getpid(), _native.gettid(), n)
    return n


def torch_reading() -> tuple[int, tuple[int, ...]] | None:
    """torch's intra-op size and, where it was read on the pool's thread,
    that thread's id."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_num_threads"):
        return None
    noted = _pool_thread
    if noted is not None and noted[0] == os.getpid():
        _, tid, n = noted
        if tid == _native.gettid() or _alive(tid):
            if tid == _native.gettid():
                n = int(torch.get_num_threads())
            return n, (tid,)
    return int(torch.get_num_threads()), ()


def _alive(tid: int) -> bool:
    """Whether a thread of this process with that id still runs."""
    return os.path.exists(f"/proc/self/task/{tid}")
