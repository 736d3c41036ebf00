"""Where libgomp puts an OpenMP team, read from the environment as libgomp
reads it: pure.

GCC's OpenMP runtime (libgomp, which PyTorch ships and vLLM-CPU runs on)
takes its places from ``OMP_PLACES``, else from ``GOMP_CPU_AFFINITY``,
and binds the team to them unless ``OMP_PROC_BIND`` is ``false``;
``OMP_PROC_BIND`` alone (``true``, ``close``, ``spread``, ``master``,
``primary``) binds to one place a hardware thread. :func:`libgomp_binding`
follows libgomp 12's parser rule for rule, so that what it says is what the
runtime does, and the tests hold it to libgomp itself (a probe built with
``gcc -fopenmp`` that prints ``omp_get_place_proc_ids`` and its team's
masks):

- ``OMP_PLACES`` wins over ``GOMP_CPU_AFFINITY`` whenever it is valid;
  ``OMP_PROC_BIND=false`` (valid, first) drops both; an invalid
  ``OMP_PROC_BIND`` counts as unset;
- an explicit place is ``{n[:len[:stride]],...}``, a bare number ``n``, or
  a place to remove (``!{...}``, ``!n``), and ``{...}:count[:stride]``
  repeats it; CPUs are read as C's ``strtoul`` reads them (spaces, a sign);
  a CPU past the affinity mask's 64-bit word is an error that voids the
  whole variable, and places with no CPU of the mask are dropped;
- ``GOMP_CPU_AFFINITY`` is CPUs and ranges ``a-b[:stride]`` in C's base 0
  (``0x10``, ``010``), separated by spaces or commas; a CPU past the mask's
  word is skipped, one outside the mask kept (libgomp then cannot bind
  that thread);
- abstract places (``threads``, ``cores``, ``sockets``, ``ll_caches``,
  ``numa_domains``, each with an optional ``(count)``) come from the host's
  topology within the mask, in libgomp's order;
- under ``master`` or ``primary`` the whole team shares the first place;
  otherwise a team as large as the places covers them all.

Intel's runtime reads ``KMP_AFFINITY``'s ``proclist=[...]``:
:func:`omp_team_cpus` falls back to it where libgomp binds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cpupin.host.topology import Host

__all__ = ["OmpBinding", "libgomp_binding", "omp_team_cpus"]

_SPACE = " \t\n\v\f\r"
_ULONG = (1 << 64) - 1
_LONG_MAX = (1 << 63) - 1
#: The most places libgomp parses (and the GOMP_CPU_AFFINITY CPU bound).
_MAX_PLACES = 65536
_BINDS = ("false", "true", "master", "primary", "close", "spread")
_LEVELS = ("threads", "cores", "sockets", "ll_caches", "numa_domains")


@dataclass(frozen=True)
class OmpBinding:
    """Where libgomp binds a team: its places, the binding policy and the
    variable the places came from."""

    places: tuple[frozenset[int], ...]
    """As ``omp_get_place_proc_ids`` lists them, in order."""
    bind: str
    """``true``, ``close``, ``spread``, ``master`` or ``primary``."""
    source: str
    """``OMP_PLACES``, ``GOMP_CPU_AFFINITY`` or ``OMP_PROC_BIND``."""
    mask: frozenset[int]

    @property
    def cpus(self) -> frozenset[int]:
        """The CPUs a team as large as the places runs on: every place's
        (the whole team on the first under ``master``/``primary``); a place
        with no CPU of the mask leaves its thread on the mask."""
        places = self.places[:1] if self.bind in ("master", "primary") else self.places
        out: set[int] = set()
        for place in places:
            out |= (place & self.mask) or self.mask
        return frozenset(out)


# --- C's number parsing ------------------------------------------------------


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _strtoul(text: str, i: int, base: int) -> tuple[int, int, bool]:
    """C's ``strtoul`` from ``text[i:]``: (value, end, overflow). No digits:
    (0, ``i``, False), the end where it started."""
    j = _skip(text, i)
    negative = False
    if j < len(text) and text[j] in "+-":
        negative = text[j] == "-"
        j += 1
    if base == 0:
        if text[j : j + 2].lower() == "0x" and j + 2 < len(text) and _digit(text[j + 2], 16):
            base, j = 16, j + 2
        elif text[j : j + 1] == "0":
            base = 8
        else:
            base = 10
    start = j
    while j < len(text) and _digit(text[j], base):
        j += 1
    if j == start:
        return 0, i, False
    value = int(text[start:j], base)
    if value > _ULONG:
        return _ULONG, j, True
    return ((-value) & _ULONG if negative else value), j, False


def _strtol(text: str, i: int) -> tuple[int, int, bool]:
    """C's ``strtol`` in base 10: (value, end, overflow)."""
    j = _skip(text, i)
    negative = False
    if j < len(text) and text[j] in "+-":
        negative = text[j] == "-"
        j += 1
    start = j
    while j < len(text) and "0" <= text[j] <= "9":
        j += 1
    if j == start:
        return 0, i, False
    value = int(text[start:j])
    if negative:
        return (-value, j, False) if value <= _LONG_MAX + 1 else (-_LONG_MAX - 1, j, True)
    return (value, j, False) if value <= _LONG_MAX else (_LONG_MAX, j, True)


