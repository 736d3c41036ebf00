"""Reading the host's registry (see :mod:`cpupin.registry.writer` for what it
holds): every record in the lock directory, read as hostile input, with its
liveness. Imported on first use: a process that only pins never reads."""

from __future__ import annotations

import errno
import functools
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from cpupin import _native
from cpupin._native import PID_LIMIT
from cpupin.cpulist import MAX_CPUS, format_cpulist, parse_cpulist
from cpupin.errors import excerpt, printable
from cpupin.host._pmqos import MAX_US, parse_resume_latency
from cpupin.host._proc import euid_of, start_time
from cpupin.registry._record import (
    BUCKETS_S,
    MAX_HOLDS,
    MAX_LISTED,
    MAX_NAME,
    MAX_PINS,
    MAX_POOL_TIDS,
    MAX_POOLS,
    MAX_RECORDS,
    MAX_SIZE,
    PROC_LOCKS,
    Pinned,
    _names,
    decode,
    lock_dir,
    open_lock_dir,
)

__all__ = ["Record", "Registry", "parent_pinned_to", "read_registry"]


def _whole(value: object, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} {excerpt(value)} is not a whole number from {lo} to {hi}")
    return value


def _cpus(value: object, what: str, host: frozenset[int]) -> frozenset[int]:
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
        cpus = frozenset(_whole(c, 0, MAX_CPUS - 1, f"{what} CPU") for c in value)
        if len(cpus) != len(value):
            raise ValueError(f"{what} lists a CPU twice")
    if not cpus <= host:
        raise ValueError(
            f"{what} names CPU {min(cpus - host)}, which this host does not have online"
        )
    return cpus


def _text(value: object, what: str, size: int = MAX_NAME) -> str:
    """A short text field, made printable; a longer one is cut, not refused
    (a thread may carry a long name)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a text")
    return printable(value[: size * 4], size)


# --- what a reader finds ----------------------------------------------------


class RecordedPool(NamedTuple):
    """A pool a process's record names (:func:`cpupin.pools.census.recorded_pools`)."""

    name: str
    kind: str
    """``threads`` (its threads, by their Python names) or ``configured``."""
    threads: int
    tids: tuple[int, ...]


def _pools(value: object) -> tuple[RecordedPool, ...]:
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
                _text(p.get("name"), "pool name"),
                kind,
                _whole(p.get("threads"), 0, 1 << 20, "a pool's threads"),
                tuple(_whole(t, 1, PID_LIMIT - 1, "a pool's tid") for t in tids),
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
    """``sysfs``: each CPU's value before the hold, to put back."""

    def as_dict(self) -> dict[str, object]:
        return {
            "mechanism": self.mechanism,
            "cpus": sorted(self.cpus),
            "cpus_list": format_cpulist(self.cpus),
            "max_us": self.max_us,
            "since": self.since,
            "previous": {str(c): v for c, v in self.previous} or None,
        }


def _drift(value: object) -> tuple[int, str]:
    if value is None:
        return (0, "")
    if not isinstance(value, dict):
        raise ValueError("pin_drift is not an object")
    return (
        _whole(value.get("total"), 0, 1 << 62, "pin_drift total"),
        _text(value.get("last"), "pin_drift last", 240),
    )


