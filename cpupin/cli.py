"""The ``cpupin`` command: one subcommand a capability, each with ``--help``
and, where it reports, ``--json``.

A bad argument exits 2 with a message naming it; nothing reaches the user as
a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from . import __version__

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _cmd_threads(args: argparse.Namespace) -> int:
    from . import _native
    from .process import process_cpus

    pid = args.pid
    stats = _native.thread_stats(pid, last_cpu=True)
    rows = []
    for st in stats:
        try:
            mask = _native.get_affinity(st.tid)
        except OSError:
            continue
        rows.append({**st._asdict(), "mask": sorted(mask)})
    if args.json:
        _print_json(rows)
        return 0
    from .cpulist import format_cpulist

    print(f"process mask {format_cpulist(process_cpus())}")
    print(f"{'tid':>8} {'name':16} {'run ms':>10} {'wait ms':>10} {'cpu':>4}")
    for row in rows:
        print(
            f"{row['tid']:>8} {row['name'][:16]:16} {row['run_ns'] / 1e6:>10.1f} "
            f"{row['wait_ns'] / 1e6:>10.1f} {row['last_cpu']!s:>4}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpupin",
        description="Pin the threads of a GPU model-serving runtime to the right CPUs.",
    )
    parser.add_argument("--version", action="version", version=f"cpupin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    threads = sub.add_parser(
        "threads", help="list a process's threads with CPU time, run-queue wait and last CPU"
    )
    threads.add_argument("pid", nargs="?", type=int, help="process id (default: this process)")
    threads.add_argument("--json", action="store_true", help="print JSON")
    threads.set_defaults(handler=_cmd_threads)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except BrokenPipeError:
        return 0
    except OSError as exc:
        what = f"{exc.filename}: " if exc.filename else ""
        print(f"cpupin {args.command}: {what}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"cpupin {args.command}: {exc}", file=sys.stderr)
        return 2
