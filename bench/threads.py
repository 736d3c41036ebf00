"""Starting threads and pools: cpupin's against the standard library's.

Paired in the same rounds: start+join of ``cpupin.Thread`` against
``threading.Thread``, and a warm ``submit().result()`` on ``cpupin.ThreadPool``
against ``ThreadPoolExecutor``; medians and ratios. ``--cpu0`` pins the
process to CPU 0 first (as ``taskset -c 0`` would): on two CPUs a new thread
that lands on the other CPU pays a cross-CPU wake and the figures turn
bimodal.

    python bench/threads.py [--rounds 21] [--cpu0]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    parser.add_argument("--cpu0", action="store_true", help="run the process on CPU 0 only")
    args = parser.parse_args()
    if args.cpu0:
        os.sched_setaffinity(0, {0})  # before cpupin records the process mask

    from _env import describe, fmt_ns, paired

    import cpupin

    print(describe())
    print(f"process mask {cpupin.format_cpulist(cpupin.process_cpus())}")
    print()

    def start_join(cls: type) -> None:
        t = cls(target=int)
        t.start()
        t.join()

    from cpupin.threads import thread as cpupin_threads

    def unnamed() -> None:
        # The cost of the kernel name alone: the same start without it.
        cpupin_threads._NAME_THREADS = False
        try:
            start_join(cpupin.Thread)
        finally:
            cpupin_threads._NAME_THREADS = sys.version_info < (3, 14)

    times = paired(
        {
            "threading.Thread": lambda: start_join(threading.Thread),
            "cpupin.Thread": lambda: start_join(cpupin.Thread),
            "cpupin.Thread, no kernel name": unnamed,
        },
        args.number,
        args.rounds,
    )
    plain = ThreadPoolExecutor(1)
    ours = cpupin.ThreadPool(1)
    plain.submit(int).result()
    ours.submit(int).result()
    times.update(
        paired(
            {
                "ThreadPoolExecutor submit().result()": lambda: plain.submit(int).result(),
                "cpupin.ThreadPool submit().result()": lambda: ours.submit(int).result(),
            },
            args.number * 5,
            args.rounds,
        )
    )
    plain.shutdown()
    ours.shutdown()
    print("| what | median | ratio to the standard library |")
    print("|---|---|---|")
    for mine, theirs in (
        ("cpupin.Thread", "threading.Thread"),
        ("cpupin.Thread, no kernel name", "threading.Thread"),
        ("cpupin.ThreadPool submit().result()", "ThreadPoolExecutor submit().result()"),
    ):
        print(f"| `{theirs}` | {fmt_ns(times[theirs])} | |")
        print(f"| `{mine}` | {fmt_ns(times[mine])} | {times[mine] / times[theirs]:.3f}x |")


if __name__ == "__main__":
    main()