def _holds(value: object, host: frozenset[int]) -> tuple[RecordedHold, ...]:
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
        cpus = _cpus(h.get("cpus"), "a wake hold's", host)
        previous: list[tuple[int, str]] = []
        raw = h.get("previous")
        if mechanism == "sysfs":
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
                _whole(h.get("max_us"), 0, MAX_US, "a wake hold's max_us"),
                _seconds(h.get("since"), "a wake hold's since"),
                tuple(sorted(previous)),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Record:
    """A record found in the lock directory, checked, with its liveness.

    A stale record is never parsed: what it shows (its pid and start time, for
    a process record) comes from its file name and owner. ``pid`` is 0 for a
    lock file nobody holds (who wrote it cannot be known)."""

    kind: str
    """``server`` (a lock file's record) or ``process`` (a process record)."""
    path: str
    pid: int
    start_time: int
    uid: int
    why_stale: str
    """Empty for a live record; else why it is stale."""
    setting: str = ""
    devices: tuple[str, ...] = ()
    workers: tuple[tuple[str, frozenset[int]], ...] = ()
    result_cpu: int | None = None
    process_mask: frozenset[int] = frozenset()
    pins: tuple[Pinned, ...] = ()
    time: float = 0.0
    role: str = ""
    """What the process says it is (``vllm-worker``, say); empty when it says nothing."""
    notes: tuple[str, ...] = ()
    """The decisions made for the process, a line each, with why."""
    steps: tuple[dict[str, object], ...] = ()
    """Its step clocks' figures (:func:`cpupin.registry.writer.step_figures`), checked."""
    server: tuple[int, int] | None = None
    """The (pid, start time) of the process that prunes this one's record."""
    pools: tuple[RecordedPool, ...] = ()
    """The process's pools as it named them (for the census from outside)."""
    wake_holds: tuple[RecordedHold, ...] = ()
    """The wake-latency holds it has in force."""
    pin_drift: tuple[int, str] = (0, "")
    """How many times its pins were found off their CPUs, and the last."""
    out_of_date: str = ""
    """Why the record is older than the process's pins (an update it could
    not write: a full disk, a file size limit); empty while it is current."""

    @property
    def live(self) -> bool:
        return not self.why_stale

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "kind": self.kind,
            "path": self.path,
            "pid": self.pid or None,
            "start_time": self.start_time,
            "uid": self.uid,
            "live": self.live,
            "stale_because": self.why_stale or None,
            "time": self.time,
        }
        if self.kind == "server":
            out.update(
                setting=self.setting,
                devices=list(self.devices),
                workers=[{"device": d, "cpus": sorted(c)} for d, c in self.workers],
                result_cpu=self.result_cpu,
                process_mask=sorted(self.process_mask),
                process_mask_list=format_cpulist(self.process_mask),
            )
        else:
            out["role"] = self.role or None
            out["notes"] = list(self.notes)
            out["steps"] = [dict(s) for s in self.steps]
            out["server_pid"] = self.server[0] if self.server else None
            out["process_mask"] = sorted(self.process_mask) or None
            out["out_of_date"] = self.out_of_date or None
            out["recorded_pools"] = [p._asdict() | {"tids": list(p.tids)} for p in self.pools]
            out["wake_holds"] = [h.as_dict() for h in self.wake_holds]
            out["pin_drift"] = (
                {"total": self.pin_drift[0], "last": self.pin_drift[1]}
                if self.pin_drift[0]
                else None
            )
            out["pins"] = [
                {
                    "tid": p.tid,
                    "name": p.name,
                    "cpus": sorted(p.cpus),
                    "cpus_list": format_cpulist(p.cpus),
                    "role": p.role,
                }
                for p in self.pins
            ]
        return out


@dataclass
class Registry:
    """Everything :func:`read_registry` found: records, and the files it
    ignored with why (at most :data:`MAX_LISTED` of each listed; the rest
    counted in :attr:`not_listed`)."""

    directory: str
    records: list[Record] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    not_listed: int = 0
    """Stale or ignored files past :data:`MAX_LISTED`, counted, not listed."""
    _stale_count: int = field(default=0, repr=False, compare=False)

    def pins_of(self, pid: int) -> list[Pinned]:
        """The registered pins of a live process."""
        return [
            pin
            for r in self.records
            if r.kind == "process" and r.live and r.pid == pid
            for pin in r.pins
        ]

    def servers_of(self, pid: int) -> list[Record]:
        return [r for r in self.records if r.kind == "server" and r.live and r.pid == pid]

    def knows(self, pid: int) -> bool:
        return any(r.live and r.pid == pid for r in self.records)

    def _ignore(self, path: str, reason: str) -> None:
        if len(self.ignored) < MAX_LISTED:
            self.ignored.append((printable(path, 160), printable(reason, 160)))
        else:
            self.not_listed += 1

    def _stale(self, record: Record) -> None:
        if self._stale_count < MAX_LISTED:
            self._stale_count += 1
            self.records.append(record)
        else:
            self.not_listed += 1


