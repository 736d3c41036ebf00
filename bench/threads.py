"""Starting threads and pools: cpupin's against the standard library's.

Start+join of ``cpupin.Thread`` against ``threading.Thread``, one start at
a time, the cases in a new random order for each start (``--starts`` of
each), with ``threading.Thread`` in twice: the second is the control, and
its ratio to the first says how far the figures can be trusted (rounds of
1,000 starts a case drifted by up to 16% against themselves on a 2-vCPU
VM; one start at a time, by 0.5% at most). Then a warm
``submit().result()`` on ``cpupin.ThreadPool`` against
``ThreadPoolExecutor``, paired in rounds; medians and ratios. ``--cpu0``
pins the process to CPU 0 first (as ``taskset -c 0`` would): on two CPUs a
new thread that lands on the other CPU pays a cross-CPU wake and the
figures turn bimodal.

``--parts`` measures why a few lines of Python matter here: what a C call
(``on_mask``) and encoding a name take inside a loop of starts against the
same calls warm, and what each adds to a start when made in the creator.

``--before-start`` measures instead what work in a new thread costs before
it sets its start event (where ``cpupin.Thread`` names it): a plain
``threading.Thread`` against the same with, first in its
``_bootstrap_inner``, the kernel name (``prctl``, one call into C), a call
into C that makes no system call, a system call that keeps the GIL
(``threading.get_native_id``), an empty 25-step Python loop, or the name
after the start event (in ``run``), with each case's context switches a
start (``getrusage``).

    python bench/threads.py [--starts 5000] [--rounds 21] [--cpu0] [--parts | --before-start]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5000, help="starts a case, one at a time")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    parser.add_argument("--cpu0", action="store_true", help="run the process on CPU 0 only")
    parser.add_argument(
        "--before-start", action="store_true", help="what work before the start event costs"
    )
    parser.add_argument(
        "--parts", action="store_true", help="what small work costs inside a loop of starts"
    )
    args = parser.parse_args()
    if args.cpu0:
        os.sched_setaffinity(0, {0})  # before cpupin records the process mask
    if args.before_start:
        before_start(args.rounds, args.number)
        return
    if args.parts:
        parts(args.starts)
        return

    from _env import describe, fmt_ns, paired

    import cpupin

    print(describe())
    print(f"process mask {cpupin.format_cpulist(cpupin.process_cpus())}")
    print()

    from cpupin.threads import thread as cpupin_threads

    class Unnamed(cpupin.Thread):
        # The cost of the kernel name alone: the same start without it.
        def start(self) -> None:
            cpupin_threads._NAME_THREADS = False
            try:
                super().start()
            finally:
                cpupin_threads._NAME_THREADS = sys.version_info < (3, 14)

    times = one_at_a_time(
        {
            "threading.Thread": threading.Thread,
            "threading.Thread, again": threading.Thread,
            "cpupin.Thread": cpupin.Thread,
            "cpupin.Thread, no kernel name": Unnamed,
        },
        args.starts,
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
        ("threading.Thread, again", "threading.Thread"),
        ("cpupin.Thread", "threading.Thread"),
        ("cpupin.Thread, no kernel name", "threading.Thread"),
        ("cpupin.ThreadPool submit().result()", "ThreadPoolExecutor submit().result()"),
    ):
        print(f"| `{theirs}` | {fmt_ns(times[theirs])} | |")
        print(f"| `{mine}` | {fmt_ns(times[mine])} | {times[mine] / times[theirs]:.3f}x |")


def one_at_a_time(cases: dict[str, type], starts: int) -> dict[str, float]:
    """Median ns of a start+join of each class, timed one start at a time,
    the cases in a new random order for each start (seeded: the same order
    each run)."""
    import random
    import statistics
    import time

    clock = time.perf_counter_ns
    took: dict[str, list[int]] = {k: [] for k in cases}
    for cls in cases.values():
        for _ in range(300):  # warm up
            t = cls(target=int)
            t.start()
            t.join()
    order = list(cases.items())
    shuffle = random.Random(38).shuffle
    for _ in range(starts):
        shuffle(order)
        for key, cls in order:
            began = clock()
            t = cls(target=int)
            t.start()
            t.join()
            took[key].append(clock() - began)
    return {k: statistics.median(v) for k, v in took.items()}


def parts(starts: int) -> None:
    """Small work inside a loop of starts against the same work warm, and
    what it adds to a start when the creator does it first."""
    import statistics
    import time

    from _env import describe, fmt_ns

    from cpupin import _native
    from cpupin.process.mask import process_cpus

    print(describe())
    print(f"process mask {sorted(os.sched_getaffinity(0))}")
    print()
    cpus = process_cpus()
    clock = time.perf_counter_ns

    def spin() -> None:
        for _ in range(12):
            pass

    work: dict[str, Callable[[threading.Thread], object]] = {
        "`on_mask()` (one C call, a system call)": lambda t: _native.on_mask(cpus),
        "`thread_name_bytes(name)`": lambda t: _native.thread_name_bytes(t.name),
        "`name.encode()`": lambda t: t.name.encode(),
        "a 12-step empty loop": lambda t: spin(),
    }
    print("| work | warm | inside a loop of starts |")
    print("|---|---|---|")
    for label, fn in work.items():
        t = threading.Thread(target=int)
        warm, cold = [], []
        for _ in range(starts // 2):
            began = clock()
            fn(t)
            warm.append(clock() - began)
        for _ in range(starts // 2):
            t = threading.Thread(target=int)
            began = clock()
            fn(t)
            cold.append(clock() - began)
            t.start()
            t.join()
        print(
            f"| {label} | {fmt_ns(statistics.median(warm))} | {fmt_ns(statistics.median(cold))} |"
        )
    print()

    def first(fn: Callable[[threading.Thread], object]) -> type:
        class First(threading.Thread):
            def start(self) -> None:
                fn(self)
                super().start()

        return First

    cases: dict[str, type] = {"threading.Thread": threading.Thread}
    cases.update({f"{label} first": first(fn) for label, fn in work.items()})
    times = one_at_a_time(cases, starts)
    plain = times["threading.Thread"]
    print("| the creator's first work | start+join | added |")
    print("|---|---|---|")
    for key, ns in times.items():
        print(f"| {key} | {fmt_ns(ns)} | {fmt_ns(ns - plain)} |")


def before_start(rounds: int, number: int) -> None:
    import resource
    import statistics
    import time

    from _env import describe

    from cpupin import _native

    print(describe())
    print(f"process mask {sorted(os.sched_getaffinity(0))}")
    print()
    state = _native.step_marker(4)[2]
    own, name = _native.lib.cpupin_step_own, _native.set_thread_name_bytes
    boot, run = threading.Thread._bootstrap_inner, threading.Thread.run

    def loop() -> None:
        for _ in range(25):
            pass

    def first(work: Callable[[], object]) -> type:
        class First(threading.Thread):
            def _bootstrap_inner(self) -> None:
                work()
                boot(self)

        return First

    class NamedInRun(threading.Thread):
        def run(self) -> None:
            name(b"named-in-run")
            run(self)

    cases: dict[str, type] = {
        "threading.Thread": threading.Thread,
        "the kernel name first": first(lambda: name(b"named-first")),
        "a call into C, no system call, first": first(lambda: own(state)),
        "get_native_id() first (a system call, GIL kept)": first(threading.get_native_id),
        "an empty 25-step loop first": first(loop),
        "the kernel name in run(), after the start event": NamedInRun,
    }
    took: dict[str, list[float]] = {k: [] for k in cases}
    switches: dict[str, list[float]] = {k: [] for k in cases}
    for cls in cases.values():
        for _ in range(number // 10):
            t = cls(target=int)
            t.start()
            t.join()
    for _ in range(rounds):
        for key, cls in cases.items():
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter_ns()
            for _ in range(number):
                t = cls(target=int)
                t.start()
                t.join()
            ns = (time.perf_counter_ns() - start) / number
            after = resource.getrusage(resource.RUSAGE_SELF)
            took[key].append(ns)
            moved = after.ru_nvcsw - before.ru_nvcsw + after.ru_nivcsw - before.ru_nivcsw
            switches[key].append(moved / number)
    plain = statistics.median(took["threading.Thread"])
    print("| new thread's first work | start+join | ratio | context switches a start |")
    print("|---|---|---|---|")
    for key in cases:
        ns = statistics.median(took[key])
        print(
            f"| {key} | {ns / 1e3:.2f} µs | {ns / plain:.3f}x | "
            f"{statistics.median(switches[key]):.2f} |"
        )


if __name__ == "__main__":
    main()
