"""The native layer against what a user would otherwise call.

Prints the environment, then a Markdown table: per-call medians of several
rounds, each cpupin call beside its alternative measured in the same rounds,
and the ratio (alternative / cpupin: above 1 means cpupin is faster).

    python bench/native.py [--rounds 15] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from _env import describe, fmt_ns, paired  # noqa: E402

import cpupin  # noqa: E402
from cpupin import _native  # noqa: E402

ROWS: list[tuple[str, str, float, float]] = []


def row(what: str, ours: str, theirs: str, times: dict[str, float]) -> None:
    ROWS.append((what, f"{ours} {fmt_ns(times[ours])}", times[ours], times[theirs]))
    ratio = times[theirs] / times[ours]
    print(
        f"| {what} | `{ours}` {fmt_ns(times[ours])} | `{theirs}` {fmt_ns(times[theirs])} "
        f"| {ratio:.2f}x |",
        flush=True,
    )


def park(count: int) -> tuple[threading.Event, list[threading.Thread]]:
    release = threading.Event()
    threads = [threading.Thread(target=release.wait, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return release, threads


def python_schedstat_loop() -> list[tuple[int, ...]]:
    out = []
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                out.append(tuple(map(int, f.read().split())))
        except OSError:
            pass
    return out


def first_call() -> object:
    _native._readers.clear()
    return cpupin.thread_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds per case (median taken)")
    parser.add_argument("--quick", action="store_true", help="fewer calls per round")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    print(describe())
    print()
    print("| call | cpupin | alternative | alternative / cpupin |")
    print("|---|---|---|---|")

    noop = _native.lib.cpupin_noop
    me = psutil.Process()
    cpus = sorted(os.sched_getaffinity(0))
    n = 200_000 // scale
    r = args.rounds

    times = paired(
        {"getcpu()": cpupin.getcpu, "no-op cffi call": noop, "psutil cpu_num()": me.cpu_num}, n, r
    )
    row("current CPU", "getcpu()", "no-op cffi call", times)
    row("current CPU", "getcpu()", "psutil cpu_num()", times)

    times = paired(
        {"gettid()": cpupin.gettid, "threading.get_native_id()": threading.get_native_id}, n, r
    )
    row("thread id", "gettid()", "threading.get_native_id()", times)

    times = paired(
        {
            "get_affinity()": cpupin.get_affinity,
            "os.sched_getaffinity(0)": lambda: os.sched_getaffinity(0),
        },
        n // 2,
        r,
    )
    row("own mask", "get_affinity()", "os.sched_getaffinity(0)", times)

    mask = frozenset(cpus)

    def os_set_and_check() -> None:
        os.sched_setaffinity(0, mask)
        if os.sched_getaffinity(0) != mask:
            raise ValueError(mask)

    times = paired(
        {
            "set_affinity(mask)": lambda: cpupin.set_affinity(mask),
            "os.sched_setaffinity(0, mask)": lambda: os.sched_setaffinity(0, mask),
            "os set, then get to check": os_set_and_check,
        },
        n // 4,
        r,
    )
    row("set own mask", "set_affinity(mask)", "os.sched_setaffinity(0, mask)", times)
    row("set own mask", "set_affinity(mask)", "os set, then get to check", times)

    # The same with another Python thread busy: a call that drops the GIL
    # waits for it to come back (cpupin's short calls keep it, as os does).
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        times = paired(
            {
                "set_affinity(mask)": lambda: cpupin.set_affinity(mask),
                "os.sched_setaffinity(0, mask)": lambda: os.sched_setaffinity(0, mask),
            },
            n // 40,
            r,
        )
        row(
            "set own mask, a 2nd thread spinning",
            "set_affinity(mask)",
            "os.sched_setaffinity(0, mask)",
            times,
        )
        release, threads = park(7)
        times = paired(
            {"thread_stats()": cpupin.thread_stats, "psutil threads()": me.threads},
            10,
            r,
        )
        row("all threads, 8, a 2nd thread spinning", "thread_stats()", "psutil threads()", times)
        release.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
        spinner.join()

    tid = threading.get_native_id()
    times = paired(
        {
            "schedstat()": cpupin.schedstat,
            "open().read() of schedstat": lambda: open(f"/proc/self/task/{tid}/schedstat").read(),
        },
        n // 20,
        r,
    )
    row("one thread's schedstat", "schedstat()", "open().read() of schedstat", times)

    for count in (8, 64, 256):
        release, threads = park(count - 1)
        try:
            calls = max(20, 4000 // count // scale)
            times = paired(
                {
                    "thread_stats()": cpupin.thread_stats,
                    "thread_stats(last_cpu=True)": lambda: cpupin.thread_stats(last_cpu=True),
                    "thread_stats() first call": first_call,
                    "psutil threads()": me.threads,
                    "Python schedstat loop": python_schedstat_loop,
                },
                calls,
                r,
            )
            what = f"all threads, {count} threads"
            row(what, "thread_stats()", "psutil threads()", times)
            row(what, "thread_stats()", "Python schedstat loop", times)
            row(what, "thread_stats() first call", "psutil threads()", times)
            row(what, "thread_stats() first call", "Python schedstat loop", times)
            row(what, "thread_stats(last_cpu=True)", "thread_stats()", times)
        finally:
            release.set()
            for t in threads:
                t.join()


if __name__ == "__main__":
    main()