def _flock_holders(inodes: set[tuple[int, int, int]]) -> dict[tuple[int, int, int], int] | None:
    """(major, minor, inode) -> pid of the exclusive ``flock`` on each of
    ``inodes``, streamed from ``/proc/locks`` however long it is (a host
    may hold many thousands of other locks); ``None`` where it cannot be
    read."""
    out: dict[tuple[int, int, int], int] = {}
    if not inodes:
        return out
    wanted = {str(ino).encode() for _, _, ino in inodes}
    try:
        with open(PROC_LOCKS, "rb") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" for a waiter)
                parts = line.split()
                if len(parts) < 6 or parts[1] != b"FLOCK" or parts[3] != b"WRITE":
                    continue
                device = parts[5].split(b":")
                if len(device) != 3 or device[2] not in wanted:
                    continue
                try:
                    key = (int(device[0], 16), int(device[1], 16), int(device[2]))
                    pid = int(parts[4])
                except ValueError:
                    continue
                if key in inodes and 0 < pid < PID_LIMIT:
                    out[key] = pid
    except OSError:
        return None
    return out


_PROC_NAME = re.compile(r"cpupin-proc-([1-9][0-9]{0,6})-([0-9]{1,19})(?:-[1-9])?\.json")
_GPU_NAME = re.compile(r"cpupin-gpu-([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\.lock")


