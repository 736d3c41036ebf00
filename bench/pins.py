"""Pinning a thread and releasing it: cpupin's registered pin against the
plain ``os`` calls a user would otherwise make.

In one process, the cases interleaved round by round so that a slow
stretch of the machine hits them alike: the calling thread pinned to the
process mask and put back with ``pin_current_thread`` + ``release`` with
the host's registry on (the record in a fresh lock directory, updated at
each pin and each release) and off (as ``CPUPIN_REGISTRY=0`` leaves it),
against a read of the old mask and two ``os.sched_setaffinity`` calls.
Medians, and the spread (lowest and highest round).

    python bench/pins.py [--rounds 15] [--number 2000]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from _env import fmt_ns, per_call_ns, start

    args = start(__doc__ or "", rounds=15, number=2000)
    lock_dir = tempfile.mkdtemp(prefix="cpupin-bench-")
    os.environ["CPUPIN_LOCK_DIR"] = lock_dir
    try:
        import cpupin
        from cpupin.registry import writer

        cpus = cpupin.process_cpus()
        mask = set(cpus)

        def pin_release() -> None:
            cpupin.pin_current_thread(cpus).release()

        def with_os() -> None:
            before = os.sched_getaffinity(0)
            os.sched_setaffinity(0, mask)
            os.sched_setaffinity(0, before)

        cases = {"registry on": False, "registry off": True, "os": None}
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for rnd in range(args.rounds + 1):  # the first round warms up
            for name, disabled in cases.items():
                if disabled is None:
                    ns = per_call_ns(with_os, args.number)
                else:
                    writer._disabled = disabled
                    ns = per_call_ns(pin_release, args.number)
                if rnd:
                    samples[name].append(ns)
        writer._disabled = False
        records = [n for n in os.listdir(lock_dir) if n.startswith("cpupin-proc-")]
        assert len(records) == 1, records  # the registry was on: one record, kept up
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in samples.items()}
    base = median["os"]
    print("| what | median | lowest-highest round | vs os | vs registry off |")
    print("|---|---|---|---|---|")
    rows = [
        ("pin_current_thread + release, registry on", "registry on"),
        ("pin_current_thread + release, registry off", "registry off"),
        ("os: sched_getaffinity + sched_setaffinity x2", "os"),
    ]
    for label, name in rows:
        ns = median[name]
        spread = f"{fmt_ns(min(samples[name]))}-{fmt_ns(max(samples[name]))}"
        off = f"{ns / median['registry off']:.2f}x" if name != "os" else ""
        print(f"| `{label}` | {fmt_ns(ns)} | {spread} | {ns / base:.1f}x | {off} |")


if __name__ == "__main__":
    main()
