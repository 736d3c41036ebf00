"""Pools under a CPU quota: default pools, an oversubscribed pool and
``cpupin.limit_pools()``, in one run.

Makes a cgroup with a quota of ``--quota`` CPUs (1 by default; root, cgroup
v1's cpu controller or v2's), and runs in it, alternating round by round:

- a torch workload (``--matrix`` square matmuls a step, each step timed by a
  ``cpupin.StepClock``) with torch's default pool (sized from the mask), with
  16 threads (``OMP_NUM_THREADS=16``, as a pool sized from a large host's
  count would be), and with ``cpupin.limit_pools()`` at start-up;
- the example runtime (``examples/runtime.py --setting off``) with its
  workers' pools left as the libraries size them (``--pools leave``), with
  ``OMP_NUM_THREADS=16``, and capped (``--pools cap``, its default).

Prints the environment, then per case the medians over the rounds of
throughput, step p50/p99 and the cgroup's throttled time per second, and
the ratios of the capped case against the others. Removes its cgroup and
leaves nothing in /tmp.

    sudo python bench/pools.py [--rounds 5] [--seconds 3] [--quota 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _env import describe, enter_cgroup, quota_cgroup  # noqa: E402

from cpupin.host.throttle import parse_cpu_stat  # noqa: E402
from cpupin.pools.limits import POOL_VARS  # noqa: E402

WORKLOAD = """
import json, os, sys, time
import torch
import cpupin
if sys.argv[1] == "limit_pools":
    cpupin.limit_pools()
a = torch.rand({matrix}, {matrix})
for _ in range(20):
    a @ a
clock = cpupin.StepClock("bench")
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    with clock.step():
        for _ in range(4):
            (a @ a).sum()
s = clock.summary()
print(json.dumps({{"steps_per_s": clock.steps / (clock.wall_sum_ns / 1e9 or 1),
                  "p50_us": s["wall_us"]["p50"], "p99_us": s["wall_us"]["p99"],
                  "wait_p99_us": s["wait_us"]["p99"], "threads": torch.get_num_threads()}}))
"""


def throttled_ns(path: str) -> int:
    return parse_cpu_stat(Path(path, "cpu.stat").read_text()).throttled_ns


def run_in(path: str, cmd: list[str], env: dict[str, str]) -> tuple[str, float]:
    """Run ``cmd`` in the cgroup: its output and the cgroup's throttled ms
    per second of its run."""
    before, start = throttled_ns(path), time.monotonic()
    out = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=enter_cgroup(path),
        timeout=600,
    )
    wall = time.monotonic() - start
    return out.stdout, (throttled_ns(path) - before) / 1e6 / wall


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    env.pop("CPUPIN_POOL_VARS", None)
    env["PYTHONPATH"] = str(HERE.parent)
    return env


def torch_case(path: str, case: str, args: argparse.Namespace) -> dict[str, float]:
    env = base_env()
    if case == "16 threads":
        env["OMP_NUM_THREADS"] = "16"
    code = WORKLOAD.format(matrix=args.matrix, seconds=args.seconds)
    out, throttled = run_in(path, [sys.executable, "-c", code, case.replace(" ", "_")], env)
    result: dict[str, float] = json.loads(out)
    result["throttled_ms_per_s"] = throttled
    return result


def runtime_case(path: str, case: str, args: argparse.Namespace, lock_dir: str) -> dict[str, float]:
    env = {**base_env(), "CPUPIN_LOCK_DIR": lock_dir}
    pools = "cap" if case == "limit_pools" else "leave"
    if case == "16 threads":
        env["OMP_NUM_THREADS"] = "16"
    cmd = [
        sys.executable,
        str(HERE.parent / "examples" / "runtime.py"),
        "--setting",
        "off",
        "--steps",
        str(args.steps),
        "--pools",
        pools,
        "--json",
    ]
    out, throttled = run_in(path, cmd, env)
    report = json.loads(out)
    (clock,) = report["step_clocks"]
    return {
        "steps_per_s": report["steps_per_s"],
        "p50_us": clock["wall_us"]["p50"],
        "p99_us": clock["wall_us"]["p99"],
        "wait_p99_us": clock["wait_us"]["p99"],
        "throttled_ms_per_s": throttled,
        "threads": float("nan"),
    }


CASES = ("default", "16 threads", "limit_pools")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="a torch case's run")
    parser.add_argument("--steps", type=int, default=1500, help="a runtime case's steps")
    parser.add_argument("--matrix", type=int, default=384)
    parser.add_argument("--quota", type=float, default=1.0, help="CPUs of quota (1)")
    args = parser.parse_args()
    print(describe())
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        "torch": {c: [] for c in CASES},
        "runtime": {c: [] for c in CASES},
    }
    with (
        quota_cgroup(args.quota) as made,
        tempfile.TemporaryDirectory(prefix="cpupin-bench-pools-") as lock_dir,
    ):
        if made is None:
            sys.exit(
                "bench/pools.py makes a cgroup with a CPU quota: run it as root, on a "
                "host with the cgroup cpu controller"
            )
        path, kind = made
        print(f"cgroup      {path} ({kind}), quota {args.quota:g} CPU(s) a 100 ms period")
        print()
        for _ in range(args.rounds):
            for case in CASES:
                results["torch"][case].append(torch_case(path, case, args))
                results["runtime"][case].append(runtime_case(path, case, args, lock_dir))
    for workload, by_case in results.items():
        print(f"{workload}: medians of {args.rounds} rounds")
        print(
            f"  {'case':12} {'steps/s':>9} {'step p50':>10} {'step p99':>10} "
            f"{'wait p99':>10} {'throttled':>12}"
        )
        medians = {}
        for case, runs in by_case.items():
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            medians[case] = m
            print(
                f"  {case:12} {m['steps_per_s']:>9.0f} {m['p50_us']:>8.0f}µs {m['p99_us']:>8.0f}µs"
                f" {m['wait_p99_us']:>8.0f}µs {m['throttled_ms_per_s']:>7.0f} ms/s"
            )
        capped = medians["limit_pools"]
        for other in ("default", "16 threads"):
            o = medians[other]
            speed = capped["steps_per_s"] / o["steps_per_s"]
            print(
                f"  limit_pools vs {other}: throughput {speed:.2f}x,"
                f" step p99 {o['p99_us'] / capped['p99_us']:.2f}x faster,"
                f" step p50 {o['p50_us'] / capped['p50_us']:.2f}x faster"
            )
        print()


if __name__ == "__main__":
    main()
