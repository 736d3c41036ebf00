"""cpupin: pin the threads of a GPU model-serving runtime to the right CPUs.

The native layer (tids, the current CPU, thread affinity with CPU sets sized
at run time, schedstat reads), CPU lists and the process mask; the host's
topology and the CPU plan; placement, the lock per GPU and the server plan;
threads and pools that start on the process mask, and pinning step threads;
pools capped to the usable CPUs, their census, and the step clock.
See the README for the guide.
"""

from __future__ import annotations

import os
import sys
from _thread import RLock

# Recorded at import, from the main thread, before anything can pin: the
# process mask (see cpupin.process.mask). Pinning (cpupin.threads.pins, with the
# record it writes) and cpupin.Thread are imported here too: a signal handler that pins while
# the main thread is in the middle of a first, lazy import of it would
# find it half made. Everything else is imported on first use, so that
# ``import cpupin`` costs little more than the native layer
# (bench/RESULTS.md).
from cpupin.process.mask import process_cpus, set_process_cpus
from cpupin.threads.pins import (
    Pin,
    ThreadInfo,
    pin_current_thread,
    pin_step_thread,
    pinned_threads,
    refresh_process_cpus,
    register_warmup,
    stray_threads,
)

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any

    from cpupin._native import (
        HAVE_AFFINITY,
        SchedStat,
        ThreadStat,
        get_affinity,
        getcpu,
        gettid,
        online_cpus,
        schedstat,
        set_affinity,
        thread_stats,
    )
    from cpupin.act.binding import bind_process
    from cpupin.act.server import ServerPlan, child_env, plan_server, resolve_devices
    from cpupin.act.wake import HoldRefused, WakeHold, hold_wake_latency
    from cpupin.cpulist import format_cpulist, parse_cpulist, parse_cpumask
    from cpupin.errors import PlanError, UnsupportedPlatform
    from cpupin.host.irqs import IrqOnPin, read_irqs
    from cpupin.host.launcher import CpuOrigin, explain_cpus
    from cpupin.host.numa_memory import NodeMemory, memory_by_node
    from cpupin.host.topology import (
        Core,
        CoreClass,
        Gpu,
        Host,
        IdleState,
        Node,
        Quota,
        parse_pci_address,
        read_host,
    )
    from cpupin.measure.handoff import HandoffResult
    from cpupin.measure.sampling import Sampler, ThreadSample, sample_threads
    from cpupin.measure.stepclock import Step, StepClock
    from cpupin.plan.binding import Binding, decide_binding
    from cpupin.plan.cpuplan import CpuPlan
    from cpupin.plan.placement import (
        Placement,
        WorkerPlacement,
        parse_setting,
        place,
        setting_from_env,
    )
    from cpupin.pools.census import Census, Pool, census
    from cpupin.pools.limits import (
        PoolLimits,
        apply_thread_limits,
        cpu_plan,
        limit_pools,
        pool_env,
        usable_cpus,
    )
    from cpupin.registry.lock import Claim, claim_gpus
    from cpupin.threads.guard import Drift, PinGuard, check_pins, guard_pins
    from cpupin.threads.thread import Queue, Thread, ThreadPool

__version__ = "0.1.0"

#: Each public name not imported above to the module that defines it,
#: imported on first use.
_LAZY: dict[str, str] = {
    "Binding": "plan.binding",
    "Census": "pools.census",
    "apply_thread_limits": "pools.limits",
    "Claim": "registry.lock",
    "Core": "host.topology",
    "CoreClass": "host.topology",
    "CpuOrigin": "host.launcher",
    "explain_cpus": "host.launcher",
    "IrqOnPin": "host.irqs",
    "read_irqs": "host.irqs",
    "CpuPlan": "plan.cpuplan",
    "Gpu": "host.topology",
    "HAVE_AFFINITY": "_native",
    "HandoffResult": "measure.handoff",
    "Host": "host.topology",
    "IdleState": "host.topology",
    "Node": "host.topology",
    "Placement": "plan.placement",
    "PlanError": "errors",
    "Pool": "pools.census",
    "PoolLimits": "pools.limits",
    "Quota": "host.topology",
    "Sampler": "measure.sampling",
    "SchedStat": "_native",
    "ServerPlan": "act.server",
    "Step": "measure.stepclock",
    "StepClock": "measure.stepclock",
    "Thread": "threads.thread",
    "ThreadPool": "threads.thread",
    "Queue": "threads.thread",
    "ThreadSample": "measure.sampling",
    "ThreadStat": "_native",
    "UnsupportedPlatform": "errors",
    "WorkerPlacement": "plan.placement",
    "bind_process": "act.binding",
    "census": "pools.census",
    "child_env": "act.server",
    "claim_gpus": "registry.lock",
    "cpu_plan": "pools.limits",
    "decide_binding": "plan.binding",
    "format_cpulist": "cpulist",
    "get_affinity": "_native",
    "getcpu": "_native",
    "gettid": "_native",
    "limit_pools": "pools.limits",
    "online_cpus": "_native",
    "parse_cpulist": "cpulist",
    "parse_cpumask": "cpulist",
    "parse_pci_address": "host.topology",
    "parse_setting": "plan.placement",
    "place": "plan.placement",
    "plan_server": "act.server",
    "pool_env": "pools.limits",
    "read_host": "host.topology",
    "resolve_devices": "act.server",
    "sample_threads": "measure.sampling",
    "schedstat": "_native",
    "set_affinity": "_native",
    "setting_from_env": "plan.placement",
    "thread_stats": "_native",
    "usable_cpus": "pools.limits",
    "HoldRefused": "act.wake",
    "WakeHold": "act.wake",
    "hold_wake_latency": "act.wake",
    "NodeMemory": "host.numa_memory",
    "Drift": "threads.guard",
    "PinGuard": "threads.guard",
    "check_pins": "threads.guard",
    "guard_pins": "threads.guard",
    "memory_by_node": "host.numa_memory",
}


