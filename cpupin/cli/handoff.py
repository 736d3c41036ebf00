"""``cpupin handoff``: the cost of one thread waking another, per CPU pair."""

from __future__ import annotations

import argparse
import sys

from cpupin.cli import _args
from cpupin.cpulist import format_cpulist
from cpupin.errors import excerpt
from cpupin.host.topology import read_host
from cpupin.measure.handoff import (
    HandoffResult,
    format_pair,
    handoff,
    handoff_matrix,
    handoff_python,
    pair_kinds,
)
from cpupin.process.mask import process_cpus


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    hand = sub.add_parser("handoff", help="the cost of one thread waking another, per CPU pair")
    hand.add_argument(
        "--cpus",
        type=_pair,
        metavar="A,B",
        help="one pair: A,B, a side 'any' left unpinned ('any' alone: both)",
    )
    hand.add_argument("--matrix", action="store_true", help="every pair of the process mask")
    hand.add_argument("--plot", metavar="FILE.png", help="with --matrix: a heatmap (matplotlib)")
    hand.add_argument(
        "--idle-us",
        type=_args.whole("--idle-us", 0, 1_000_000),
        default=0,
        metavar="N",
        help="the sender waits N µs before each handoff (idle states show)",
    )
    hand.add_argument(
        "--spin", action="store_true", help="pass the token through a cache line without sleeping"
    )
    hand.add_argument(
        "--python",
        nargs="?",
        const="event",
        choices=("event", "queue"),
        help="measure two cpupin.Threads in Python instead of C",
    )
    hand.add_argument(
        "--rounds",
        type=_args.whole("--rounds", 1, 1_000_000),
        default=2000,
        help="rounds a pair (2000)",
    )
    hand.add_argument("--json", action="store_true", help="print JSON")
    hand.set_defaults(handler=run)


def _pair(text: str) -> tuple[int | None, int | None]:
    if text.strip() == "any":
        return None, None  # both unpinned, as the help says
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a pair such as 0,1, or any")
    out: list[int | None] = []
    for part in parts:
        part = part.strip()
        if part in ("any", "-"):
            out.append(None)
        elif part.isascii() and part.isdigit() and len(part) <= 6:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(
                f"{excerpt(part)} in {excerpt(text)} is not a CPU number"
            )
    return out[0], out[1]


#: The most handoffs --matrix measures (a minute or so at 10 µs each).
_MATRIX_ROUNDS = 10_000_000


def _need_matplotlib() -> None:
    try:
        # matplotlib is an optional extra, imported only by --plot: it costs
        # about 300 ms and is not installed by default.
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'cpupin[plot]'") from None


def run(args: argparse.Namespace) -> int:
    mask = process_cpus()
    _check(args, mask)
    if args.matrix:
        grid = _measure_matrix(args, mask)
        _print_matrix(args, grid, sorted(mask))
        return 0
    results = _measure_pairs(args, mask)
    _print_pairs(args, results)
    return 0


def _check(args: argparse.Namespace, mask: frozenset[int]) -> None:
    """Every combination of arguments this mask cannot honour, refused
    before anything is measured."""
    if args.plot and not args.matrix:
        raise ValueError("--plot draws the --matrix: add --matrix")
    if args.cpus is not None and args.matrix:
        raise ValueError("--cpus names one pair and --matrix measures every pair: give one")
    if args.cpus is not None:
        outside = [cpu for cpu in args.cpus if cpu is not None and cpu not in mask]
        if outside:
            raise ValueError(
                f"--cpus: CPU {format_cpulist(outside)} is outside the process mask "
                f"{format_cpulist(mask)}: name CPUs of the mask, or any"
            )
        if args.spin and (None in args.cpus or args.cpus[0] == args.cpus[1]):
            raise ValueError(
                "--spin needs two different CPUs in --cpus (two spinners on one CPU, or "
                "unpinned, wait on each other)"
            )
    if args.spin and len(mask) < 2:
        raise ValueError(
            f"--spin needs two CPUs, and this process may use only CPU {format_cpulist(mask)}"
        )
    if args.matrix and len(mask) * len(mask) * args.rounds > _MATRIX_ROUNDS:
        raise ValueError(
            f"--matrix of {len(mask)} CPUs with --rounds {args.rounds} is "
            f"{len(mask) ** 2 * args.rounds} handoffs: lower --rounds, or narrow the mask "
            "with taskset"
        )
    if args.plot:
        _need_matplotlib()


