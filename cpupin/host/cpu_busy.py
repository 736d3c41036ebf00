"""How long each CPU has been busy since boot, from ``/proc/stat``.

Busy is every column of a ``cpuN`` line but ``idle`` and ``iowait`` (the
CPU ran nothing then): user, nice, system, irq, softirq and steal (time the
hypervisor gave another guest, which no task of this host had either).
``guest`` and ``guest_nice`` are already inside user and nice, so they are
not added twice. The difference of two reads over a wall time is how many
CPUs' worth of work ran there.
"""

from __future__ import annotations

import os

from cpupin.host._sysfs import Reader

__all__ = ["parse_cpu_busy", "read_cpu_busy"]

#: The most bytes of ``/proc/stat`` read: its ``cpuN`` lines come first,
#: about 60 bytes a CPU, so this holds hosts of several thousand CPUs.
LIMIT = 1 << 20

_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Larger than any real CPU number or tick count: a line holding more is
#: not the kernel's and is skipped.
_MAX_CPU = 1 << 16
_MAX_TICKS = 1 << 62


def parse_cpu_busy(text: str) -> dict[int, float]:
    """Each CPU's busy seconds since boot, by CPU number, from the text of
    ``/proc/stat``. Pure. A line that is not a well-formed ``cpuN`` line
    (too few columns, a column that is not a number, numbers out of range)
    is skipped, so a CPU missing here is one the text did not tell."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *columns = line.split()
        number = name[3:]
        if not number.isdigit() or len(columns) < 4 or len(number) > 6:
            continue
        if not all(c.isdigit() and len(c) < 20 for c in columns):
            continue
        cpu = int(number)
        ticks = [int(c) for c in columns[:8]]
        if cpu >= _MAX_CPU or any(t >= _MAX_TICKS for t in ticks):
            continue
        # user nice system idle iowait irq softirq steal
        busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
        out[cpu] = busy / _CLK_TCK
    return out


def read_cpu_busy(root: str = "/") -> dict[int, float]:
    """:func:`parse_cpu_busy` of the host's ``/proc/stat`` (under ``root``);
    empty where it cannot be read."""
    with Reader(root) as r:
        text = r.text("proc/stat", LIMIT, head=True)
    return parse_cpu_busy(text or "")
