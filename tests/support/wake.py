"""What this machine lets a wake-latency hold do, read from its own files (the
oracle); the fake sysfs trees the holds' tests write, and the mount
namespace where the real files are held."""

import errno
import os
import shutil
import subprocess
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


def tree(root, values):
    base = root / "sys/devices/system/cpu"
    base.mkdir(parents=True)
    (base / "online").write_text(f"0-{max(values)}\n")
    (base / "cpuidle").mkdir()
    (base / "cpuidle/current_driver").write_text("intel_idle\n")
    for cpu, text in values.items():
        (base / f"cpu{cpu}/power").mkdir(parents=True)
        (base / f"cpu{cpu}/power/pm_qos_resume_latency_us").write_text(text + "\n")
    return root


def values(root, cpus):
    rel = "sys/devices/system/cpu/cpu{}/power/pm_qos_resume_latency_us"
    return {c: (root / rel.format(c)).read_text().strip() for c in cpus}


#: A mount namespace where cpuidle names a driver, whatever this host lists
#: (a driver, "none" as many VMs, or nothing at all under a tmpfs, as CI's
#: no-idle pass shows it): a fresh tmpfs over the cpuidle folder, holding
#: only that name. The PM QoS files and /dev/cpu_dma_latency stay the real ones.
CPUIDLE = "/sys/devices/system/cpu/cpuidle"
NAMESPACE = (
    f"mount --make-rprivate / && mount -t tmpfs none {CPUIDLE} && "
    f'echo intel_idle > {CPUIDLE}/current_driver && exec "$@"'
)


def cpuidle_refusal():
    if not os.path.isdir(CPUIDLE):
        return f"this kernel has no {CPUIDLE} folder to name a driver in (CONFIG_CPU_IDLE off)"
    return None


def namespace_refusal():
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    if os.geteuid() != 0:
        return "a mount namespace and the real PM QoS files need root"
    cpu = min(os.sched_getaffinity(0))
    if not os.path.exists(REAL.format(cpu)):
        return "this kernel exposes no pm_qos_resume_latency_us"
    if cpuidle_refusal():
        return cpuidle_refusal()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare -m refused: {probe.stderr.decode()[:80]}"
    if not os.access(REAL.format(cpu), os.W_OK):
        return "the real PM QoS files are read-only here"
    return None


#: A holder of fake-tree CPUs that SIGKILLs itself at step ``kill_at`` (1
#: and on) of its hold or its release (``holds.checkpoint``), or prints the
#: number of steps it went through: ``ROOT CPUS MAX_US PHASE KILL_AT``, with
#: PHASE ``hold``, ``release`` or ``wait`` (says ``ready``, waits for a line).
STEPPED_HOLDER = """
import os, signal, sys
import cpupin
from cpupin.registry import holds

root, cpus, max_us, phase, kill_at = sys.argv[1:6]
steps = []
active = phase == "hold"
def checkpoint(what):
    steps.append(what)
    if active and len(steps) == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)
holds.checkpoint = checkpoint
hold = cpupin.hold_wake_latency({int(c) for c in cpus.split(",")}, int(max_us), root=root)
if phase == "release":
    steps.clear()
    active = True
    hold.release()
elif phase == "wait":
    print("ready", flush=True)
    sys.stdin.readline()
print(len(steps), flush=True)
"""
