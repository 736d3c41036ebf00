"""Device interrupts that land on pinned cores: which, how often, and what
would keep them off. Read only: moving them is :mod:`cpupin.act.irq_steer`'s
(``cpupin irqs --apply``), never a side effect of reading.

A step thread pinned to a core shares it with whatever interrupts the
kernel sends there: a NIC's receive queue, an NVMe queue, the GPU's own.
:func:`irqs_on` takes two reads of ``/proc/interrupts`` and each IRQ's
affinity (``/proc/irq/N/effective_affinity_list``, where the kernel says
where it really delivers, else ``smp_affinity_list``) and lists the IRQs
that may land on the given CPUs, with their rate there. NVMe queues (and
other multi-queue block devices) are *managed*: the kernel spreads them over
the CPUs itself and nobody can move them; irqbalance moves the rest, and
:func:`irqbalance_advice` gives the setting that keeps them off.

Everything is read through :class:`~cpupin.host._sysfs.Reader` under a root, as
hostile input: a FIFO, a symlink out of the root, a huge file, or a number
past 64 bits is a reason, never a wait or a traceback.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cpupin.cpulist import format_cpulist, format_cpumask
from cpupin.errors import excerpt
from cpupin.host._sysfs import Reader

__all__ = [
    "Interrupts",
    "IrqOnPin",
    "classify",
    "irqbalance_advice",
    "irqs_on",
    "parse_interrupts",
    "read_irqs",
]

#: The most bytes of ``/proc/interrupts`` read: 1,000 IRQs on 4,096 CPUs.
INTERRUPTS_LIMIT = 64 << 20
#: The largest count accepted (the kernel's counters are 64-bit at most).
_MAX_COUNT = (1 << 64) - 1
#: The most IRQs listed in a report.
MAX_LISTED = 64
#: The most numbered IRQs read of one ``/proc/interrupts`` (hosts have a few
#: thousand); past it a capture is read no further, and a reason says so, so
#: that each IRQ's affinity files are never read millions of times.
MAX_IRQS = 16384


@dataclass(frozen=True)
class Interrupts:
    """One read of ``/proc/interrupts``: the CPUs of its columns, and each
    numbered IRQ's counts in those columns and its description (chip, type,
    the names of the devices' handlers)."""

    cpus: tuple[int, ...]
    counts: dict[str, tuple[int, ...]]
    names: dict[str, str]


@dataclass(frozen=True)
class IrqOnPin:
    """An IRQ that may land on a pinned CPU."""

    irq: str
    name: str
    kind: str
    """``GPU``, ``NIC``, ``NVMe`` or ``other``."""
    managed: bool
    """A kernel-managed queue IRQ: its affinity cannot be changed."""
    cpus: frozenset[int]
    """Where it may land (its effective affinity, else its smp_affinity)."""
    affinity: str
    """``effective`` or ``smp``: which file said."""
    pinned: frozenset[int]
    """The pinned CPUs among :attr:`cpus`."""
    per_s: float | None
    """Its interrupts a second on the pinned CPUs, between the two reads."""

    def as_dict(self) -> dict[str, object]:
        return {
            "irq": self.irq,
            "name": self.name,
            "kind": self.kind,
            "managed": self.managed,
            "cpus": sorted(self.cpus),
            "affinity": self.affinity,
            "pinned": sorted(self.pinned),
            "per_s": None if self.per_s is None else round(self.per_s, 1),
        }


_CPU_HEADER = re.compile(r"CPU(\d{1,6})\Z", re.ASCII)


def parse_interrupts(text: str, reasons: list[str] | None = None) -> Interrupts:
    """The numbered IRQs of ``/proc/interrupts``. Rows of architectural
    counters (``NMI``, ``LOC``...) are left out: they cannot move. A row
    that does not parse is left out, with a reason."""
    why = [] if reasons is None else reasons
    lines = io.StringIO(text)  # a line at a time: never a list of millions
    header = lines.readline().split()
    cpus = []
    for word in header:
        m = _CPU_HEADER.match(word)
        if m is None:
            why.append(f"proc/interrupts: header {excerpt(word)} is not a CPU column; not read")
            return Interrupts((), {}, {})
        cpus.append(int(m.group(1)))
    counts: dict[str, tuple[int, ...]] = {}
    names: dict[str, str] = {}
    bad = 0
    for line in lines:
        label, _, rest = line.partition(":")
        label = label.strip()
        if not (label.isascii() and label.isdigit() and len(label) <= 7):
            continue
        if len(counts) >= MAX_IRQS and label not in counts:
            why.append(
                f"proc/interrupts: more than {MAX_IRQS} IRQs; read no further (the first "
                f"{MAX_IRQS} are shown)"
            )
            break
        fields = rest.split()
        values = fields[: len(cpus)]
        if len(values) < len(cpus) or not all(
            v.isascii() and v.isdigit() and len(v) <= 20 and int(v) <= _MAX_COUNT for v in values
        ):
            bad += 1
            continue
        counts[label] = tuple(int(v) for v in values)
        names[label] = " ".join(fields[len(cpus) :])
    if bad:
        why.append(f"proc/interrupts: {bad} row(s) without a count for each CPU; left out")
    return Interrupts(tuple(cpus), counts, names)


