"""A record's values, each checked as hostile input: whole numbers in
bounds, CPUs this host has online, short printable texts, and the nested
shapes a process record holds (its pools, its wake-latency holds, its pin
drift, its step clocks' figures). Each check raises ``ValueError`` naming
the field; :mod:`cpupin.registry.reader` builds records from them."""

from __future__ import annotations

from typing import NamedTuple

from cpupin._native import PID_LIMIT
from cpupin.cpulist import MAX_CPUS, format_cpulist, parse_cpulist
from cpupin.errors import excerpt, printable
from cpupin.host._pmqos import MAX_US, parse_resume_latency
from cpupin.registry._record import (
    BUCKETS_S,
    MAX_HOLDS,
    MAX_NAME,
    MAX_POOL_TIDS,
    MAX_POOLS,
)


def whole(value: object, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} {excerpt(value)} is not a whole number from {lo} to {hi}")
    return value


def cpu_list(value: object, what: str, host: frozenset[int]) -> frozenset[int]:
    """A list of CPUs of this host, each once: a list of numbers, or ranges
    (``"0-999"``) as a record that outgrew one slot writes them."""
    if isinstance(value, str) and 0 < len(value) <= 8 * len(host) + 8:
        try:
            cpus = parse_cpulist(value)
        except ValueError:
            raise ValueError(f"{what} is not a list of this host's CPUs") from None
        if not cpus:
            raise ValueError(f"{what} is not a list of this host's CPUs")
    else:
        if not isinstance(value, list) or not value or len(value) > len(host):
            raise ValueError(f"{what} is not a list of this host's CPUs")
        cpus = frozenset(whole(c, 0, MAX_CPUS - 1, f"{what} CPU") for c in value)
        if len(cpus) != len(value):
            raise ValueError(f"{what} lists a CPU twice")
    if not cpus <= host:
        raise ValueError(
            f"{what} names CPU {min(cpus - host)}, which this host does not have online"
        )
    return cpus


def short_text(value: object, what: str, size: int = MAX_NAME) -> str:
    """A short text field, made printable; a longer one is cut, not refused
    (a thread may carry a long name)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a text")
    return printable(value[: size * 4], size)


class RecordedPool(NamedTuple):
    """A pool a process's record names (:func:`cpupin.pools.census.recorded_pools`)."""

    name: str
    kind: str
    """``threads`` (its threads, by their Python names) or ``configured``."""
    threads: int
    tids: tuple[int, ...]


def pool_list(value: object) -> tuple[RecordedPool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_POOLS:
        raise ValueError(f"pools is not a list of at most {MAX_POOLS}")
    out = []
    room = MAX_POOL_TIDS
    for p in value:
        if not isinstance(p, dict):
            raise ValueError("a pool is not an object")
        kind = p.get("kind")
        if kind not in ("threads", "configured"):
            raise ValueError(f"a pool's kind {excerpt(kind)} is not threads or configured")
        tids = p.get("tids")
        if not isinstance(tids, list) or len(tids) > room:
            raise ValueError(f"a pool's tids are not a list of at most {MAX_POOL_TIDS} in all")
        room -= len(tids)
        out.append(
            RecordedPool(
                short_text(p.get("name"), "pool name"),
                kind,
                whole(p.get("threads"), 0, 1 << 20, "a pool's threads"),
                tuple(whole(t, 1, PID_LIMIT - 1, "a pool's tid") for t in tids),
            )
        )
    return tuple(out)


class RecordedHold(NamedTuple):
    """A wake-latency hold a process's record says is in force
    (:func:`cpupin.hold_wake_latency`)."""

    mechanism: str
    cpus: frozenset[int]
    max_us: int
    since: float
    previous: tuple[tuple[int, str], ...]
    """``sysfs``, in a record of a cpupin before the wake journal: each CPU's
    value before the hold. The journal keeps them now
    (:mod:`cpupin.registry.holds`)."""
    warden: int | None = None
    """``sysfs``: the pid of the process that puts the CPUs back if the
    holder dies holding them (:mod:`cpupin.registry.warden`)."""

    def as_dict(self) -> dict[str, object]:
        return {
            "mechanism": self.mechanism,
            "cpus": sorted(self.cpus),
            "cpus_list": format_cpulist(self.cpus),
            "max_us": self.max_us,
            "since": self.since,
            "previous": {str(c): v for c, v in self.previous} or None,
            "warden": self.warden,
        }


def pin_drift(value: object) -> tuple[int, str]:
    if value is None:
        return (0, "")
    if not isinstance(value, dict):
        raise ValueError("pin_drift is not an object")
    return (
        whole(value.get("total"), 0, 1 << 62, "pin_drift total"),
        short_text(value.get("last"), "pin_drift last", 240),
    )


class AutoActs(NamedTuple):
    """What the vLLM plugin's ``auto`` did to a process, as its record says:
    threads it moved off the OpenMP CPUs, the CPUs they are confined to
    (empty: none, or widened), and whether it widened them."""

    moved: int = 0
    confined: frozenset[int] = frozenset()
    widened: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"moved": self.moved, "confined": sorted(self.confined), "widened": self.widened}


