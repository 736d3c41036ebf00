"""What a StepClock costs a step, against what a user would otherwise time
a step with, in the same rounds.

Cases, each a loop of empty steps (per step, the loop's own cost taken out):
``with clock.step()`` (steps back to back: one read a step), ``begin()`` and
``end()`` with a gap between steps (two reads), two ``time.perf_counter_ns()``
(wall time only), two ``os.pread()`` of a kept ``/proc/thread-self/schedstat``
descriptor (the reads a step's wait needs, without parsing or any check), and
two reads of it with ``open().read()`` (without a kept descriptor). As root on
a host with the cgroup cpu controller, the clock again inside a cgroup with a
quota, where each mark also reads the group's throttled time
(``cpu.stat.local``, else ``cpu.stat``): only with ``--quota N``,
which makes that cgroup (``cpupin-bench-*`` under the cpu controller's
mount, removed after); without it no cgroup is made.

    python bench/stepclock.py [--rounds 15] [--number 20000] [--quota 1.5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _env import enter_cgroup, quota_cgroup, start  # noqa: E402

CASES = """
import os, sys, time
sys.path.insert(0, {here!r})
from _env import paired
import cpupin
clock = cpupin.StepClock()
def loop_with(n):
    for _ in range(n):
        with clock.step():
            pass
gapped = cpupin.StepClock("gapped")
gapped._state[11] = 0  # no join window: every begin reads, as after a gap between steps
def begin_end(n):
    b, e = gapped.begin, gapped.end
    for _ in range(n):
        b(); e()
def perf(n):
    c = time.perf_counter_ns
    for _ in range(n):
        c(); c()
def python_schedstat(n):
    for _ in range(n):
        open("/proc/thread-self/schedstat").read(); open("/proc/thread-self/schedstat").read()
kept = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
def kept_pread(n):
    p = os.pread
    for _ in range(n):
        p(kept, 127, 0); p(kept, 127, 0)
def empty(n):
    for _ in range(n):
        pass
N = {number}
cases = {{"with clock.step() (back to back)": lambda: loop_with(N),
          "clock.begin() + end() (a gap between steps)": lambda: begin_end(N),
          "two time.perf_counter_ns()": lambda: perf(N),
          "two os.pread() of a kept schedstat": lambda: kept_pread(N),
          "two open().read() of schedstat": lambda: python_schedstat(N // 10),
          "empty loop": lambda: empty(N)}}
got = paired(cases, 1, {rounds})
got["two open().read() of schedstat"] /= N // 10
for k in list(got):
    if k != "two open().read() of schedstat":
        got[k] /= N
print(repr(({{k: v for k, v in got.items()}}, clock.throttle_source)))
"""


def measure(args: argparse.Namespace, enter=None) -> tuple[dict[str, float], str | None]:
    code = CASES.format(here=str(HERE), number=args.number, rounds=args.rounds)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        preexec_fn=enter,
    )
    return eval(out.stdout)  # noqa: S307 - our own child's output


def show(title: str, got: dict[str, float]) -> None:
    from _env import fmt_ns

    empty = got.pop("empty loop")
    print(title)
    clock = got["with clock.step() (back to back)"] - empty
    for name, ns in got.items():
        per_step = ns - empty if name != "two open().read() of schedstat" else ns
        ratio = "" if name.startswith("with") else f"  ({per_step / clock:.2f}x the clock)"
        print(f"  {name:44} {fmt_ns(per_step):>10} a step{ratio}")


def main() -> None:
    args = start(
        __doc__ or "",
        rounds=15,
        number=20000,
        extra=[("--quota", float, None, "also in a cgroup with a quota of N CPUs, made here")],
    )
    got, source = measure(args)
    show(f"no quota (cpu.stat {'read' if source else 'not read'}): medians of {args.rounds}", got)
    if args.quota is None:
        print("with a quota: not measured (--quota N makes a cgroup for it)")
        return
    with quota_cgroup(args.quota) as made:
        if made is None:
            print("with a quota: not measured (needs root and the cgroup cpu controller)")
            return
        print(f"cgroup      {made[0]} ({made[1]}), made for this run")
        got, source = measure(args, enter_cgroup(made[0]))
    show(
        f"in a cgroup with a {args.quota:g}-CPU quota (reads {source}): medians of {args.rounds}",
        got,
    )


if __name__ == "__main__":
    main()
