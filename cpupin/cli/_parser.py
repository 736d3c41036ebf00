"""The ``cpupin`` command's parser: argparse, with the width of the
terminal, every subcommand's parser or one alone. Imported when a command
line is parsed by argparse (``cpupin exec``'s usual arguments are not, see
:func:`cpupin.cli.bind.quick_args`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cpupin import __version__

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any

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
        importlib.import_module(f"cpupin.cli.{name}").register(sub)
    # Each subcommand's --help opens with what it does: its line in the list.
    for action in sub._choices_actions:
        command = sub.choices[action.dest]
        if command.description is None and action.help:
            command.description = action.help[0].upper() + action.help[1:] + "."
    return parser
