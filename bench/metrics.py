"""A Prometheus scrape of a process's threads: cpupin's collector against
psutil and a plain Python read of /proc for the same per-thread numbers.

Prints the environment, then medians over ``--rounds`` for a process of
``--threads`` threads: one scrape (``generate_latest`` of a registry holding
``cpupin.measure.metrics.ThreadCollector``), the collector's read alone, psutil's
``Process.threads()`` (CPU times only, no run-queue wait), and a Python loop
over ``/proc/self/task/*/schedstat``.

    python bench/metrics.py [--threads 500] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import describe, fmt_ns, paired  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(describe())
    print()
    import prometheus_client
    import psutil

    import cpupin
    from cpupin.measure.metrics import ThreadCollector

    stop = threading.Event()
    parked = [threading.Thread(target=stop.wait, daemon=True) for _ in range(args.threads - 1)]
    for t in parked:
        t.start()
    collectors = prometheus_client.CollectorRegistry()
    collector = ThreadCollector()
    collectors.register(collector)
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
    me = psutil.Process()

    def python_loop() -> int:
        total = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except OSError:
                pass
        return total

    print(f"threads {len(cpupin.thread_stats())}")
    print()
    print("| what | median |")
    print("|---|---|")
    times = paired(
        {
            "scrape: generate_latest(ThreadCollector)": lambda: prometheus_client.generate_latest(
                collectors
            ),
            "ThreadCollector.collect() alone": lambda: list(collector.collect()),
            "psutil Process.threads()": me.threads,
            "a Python loop over /proc/self/task/*/schedstat": python_loop,
        },
        3,
        args.rounds,
    )
    for what, ns in times.items():
        print(f"| `{what}` | {fmt_ns(ns)} |")
    pin.release()
    stop.set()


if __name__ == "__main__":
    main()
