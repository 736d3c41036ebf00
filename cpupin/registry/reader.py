"""Reading the host's registry (see :mod:`cpupin.registry.writer` for what it
holds): every record in the lock directory, read as hostile input, with its
liveness. Imported on first use: a process that only pins never reads."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from cpupin import _native
from cpupin._native import PID_LIMIT
from cpupin.cpulist import MAX_CPUS, format_cpulist
from cpupin.errors import printable
from cpupin.host._proc import start_time
from cpupin.registry import _fields as fields
from cpupin.registry import _files as files
from cpupin.registry._fields import RecordedHold, RecordedPool
from cpupin.registry._record import (
    MAX_LISTED,
    MAX_PINS,
    MAX_RECORDS,
    Pinned,
    _names,
    lock_dir,
    open_lock_dir,
)

__all__ = ["Record", "Registry", "parent_pinned_to", "read_registry"]


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
    auto: fields.AutoActs = fields.AutoActs()
    """What the vLLM plugin's ``auto`` did to the process."""
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
            out["auto"] = self.auto.as_dict()
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
    still_applied: list[dict[str, object]] = field(default_factory=list)
    """What cpupin changed on the host and has not put back, with no live
    process owning it: CPUs whose wake-latency holders died, and IRQs moved
    (:mod:`cpupin.registry.holds`, :mod:`cpupin.registry.moves`)."""
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


def _common(record: dict[str, object]) -> tuple[int, int, int, float]:
    pid = fields.whole(record.get("pid"), 1, PID_LIMIT - 1, "pid")
    started = fields.whole(record.get("start_time"), 0, 1 << 62, "start_time")
    uid = fields.whole(record.get("uid"), 0, (1 << 32) - 2, "uid")
    when = record.get("time")
    if type(when) not in (int, float) or not math.isfinite(when):  # type: ignore[arg-type]
        raise ValueError("time is not a number")
    return pid, started, uid, float(when)  # type: ignore[arg-type]


