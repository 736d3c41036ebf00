"""What a journaled wake-latency hold costs to take and give up: cpupin's
``hold_wake_latency`` + ``release`` through sysfs (the journal written and
flushed before the writes, under its lock, and again after) against what a
user would otherwise do, writing each CPU's ``pm_qos_resume_latency_us`` and
writing the old value back. On a fake sysfs tree (no root or cpuidle
needed), with the lock directory on the disk (``/tmp``) and in memory
(``/dev/shm``), in alternating rounds: without a warden
(``CPUPIN_WARDEN=0``: the journal's own cost), and with one, released at
once (its whole start and end in each pair). Then, as a server holds, the
hold and its release timed apart, the release once the warden has been up
for a moment, with a warden and without.

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

        def journaled(where: str, warden: str = "0"):  # type: ignore[no-untyped-def]
            def case() -> None:
                os.environ["CPUPIN_LOCK_DIR"] = where
                os.environ["CPUPIN_WARDEN"] = warden
                cpupin.hold_wake_latency(held, 0, root=root).release()

            return case

        got = paired(
            {
                "hold + release, journal on /tmp": journaled(disk),
                "hold + release, journal on /dev/shm": journaled(memory),
                "the same with its warden, released at once": journaled(memory, "1"),
                "by hand: write n/a, write back": by_hand,
            },
            args.number,
            args.rounds,
        )
        apart = held_apart(cpupin, root, held, memory, args.rounds)
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
    print()
    print(f"held {HELD_S} s, journal on /dev/shm: medians of {args.rounds}")
    print()
    print("| case | hold | release |")
    print("|---|---|---|")
    for name, (hold_ns, release_ns) in apart.items():
        print(f"| {name} | {fmt_ns(hold_ns)} | {fmt_ns(release_ns)} |")


#: How long a hold of the second table is held before its release.
HELD_S = 0.2


def held_apart(cpupin, root, held, where, rounds):  # type: ignore[no-untyped-def]
    import statistics
    import time

    os.environ["CPUPIN_LOCK_DIR"] = where
    out = {}
    names = ("with its warden", "no warden (CPUPIN_WARDEN=0)")
    samples: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in names}
    for _ in range(rounds):
        for name, (holds, releases) in samples.items():
            os.environ["CPUPIN_WARDEN"] = "1" if name == "with its warden" else "0"
            start = time.perf_counter_ns()
            hold = cpupin.hold_wake_latency(held, 0, root=root)
            holds.append(time.perf_counter_ns() - start)
            time.sleep(HELD_S)
            start = time.perf_counter_ns()
            hold.release()
            releases.append(time.perf_counter_ns() - start)
    for name, (holds, releases) in samples.items():
        out[name] = (statistics.median(holds), statistics.median(releases))
    return out


if __name__ == "__main__":
    main()