_GPU = re.compile(r"\b(nvidia|amdgpu|i915|xe|habanalabs)\b", re.IGNORECASE)
_NIC = re.compile(
    r"\b(mlx[45]\w*|ice|i40e|ixgbe\w*|igb|e1000e?|bnxt\w*|ena|efa|gve|hfi1|qede|"
    r"eth\d+|en[ops]\w+|virtio\d+-(input|output)[.\d]*)\b|-(rx|tx|TxRx)-\d+",
    re.IGNORECASE,
)
_NVME = re.compile(r"\bnvme\d+q\d+\b", re.IGNORECASE)


def classify(description: str) -> tuple[str, bool]:
    """(kind, managed) of an IRQ from its ``/proc/interrupts`` description.
    NVMe's queue IRQs are managed by the kernel (they cannot be moved);
    ``nvmeNq0``, the admin queue, is not."""
    m = _NVME.search(description)
    if m is not None:
        return "NVMe", not m.group(0).lower().endswith("q0")
    if _GPU.search(description):
        return "GPU", False
    if _NIC.search(description):
        return "NIC", False
    return "other", False


def _affinity(r: Reader, irq: str) -> tuple[frozenset[int] | None, str]:
    effective = r.cpus(f"proc/irq/{irq}/effective_affinity_list")
    if effective:
        return effective, "effective"
    return r.cpus(f"proc/irq/{irq}/smp_affinity_list"), "smp"


def irqs_on(
    r: Reader,
    pinned: frozenset[int],
    first: Interrupts,
    second: Interrupts | None = None,
    seconds: float = 0.0,
) -> list[IrqOnPin]:
    """The IRQs of ``first`` whose affinity includes a CPU of ``pinned``, the
    busiest on those CPUs first, with their rate there between ``first``
    and ``second`` (``seconds`` apart)."""
    out = []
    column = {cpu: i for i, cpu in enumerate(first.cpus)}
    later = second.counts if second is not None and second.cpus == first.cpus else {}
    for irq, counts in first.counts.items():
        cpus, source = _affinity(r, irq)
        if not cpus or not cpus & pinned:
            continue
        name = excerpt(first.names.get(irq, ""), 60)
        kind, managed = classify(first.names.get(irq, ""))
        on = cpus & pinned
        rate = None
        if irq in later and seconds > 0:
            delta = sum(later[irq][column[c]] - counts[column[c]] for c in on if c in column)
            rate = max(delta, 0) / seconds
        out.append(IrqOnPin(irq, name, kind, managed, cpus, source, on, rate))
    out.sort(key=lambda i: (-(i.per_s or 0.0), int(i.irq)))
    return out


def read_irqs(
    root: str,
    pinned: Iterable[int],
    interval: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[IrqOnPin], list[str]]:
    """Two reads of ``proc/interrupts`` under ``root``, ``interval`` apart,
    and the IRQs that may land on ``pinned``; with the reasons for anything
    not read. One read, and no rates, when ``interval`` is 0."""
    wanted = frozenset(pinned)
    with Reader(root) as r:
        text = r.text("proc/interrupts", limit=INTERRUPTS_LIMIT)
        if text is None:
            return [], r.reasons or ["no proc/interrupts under the root: interrupts not read"]
        first = parse_interrupts(text, r.reasons)
        second = None
        start = clock()
        if interval > 0:
            sleep(interval)
            again = r.text("proc/interrupts", limit=INTERRUPTS_LIMIT)
            second = parse_interrupts(again, r.reasons) if again is not None else None
        seconds = clock() - start if interval > 0 else 0.0
        return irqs_on(r, wanted, first, second, seconds), r.reasons


def irqbalance_advice(pinned: Iterable[int], irqs: Iterable[IrqOnPin]) -> list[str]:
    """What to set so that irqbalance keeps device interrupts off ``pinned``,
    and what it cannot move. cpupin writes none of it."""
    cpus = sorted(set(pinned))
    if not cpus:
        return []
    listed = list(irqs)
    lines = [
        f"irqbalance: IRQBALANCE_BANNED_CPULIST={format_cpulist(cpus)} (irqbalance 1.8 and "
        f"later), or IRQBALANCE_BANNED_CPUS={format_cpumask(cpus)} (older), in "
        "/etc/default/irqbalance or /etc/sysconfig/irqbalance, then restart irqbalance"
    ]
    fixed = [i.irq for i in listed if i.managed]
    if fixed:
        lines.append(
            f"managed IRQ(s) {', '.join(fixed[:12])}{'...' if len(fixed) > 12 else ''} cannot "
            "move (the kernel spreads a multi-queue device over the CPUs): boot with "
            f"isolcpus=managed_irq,{format_cpulist(cpus)} to keep them off where the device "
            "has other CPUs, or accept their rate"
        )
    movable = [i.irq for i in listed if not i.managed]
    if movable:
        lines.append(
            "without irqbalance, an IRQ that is not managed can be moved by writing a CPU "
            "list to /proc/irq/N/smp_affinity_list (as root); irqbalance --banirq=N would "
            f"instead leave IRQ N where it is: IRQ {', '.join(movable[:12])}"
            + ("..." if len(movable) > 12 else "")
        )
    return lines
