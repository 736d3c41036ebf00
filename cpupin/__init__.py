"""cpupin: pin the threads of a GPU model-serving runtime to the right CPUs.

The native layer (tids, the current CPU, thread affinity with CPU sets sized
at run time, schedstat reads), CPU lists, and the process mask. See the
README for the guide.
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
from .cpulist import format_cpulist, parse_cpulist, parse_cpumask
from .errors import UnsupportedPlatform
from .process import process_cpus, set_process_cpus

__version__ = "0.1.0"

__all__ = [
    "HAVE_AFFINITY",
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
