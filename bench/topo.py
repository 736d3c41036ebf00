"""Reading a host's topology: cpupin against what a user might run instead.

Prints the environment, then per-call medians: ``read_host`` of the shipped
DGX H100 tree (224 CPUs) and of this machine, the CPU plan, and hwloc's
``lstopo`` on the same tree (``HWLOC_FSROOT``) when it is installed, and
``psutil.cpu_count`` on this machine.

    python bench/topo.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository root: host specs read back in memory live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _env import describe, fmt_ns, paired, timed  # noqa: E402

from cpupin import cli
from cpupin.cli import _args as cli_args  # noqa: E402
from cpupin.cpulist import parse_cpulist  # noqa: E402
from cpupin.host import _sysfs  # noqa: E402
from cpupin.host.shapes import (  # noqa: E402
    HostSpec,  # noqa: E402
    _built,
    host_named,
)
from cpupin.host.topology import read_host  # noqa: E402
from cpupin.plan.cpuplan import CpuPlan  # noqa: E402
from tests.support.specs import spec_host  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--host", default="dgx-h100")
    args = parser.parse_args()
    print(describe())
    print()
    root = _built(args.host)
    host = host_named(args.host)
    print(f"tree: {args.host}, {len(host.cpus)} CPUs, {len(host.gpus)} GPUs, {root}")
    print()
    print("| what | median |")
    print("|---|---|")
    times = paired(
        {
            f"read_host({args.host} tree)": lambda: read_host(root),
            "CpuPlan.for_host": lambda: CpuPlan.for_host(host).pool_size(),
            "read_host('/') (this machine)": lambda: read_host("/"),
        },
        20,
        args.rounds,
    )
    try:
        import psutil

        times.update(
            paired(
                {"psutil.cpu_count(logical=False)": lambda: psutil.cpu_count(logical=False)},
                200,
                args.rounds,
            )
        )
    except ImportError:
        pass

    def walked() -> object:
        _sysfs._openat2 = False
        try:
            return read_host(root)
        finally:
            _sysfs._openat2 = True

    times.update(
        paired({f"read_host({args.host} tree), the walk (no openat2)": walked}, 20, args.rounds)
    )
    ranges = ",".join(["0-65535"] * 8000)
    times.update(
        paired({"parse_cpulist(8,000 x '0-65535')": lambda: parse_cpulist(ranges)}, 1, args.rounds)
    )
    for what, ns in times.items():
        print(f"| `{what}` | {fmt_ns(ns)} |")
    huge_host = spec_host(
        HostSpec("huge", sockets=1024, nodes_per_socket=2, cores_per_node=16, threads=2)
    )
    cli_args.load_host = lambda a: (huge_host, "huge", huge_host.cpus)
    out = open(os.devnull, "w")
    for argv in (["topo"], ["plan", "--gpu", "0000:01:00.0", "--setting", "auto"]):
        for flag in ([], ["--json"]):
            samples = []
            for _ in range(max(3, args.rounds // 5)):
                stdout, sys.stdout = sys.stdout, out
                start = time.perf_counter_ns()
                try:
                    cli.main(argv + flag)
                finally:
                    sys.stdout = stdout
                samples.append(time.perf_counter_ns() - start)
            label = " ".join(["cpupin", *argv, *flag])
            print(
                f"| `{label}` on 65,536 CPUs, 2,048 nodes | {fmt_ns(statistics.median(samples))} |"
            )
    lstopo = shutil.which("lstopo-no-graphics")
    if lstopo:
        env = {**os.environ, "HWLOC_FSROOT": root, "HWLOC_COMPONENTS": "-x86"}
        ns = timed([lstopo, "--of", "xml", "-"], args.rounds, env)
        print(f"| `HWLOC_FSROOT=tree lstopo-no-graphics --of xml` (a process) | {fmt_ns(ns)} |")
        ns = timed([sys.executable, "-c", "pass"], args.rounds)
        print(f"| `python -c pass` (a process, for scale) | {fmt_ns(ns)} |")
    else:
        print("| lstopo | not installed (apt-get install hwloc) |")


if __name__ == "__main__":
    main()
