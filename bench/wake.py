"""The wake-latency hold, measured: a handoff to an idle other CPU with no
hold, with the pair's ``pm_qos_resume_latency_us`` at ``n/a`` (sysfs), and
with ``/dev/cpu_dma_latency`` at 0 (every CPU), in alternating rounds; and
``perf bench sched pipe`` on the same two CPUs with and without the hold,
where perf is installed. Root, on a host with cpuidle.

    sudo python bench/wake.py [--cpus 0,1] [--rounds 5] [--handoffs 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _env import describe  # noqa: E402
from handoff import perf_pipe  # noqa: E402

import cpupin  # noqa: E402
from cpupin.measure.handoff import handoff  # noqa: E402

IDLE_US = 200


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default=None, help="the pair, A,B (default: the first two)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (5)")
    ap.add_argument("--handoffs", type=int, default=2000, help="handoffs a round (2000)")
    ap.add_argument("--perf-loops", type=int, default=20000, help="perf's loops a round")
    args = ap.parse_args()
    mask = sorted(cpupin.process_cpus())
    if args.cpus:
        a, b = (int(x) for x in args.cpus.split(","))
    elif len(mask) >= 2:
        a, b = mask[0], mask[1]
    else:
        print("one CPU in the mask: no other CPU to hand off to", file=sys.stderr)
        return 2
    print(describe())
    print(f"pair {a},{b}; the sender waits {IDLE_US} µs before each handoff")
    print(f"pm_qos_resume_latency_us before: {cpupin.act.wake.resume_latencies({a, b})}")
    cases: dict[str, Callable[[], AbstractContextManager[object]]] = {
        "no hold": nullcontext,
        "sysfs n/a on the pair": lambda: cpupin.hold_wake_latency({a, b}, 0),
        "dma 0, every CPU": lambda: cpupin.hold_wake_latency(None, 0),
    }
    try:
        with cpupin.hold_wake_latency({a, b}, 0):
            pass
    except cpupin.HoldRefused as exc:
        print(f"no hold possible here: {exc.strerror}", file=sys.stderr)
        return 2
    medians: dict[str, list[float]] = {k: [] for k in cases}
    p99s: dict[str, list[float]] = {k: [] for k in cases}
    perf: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, hold in cases.items():
            with hold():
                res = handoff(
                    (a, b), rounds=args.handoffs, warmup=args.handoffs // 10, idle_us=IDLE_US
                )
                cost = res.wake_median_ns if res.wake_median_ns is not None else res.median_ns
                medians[name].append(cost)
                p99s[name].append(res.wake_p99_ns or res.p99_ns)
                ns = perf_pipe(f"{a},{b}", args.perf_loops)
                if ns is not None:
                    perf[name].append(ns)
        print(f"round {r + 1}: " + ", ".join(f"{k} {medians[k][-1] / 1000:.1f} µs" for k in cases))
    base = statistics.median(medians["no hold"])
    print()
    print("| case | handoff median | p99 (median of rounds) | vs no hold | perf sched pipe |")
    print("|---|---|---|---|---|")
    for name in cases:
        med = statistics.median(medians[name])
        p99 = statistics.median(p99s[name])
        pipe = f"{statistics.median(perf[name]) / 1000:.1f} µs" if perf[name] else "no perf"
        print(
            f"| {name} | {med / 1000:.1f} µs | {p99 / 1000:.1f} µs | {base / med:.1f}x | {pipe} |"
        )
    print(f"\npm_qos_resume_latency_us after: {cpupin.act.wake.resume_latencies({a, b})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
