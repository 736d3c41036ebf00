"""What this machine lets a wake-latency hold do, read from its own files (the oracle)."""

import errno
import os
from pathlib import Path

REAL = "/sys/devices/system/cpu/cpu{}/power/pm_qos_resume_latency_us"
DMA = "/dev/cpu_dma_latency"

DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")


def machine_refusal(sysfs=True):
    """The word a refused hold's message holds on this machine, or None where
    it should be taken. ``sysfs=False``: one of every CPU through
    /dev/cpu_dma_latency, which needs no per-CPU file.

    Judged from the files themselves, in the order a hold meets them: no
    cpuidle driver listed (many VMs list none); then the file missing (a
    container hides it); then a write the kernel refuses, asked of the
    kernel with access(2): not root, or sysfs mounted read-only (a
    container's default)."""
    try:
        driver = DRIVER.read_text().strip()
    except OSError:
        driver = ""
    if driver in ("", "none"):
        return "cpuidle"
    path = REAL.format(min(os.sched_getaffinity(0))) if sysfs else DMA
    if not os.path.exists(path):
        return "pm_qos_resume_latency_us" if sysfs else "cpu_dma_latency"
    if os.access(path, os.W_OK):
        return None
    if os.geteuid() != 0:
        return "root"
    try:  # root, and still refused: os.access does not say why; open does
        os.close(os.open(path, os.O_WRONLY))
    except OSError as exc:
        return "read-only" if exc.errno == errno.EROFS else os.strerror(exc.errno or 0)
    return None
