"""Guarding pins: a pin holds only until something else sets the thread's
mask. OpenMP runtimes bind the thread that loads them or starts a team
(``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``, ``OMP_PROC_BIND``/``OMP_PLACES``),
NCCL binds the thread that creates a communicator to its GPU's CPUs, and a
framework's own affinity code, or ``taskset -p``, may move any thread.

:func:`check_pins` compares every registered pin of this process with its
thread's mask now (one native call a pin), names the likely cause of each
drift, re-applies the pin when asked, and counts it: in the process's
record (``cpupin ps``, ``cpupin audit``) and in Prometheus
(``cpupin_pin_drift_total``). :func:`guard_pins` runs that check on a
low-rate thread of its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import replace

from cpupin import _native
from cpupin.errors import excerpt
from cpupin.threads._drift import AFFINITY_VARS, Drift, likely_cause, nccl_loaded

__all__ = [
    "AFFINITY_VARS",
    "Drift",
    "PinGuard",
    "check_pins",
    "drift_total",
    "guard_pins",
    "likely_cause",
]

log = logging.getLogger("cpupin")

_lock = threading.Lock()
_total = 0
_last = ""
_warned: set[tuple[int, frozenset[int]]] = set()


def drift_total() -> int:
    """How many drifts :func:`check_pins` has found in this process."""
    return _total


def check_pins(*, reapply: bool = False) -> list[Drift]:
    """Every registered pin of this process whose thread is off it now, with
    its likely cause; ``reapply`` pins each back (a thread that exited, or
    whose tid names another thread now, is left alone). Each drift is
    counted, logged once, and put in the process's record."""
    global _total, _last
    from cpupin.process.mask import process_cpus
    from cpupin.threads import pins as table

    with table._pins_lock:
        pins = list(table._pins.items())
    drifts = []
    mask = process_cpus()
    nccl = nccl_loaded()
    for tid, pin in pins:
        cpus, role, name, started = pin
        found = table._drift(tid, cpus, role, name, started, mask, nccl)
        if found is None:
            continue  # on its pin, or it exited: the next publish drops its pin
        # Judged again and re-applied under the pins' lock, the lock release
        # takes: a pin released since (its thread back on its old mask) is
        # no drift and is never pinned again.
        with table._pins_lock:
            if table._pins.get(tid) != pin:
                continue
            if reapply:
                found = table._drift(tid, cpus, role, name, started, mask, nccl)
                if found is None:
                    continue
                try:
                    _native.set_affinity(cpus, tid)
                    found = replace(found, reapplied=True)
                except (OSError, ValueError):
                    pass
        drifts.append(found)
    if drifts:
        with _lock:
            _total += len(drifts)
            _last = drifts[-1].describe()
            fresh = [d for d in drifts if (d.tid, d.now) not in _warned]
            _warned.update((d.tid, d.now) for d in fresh)
        for d in fresh:
            log.warning("cpupin: pin drift: %s", d.describe())
        _publish()
    return drifts


def _publish() -> None:
    from cpupin.registry import writer as registry

    registry.describe_process(pin_drift={"total": _total, "last": _last})


class PinGuard:
    """A low-rate check of this process's pins (:func:`guard_pins`)."""

    def __init__(
        self, interval: float, reapply: bool, on_drift: Callable[[Drift], object] | None
    ) -> None:
        self.interval = interval
        self.reapply = reapply
        self.on_drift = on_drift
        self.checks = 0
        self._stop = threading.Event()
        from cpupin.threads.thread import Thread

        self._thread = Thread(target=self._run, name="cpupin-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                found = check_pins(reapply=self.reapply)
            except Exception:  # noqa: BLE001 - a guard never takes the runtime down
                log.exception("cpupin: the pin guard's check failed")
                continue
            self.checks += 1
            for d in found:
                if self.on_drift is not None:
                    try:
                        self.on_drift(d)
                    except Exception:  # noqa: BLE001 - the user's callback
                        log.exception("cpupin: on_drift raised")

    def stop(self) -> None:
        """Stop checking (returns once the guard's thread has ended)."""
        self._stop.set()
        if self._thread.ident != threading.get_ident():
            self._thread.join()

    def __enter__(self) -> PinGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def guard_pins(
    interval: float = 1.0,
    *,
    reapply: bool = True,
    on_drift: Callable[[Drift], object] | None = None,
) -> PinGuard:
    """Check this process's pins every ``interval`` seconds on a thread of
    cpupin's own (started on the process mask), re-apply a pin found off
    its CPUs (``reapply=False`` only reports), and call ``on_drift`` with
    each drift. A check costs one native call a pin: at the default of once
    a second, microseconds a second."""
    if type(interval) not in (int, float) or not 0.01 <= interval <= 3600:
        raise ValueError(
            f"interval {excerpt(interval)} is not a number of seconds from 0.01 to 3600"
        )
    return PinGuard(float(interval), reapply, on_drift)


def _after_fork_in_child() -> None:
    global _lock, _total, _last
    _lock = threading.Lock()
    _total, _last = 0, ""
    _warned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
