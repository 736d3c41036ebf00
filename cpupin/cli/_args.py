"""What the subcommands share: argument types that validate before any work
starts, the host a command looks at, and JSON output."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

from cpupin._native import PID_LIMIT
from cpupin.cpulist import format_cpulist, is_digits, parse_cpulist
from cpupin.errors import excerpt
from cpupin.host.topology import Host, read_host
from cpupin.process.mask import process_cpus

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    import argparse

#: The shipped hosts (cpupin.host.shapes.HOSTS, which a test keeps equal): named
#: here so that building the parser does not build their specs.
HOST_NAMES = ("amd-8gpu", "dgx-h100", "gh200", "h100-vm", "xeon-sst-bf", "xeon6-b300", "xeon6-pct")


def type_error(message: str) -> Exception:
    """argparse's ``ArgumentTypeError`` with ``message``: argparse is imported
    only when an argument is refused or a parser built (``cpupin exec``'s
    usual arguments go without it, see :func:`cpupin.cli.bind.quick_args`)."""
    import argparse

    return argparse.ArgumentTypeError(message)


def _number(text: str) -> int | None:
    """``text`` as a whole number (at most 12 ASCII digits), else ``None``."""
    body = text.strip()
    return int(body) if is_digits(body) and len(body) <= 12 else None


def whole_number(text: str, lo: int, hi: int) -> int | None:
    """``text`` as a whole number from lo to hi, else ``None``."""
    value = _number(text)
    return value if value is not None and lo <= value <= hi else None


def whole(name: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: ASCII digits naming a whole number from lo to hi."""

    def parse(text: str) -> int:
        value = _number(text)
        if value is None:
            raise type_error(
                f"{excerpt(text)} is not a whole number: {name} runs from {lo} to {hi}"
            )
        if not lo <= value <= hi:
            raise type_error(f"{name} {value} is outside {lo} to {hi}")
        return value

    return parse


def seconds(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds from lo to hi."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 32 else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and lo <= value <= hi):
            raise type_error(f"{excerpt(text)} is not a number of seconds from {lo:g} to {hi:g}")
        return value

    return parse


pid = whole("pid", 1, PID_LIMIT - 1)


def pid_or_self(text: str) -> int | None:
    if text == "self":
        return None
    if _number(text) is not None:
        return pid(text)  # a number out of range: what whole() says names it
    raise type_error(
        f"{excerpt(text)} is not a pid: give a process id from 1 to {PID_LIMIT - 1}, or self"
    )


def nonempty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise type_error(f"an empty {what}: name one")
        return text

    return parse


def host_name(text: str) -> str:
    if text not in HOST_NAMES:
        raise type_error(f"no shipped host {excerpt(text)}: choose one of {', '.join(HOST_NAMES)}")
    return text


def add_host(parser: argparse.ArgumentParser) -> None:
    """``--root DIR | --host NAME``: the host a command looks at."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--root", type=nonempty("--root"), metavar="DIR", help="read sysfs and procfs under DIR"
    )
    where.add_argument(
        "--host",
        type=host_name,
        metavar="NAME",
        help="a shipped host: " + ", ".join(HOST_NAMES),
    )


def load_host(args: argparse.Namespace) -> tuple[Host, str, frozenset[int]]:
    """(host, its title, the mask a process there has)."""
    if args.host:
        from cpupin.host.shapes import HOSTS, host_named

        host = host_named(args.host)
        return host, f"{args.host}: {HOSTS[args.host].description}", host.default_mask()
    if args.root:
        if not os.path.isdir(args.root):
            raise ValueError(f"--root {excerpt(args.root)} is not a directory")
        host = read_host(args.root)
        if not host.cpus:
            raise ValueError(
                f"--root {excerpt(args.root)} lists no online CPU under "
                "sys/devices/system/cpu: give the root of a sysfs and procfs capture "
                "(the folder that holds sys/ and proc/)"
            )
        return host, f"the tree under {host.root}", host.default_mask()
    host = read_host("/")
    return host, "this machine", process_cpus() & host.cpus


def mask_arg(text: str | None, host: Host, mask: frozenset[int]) -> frozenset[int]:
    """``--mask CPULIST`` within the host's CPUs (``mask`` when not given);
    naming no CPU of the host is an error."""
    if text is None:
        return mask
    try:
        cpus = parse_cpulist(text) & host.cpus
    except ValueError as exc:
        raise ValueError(f"--mask: {exc}") from None
    if not cpus:
        raise ValueError(
            f"--mask {excerpt(text)} names no online CPU of the host (its CPUs are "
            f"{format_cpulist(host.cpus) or 'none'})"
        )
    return cpus


def print_json(obj: object) -> None:
    """Strict JSON (no NaN or Infinity: every number a parser accepts;
    control characters and non-ASCII escaped)."""
    import json  # here: exec, which prints none, starts without it

    json.dump(obj, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
