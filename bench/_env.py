"""What every benchmark prints first: the machine it ran on."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def describe() -> str:
    lines = [f"date        {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"]
    lines.append(f"python      {sys.version.split()[0]} ({platform.python_implementation()})")
    lines.append(f"kernel      {platform.release()} {platform.machine()}")
    model = "?"
    hypervisor = False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and " hypervisor" in line:
                    hypervisor = True
    except OSError:
        pass
    lines.append(f"cpu         {model}{' (virtual machine)' if hypervisor else ''}")
    lines.append(f"cpus        {os.cpu_count()} online, mask {sorted(os.sched_getaffinity(0))}")
    states = []
    base = "/sys/devices/system/cpu/cpu0/cpuidle"
    try:
        for state in sorted(os.listdir(base)):
            with open(f"{base}/{state}/name") as f:
                name = f.read().strip()
            with open(f"{base}/{state}/latency") as f:
                latency = f.read().strip()
            states.append(f"{name} {latency} µs")
    except OSError:
        pass
    lines.append(f"idle states {', '.join(states) or 'none listed'}")
    versions = []
    for module in ("cffi", "psutil", "torch", "numpy"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            pass
    lines.append(f"packages    {', '.join(versions)}")
    return "\n".join(lines)


def per_call_ns(fn: Callable[[], object], number: int) -> float:
    """Nanoseconds a call of ``fn`` over ``number`` calls in a tight loop."""
    calls = range(number)
    start = time.perf_counter_ns()
    for _ in calls:
        fn()
    return (time.perf_counter_ns() - start) / number


def paired(cases: dict[str, Callable[[], object]], number: int, rounds: int) -> dict[str, float]:
    """Median per-call ns of each case, the cases interleaved round by round
    so that a slow stretch of the machine hits all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        per_call_ns(fn, max(1, number // 10))  # warm up
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(per_call_ns(fn, number))
    return {name: statistics.median(values) for name, values in samples.items()}


def fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def timed(cmd: list[str], rounds: int, env: dict[str, str] | None = None) -> float:
    """The median wall time of running ``cmd`` as a process, in ns."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        subprocess.run(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True
        )
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


def start(
    doc: str,
    rounds: int = 15,
    number: int | None = None,
    extra: Sequence[tuple[str, type, object, str]] = (),
) -> argparse.Namespace:
    """A benchmark's arguments (``--rounds``, ``--number`` calls a round
    where it takes one, and ``extra`` ones: flag, type, default, help),
    after printing the machine."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    if number is not None:
        parser.add_argument("--number", type=int, default=number, help="calls per round")
    for flag, kind, default, text in extra:
        parser.add_argument(flag, type=kind, default=default, help=text)
    args = parser.parse_args()
    print(describe())
    print()
    return args


@contextlib.contextmanager
def quota_cgroup(quota_cpus: float) -> Iterator[tuple[str, str] | None]:
    """A fresh cgroup with a CPU quota of ``quota_cpus`` a 100 ms period
    (cgroup v1's cpu controller, else v2's): yields (its folder, v1 or v2),
    or ``None`` where that needs root or no hierarchy has the controller.
    Processes left in it go back to the root cgroup and it is removed."""
    mount = kind = None
    if os.geteuid() == 0:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if parts[2] == "cgroup" and "cpu" in parts[3].split(","):
                    kind, mount = "v1", parts[1]
                    break
                if parts[2] == "cgroup2" and kind is None:
                    try:
                        if "cpu" in Path(parts[1], "cgroup.controllers").read_text().split():
                            kind, mount = "v2", parts[1]
                    except OSError:
                        pass
    if kind is None or mount is None:
        yield None
        return
    path = f"{mount}/cpupin-bench-{uuid.uuid4().hex[:8]}"
    if kind == "v2":
        Path(mount, "cgroup.subtree_control").write_text("+cpu")
    os.mkdir(path)
    try:
        quota = int(quota_cpus * 100_000)
        if kind == "v1":
            Path(path, "cpu.cfs_period_us").write_text("100000")
            Path(path, "cpu.cfs_quota_us").write_text(str(quota))
        else:
            Path(path, "cpu.max").write_text(f"{quota} 100000")
        yield path, kind
    finally:
        time.sleep(0.1)  # a child just killed may still be listed
        for pid in Path(path, "cgroup.procs").read_text().split():
            try:
                Path(mount, "cgroup.procs").write_text(pid)
            except OSError:
                pass
        os.rmdir(path)


def enter_cgroup(path: str) -> Callable[[], None]:
    """A ``preexec_fn`` that puts the child in the cgroup at ``path``."""

    def enter() -> None:
        Path(path, "cgroup.procs").write_text(str(os.getpid()))

    return enter