#: Modules the guides reach as attributes of the package (``cpupin.handoff``
#: in docs/pinning.md), by the name they had before the package had parts.
_MODULES: dict[str, str] = {"handoff": "measure.handoff"}


def __getattr__(name: str) -> Any:
    """A public name, or a submodule, imported when first asked for."""
    if name in _MODULES:
        found = _load(_MODULES[name])
        globals()[name] = found
        return found
    module = _LAZY.get(name)
    if module is None:
        try:
            return _load(name)
        except ModuleNotFoundError:
            raise AttributeError(f"module 'cpupin' has no attribute {name!r}") from None
    value = getattr(_load(module), name)
    globals()[name] = value
    return value


# A lazy import runs under this lock, which a fork waits for: a child forked
# while another thread was half way through importing a module would find it
# half made, its import lock held by a thread the child does not have, and
# hang on its first use of the name.
_import_lock = RLock()


def _load(module: str) -> Any:
    """Import ``cpupin.<module>`` under :data:`_import_lock`, with the
    catchable asynchronous signals held back in the main thread meanwhile:
    a handler that ran half way through the import would find the module
    half made (``partially initialized module``); held back, it runs as
    soon as the import is done."""
    held = None
    # threading is not imported with cpupin (3 ms): without it no thread
    # can be told from the main one, and holding signals in another thread
    # (its own mask, given back after) costs nothing.
    threading = sys.modules.get("threading")
    main = getattr(threading, "main_thread", None)
    if main is None or threading.current_thread() is main():  # type: ignore[union-attr]
        import signal

        if hasattr(signal, "pthread_sigmask"):
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _asynchronous(signal))
    try:
        with _import_lock:
            # __import__, not importlib.import_module: importlib (and the
            # warnings it loads) would cost every `import cpupin` 0.5 ms.
            __import__(f"{__name__}.{module}")
            return sys.modules[f"{__name__}.{module}"]
    finally:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _asynchronous(signal: Any) -> set[Any]:
    """Every signal but those the kernel sends for a fault of the thread
    itself (held back, those would kill the process)."""
    faults = {
        getattr(signal, n, None)
        for n in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT")
    }
    return set(signal.valid_signals()) - faults


def _before_fork() -> None:
    _import_lock.acquire()


def _after_fork_in_parent() -> None:
    _import_lock.release()


def _after_fork_in_child() -> None:
    """A fresh lock; and a cpupin module another thread was importing when
    the process forked (by a path other than this package's names) is
    forgotten, so that the child imports it afresh instead of waiting for
    a thread it does not have."""
    global _import_lock
    _import_lock = RLock()
    bootstrap = sys.modules.get("_frozen_importlib")
    locks = getattr(bootstrap, "_module_locks", None)
    for name, mod in list(sys.modules.items()):
        if name.startswith("cpupin.") and getattr(
            getattr(mod, "__spec__", None), "_initializing", False
        ):
            del sys.modules[name]
            if isinstance(locks, dict):
                locks.pop(name, None)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "HAVE_AFFINITY",
    "Binding",
    "Census",
    "Pool",
    "PoolLimits",
    "Step",
    "StepClock",
    "census",
    "cpu_plan",
    "limit_pools",
    "apply_thread_limits",
    "pool_env",
    "usable_cpus",
    "bind_process",
    "decide_binding",
    "Claim",
    "HandoffResult",
    "Core",
    "CoreClass",
    "CpuOrigin",
    "CpuPlan",
    "IrqOnPin",
    "explain_cpus",
    "read_irqs",
    "Gpu",
    "Host",
    "IdleState",
    "Node",
    "PlanError",
    "Placement",
    "Quota",
    "Pin",
    "ServerPlan",
    "Thread",
    "ThreadInfo",
    "ThreadPool",
    "Queue",
    "Sampler",
    "ThreadSample",
    "WorkerPlacement",
    "child_env",
    "claim_gpus",
    "parse_pci_address",
    "parse_setting",
    "pin_current_thread",
    "pin_step_thread",
    "pinned_threads",
    "refresh_process_cpus",
    "register_warmup",
    "stray_threads",
    "place",
    "plan_server",
    "read_host",
    "resolve_devices",
    "sample_threads",
    "setting_from_env",
    "SchedStat",
    "ThreadStat",
    "UnsupportedPlatform",
    "__version__",
    "format_cpulist",
    "get_affinity",
    "getcpu",
    "gettid",
    "online_cpus",
    "parse_cpulist",
    "parse_cpumask",
    "process_cpus",
    "schedstat",
    "set_affinity",
    "set_process_cpus",
    "thread_stats",
    "HoldRefused",
    "WakeHold",
    "hold_wake_latency",
    "NodeMemory",
    "memory_by_node",
    "Drift",
    "PinGuard",
    "check_pins",
    "guard_pins",
]
