"""The names of a process's pools, and what its record says of them: light
(no topology, no registry), so that the registry's writer can read them.
:mod:`cpupin.pools.census` judges them."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from typing import Any

from cpupin.errors import printable
from cpupin.registry._record import MAX_NAME, MAX_POOL_TIDS, MAX_POOLS
from cpupin.registry._torch_thread import torch_reading

__all__ = [
    "ONE_EACH",
    "configured_pools",
    "controllers",
    "pool_name",
    "recorded_pools",
]

_TRAILING_NUMBER = re.compile(r"[\s_\-.:#/]*\d+\Z")
_THREAD_N = re.compile(r"\AThread-\d+")


@functools.lru_cache(maxsize=4096)
def pool_name(name: str) -> str:
    """The pool a thread's name puts it in: its name without a trailing
    number (``ThreadPoolExecutor-0_3`` -> ``ThreadPoolExecutor-0``,
    ``Thread-7 (worker)`` -> ``Thread (worker)``)."""
    if name == _FEEDER[:15]:  # the kernel's name for it, cut to 15 bytes
        return _FEEDER
    stem = _THREAD_N.sub("Thread", name)
    return _TRAILING_NUMBER.sub("", stem) or name


#: A ``multiprocessing.Queue``'s feeder: one thread a queue, never a pool
#: sized from anything, so never "sized from the host".
_FEEDER = "QueueFeederThread"
ONE_EACH = frozenset({_FEEDER})


#: How long threadpoolctl's list of the loaded libraries is kept: its scan
#: of every shared object costs milliseconds, too much for each scrape, and
#: libraries are loaded at start-up; the sizes are read afresh each time.
_SCAN_TTL_S = 30.0
_scan: tuple[float, int, list[Any]] = (0.0, 0, [])


def controllers() -> list[Any]:
    global _scan
    now = time.monotonic()
    at, pid, found = _scan
    if pid != os.getpid() or now - at > _SCAN_TTL_S:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - a dependency
            return []
        found = list(ThreadpoolController().lib_controllers)
        _scan = (now, os.getpid(), found)
    return found


def configured_pools(*, scan: bool) -> list[tuple[str, int, tuple[int, ...]]]:
    """The pools this process's libraries configured: (name, size, the
    threads it was read on): torch's intra-op pool, read on the thread
    that runs it where that one said so (:func:`note_pool_thread`), and each
    BLAS or OpenMP runtime threadpoolctl finds (``scan=False``: only those a
    scan already found, since a scan costs milliseconds)."""
    out: list[tuple[str, int, tuple[int, ...]]] = []
    found = torch_reading()
    if found is not None:
        out.append(("torch intra-op", found[0], found[1]))
    _, pid, libs = _scan
    for lib in controllers() if scan else libs if pid == os.getpid() else []:
        try:
            n = int(lib.num_threads)
        except Exception:  # noqa: BLE001 - a library that cannot say is left out
            continue
        label = f"{lib.internal_api} ({os.path.basename(lib.filepath)})"
        out.append((printable(label, MAX_NAME), n, ()))
    return out


def recorded_pools() -> list[dict[str, object]]:
    """This process's pools as its record carries them, for the census from
    outside: its threads (but the main one) grouped by their Python names,
    with their ids (``threads`` counts them all; at most
    :data:`MAX_POOL_TIDS` ids are listed in all), and the pools its
    libraries configured (torch's intra-op size where it was read on the
    pool's thread, threadpoolctl's libraries when already scanned). Cheap:
    no library is scanned here."""
    main = threading.main_thread()
    groups: dict[str, list[int]] = {}
    for t in threading.enumerate():
        tid = t.native_id
        if tid is not None and t is not main:
            groups.setdefault(pool_name(t.name), []).append(tid)
    out: list[dict[str, object]] = []
    room = MAX_POOL_TIDS
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    for name, tids in ranked[: MAX_POOLS - 4]:
        kept = sorted(tids)[: max(room, 0)]
        room -= len(kept)
        out.append(
            {
                "name": printable(name, MAX_NAME),
                "kind": "threads",
                "threads": len(tids),
                "tids": kept,
            }
        )
    out.extend(
        {"name": name, "kind": "configured", "threads": n, "tids": list(tids)}
        for name, n, tids in configured_pools(scan=False)[:4]
    )
    return out
