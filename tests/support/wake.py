"""What this machine lets a wake-latency hold do, read from its own files (the oracle)."""

import os
from pathlib import Path

REAL = "/sys/devices/system/cpu/cpu{}/power/pm_qos_resume_latency_us"


DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")


def machine_refusal(sysfs=True):
    """Why this machine refuses a hold (``sysfs=False``: one of every CPU
    through /dev/cpu_dma_latency, which needs no per-CPU file), from the
    files themselves (the oracle), or None where it should be taken."""
    try:
        driver = DRIVER.read_text().strip()
    except OSError:
        driver = ""
    if driver in ("", "none"):
        return "cpuidle"
    if os.geteuid() != 0:
        return "root"
    if sysfs and not os.path.exists(REAL.format(min(os.sched_getaffinity(0)))):
        return "pm_qos_resume_latency_us"
    if not sysfs and not os.path.exists("/dev/cpu_dma_latency"):
        return "cpu_dma_latency"
    return None