def _digit(c: str, base: int) -> bool:
    if "0" <= c <= "9":
        return int(c) < base
    return base == 16 and c.lower() in "abcdef"


def _starts(text: str, i: int, word: str) -> bool:
    return text[i : i + len(word)].lower() == word


def _word_limit(mask: frozenset[int]) -> int:
    """The first CPU number libgomp cannot hold: its sets are as many 64-bit
    words as the mask's highest CPU needs."""
    return 64 * ((max(mask) + 64) // 64)


# --- OMP_PROC_BIND -----------------------------------------------------------


def _bind(text: str | None) -> str | None:
    """The first value of ``OMP_PROC_BIND``; ``None`` when unset or invalid."""
    if text is None:
        return None
    i = _skip(text, 0)
    if i == len(text):
        return None
    first = next((w for w in _BINDS if _starts(text, i, w)), None)
    if first is None:
        return None
    i = _skip(text, i + len(first))
    if i == len(text):
        return first
    if text[i] != "," or first in ("false", "true"):
        return None
    while True:
        i = _skip(text, i + 1)
        word = next((w for w in _BINDS[2:] if _starts(text, i, w)), None)
        if word is None:
            return None
        i = _skip(text, i + len(word))
        if i == len(text):
            return first
        if text[i] != ",":
            return None


# --- OMP_PLACES ----------------------------------------------------------------


class _Invalid(Exception):
    """The variable is invalid: libgomp ignores it whole."""


def _add(place: set[int], num: int, length: int, stride: int, limit: int) -> None:
    """libgomp's add: ``length`` CPUs from ``num`` by ``stride``; a CPU past
    ``limit`` (or a stride that wraps) voids the variable."""
    while True:
        if num >= limit:
            raise _Invalid
        place.add(num)
        length -= 1
        if length == 0:
            return
        if (stride < 0 and num + stride < 0) or (stride > 0 and num + stride > _ULONG):
            raise _Invalid
        num += stride


def _one_place(text: str, i: int, limit: int) -> tuple[set[int], bool, int, int, int]:
    """One place from ``text[i:]``: (its CPUs, negated, count, stride, end)."""
    place: set[int] = set()
    i = _skip(text, i)
    negate = False
    if i < len(text) and text[i] == "!":
        negate = True
        i = _skip(text, i + 1)
    if i >= len(text) or text[i] != "{":
        num, end, over = _strtoul(text, i, 10)
        if over or end == i:
            raise _Invalid
        _add(place, num, 1, 1, limit)
        i = end
    else:
        i = _skip(text, i + 1)
        removed: list[int] = []
        while True:
            this_negate = i < len(text) and text[i] == "!"
            if this_negate:
                i = _skip(text, i + 1)
            num, end, over = _strtoul(text, i, 10)
            if over or end == i:
                raise _Invalid
            i = _skip(text, end)
            length, stride = 1, 1
            if i < len(text) and text[i] == ":":
                if this_negate:
                    raise _Invalid
                length, i, over = _strtoul(text, i + 1, 10)
                if over or length == 0:
                    raise _Invalid
                i = _skip(text, i)
                if i < len(text) and text[i] == ":":
                    stride, i = _stride(text, i + 1)
            if this_negate:
                removed.append(num)
            else:
                _add(place, num, length, stride, limit)
            if i < len(text) and text[i] == "}":
                break
            if i >= len(text) or text[i] != ",":
                raise _Invalid
            i = _skip(text, i + 1)
        for num in removed:  # libgomp removes in a second pass, after every add
            if num >= limit or num not in place:
                raise _Invalid
            place.discard(num)
        i += 1
    i = _skip(text, i)
    count, stride = 1, 1
    if i < len(text) and text[i] == ":":
        if negate:
            raise _Invalid
        count, i, over = _strtoul(text, i + 1, 10)
        if over or count == 0 or count >= _MAX_PLACES:
            raise _Invalid
        i = _skip(text, i)
        if i < len(text) and text[i] == ":":
            stride, i = _stride(text, i + 1)
    return place, negate, count, stride, i


def _stride(text: str, i: int) -> tuple[int, int]:
    """A stride after its ``:``: (value, the end past spaces)."""
    start = _skip(text, i)
    stride, end, over = _strtol(text, start)
    if over or end == start:
        raise _Invalid
    return stride, _skip(text, end)


def _explicit(text: str, mask: frozenset[int], limit: int) -> list[frozenset[int]]:
    places: list[frozenset[int]] = []
    total = 0
    negated = False
    i = 0
    while True:
        place, negate, count, stride, i = _one_place(text, i, limit)
        if negate:
            total += 0 if negated else 1
            negated = True
            frozen = frozenset(place)
            if frozen not in places:
                raise _Invalid  # removing a place that is not there
            places.remove(frozen)
        else:
            total += count
            copy = frozenset(place)
            places.append(copy)
            for _ in range(count - 1):
                if any(c + stride < 0 or c + stride >= limit for c in copy):
                    raise _Invalid
                copy = frozenset(c + stride for c in copy)
                places.append(copy)
        if total > _MAX_PLACES:
            raise _Invalid
        if i == len(text):
            break
        if text[i] != ",":
            raise _Invalid
        i += 1
    if not places:
        raise _Invalid
    kept = [p & mask for p in places if p & mask]
    if not kept:
        raise _Invalid
    return kept


def _abstract(text: str, i: int) -> tuple[int, int | None] | None:
    """(level, count) of an abstract name at ``text[i:]``; ``None`` for no
    name; :class:`_Invalid` for a name followed by anything but ``(N)``."""
    level = next((n for n, w in enumerate(_LEVELS, 1) if _starts(text, i, w)), 0)
    if not level:
        return None
    i = _skip(text, i + len(_LEVELS[level - 1]))
    if i == len(text):
        return level, None
    if text[i] != "(":
        raise _Invalid
    count, end, over = _strtoul(text, i + 1, 10)
    if over or end == i + 1:
        raise _Invalid
    i = _skip(text, end)
    if i == len(text) or text[i] != ")":
        raise _Invalid
    if _skip(text, i + 1) != len(text):
        raise _Invalid
    return level, count


def _units(level: int, mask: frozenset[int], host: Host | None) -> list[frozenset[int]]:
    """The places of an abstract level within ``mask``, in libgomp's order."""
    cores: list[tuple[frozenset[int], int | None]] = []
    if host is not None:
        cores = [(frozenset(c.cpus) & mask, c.package) for c in host.cores]
        cores = [(cpus, pkg) for cpus, pkg in cores if cpus]
    covered = frozenset().union(*(cpus for cpus, _ in cores)) if cores else frozenset()
    cores += [(frozenset({cpu}), None) for cpu in sorted(mask - covered)]
    cores.sort(key=lambda item: min(item[0]))
    if level == 1:
        return [frozenset({cpu}) for cpus, _ in cores for cpu in sorted(cpus)]
    if level == 2:
        return [cpus for cpus, _ in cores]
    groups: list[frozenset[int]]
    if level == 3:
        by: dict[int | None, set[int]] = {}
        for cpus, pkg in cores:
            by.setdefault(pkg, set()).update(cpus)
        groups = [frozenset(g) for g in by.values()]
    elif level == 4:
        groups = [d & mask for d in host.caches] if host is not None and host.caches else [mask]
    else:
        groups = (
            [n.cpus & mask for n in sorted(host.nodes, key=lambda n: n.id)]
            if host is not None and host.nodes
            else [mask]
        )
        return [g for g in groups if g]
    return sorted((g for g in groups if g), key=min)


def _places(
    text: str | None, ignore: bool, mask: frozenset[int], host: Host | None
) -> list[frozenset[int]] | None:
    """``OMP_PLACES``'s places, or ``None`` where libgomp takes none from it."""
    if text is None:
        return None
    limit = _word_limit(mask)
    try:
        i = _skip(text, 0)
        if i == len(text):
            raise _Invalid
        abstract = _abstract(text, i)
        if abstract is not None:
            if ignore:
                return None
            level, count = abstract
            units = _units(level, mask, host)
            kept = units[: min(len(mask), len(units) if count is None else count)]
            return kept or None
        places = _explicit(text[i:], mask, limit)
    except _Invalid:
        return None
    return None if ignore else places


# --- GOMP_CPU_AFFINITY -----------------------------------------------------------


def _affinity(text: str | None, ignore: bool, mask: frozenset[int]) -> list[frozenset[int]] | None:
    if text is None:
        return None
    limit = _word_limit(mask)
    cpus: list[int] = []
    i = 0
    while True:
        i = _skip(text, i)
        first, end, over = _strtoul(text, i, 0)
        if over or end == i or first >= _MAX_PLACES:
            return None
        last, stride = first, 1
        i = end
        if i < len(text) and text[i] == "-":
            last, end, over = _strtoul(text, i + 1, 0)
            if over or end == i + 1 or last >= _MAX_PLACES or last < first:
                return None
            i = end
            if i < len(text) and text[i] == ":":
                stride, end, over = _strtoul(text, i + 1, 0)
                if over or stride == 0 or stride >= _MAX_PLACES:
                    return None
                i = end
        cpus.extend(range(first, last + 1, stride))
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i == len(text):
            break
    if ignore:
        return None
    places = [frozenset({cpu}) for cpu in cpus if cpu < limit]
    return places or None


# --- the binding -----------------------------------------------------------------


def libgomp_binding(
    environ: Mapping[str, str], mask: Iterable[int], host: Host | None = None
) -> OmpBinding | None:
    """Where libgomp binds a team started with the process mask ``mask``
    under ``environ``; ``None`` where it binds nothing. ``host`` gives the
    topology abstract places are made of (without it: a core a CPU, one
    socket, one cache, one node)."""
    cpus = frozenset(mask)
    if not cpus:
        return None
    bind = _bind(environ.get("OMP_PROC_BIND"))
    ignore = bind == "false"
    source = "OMP_PLACES"
    places = _places(environ.get("OMP_PLACES"), ignore, cpus, host)
    if places is None:
        source = "GOMP_CPU_AFFINITY"
        places = _affinity(environ.get("GOMP_CPU_AFFINITY"), ignore, cpus)
    if bind is None or bind == "false":
        if places is None or ignore:
            return None
        bind = "true"
    if places is None:
        source = "OMP_PROC_BIND"
        places = _units(1, cpus, host)
    return OmpBinding(tuple(places), bind, source, cpus)


def _proclist(text: str) -> frozenset[int] | None:
    """``KMP_AFFINITY``'s ``proclist=[...]``: CPUs and ranges."""
    start = text.find("proclist=[")
    if start < 0:
        return None
    inner = text[start + len("proclist=[") :].partition("]")[0]
    out: set[int] = set()
    for item in inner.replace(",", " ").split():
        first, _, last = item.partition("-")
        if not (first.isascii() and first.isdigit() and (not last or last.isdigit())):
            return None
        lo, hi = int(first), int(last or first)
        if not lo <= hi < _MAX_PLACES:
            return None
        out.update(range(lo, hi + 1))
    return frozenset(out) or None


def omp_team_cpus(
    environ: Mapping[str, str], mask: Iterable[int], host: Host | None = None
) -> tuple[frozenset[int], str] | None:
    """The CPUs an OpenMP team binds to and the variable that says so:
    libgomp's binding, else Intel's ``KMP_AFFINITY`` proclist (within the
    mask); ``None`` when neither binds."""
    cpus = frozenset(mask)
    found = libgomp_binding(environ, cpus, host)
    if found is not None:
        return found.cpus, found.source
    listed = _proclist(environ.get("KMP_AFFINITY", ""))
    if listed is not None and listed & cpus:
        return listed & cpus, "KMP_AFFINITY"
    return None
