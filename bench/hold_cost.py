"""What a journaled wake-latency hold costs to take and give up: cpupin's
``hold_wake_latency`` + ``release`` through sysfs (the journal written and
flushed before the writes, under its lock, and again after) against what a
user would otherwise do, writing each CPU's ``pm_qos_resume_latency_us`` and
writing the old value back. On a fake sysfs tree (no root or cpuidle
needed), with the lock directory on the disk (``/tmp``) and in memory
(``/dev/shm``), in alternating rounds.

    python bench/hold_cost.py [--rounds 15] [--number 50] [--cpus 2]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tree(base: str, cpus: int) -> str:
    root = os.path.join(base, "root")
    cpu = os.path.join(root, "sys/devices/system/cpu")
    os.makedirs(os.path.join(cpu, "cpuidle"))
    with open(os.path.join(cpu, "online"), "w") as f:
        f.write(f"0-{cpus - 1}\n")
    with open(os.path.join(cpu, "cpuidle/current_driver"), "w") as f:
        f.write("intel_idle\n")
    for c in range(cpus):
        os.makedirs(os.path.join(cpu, f"cpu{c}/power"))
        with open(os.path.join(cpu, f"cpu{c}/power/pm_qos_resume_latency_us"), "w") as f:
            f.write("0\n")
    return root


def main() -> None:
    from _env import fmt_ns, paired, start

    args = start(__doc__ or "", rounds=15, number=50, extra=[("--cpus", int, 2, "CPUs held")])
    import cpupin

    base = tempfile.mkdtemp(prefix="cpupin-bench-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="cpupin-bench-locks-", dir="/tmp")
    memory = tempfile.mkdtemp(prefix="cpupin-bench-locks-", dir="/dev/shm")
    try:
        root = tree(base, args.cpus)
        held = set(range(args.cpus))
        paths = [
            os.path.join(root, f"sys/devices/system/cpu/cpu{c}/power/pm_qos_resume_latency_us")
            for c in sorted(held)
        ]

        def by_hand() -> None:
            before = []
            for p in paths:
                with open(p) as f:
                    before.append(f.read().strip())
                with open(p, "w") as f:
                    f.write("n/a")
            for p, text in zip(paths, before, strict=True):
                with open(p, "w") as f:
                    f.write(text)

        def journaled(where: str):  # type: ignore[no-untyped-def]
            def case() -> None:
                os.environ["CPUPIN_LOCK_DIR"] = where
                cpupin.hold_wake_latency(held, 0, root=root).release()

            return case

        got = paired(
            {
                "hold + release, journal on /tmp": journaled(disk),
                "hold + release, journal on /dev/shm": journaled(memory),
                "by hand: write n/a, write back": by_hand,
            },
            args.number,
            args.rounds,
        )
    finally:
        for d in (base, disk, memory):
            shutil.rmtree(d, ignore_errors=True)
    hand = got["by hand: write n/a, write back"]
    print(f"{args.cpus} CPU(s), {args.rounds} rounds of {args.number}; median a hold and release")
    print()
    print("| case | median | vs by hand |")
    print("|---|---|---|")
    for name, ns in got.items():
        print(f"| {name} | {fmt_ns(ns)} | {ns / hand:.0f}x |")


if __name__ == "__main__":
    main()