def _measure_matrix(args: argparse.Namespace, mask: frozenset[int]) -> dict[tuple[int, int], float]:
    def progress(done: int, total: int) -> None:
        if not sys.stderr.isatty():  # a log file gets no redrawn bar
            return
        bar = "#" * (30 * done // total)
        print(f"\r[{bar:<30}] {done}/{total} pairs", end="", file=sys.stderr, flush=True)

    grid = handoff_matrix(
        mask, rounds=args.rounds, idle_us=args.idle_us, spin=args.spin, progress=progress
    )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return grid


def _print_matrix(
    args: argparse.Namespace, grid: dict[tuple[int, int], float], cpus: list[int]
) -> None:
    if args.plot:
        _plot(grid, cpus, args.plot)
    if args.json:
        _args.print_json(
            {
                "mode": "spin" if args.spin else "futex",
                "idle_us": args.idle_us,
                "rounds": args.rounds,
                "cpus": cpus,
                "median_ns": [[grid.get((a, b)) for b in cpus] for a in cpus],
            }
        )
        return
    print("one-way handoff, median ns (rows: A, columns: B)")
    print("      " + "".join(f"{b:>9}" for b in cpus))
    for a in cpus:
        print(
            f"{a:>5} "
            + "".join(f"{grid[(a, b)]:>9.0f}" if (a, b) in grid else f"{'-':>9}" for b in cpus)
        )


def _measure_pairs(args: argparse.Namespace, mask: frozenset[int]) -> dict[str, HandoffResult]:
    if args.cpus is not None:
        pairs = {format_pair(args.cpus): args.cpus}
    else:
        pairs = pair_kinds(read_host("/"), mask)
        if args.spin:
            pairs = {k: p for k, p in pairs.items() if None not in p and p[0] != p[1]}
    results = {}
    for kind, cpus in pairs.items():
        if args.python:
            results[kind] = handoff_python(cpus, rounds=args.rounds, kind=args.python)
        else:
            results[kind] = handoff(
                cpus,
                rounds=args.rounds,
                warmup=args.rounds // 10,
                idle_us=args.idle_us,
                spin=args.spin,
            )
    return results


def _print_pairs(args: argparse.Namespace, results: dict[str, HandoffResult]) -> None:
    if args.json:
        rows = [{"kind": kind, **r.as_dict()} for kind, r in results.items()]
        _args.print_json(rows[0] if args.cpus is not None else rows)
        return
    print(
        f"one-way handoff, ns ({next(iter(results.values())).mode}"
        + (f", sender idle {args.idle_us} µs first" if args.idle_us else "")
        + ")"
    )
    print(
        f"  {'pair':14} {'CPUs':>9} {'median':>9} {'p90':>9} {'p99':>9}"
        + (f" {'wake':>9}" if args.idle_us else "")
    )
    for kind, r in results.items():
        wake = f" {r.wake_median_ns:>9.0f}" if args.idle_us and r.wake_median_ns else ""
        print(
            f"  {kind:14} {format_pair(r.cpus):>9} {r.median_ns:>9.0f} {r.p90_ns:>9.0f} "
            f"{r.p99_ns:>9.0f}{wake}"
        )


def _plot(grid: dict[tuple[int, int], float], cpus: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'cpupin[plot]'") from None
    data = [[grid.get((a, b), float("nan")) / 1000 for b in cpus] for a in cpus]
    fig, ax = plt.subplots(figsize=(2 + 0.4 * len(cpus), 1.5 + 0.4 * len(cpus)))
    image = ax.imshow(data, cmap="viridis")
    ax.set_xticks(range(len(cpus)), [str(c) for c in cpus])
    ax.set_yticks(range(len(cpus)), [str(c) for c in cpus])
    ax.set_xlabel("CPU B (woken)")
    ax.set_ylabel("CPU A (waking)")
    ax.set_title("one-way handoff, median µs")
    if len(cpus) <= 16:
        for i, row in enumerate(data):
            for j, value in enumerate(row):
                bright = value > (min(map(min, data)) + max(map(max, data))) / 2
                ax.text(
                    j,
                    i,
                    f"{value:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="k" if bright else "w",
                )
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)
