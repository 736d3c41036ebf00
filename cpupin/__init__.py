"""cpupin: pin the threads of a GPU model-serving runtime to the right CPUs.

The native layer (tids, the current CPU, thread affinity with CPU sets sized
at run time, schedstat reads), CPU lists and the process mask; the host's
topology and the CPU plan; placement, the lock per GPU and the server plan;
threads and pools that start on the process mask, and pinning step threads;
pools capped to the usable CPUs, their census, and the step clock.
See the README for the guide.
"""

from __future__ import annotations

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
from .handoff import HandoffResult  # also makes cpupin.handoff.handoff reachable
from .lock import Claim, claim_gpus
from .placement import Placement, WorkerPlacement, parse_setting, place, setting_from_env
from .pools import Census, Pool, PoolLimits, census, cpu_plan, limit_pools, pool_env, usable_cpus
from .process import process_cpus, set_process_cpus
from .sampling import Sampler, ThreadSample, sample_threads
from .server import ServerPlan, child_env, plan_server, resolve_devices
from .stepclock import Step, StepClock
from .threads import (
    Pin,
    Thread,
    ThreadInfo,
    ThreadPool,
    pin_current_thread,
    pin_step_thread,
    pinned_threads,
    refresh_process_cpus,
    register_warmup,
    stray_threads,
)
from .topology import Core, Gpu, Host, IdleState, Node, Quota, parse_pci_address, read_host

__version__ = "0.1.0"

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
    "CpuPlan",
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
]
