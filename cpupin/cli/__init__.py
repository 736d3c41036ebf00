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

import os
import sys

from cpupin.errors import excerpt

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from typing import Any

    Handler = Callable[[argparse.Namespace], int]

__all__ = ["REPORT", "build_parser", "main"]

#: Names of the parser's module, imported on first use: argparse costs
#: ``cpupin exec`` about 6 ms of its start (bench/RESULTS.md).
_PARSER_NAMES = frozenset(
    ("COMMANDS", "EPILOG", "MODULE_OF", "Formatter", "Parser", "RawFormatter", "build_parser")
)


def __getattr__(name: str) -> Any:
    if name in _PARSER_NAMES:
        from cpupin.cli import _parser

        return getattr(_parser, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Where to report a bug, printed with an internal error.
REPORT = "https://github.com/cpupin/cpupin/issues"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0 done, 1 an internal error (a bug of cpupin's,
    printed as one line unless ``CPUPIN_DEBUG=1``), 2 bad input or a request
    this host cannot meet; argparse's own errors exit 2 as well."""
    words = list(sys.argv[1:] if argv is None else argv)
    first = next((w for w in words if not w.startswith("-")), None)
    before = words[: words.index(first)] if first is not None else words
    only = first if not {"-h", "--help", "--version"} & set(before) else None
    args: Any = None  # argparse's Namespace, or quick_args's the same
    if only == "exec" and words[:1] == ["exec"]:
        from cpupin.cli import bind

        args = bind.quick_args(words[1:])
    if args is None:
        from cpupin.cli._parser import build_parser

        parser = build_parser(only)
        args = parser.parse_args(words)
        if getattr(args, "handler", None) is None:  # no subcommand: say what there is
            parser.print_help(sys.stderr)
            return 2
    handler: Handler = args.handler
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