def _open_record(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """A record file opened without following a link or blocking, checked to
    be a regular file of one link and at most :data:`MAX_SIZE` bytes. A file
    replaced while it was opened (no link left: its writer renamed a new one
    over it) is opened again."""
    for _ in range(3):
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_nlink > 1:
                raise ValueError(f"{info.st_nlink} hard links: a record file has one")
            if info.st_size > MAX_SIZE:
                raise ValueError(f"larger than {MAX_SIZE} bytes")
        except BaseException:
            os.close(fd)
            raise
        if info.st_nlink == 1:
            return fd, info
        os.close(fd)
    raise ValueError("replaced each time it was opened")


def _open_owned(
    dir_fd: int, name: str, pid: int, inode: os.stat_result | None = None
) -> tuple[int, os.stat_result]:
    """:func:`_open_record`, then checked to be the file ``inode`` names
    (when given) and owned by the uid ``pid`` runs as; closed on failure."""
    fd, info = _open_record(dir_fd, name)
    try:
        if inode is not None and (info.st_dev, info.st_ino) != (inode.st_dev, inode.st_ino):
            raise ValueError("replaced while it was read")
        _owner_is(info, pid)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


#: Reads of a record that races its writer before it is refused as torn.
_READS = 10


def _decode(fd: int) -> dict[str, object] | None:
    """The record in the file open at ``fd`` (closed after); ``None`` when it
    holds none yet. A read that races a writer's pwrite mixes two records at
    any byte: a bad checksum, or a last line that is no checksum at all. So a
    file that does not decode is read again, up to :data:`_READS` times, and
    refused only when two reads in a row find the same bytes (nobody is
    writing it) or the reads run out."""
    previous = None
    try:
        for attempt in range(_READS):
            raw = os.pread(fd, MAX_SIZE, 0)
            if not raw.strip(b" \n\0"):
                return None
            try:
                return decode(raw)
            except ValueError:
                if attempt == _READS - 1 or raw == previous:
                    raise
                previous = raw
    finally:
        os.close(fd)
    raise AssertionError("not reached")


def _common(record: dict[str, object]) -> tuple[int, int, int, float]:
    pid = _whole(record.get("pid"), 1, PID_LIMIT - 1, "pid")
    started = _whole(record.get("start_time"), 0, 1 << 62, "start_time")
    uid = _whole(record.get("uid"), 0, (1 << 32) - 2, "uid")
    when = record.get("time")
    if type(when) not in (int, float) or not math.isfinite(when):  # type: ignore[arg-type]
        raise ValueError("time is not a number")
    return pid, started, uid, float(when)  # type: ignore[arg-type]


def _alive(pid: int, started: int) -> str:
    now = start_time(pid)
    if now is None:
        return f"pid {pid} has exited"
    if now != started:
        return f"pid {pid} now names another process (a reused pid)"
    return ""


def _owner_is(info: os.stat_result, pid: int) -> None:
    """Refuse a file its process could not have written: its owner must be
    the uid that process runs as (another user's file naming a root process
    would otherwise vouch for it)."""
    uid = euid_of(pid)
    if uid is None:
        raise ValueError(f"pid {pid} has exited")
    if info.st_uid != uid:
        raise ValueError(f"owned by uid {info.st_uid}, but pid {pid} runs as uid {uid}")


def _server(
    path: str, record: dict[str, object], info: os.stat_result, holder: int, host: frozenset[int]
) -> Record:
    pid, started, uid, when = _common(record)
    if pid != holder or uid != info.st_uid:
        raise ValueError(
            f"names pid {pid} and uid {uid}, but pid {holder} holds the lock and the file "
            f"is uid {info.st_uid}'s"
        )
    setting = _text(record.get("setting"), "setting", 16)
    devices = record.get("devices")
    if not isinstance(devices, list) or len(devices) > 256:
        raise ValueError("devices is not a list")
    workers_raw = record.get("workers")
    if not isinstance(workers_raw, list) or len(workers_raw) > 256:
        raise ValueError("workers is not a list")
    workers = []
    for w in workers_raw:
        if not isinstance(w, dict):
            raise ValueError("a worker is not an object")
        workers.append((_text(w.get("device"), "device"), _cpus(w.get("cpus"), "worker", host)))
    result = record.get("result_cpu")
    result_cpu = None if result is None else _whole(result, 0, MAX_CPUS - 1, "result_cpu")
    if result_cpu is not None and result_cpu not in host:
        raise ValueError(f"result_cpu {result_cpu} is not a CPU this host has online")
    mask = _cpus(record.get("process_mask"), "process_mask", host)
    return Record(
        "server",
        path,
        pid,
        started,
        uid,
        _alive(pid, started),
        setting,
        tuple(_text(d, "device") for d in devices),
        tuple(workers),
        result_cpu,
        mask,
        time=when,
    )


def _process(
    path: str,
    record: dict[str, object],
    info: os.stat_result,
    named: tuple[int, int],
    host: frozenset[int],
) -> Record:
    pid, started, uid, when = _common(record)
    if (pid, started) != named or uid != info.st_uid:
        raise ValueError(
            f"names pid {pid}, start {started}, uid {uid}: not its file name's process "
            f"or not its owner"
        )
    pins_raw = record.get("pins")
    if not isinstance(pins_raw, list) or len(pins_raw) > MAX_PINS:
        raise ValueError("pins is not a list")
    pins = []
    for p in pins_raw:
        if not isinstance(p, dict):
            raise ValueError("a pin is not an object")
        pins.append(
            Pinned(
                _whole(p.get("tid"), 1, PID_LIMIT - 1, "tid"),
                _text(p.get("name"), "name"),
                _cpus(p.get("cpus"), "pin", host),
                _text(p.get("role"), "role", 32),
            )
        )
    role = record.get("role")
    notes = record.get("notes", [])
    if not isinstance(notes, list) or len(notes) > 16:
        raise ValueError("notes is not a list of at most 16")
    steps = record.get("steps", [])
    if not isinstance(steps, list) or len(steps) > 8:
        raise ValueError("steps is not a list of at most 8 clocks")
    mask_raw = record.get("process_mask")
    mask = frozenset() if mask_raw is None else _cpus(mask_raw, "process_mask", host)
    server_raw = record.get("server")
    server = None
    if server_raw is not None:
        if not isinstance(server_raw, list) or len(server_raw) != 2:
            raise ValueError("server is not a pid and a start time")
        server = (
            _whole(server_raw[0], 1, PID_LIMIT - 1, "server pid"),
            _whole(server_raw[1], 0, 1 << 62, "server start_time"),
        )
    return Record(
        "process",
        path,
        pid,
        started,
        uid,
        _alive(pid, started),
        pins=tuple(pins),
        time=when,
        role="" if role is None else _text(role, "role", 32),
        notes=tuple(_text(n, "note", 240) for n in notes),
        steps=tuple(_step_figures(s) for s in steps),
        server=server,
        process_mask=mask,
        pools=_pools(record.get("pools")),
        wake_holds=_holds(record.get("wake_holds"), host),
        pin_drift=_drift(record.get("pin_drift")),
        out_of_date=""
        if record.get("out_of_date") is None
        else _text(record.get("out_of_date"), "out_of_date", 240),
    )


_STEP_SUMS = ("wall_s", "wait_s", "throttled_s")
_STEP_PERCENTILES = ("wall_p50_us", "wall_p99_us", "wait_p50_us", "wait_p99_us")


def _seconds(value: object, what: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1e12:  # type: ignore[operator]
        raise ValueError(f"{what} {excerpt(value)} is not a time in range")
    return float(value)  # type: ignore[arg-type]


def _step_figures(value: object) -> dict[str, object]:
    """One clock's figures in a record, each checked (the histogram has one
    count a bucket of :data:`BUCKETS_S` and one above)."""
    if not isinstance(value, dict):
        raise ValueError("a clock's figures are not an object")
    counts = value.get("counts")
    if not isinstance(counts, list) or len(counts) != len(BUCKETS_S) + 1:
        raise ValueError(f"a clock's counts are not {len(BUCKETS_S) + 1} numbers")
    out: dict[str, object] = {
        "clock": _text(value.get("clock"), "clock"),
        "tid": _whole(value.get("tid"), 1, PID_LIMIT - 1, "a clock's tid"),
        "steps": _whole(value.get("steps"), 0, 1 << 62, "steps"),
        "counts": [_whole(c, 0, 1 << 62, "a bucket's count") for c in counts],
    }
    for key in _STEP_SUMS:
        out[key] = _seconds(value.get(key), key)
    for key in _STEP_PERCENTILES:
        got = value.get(key)
        out[key] = None if got is None else _seconds(got, key)
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return "a symbolic link"
        return exc.strerror or str(exc)
    return str(exc)


def read_registry(
    directory: str | os.PathLike[str] | None = None, cpus: frozenset[int] | None = None
) -> Registry:
    """Every record in the lock directory, checked and classified; never
    raises for what the directory holds.

    Only names of the registry's shapes are looked at (anything else in the
    directory is passed over, however many). A process record is stale from
    its name alone when its process has exited; a live one is read only when
    its owner is the uid that process runs as, and counts only when it names
    the process of its file name. A lock file is read only when ``/proc/locks``
    shows a holder, who must be the record's pid and run as the file's owner.
    Every CPU must be one of ``cpus`` (default: this host's online CPUs). At
    most :data:`MAX_RECORDS` files are read; the rest are counted.
    """
    where = lock_dir(directory)
    registry = Registry(where)
    host = _native.online_cpus() if cpus is None else cpus
    try:
        dir_fd = open_lock_dir(where)
    except OSError as exc:
        registry._ignore(where, str(exc.strerror or exc))
        return registry
    try:
        _scan(registry, dir_fd, where, host)
    finally:
        os.close(dir_fd)
    return registry


def _scan(registry: Registry, dir_fd: int, where: str, host: frozenset[int]) -> None:
    procs: list[tuple[str, int, int]] = []  # (name, pid, start time)
    gpus: list[tuple[str, os.stat_result]] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            name = entry.name
            if not name.startswith("cpupin-"):
                continue
            found = _PROC_NAME.fullmatch(name)
            if found:
                procs.append((name, int(found.group(1)), int(found.group(2))))
            elif _GPU_NAME.fullmatch(name):
                try:
                    gpus.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
                except OSError:
                    continue  # removed meanwhile
    inodes = {(os.major(i.st_dev), os.minor(i.st_dev), i.st_ino) for _, i in gpus}
    holders = _flock_holders(inodes)
    # What is worth opening, each with its reader: held lock files, then the
    # records of live processes. The rest is stale, judged without a read.
    reads: list[tuple[str, Callable[[], Record | None]]] = []
    for name, info in sorted(gpus):
        path = os.path.join(where, name)
        key = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        holder = None if holders is None else holders.get(key)
        if holder is not None:
            reads.append(
                (path, functools.partial(_read_server, dir_fd, name, path, holder, info, host))
            )
        elif info.st_size and stat.S_ISREG(info.st_mode):
            why = "nobody holds its lock" if holders is not None else "/proc/locks unreadable"
            registry._stale(Record("server", path, 0, 0, info.st_uid, why))
    seen: set[tuple[int, int]] = set()  # the live processes with a record read
    for name, pid, started in sorted(procs, key=lambda p: (p[1], p[2], p[0])):
        path = os.path.join(where, name)
        why = _alive(pid, started)
        if not why:
            reads.append(
                (path, functools.partial(_read_live, dir_fd, name, path, pid, started, host, seen))
            )
            continue
        try:
            owner = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid
        except OSError:
            continue  # removed meanwhile
        registry._stale(Record("process", path, pid, started, owner, why))
    for opened, (path, reader) in enumerate(reads):
        if opened >= MAX_RECORDS:
            registry.not_listed += len(reads) - opened
            break
        try:
            record = reader()
        except (OSError, ValueError) as exc:
            registry._ignore(path, _reason(exc))
            continue
        if record is not None:
            registry.records.append(record)


def _read_server(
    dir_fd: int, name: str, path: str, holder: int, info: os.stat_result, host: frozenset[int]
) -> Record | None:
    """A held lock file's record; ``None`` when its holder wrote none (yet)."""
    fd, now = _open_owned(dir_fd, name, holder, info)
    record = _decode(fd)
    return None if record is None else _server(path, record, now, holder, host)


def _read_process(
    dir_fd: int, name: str, path: str, pid: int, started: int, host: frozenset[int]
) -> Record:
    """A process record, read only when its owner is the uid ``pid`` runs as,
    and counted only when it names that process."""
    fd, info = _open_owned(dir_fd, name, pid)
    record = _decode(fd)
    if record is None:
        raise ValueError("no record (an empty file)")
    return _process(path, record, info, (pid, started), host)


def _read_live(
    dir_fd: int,
    name: str,
    path: str,
    pid: int,
    started: int,
    host: frozenset[int],
    seen: set[tuple[int, int]],
) -> Record:
    """:func:`_read_process` for a live process, once per process."""
    if (pid, started) in seen:
        raise ValueError(f"a second record of pid {pid}")
    record = _read_process(dir_fd, name, path, pid, started, host)
    seen.add((pid, started))
    return record


def parent_pinned_to(cpus: frozenset[int]) -> bool:
    """Whether this process's parent has a live record (in the lock
    directory) with a pin on exactly ``cpus``: then this process, whose main
    thread is on ``cpus``, was started from that pinned thread."""
    ppid = os.getppid()
    started = start_time(ppid)
    if ppid <= 1 or started is None:
        return False
    try:
        dir_fd = open_lock_dir(lock_dir())
    except OSError:
        return False
    try:
        host = _native.online_cpus()
        for name in _names(ppid, started):
            try:
                record = _read_process(dir_fd, name, name, ppid, started, host)
            except (OSError, ValueError):
                continue
            return record.live and any(pin.cpus == cpus for pin in record.pins)
    finally:
        os.close(dir_fd)
    return False
