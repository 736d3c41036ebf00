"""The ``cpupin`` command: one module a subcommand, each with ``--help`` and,
where it reports, ``--json``. This package parses arguments, calls the
library and formats what it returns; the work and the JSON shapes live in
the library's objects (``as_dict``).

:func:`main` is the one place an exception ends: bad input exits 2 with one
line naming the value, an internal error exits 1 with one line and where to
report it (``CPUPIN_DEBUG=1`` shows the traceback), and nothing reaches a
user as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from cpupin import __version__
from cpupin.errors import excerpt

from . import bind, doctor, handoff, plan, ps, threads, top, topo

__all__ = ["REPORT", "build_parser", "main"]

#: Where to report a bug, printed with an internal error.
REPORT = "https://github.com/cpupin/cpupin/issues"

Handler = Callable[[argparse.Namespace], int]

#: The subcommands in the order --help lists them.
COMMANDS = (threads, topo, plan, top, handoff, bind, doctor, ps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpupin",
        description="Pin the threads of a GPU model-serving runtime to the right CPUs.",
    )
    parser.add_argument("--version", action="version", version=f"cpupin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0 done, 1 an internal error (a bug of cpupin's,
    printed as one line unless ``CPUPIN_DEBUG=1``), 2 bad input or a request
    this host cannot meet; argparse's own errors exit 2 as well."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    name = f"cpupin {args.command}"
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader went away (| head): no message, and no second error when
        # Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        what = f"{exc.filename}: " if exc.filename else ""
        print(f"{name}: {what}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - no traceback reaches a user
        if os.environ.get("CPUPIN_DEBUG") == "1":
            raise
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"{name}: internal error: {type(exc).__name__}: {excerpt(str(exc), 200)} "
            f"(at {os.path.basename(where.filename)}:{where.lineno}); please report it at "
            f"{REPORT} (CPUPIN_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