def auto_acts(value: object, host: frozenset[int]) -> AutoActs:
    if value is None:
        return AutoActs()
    if not isinstance(value, dict):
        raise ValueError("auto is not an object")
    widened = value.get("widened")
    if type(widened) is not bool:
        raise ValueError(f"auto widened {excerpt(widened)} is not true or false")
    confined = value.get("confined")
    return AutoActs(
        whole(value.get("moved"), 0, 1 << 20, "auto moved"),
        frozenset() if confined in ("", []) else cpu_list(confined, "auto confined", host),
        widened,
    )


def hold_list(value: object, host: frozenset[int]) -> tuple[RecordedHold, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_HOLDS:
        raise ValueError(f"wake_holds is not a list of at most {MAX_HOLDS}")
    out = []
    for h in value:
        if not isinstance(h, dict):
            raise ValueError("a wake hold is not an object")
        mechanism = h.get("mechanism")
        if mechanism not in ("sysfs", "dma"):
            raise ValueError(f"a wake hold's mechanism {excerpt(mechanism)} is not sysfs or dma")
        cpus = cpu_list(h.get("cpus"), "a wake hold's", host)
        previous: list[tuple[int, str]] = []
        raw = h.get("previous")
        if mechanism == "sysfs" and raw is not None:  # written by a cpupin before the journal
            if not isinstance(raw, dict) or len(raw) != len(cpus):
                raise ValueError("a sysfs wake hold's previous values are not one a CPU")
            for key, text in raw.items():
                if not (key.isascii() and key.isdigit() and int(key) in cpus):
                    raise ValueError(f"a wake hold's previous value names CPU {excerpt(key)}")
                if not isinstance(text, str):
                    raise ValueError(f"a wake hold's previous value {excerpt(text)} is not one")
                parse_resume_latency(text)  # ValueError naming it, for anything else
                previous.append((int(key), text))
        out.append(
            RecordedHold(
                mechanism,
                cpus,
                whole(h.get("max_us"), 0, MAX_US, "a wake hold's max_us"),
                seconds(h.get("since"), "a wake hold's since"),
                tuple(sorted(previous)),
                None
                if h.get("warden") is None
                else whole(h.get("warden"), 1, PID_LIMIT - 1, "a wake hold's warden"),
            )
        )
    return tuple(out)


_STEP_SUMS = ("wall_s", "wait_s", "throttled_s")
_STEP_PERCENTILES = ("wall_p50_us", "wall_p99_us", "wait_p50_us", "wait_p99_us")


def seconds(value: object, what: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1e12:  # type: ignore[operator]
        raise ValueError(f"{what} {excerpt(value)} is not a time in range")
    return float(value)  # type: ignore[arg-type]


def clock_figures(value: object) -> dict[str, object]:
    """One clock's figures in a record, each checked (the histogram has one
    count a bucket of :data:`BUCKETS_S` and one above)."""
    if not isinstance(value, dict):
        raise ValueError("a clock's figures are not an object")
    counts = value.get("counts")
    if not isinstance(counts, list) or len(counts) != len(BUCKETS_S) + 1:
        raise ValueError(f"a clock's counts are not {len(BUCKETS_S) + 1} numbers")
    out: dict[str, object] = {
        "clock": short_text(value.get("clock"), "clock"),
        "tid": whole(value.get("tid"), 1, PID_LIMIT - 1, "a clock's tid"),
        "steps": whole(value.get("steps"), 0, 1 << 62, "steps"),
        "counts": [whole(c, 0, 1 << 62, "a bucket's count") for c in counts],
    }
    for key in _STEP_SUMS:
        out[key] = seconds(value.get(key), key)
    for key in _STEP_PERCENTILES:
        got = value.get(key)
        out[key] = None if got is None else seconds(got, key)
    return out
