"""CPU lists (``"0-3,8-11"``) and sysfs hex masks, strictly parsed.

The kernel writes both forms; users type the first. A bad list is an error
that quotes the text, never a set that is silently different.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from cpupin.errors import excerpt

__all__ = [
    "MAX_CPUS",
    "as_cpu",
    "cpus_phrase",
    "format_cpulist",
    "format_cpumask",
    "parse_cpulist",
    "parse_cpumask",
]

#: One past the highest CPU number accepted. Linux allows at most 8192 CPUs
#: today; the bound keeps a typo such as ``0-4000000000`` from building a
#: set of four billion numbers.
MAX_CPUS = 1 << 16

_DIGITS = 10  # more digits than any CPU number below MAX_CPUS could have
# What a mask's word may hold. The lists and masks are read with str's
# methods, not regular expressions: compiling them cost every start (every
# `cpupin exec`) half a millisecond.
_HEX = frozenset("0123456789abcdefABCDEF")


def is_digits(text: str) -> bool:
    """ASCII digits, at least one (``str.isdigit`` alone takes other digits)."""
    return text.isascii() and text.isdigit()


def is_hex(text: str, most: int) -> bool:
    """One to ``most`` hex digits (a mask's word, a PCI address's part)."""
    return 0 < len(text) <= most and _HEX.issuperset(text)


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a CPU list such as ``"0-3,8-11"`` (the kernel's ``cpulist``).

    Surrounding white space and a trailing newline are fine and the empty
    string is the empty set (a NUMA node without CPUs). A reversed range, a
    stride (``0-7:2``), a sign, a number of :data:`MAX_CPUS` or more, or
    anything else raises :class:`ValueError` quoting (the start of) the text.

    Linear in the text: ranges are merged before any CPU is counted, so
    thousands of overlapping ranges cost no more than one.
    """
    if not isinstance(text, str):
        raise TypeError(f"a CPU list is a str such as '0-3,8', not {type(text).__name__}")
    body = text.strip()
    if not body:
        return frozenset()
    ranges = []
    for item in body.split(","):
        first_text, dash, last_text = item.strip().partition("-")
        if not is_digits(first_text) or (dash and not is_digits(last_text)):
            raise ValueError(
                f"bad CPU list {excerpt(text)}: {excerpt(item, 20)} is not a CPU number "
                "or a range like 0-3"
            )
        last_text = last_text if dash else first_text
        if len(last_text) > _DIGITS or len(first_text) > _DIGITS:
            raise ValueError(
                f"bad CPU list {excerpt(text)}: {excerpt(item, 20)} is past the limit of {MAX_CPUS}"
            )
        first, last = int(first_text), int(last_text)
        if last < first:
            raise ValueError(
                f"bad CPU list {excerpt(text)}: the range {excerpt(item, 20)} runs backwards"
            )
        if last >= MAX_CPUS:
            raise ValueError(
                f"bad CPU list {excerpt(text)}: CPU {last} is past the limit of {MAX_CPUS}"
            )
        ranges.append((first, last))
    ranges.sort()
    cpus: list[int] = []
    top = -1
    for first, last in ranges:
        if last > top:
            cpus.extend(range(max(first, top + 1), last + 1))
            top = last
    return frozenset(cpus)


def parse_cpumask(text: str) -> frozenset[int]:
    """Parse a sysfs hex mask such as ``"00000000,0000ff00"``.

    Comma-separated 32-bit words, most significant first, of any width; the
    empty string is the empty set. Anything else raises :class:`ValueError`
    quoting (the start of) the text.
    """
    if not isinstance(text, str):
        raise TypeError(f"a CPU mask is a str such as 'ff,00000000', not {type(text).__name__}")
    body = text.strip()
    if not body:
        return frozenset()
    words = body.split(",")
    for word in words:
        if not is_hex(word, 8):
            raise ValueError(
                f"bad CPU mask {excerpt(text)}: {excerpt(word, 20)} is not a word of one to "
                "eight hex digits"
            )
    # Leading zero words are fine (the kernel pads to nr_cpu_ids); only the
    # significant ones are converted.
    first = 0
    while first < len(words) - 1 and int(words[first], 16) == 0:
        first += 1
    if 32 * (len(words) - first - 1) >= MAX_CPUS:
        raise ValueError(f"bad CPU mask {excerpt(text)}: a CPU past the limit of {MAX_CPUS} is set")
    value = int("".join(word.zfill(8) for word in words[first:]), 16)
    if value.bit_length() > MAX_CPUS:
        raise ValueError(
            f"bad CPU mask {excerpt(text)}: CPU {value.bit_length() - 1} is past "
            f"the limit of {MAX_CPUS}"
        )
    return frozenset(_bits(value))


def format_cpumask(cpus: Iterable[int], words: int = 0) -> str:
    """The sysfs hex mask of ``cpus``, as :func:`parse_cpumask` reads it:
    comma-separated 32-bit words, most significant first, at least ``words``
    of them (the kernel pads to ``nr_cpu_ids``) and at least one."""
    value = sum(1 << cpu for cpu in set(cpus))
    count = max(words, 1, (value.bit_length() + 31) // 32)
    return ",".join(f"{(value >> (32 * i)) & 0xFFFFFFFF:08x}" for i in reversed(range(count)))


def _bits(value: int) -> Iterable[int]:
    cpu = 0
    while value:
        low = value & 0xFFFFFFFFFFFFFFFF
        while low:
            bit = low & -low
            yield cpu + bit.bit_length() - 1
            low ^= bit
        value >>= 64
        cpu += 64


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPUs as the kernel does: sorted, runs as ranges (``"0-3,8-11"``).

    Raises :class:`ValueError` for a negative number or a bool.
    """
    if type(cpus) is frozenset and set(map(type, cpus)) <= {int}:
        ordered = sorted(cpus)  # a set of plain ints: only the sign to check
        if ordered and ordered[0] < 0:
            as_cpu(ordered[0])
    else:
        ordered = sorted(set(_checked(cpus)))
    if not ordered:
        return ""
    # Where a run breaks, found in one comprehension; then one part a run.
    ends = [i for i in range(1, len(ordered)) if ordered[i] != ordered[i - 1] + 1]
    parts = []
    start = 0
    for end in (*ends, len(ordered)):
        first, last = ordered[start], ordered[end - 1]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end
    return ",".join(parts)


def as_cpu(value: object) -> int:
    """``value`` as a CPU number, or :class:`ValueError` naming it.

    Anything with ``__index__`` (numpy integers too) passes; a bool, a float,
    a string or a negative number does not.
    """
    if not isinstance(value, bool):
        try:
            cpu = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if cpu >= 0:
                return cpu
    raise ValueError(f"{value!r} is not a CPU number (a whole number from 0)")


def _checked(cpus: Iterable[int]) -> Iterable[int]:
    return map(as_cpu, cpus)


def cpus_phrase(cpus: Iterable[int], verb: str = "") -> str:
    """CPUs as a sentence names them: ``CPU 5 is``, ``CPUs 2 and 130 are``,
    ``CPUs 0-3, 8 and 10 are`` (with ``verb`` "is": the verb agrees)."""
    runs = format_cpulist(cpus).split(",")
    many = len(runs) > 1 or "-" in runs[0]
    text = ("CPUs " if many else "CPU ") + (
        runs[0] if len(runs) == 1 else ", ".join(runs[:-1]) + " and " + runs[-1]
    )
    if verb == "is":
        text += " are" if many else " is"
    return text
