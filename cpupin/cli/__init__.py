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
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cpupin import __version__
from cpupin.errors import excerpt

__all__ = ["REPORT", "build_parser", "main"]

#: Where to report a bug, printed with an internal error.
REPORT = "https://github.com/cpupin/cpupin/issues"

Handler = Callable[[argparse.Namespace], int]

#: The modules of the subcommands, in the order --help lists them.
COMMANDS = (
    "threads",
    "topo",
    "plan",
    "top",
    "handoff",
    "bind",
    "verify",
    "doctor",
    "ps",
    "irqs",
)

#: Each subcommand to its module: a run imports that one alone (``cpupin
#: exec`` starts a server's workers; it must cost little more than Python).
MODULE_OF = {
    "threads": "threads",
    "audit": "threads",
    "topo": "topo",
    "plan": "plan",
    "top": "top",
    "handoff": "handoff",
    "exec": "bind",
    "verify": "verify",
    "doctor": "doctor",
    "ps": "ps",
    "irqs": "irqs",
}


EPILOG = """\
examples:
  cpupin doctor                     whether pinning pays here, and the pools a process gets
  cpupin threads PID                a process's threads, their wait, and its pools' census
  cpupin top PID                    live: CPU and run-queue wait a second, each stall named
  cpupin ps                         every registered process on this host, and its pins
  cpupin exec --node 0 -- CMD       run CMD on node 0's CPUs and memory, pools sized
  cpupin plan --host dgx-h100       where a server's threads would go on a shipped host
  srun $(cpupin plan --emit slurm --ranks 2 --node 0) cpupin verify --ranks 2 --node 0
                                    Slurm's options for the plan; each rank checks its share
  cpupin irqs --cpus 2,3            which device interrupts would move off CPUs 2-3 (--apply)

exit codes:
  0  done; 1  a fault of cpupin's own (please report it), or verify found the
  rank differs from the plan; 2  bad input, or the
  process asked about is gone; 3  audit --fail-on-narrow found a narrower
  thread; 126, 127  exec's command could not run, or was not found
"""


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it
    (``$COLUMNS``, else standard output's terminal, else 80), without
    importing shutil: argparse makes a formatter for every argument it adds,
    and each would import it (2 ms of every run, ``exec``'s included)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns if columns > 0 else 80


class Formatter(argparse.HelpFormatter):
    """argparse's formatter, its width found by :func:`_columns`."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        if kwargs.get("width") is None:
            kwargs["width"] = _columns() - 2
        super().__init__(prog, **kwargs)


class RawFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter of descriptions as written, its width found by
    :func:`_columns`."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        if kwargs.get("width") is None:
            kwargs["width"] = _columns() - 2
        super().__init__(prog, **kwargs)


class Parser(argparse.ArgumentParser):
    """A subcommand's parser: :class:`Formatter` unless it names another."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(**kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of subcommand ``only`` alone."""
    parser = argparse.ArgumentParser(
        prog="cpupin",
        description="Pin the threads of a GPU model-serving runtime to the right CPUs.",
        formatter_class=RawFormatter,
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"cpupin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    modules = (MODULE_OF[only],) if only in MODULE_OF else COMMANDS
    for name in modules:
        importlib.import_module(f".{name}", __name__).register(sub)
    # Each subcommand's --help opens with what it does: its line in the list.
    for action in sub._choices_actions:
        command = sub.choices[action.dest]
        if command.description is None and action.help:
            command.description = action.help[0].upper() + action.help[1:] + "."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0 done, 1 an internal error (a bug of cpupin's,
    printed as one line unless ``CPUPIN_DEBUG=1``), 2 bad input or a request
    this host cannot meet; argparse's own errors exit 2 as well."""
    words = list(sys.argv[1:] if argv is None else argv)
    first = next((w for w in words if not w.startswith("-")), None)
    before = words[: words.index(first)] if first is not None else words
    only = first if not {"-h", "--help", "--version"} & set(before) else None
    parser = build_parser(only)
    args = parser.parse_args(words)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:  # no subcommand: say what there is, as for any bad input
        parser.print_help(sys.stderr)
        return 2
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
        import traceback  # here: every run but a failed one goes without

        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"{name}: internal error: {type(exc).__name__}: {excerpt(str(exc), 200)} "
            f"(at {os.path.basename(where.filename)}:{where.lineno}); please report it at "
            f"{REPORT} (CPUPIN_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
