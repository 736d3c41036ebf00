"""cpupin: pin the threads of a GPU model-serving runtime to the right CPUs.

The native layer (tids, the current CPU, thread affinity with CPU sets sized
at run time, schedstat reads), CPU lists and the process mask; the host's
topology and the CPU plan; placement, the lock per GPU and the server plan;
threads and pools that start on the process mask, and pinning step threads;
pools capped to the usable CPUs, their census, and the step clock.
See the README for the guide.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

# Recorded at import, from the main thread, before anything can pin: the
# process mask (see cpupin.process). Pinning (cpupin.threads, with the
# record it writes) is imported here too: a signal handler that pins while
# the main thread is in the middle of a first, lazy import of it would
# find it half made. Everything else is imported on first use, so that
# ``import cpupin`` costs little more than the native layer
# (bench/RESULTS.md).
from .process import process_cpus, set_process_cpus
from .threads import (
    Pin,
    Thread,
    ThreadInfo,
    pin_current_thread,
    pin_step_thread,
    pinned_threads,
    refresh_process_cpus,
    register_warmup,
    stray_threads,
)

if TYPE_CHECKING:
    from ._native import (
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
    from .binding import Binding, bind_process, decide_binding
    from .cpulist import format_cpulist, parse_cpulist, parse_cpumask
    from .cpuplan import CpuPlan
    from .errors import PlanError, UnsupportedPlatform
    from .guard import Drift, PinGuard, check_pins, guard_pins
    from .handoff import HandoffResult
    from .irqs import IrqOnPin, read_irqs
    from .launcher import CpuOrigin, explain_cpus
    from .lock import Claim, claim_gpus
    from .numa_memory import NodeMemory, memory_by_node
    from .placement import Placement, WorkerPlacement, parse_setting, place, setting_from_env
    from .pool_census import Census, Pool, census
    from .pools import PoolLimits, cpu_plan, limit_pools, pool_env, usable_cpus
    from .sampling import Sampler, ThreadSample, sample_threads
    from .server import ServerPlan, child_env, plan_server, resolve_devices
    from .stepclock import Step, StepClock
    from .threads import Queue, ThreadPool
    from .topology import (
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
    from .wake import HoldRefused, WakeHold, hold_wake_latency

__version__ = "0.1.0"

#: Each public name not imported above to the module that defines it,
#: imported on first use.
_LAZY: dict[str, str] = {
    "Binding": "binding",
    "Census": "pool_census",
    "Claim": "lock",
    "Core": "topology",
    "CoreClass": "topology",
    "CpuOrigin": "launcher",
    "explain_cpus": "launcher",
    "IrqOnPin": "irqs",
    "read_irqs": "irqs",
    "CpuPlan": "cpuplan",
    "Gpu": "topology",
    "HAVE_AFFINITY": "_native",
    "HandoffResult": "handoff",
    "Host": "topology",
    "IdleState": "topology",
    "Node": "topology",
    "Placement": "placement",
    "PlanError": "errors",
    "Pool": "pool_census",
    "PoolLimits": "pools",
    "Quota": "topology",
    "Sampler": "sampling",
    "SchedStat": "_native",
    "ServerPlan": "server",
    "Step": "stepclock",
    "StepClock": "stepclock",
    "ThreadPool": "threads",
    "Queue": "threads",
    "ThreadSample": "sampling",
    "ThreadStat": "_native",
    "UnsupportedPlatform": "errors",
    "WorkerPlacement": "placement",
    "bind_process": "binding",
    "census": "pool_census",
    "child_env": "server",
    "claim_gpus": "lock",
    "cpu_plan": "pools",
    "decide_binding": "binding",
    "format_cpulist": "cpulist",
    "get_affinity": "_native",
    "getcpu": "_native",
    "gettid": "_native",
    "limit_pools": "pools",
    "online_cpus": "_native",
    "parse_cpulist": "cpulist",
    "parse_cpumask": "cpulist",
    "parse_pci_address": "topology",
    "parse_setting": "placement",
    "place": "placement",
    "plan_server": "server",
    "pool_env": "pools",
    "read_host": "topology",
    "resolve_devices": "server",
    "sample_threads": "sampling",
    "schedstat": "_native",
    "set_affinity": "_native",
    "setting_from_env": "placement",
    "thread_stats": "_native",
    "usable_cpus": "pools",
    "HoldRefused": "wake",
    "WakeHold": "wake",
    "hold_wake_latency": "wake",
    "NodeMemory": "numa_memory",
    "Drift": "guard",
    "PinGuard": "guard",
    "check_pins": "guard",
    "guard_pins": "guard",
    "memory_by_node": "numa_memory",
}


def __getattr__(name: str) -> Any:
    """A public name, or a submodule, imported when first asked for."""
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
_import_lock = threading.RLock()


def _load(module: str) -> Any:
    """Import ``cpupin.<module>`` under :data:`_import_lock`, with the
    catchable asynchronous signals held back in the main thread meanwhile:
    a handler that ran half way through the import would find the module
    half made (``partially initialized module``); held back, it runs as
    soon as the import is done."""
    held = None
    if threading.current_thread() is threading.main_thread():
        import signal

        if hasattr(signal, "pthread_sigmask"):
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _asynchronous(signal))
    try:
        with _import_lock:
            return importlib.import_module(f".{module}", __name__)
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
    _import_lock = threading.RLock()
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
