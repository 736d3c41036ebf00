"""PM QoS resume latency files: their values, and writing them back. Light
(no registry), so that both :mod:`cpupin.act.wake` and the registry's pruning
(which puts back a dead holder's values) use it."""

from __future__ import annotations

import errno
from collections.abc import Mapping

from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader

__all__ = ["MAX_US", "SYSFS", "format_resume_latency", "parse_resume_latency", "restore"]

#: The largest latency a hold may name: PM QoS values are signed 32-bit µs.
MAX_US = 2_000_000_000
SYSFS = "sys/devices/system/cpu/cpu{}/power/pm_qos_resume_latency_us"


def parse_resume_latency(text: str) -> int | None:
    """A ``pm_qos_resume_latency_us`` value: the most µs a wake may take
    (``n/a``: 0, no latency accepted), or ``None`` for ``0`` (no limit).
    :class:`ValueError` for anything else. Pure."""
    body = text.strip()
    if body == "n/a":
        return 0
    if not (body.isascii() and body.isdigit() and len(body) <= 10):
        raise ValueError(f"{excerpt(body)} is not n/a or a number of µs")
    value = int(body)
    if value > MAX_US:
        raise ValueError(f"{value} µs is more than a resume latency can be ({MAX_US})")
    return None if value == 0 else value


def format_resume_latency(max_us: int | None) -> str:
    """What to write for a limit of ``max_us`` (``None``: no limit). Pure."""
    if max_us is None:
        return "0"
    return "n/a" if max_us == 0 else str(max_us)


def why(exc: OSError, what: str) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{what}: not permitted ({exc.strerror}): it needs root"
    if exc.errno == errno.EROFS:
        return f"{what}: read-only ({exc.strerror}): a container mounts sysfs read-only"
    return f"{what}: {exc.strerror}"


def restore(previous: Mapping[int, str], held_us: int, root: str = "/") -> list[str]:
    """Put back each CPU's value where it is still the one a hold of
    ``held_us`` wrote. Returns a note for each CPU left as it is."""
    notes = []
    mine = format_resume_latency(held_us)
    with Reader(root) as r:
        for cpu, before in sorted(previous.items()):
            rel = SYSFS.format(cpu)
            now = r.text(rel, 32)
            if now is None:
                notes.append(f"CPU {cpu}: its resume latency is gone (offline?): nothing put back")
                continue
            if now.strip() != mine:
                notes.append(
                    f"CPU {cpu}: changed since the hold (now {excerpt(now.strip(), 12)}): left "
                    "as it is"
                )
                continue
            try:
                r.write(rel, before)
            except OSError as exc:
                notes.append(f"CPU {cpu}: {why(exc, 'cannot put back ' + before)}")
    return notes
