"""The handoff benchmark against its anchors, in one run.

- ``perf bench sched pipe -T`` (two threads, a pipe) on one CPU and on two,
  beside cpupin's C futex handoff on the same CPUs;
- ``cpupin handoff --spin`` beside ``bench/pingpong.c`` (a cache-line
  ping-pong of our own, compiled here);
- this machine's table: same CPU, other CPU, unpinned; busy and with the
  sender idle 200 µs first; and the Python handoff a runtime sees;
- within one last-level cache and across two (``same L3``, ``other L3``),
  where the mask spans more than one of a node's, or a line saying it does
  not.

    python bench/handoff.py [--rounds 20000] [--l3-only]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _env import describe  # noqa: E402

from cpupin.cpulist import format_cpulist  # noqa: E402
from cpupin.host.topology import read_host  # noqa: E402
from cpupin.measure.handoff import handoff, handoff_python, pair_kinds  # noqa: E402


def perf_pipe(cpus: str, loops: int) -> float | None:
    """perf's one-way time in ns (it reports usecs/op for a round trip... of
    one write and one read each way: half an op is one handoff)."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    out = subprocess.run(
        ["taskset", "-c", cpus, perf, "bench", "sched", "pipe", "-T", "-l", str(loops)],
        capture_output=True,
        text=True,
        check=False,
    )
    m = re.search(r"([\d.]+) usecs/op", out.stdout)
    return float(m.group(1)) * 1000 / 2 if m else None


def pingpong(a: int, b: int, rounds: int) -> float | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "pingpong"
        subprocess.run(
            [cc, "-O2", "-pthread", str(HERE / "pingpong.c"), "-o", str(exe)], check=True
        )
        runs = [
            float(
                subprocess.run(
                    [str(exe), str(a), str(b), str(rounds)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            for _ in range(5)
        ]
    return statistics.median(runs)


def median_of(runs: int, fn):  # type: ignore[no-untyped-def]
    results = [fn() for _ in range(runs)]
    return statistics.median(r.median_ns for r in results), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5, help="runs a row (median taken)")
    parser.add_argument("--l3-only", action="store_true", help="only the last-level cache table")
    args = parser.parse_args()
    print(describe())
    print()
    n, runs = args.rounds, args.runs
    caches(n, runs)
    if args.l3_only:
        return
    print("## Anchors (one-way ns, median of runs)")
    print()
    print("| what | cpupin | anchor | cpupin / anchor |")
    print("|---|---|---|---|")
    for label, cpus, pair in (("one CPU", "0", (0, 0)), ("two CPUs", "0,1", (None, None))):
        ours, _ = median_of(runs, lambda p=pair: handoff(p, rounds=n, warmup=n // 10))
        theirs = statistics.median(x for x in (perf_pipe(cpus, n) for _ in range(runs)) if x)
        print(
            f"| futex handoff, {label} | {ours:.0f} | perf bench sched pipe -T: {theirs:.0f} "
            f"| {ours / theirs:.2f}x |"
        )
    ours, _ = median_of(runs, lambda: handoff((0, 1), rounds=n * 10, spin=True))
    theirs = pingpong(0, 1, n * 50)
    print(
        f"| --spin, CPUs 0,1 | {ours:.0f} | bench/pingpong.c: {theirs:.0f} | {ours / theirs:.2f}x |"
    )
    print()
    print(
        "## This machine (one-way ns: median / p99; idle: the sender waits 200 µs first, "
        "wake = handoff to the receiver running)"
    )
    print()
    print("| pair | busy | idle 200 µs, wake | Python Event | Python SimpleQueue |")
    print("|---|---|---|---|---|")
    for label, pair in (("same CPU", (0, 0)), ("other CPU", (0, 1)), ("unpinned", (None, None))):
        busy, br = median_of(runs, lambda p=pair: handoff(p, rounds=n, warmup=n // 10))
        idle_runs = [handoff(pair, rounds=500, warmup=50, idle_us=200) for _ in range(runs)]
        wake = statistics.median(r.wake_median_ns for r in idle_runs)
        wake99 = statistics.median(r.wake_p99_ns for r in idle_runs)
        py_e = statistics.median(handoff_python(pair, rounds=2000).median_ns for _ in range(runs))
        py_q = statistics.median(
            handoff_python(pair, rounds=2000, kind="queue").median_ns for _ in range(runs)
        )
        p99 = statistics.median(r.p99_ns for r in br)
        print(
            f"| {label} | {busy:.0f} / {p99:.0f} | {wake:.0f} / {wake99:.0f} | {py_e:.0f} | "
            f"{py_q:.0f} |"
        )


def caches(n: int, runs: int) -> None:
    """Same L3 against other L3, busy and idle, where the mask allows both."""
    host = read_host("/")
    mask = frozenset(os.sched_getaffinity(0))
    kinds = pair_kinds(host, mask)
    print("## Last-level caches (one-way ns: median / p99)")
    print()
    if "other L3" not in kinds:
        domains = [d & mask for d in host.caches if d & mask]
        shown = " | ".join(format_cpulist(d) for d in domains) or "unknown"
        print(
            f"This machine's mask holds {len(domains)} last-level cache domain(s) of a node "
            f"({shown}): there is no cross-L3 pair to measure here."
        )
        print()
        return
    print("| pair | CPUs | busy | idle 200 µs, wake |")
    print("|---|---|---|---|")
    rows = {}
    for kind in ("same L3", "other L3"):
        if kind not in kinds:
            continue
        pair = kinds[kind]
        busy, br = median_of(runs, lambda p=pair: handoff(p, rounds=n, warmup=n // 10))
        idle = [handoff(pair, rounds=500, warmup=50, idle_us=200) for _ in range(runs)]
        wake = statistics.median(r.wake_median_ns for r in idle)
        rows[kind] = busy
        print(
            f"| {kind} | {pair[0]},{pair[1]} | {busy:.0f} / "
            f"{statistics.median(r.p99_ns for r in br):.0f} | {wake:.0f} |"
        )
    if len(rows) == 2:
        print()
        print(f"other L3 / same L3, busy: {rows['other L3'] / rows['same L3']:.2f}x")
    print()


if __name__ == "__main__":
    main()
