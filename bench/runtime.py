"""The example runtime with pinning off and with a CPU number, alternating
runs, on this machine: steps per second, inter-token latency, and the step
threads' run-queue wait.

    python bench/runtime.py [--runs 5] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _env import describe  # noqa: E402


def run(setting: str, steps: int) -> dict[str, object]:
    out = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "examples" / "runtime.py"),
            "--setting",
            setting,
            "--steps",
            str(steps),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--settings", default="off,0")
    args = parser.parse_args()
    print(describe())
    print()
    settings = args.settings.split(",")
    results: dict[str, list[dict[str, object]]] = {s: [] for s in settings}
    for _ in range(args.runs):
        for setting in settings:  # alternating, so a slow stretch hits both
            results[setting].append(run(setting, args.steps))
    print(f"{args.runs} runs of {args.steps} steps each, alternating; medians")
    print()
    print(
        "| setting | steps/s | ITL p50 ms | ITL p95 ms | ITL p99 ms | step threads' wait "
        "ms/s (main, gpu, plan) | strays |"
    )
    print("|---|---|---|---|---|---|---|")
    base = None
    for setting, reports in results.items():

        def med(key: str, sub: str | None = None, reports=reports) -> float:
            return statistics.median(r[key][sub] if sub else r[key] for r in reports)

        waits = []
        for name in ("main", "gpu", "plan"):
            waits.append(
                statistics.median(
                    next(t["wait_ms_per_s"] for t in r["threads"] if t["name"] == f"worker0-{name}")
                    for r in reports
                )
            )
        rate = med("steps_per_s")
        base = base or rate
        strays = sum(len(r["stray"]) for r in reports)
        print(
            f"| {setting} | {rate:.0f} ({rate / base:.2f}x) | {med('itl_ms', 'p50'):.3f} | "
            f"{med('itl_ms', 'p95'):.3f} | {med('itl_ms', 'p99'):.3f} | "
            f"{', '.join(f'{w:.0f}' for w in waits)} | {strays} |"
        )


if __name__ == "__main__":
    main()