def _server(
    path: str, record: dict[str, object], info: os.stat_result, holder: int, host: frozenset[int]
) -> Record:
    pid, started, uid, when = _common(record)
    if pid != holder or uid != info.st_uid:
        raise ValueError(
            f"names pid {pid} and uid {uid}, but pid {holder} holds the lock and the file "
            f"is uid {info.st_uid}'s"
        )
    setting = fields.short_text(record.get("setting"), "setting", 16)
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
        workers.append(
            (
                fields.short_text(w.get("device"), "device"),
                fields.cpu_list(w.get("cpus"), "worker", host),
            )
        )
    result = record.get("result_cpu")
    result_cpu = None if result is None else fields.whole(result, 0, MAX_CPUS - 1, "result_cpu")
    if result_cpu is not None and result_cpu not in host:
        raise ValueError(f"result_cpu {result_cpu} is not a CPU this host has online")
    mask = fields.cpu_list(record.get("process_mask"), "process_mask", host)
    return Record(
        "server",
        path,
        pid,
        started,
        uid,
        files.gone_because(pid, started),
        setting,
        tuple(fields.short_text(d, "device") for d in devices),
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
                fields.whole(p.get("tid"), 1, PID_LIMIT - 1, "tid"),
                fields.short_text(p.get("name"), "name"),
                fields.cpu_list(p.get("cpus"), "pin", host),
                fields.short_text(p.get("role"), "role", 32),
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
    mask = frozenset() if mask_raw is None else fields.cpu_list(mask_raw, "process_mask", host)
    server_raw = record.get("server")
    server = None
    if server_raw is not None:
        if not isinstance(server_raw, list) or len(server_raw) != 2:
            raise ValueError("server is not a pid and a start time")
        server = (
            fields.whole(server_raw[0], 1, PID_LIMIT - 1, "server pid"),
            fields.whole(server_raw[1], 0, 1 << 62, "server start_time"),
        )
    return Record(
        "process",
        path,
        pid,
        started,
        uid,
        files.gone_because(pid, started),
        pins=tuple(pins),
        time=when,
        role="" if role is None else fields.short_text(role, "role", 32),
        notes=tuple(fields.short_text(n, "note", 240) for n in notes),
        steps=tuple(fields.clock_figures(s) for s in steps),
        server=server,
        process_mask=mask,
        pools=fields.pool_list(record.get("pools")),
        wake_holds=fields.hold_list(record.get("wake_holds"), host),
        pin_drift=fields.pin_drift(record.get("pin_drift")),
        auto=fields.auto_acts(record.get("auto"), host),
        out_of_date=""
        if record.get("out_of_date") is None
        else fields.short_text(record.get("out_of_date"), "out_of_date", 240),
    )


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
    _changes(registry, where, host)
    return registry


def _changes(registry: Registry, where: str, host: frozenset[int]) -> None:
    """The journals' changes still applied, and each stale record's holds
    as the wake journal still names them (a stale record is never parsed;
    the journal, written before each hold, is the truth)."""
    from cpupin.registry.holds import dead_holds, still_applied
    from cpupin.registry.moves import still_moved

    registry.still_applied = [*still_applied(where), *still_moved(where)]
    dead = dead_holds(where)
    for i, r in enumerate(registry.records):
        held = dead.get((r.pid, r.start_time)) if r.kind == "process" and not r.live else None
        if not held:
            continue
        by_hold: dict[tuple[int, float], set[int]] = {}
        for cpu, h in held:
            by_hold.setdefault((h.max_us, h.since), set()).add(cpu)
        registry.records[i] = dataclasses.replace(
            r,
            wake_holds=tuple(
                RecordedHold("sysfs", frozenset(cpus), us, since, ())
                for (us, since), cpus in sorted(by_hold.items())
            ),
        )


def _scan(registry: Registry, dir_fd: int, where: str, host: frozenset[int]) -> None:
    procs: list[tuple[str, int, int]] = []  # (name, pid, start time)
    gpus: list[tuple[str, os.stat_result]] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            name = entry.name
            if not name.startswith("cpupin-"):
                continue
            found = files.PROC_NAME.fullmatch(name)
            if found:
                procs.append((name, int(found.group(1)), int(found.group(2))))
            elif files.GPU_NAME.fullmatch(name):
                try:
                    gpus.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
                except OSError:
                    continue  # removed meanwhile
    inodes = {(os.major(i.st_dev), os.minor(i.st_dev), i.st_ino) for _, i in gpus}
    holders = files.flock_holders(inodes)
    # What is worth opening, each with its reader: held lock files, then the
    # records of live processes. The rest is stale, judged without a read.
    reads: list[tuple[str, Callable[[], Record | None]]] = []
    until = files.patience_ends()  # for torn records, shared by every file read
    for name, info in sorted(gpus):
        path = os.path.join(where, name)
        key = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        holder = None if holders is None else holders.get(key)
        if holder is not None:
            read = functools.partial(_read_server, dir_fd, name, path, holder, info, host, until)
            reads.append((path, read))
        elif info.st_size and stat.S_ISREG(info.st_mode):
            why = "nobody holds its lock" if holders is not None else "/proc/locks unreadable"
            registry._stale(Record("server", path, 0, 0, info.st_uid, why))
    seen: set[tuple[int, int]] = set()  # the live processes with a record read
    for name, pid, started in sorted(procs, key=lambda p: (p[1], p[2], p[0])):
        path = os.path.join(where, name)
        why = files.gone_because(pid, started)
        if not why:
            live = functools.partial(
                _read_process, dir_fd, name, path, pid, started, host, until, seen
            )
            reads.append((path, live))
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
            registry._ignore(path, files.reason(exc))
            continue
        if record is not None:
            registry.records.append(record)


def _read_server(
    dir_fd: int,
    name: str,
    path: str,
    holder: int,
    info: os.stat_result,
    host: frozenset[int],
    until: float,
) -> Record | None:
    """A held lock file's record; ``None`` when its holder wrote none (yet)."""
    fd, now = files.open_owned(dir_fd, name, holder, info)
    record = files.decode_file(fd, until)
    return None if record is None else _server(path, record, now, holder, host)


def _read_process(
    dir_fd: int,
    name: str,
    path: str,
    pid: int,
    started: int,
    host: frozenset[int],
    until: float | None = None,
    seen: set[tuple[int, int]] | None = None,
) -> Record:
    """A process record, read only when its owner is the uid ``pid`` runs as,
    and counted only when it names that process; with ``seen`` (the
    processes whose record a reading has counted), once per process."""
    if seen is not None and (pid, started) in seen:
        raise ValueError(f"a second record of pid {pid}")
    fd, info = files.open_owned(dir_fd, name, pid)
    record = files.decode_file(fd, until)
    if record is None:
        raise ValueError("no record (an empty file)")
    counted = _process(path, record, info, (pid, started), host)
    if seen is not None:
        seen.add((pid, started))
    return counted


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
