"""The host's registry of pins: records in the lock directory.

The lock directory is already where every server on a host meets, so it is
also where each one says what it pinned, with no daemon:

- **a server's record** lives in each GPU lock file it holds: after the lock
  is taken (and the path checked to name the locked inode), the server writes
  its pid, start time, uid, setting, devices, each worker's step CPUs, the
  result CPU and its process mask. The record fills a fixed slot of
  :data:`SLOT` bytes written with one ``pwrite`` (the file keeps that size:
  never truncated to zero, never unlinked), and ends with a CRC-32 of its
  JSON, so a reader that races a writer sees a bad checksum, never a torn
  record that parses.
- **a process's record** (``cpupin-proc-<pid>-<start>.json``) lists the
  threads it pinned on purpose: tid, name, CPUs and role (``step``,
  ``result``, or the runtime's word). It is rewritten whole (a new file
  renamed over the old) whenever a pin is made or released, and removed at
  exit.

Everything read here is hostile (:func:`read_registry` says how): only
names of these shapes are looked at; a record of a process that has exited
is stale from its name alone and never opened; a live one is opened
read-only, non-blocking, without following a symlink, a regular file of one
link and at most :data:`MAX_SIZE` bytes, and parsed (strict JSON, every
field checked) only when its owner is the uid its process runs as. A record
is **live** only while its process exists with the same start time (a pid
is reused) and, for a lock record, while ``/proc/locks`` shows that pid's
exclusive ``flock`` on that file's inode. A reader never takes the lock
itself: even a shared lock held for an instant would make a server that
starts at that moment stand aside.
"""

from __future__ import annotations

import atexit
import errno
import functools
import json
import logging
import math
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from . import _native
from ._native import PID_LIMIT
from ._proc import euid_of, start_time
from .cpulist import MAX_CPUS, format_cpulist
from .errors import excerpt, printable

__all__ = [
    "MAX_SIZE",
    "SLOT",
    "VERSION",
    "Record",
    "Registry",
    "decode",
    "encode",
    "lock_dir",
    "open_lock_dir",
    "prune",
    "read_registry",
    "register_pins",
]

log = logging.getLogger("cpupin")

#: The record format's version.
VERSION = 1
#: The bytes a lock file's record occupies (one page: one pwrite).
SLOT = 4096
#: The most bytes read of any record file.
MAX_SIZE = 64 * 1024
#: The environment variable naming the shared lock directory.
ENV_LOCK_DIR = "CPUPIN_LOCK_DIR"
#: Where the kernel lists every file lock.
PROC_LOCKS = "/proc/locks"
#: The most pins one process record lists.
MAX_PINS = 4096
#: The longest thread name or role a record keeps (longer ones are cut).
MAX_NAME = 64
#: The most record files one read opens; past this they are counted.
MAX_RECORDS = 4096
#: The most stale records and ignored files a read lists; past this, counted.
MAX_LISTED = 200


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"


#: The working directory at import, against which a relative
#: ``CPUPIN_LOCK_DIR`` is resolved: a runtime that changes directory later
#: still meets its peers in the same place.
_START_CWD = _cwd()


def lock_dir(directory: str | os.PathLike[str] | None = None) -> str:
    """The shared lock directory: ``directory``, else ``$CPUPIN_LOCK_DIR``
    (a relative one taken from the working directory the process had when
    it imported cpupin), else ``/tmp``. The locks, the servers' records and
    the pin records all live there."""
    if directory is not None:
        return os.fspath(directory)
    value = os.environ.get(ENV_LOCK_DIR) or "/tmp"
    if not os.path.isabs(value):
        value = os.path.normpath(os.path.join(_START_CWD, value))
    return value


# --- the record format ------------------------------------------------------


def encode(record: Mapping[str, object], size: int | None = SLOT) -> bytes:
    """A record as bytes: its JSON, a line with the JSON's CRC-32, and (with
    ``size``) spaces up to that size. :class:`ValueError` when it does not
    fit."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    data = body + b"\n" + f"crc32={zlib.crc32(body):08x}\n".encode()
    if size is None:
        return data
    if len(data) > size:
        raise ValueError(f"a record of {len(data)} bytes does not fit in {size}")
    return data.ljust(size, b" ")


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number out of range")
    return value


def _small_int(text: str) -> int:
    if len(text) > 20:
        raise ValueError("a number of more than 20 digits")
    return int(text)


def decode(raw: bytes) -> dict[str, object]:
    """The record in ``raw``, checked; :class:`ValueError` with a short
    reason for anything else (torn, foreign, malformed). Strict JSON only:
    no NaN or Infinity, no number of more than 20 digits, no nesting deep
    enough to exhaust the parser; nothing in ``raw`` raises anything else."""
    text = raw.rstrip(b" \n\0")
    body, _, check = text.rpartition(b"\n")
    if not check.startswith(b"crc32=") or not body:
        raise ValueError("no record (an empty or foreign file)")
    try:
        crc = int(check[6:14], 16)
    except ValueError:
        raise ValueError("a bad checksum line") from None
    if zlib.crc32(body) != crc:
        raise ValueError("the checksum does not match (torn or edited)")
    try:
        record = json.loads(
            body, parse_constant=_no_constant, parse_float=_finite, parse_int=_small_int
        )
    except (ValueError, RecursionError):
        raise ValueError("not JSON (or numbers out of range, or nested too deep)") from None
    if not isinstance(record, dict) or type(record.get("version")) is not int:
        raise ValueError(f"not a version-{VERSION} record")
    if record["version"] != VERSION:
        raise ValueError(f"not a version-{VERSION} record")
    return record


def _whole(value: object, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{what} {excerpt(value)} is not a whole number from {lo} to {hi}")
    return value


def _cpus(value: object, what: str, host: frozenset[int]) -> frozenset[int]:
    """A list of CPUs of this host, each once."""
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


@dataclass(frozen=True)
class Pinned:
    """One registered pin of a process."""

    tid: int
    name: str
    cpus: frozenset[int]
    role: str


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


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, MAX_SIZE, 0)
    finally:
        os.close(fd)


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
    return Record(
        "process", path, pid, started, uid, _alive(pid, started), pins=tuple(pins), time=when
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return "a symbolic link"
        return exc.strerror or str(exc)
    return str(exc)


def open_lock_dir(where: str) -> int:
    """The lock directory, opened as a directory without following a
    symbolic link in its last component (as :func:`cpupin.claim_gpus` opens
    it); ``OSError`` with a sentence otherwise."""
    try:
        return os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(where):
            raise OSError(
                exc.errno,
                f"the lock directory {printable(where, 120)} is a symbolic link: name the "
                "directory it points to",
            ) from None
        raise OSError(
            exc.errno,
            f"cannot open the lock directory {printable(where, 120)}: {exc.strerror}",
        ) from None


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
    raw = _read(fd)
    if not raw.strip(b" \n\0"):
        return None
    return _server(path, decode(raw), now, holder, host)


def _read_process(
    dir_fd: int, name: str, path: str, pid: int, started: int, host: frozenset[int]
) -> Record:
    """A process record, read only when its owner is the uid ``pid`` runs as,
    and counted only when it names that process."""
    fd, info = _open_owned(dir_fd, name, pid)
    return _process(path, decode(_read(fd)), info, (pid, started), host)


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


# --- this process's record --------------------------------------------------

# One lock for the record, re-entrant: a signal handler that releases a pin
# runs in the thread it interrupted, which may be inside register_pins.
_lock = threading.RLock()
# Where this process's record is (directory, name), when it has one.
_written: tuple[str, str] | None = None
# This process's pid and start time, read once (a forked child reads its own).
_me: tuple[int, int] | None = None
# Set at exit: threads still pinning (daemons) write no record afterwards.
_closed = False
# The lock directories already warned about, so that each says why once.
_warned: set[str] = set()
#: ``CPUPIN_REGISTRY=0`` keeps this process from writing its record.
_disabled = os.environ.get("CPUPIN_REGISTRY") == "0"


def _names(pid: int, started: int) -> list[str]:
    """The names this process's record may take: its own, then a few
    others for when another user squats the first (readers accept each)."""
    base = f"cpupin-proc-{pid}-{started}"
    return [f"{base}.json", *(f"{base}-{i}.json" for i in range(1, 4))]


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data``, or ``OSError`` (a full disk writes short)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def register_pins(pins: Iterable[Pinned], directory: str | None = None) -> None:
    """Write this process's record of its deliberate pins (all of them: the
    record is replaced whole), or remove it when there are none.

    The lock directory is opened without following a symbolic link, the
    record written to a new file in it (every byte checked: a short write on
    a full disk keeps the old record) and renamed over the old one, so a
    reader sees one or the other, never a torn record. A name another user
    squats is passed over for the next of :func:`_names`. Best effort: a
    directory that cannot take the record logs why once, at warning level,
    and the pins stand."""
    listed = sorted(pins, key=lambda p: p.tid)
    with _lock:
        if _disabled or _closed:
            return
        where = lock_dir(directory)
        try:
            dir_fd = open_lock_dir(where)
        except OSError as exc:
            _warn_once(where, exc.strerror or str(exc))
            return
        try:
            _replace(dir_fd, where, listed)
        finally:
            os.close(dir_fd)


def _record_bytes(listed: list[Pinned], pid: int, started: int) -> bytes:
    record = {
        "version": VERSION,
        "pid": pid,
        "start_time": started,
        "uid": os.geteuid(),
        "time": round(time.time(), 3),
        "pins": [
            {"tid": p.tid, "name": p.name[:MAX_NAME], "cpus": sorted(p.cpus), "role": p.role}
            for p in listed
        ],
    }
    return encode(record, size=None)


def _replace(dir_fd: int, where: str, listed: list[Pinned]) -> None:
    global _written, _me
    if _written is not None and _written[0] != where:
        _remove()  # the directory changed: the old record goes
    if not listed:
        _remove(dir_fd)
        return
    if _me is None:
        _me = (os.getpid(), start_time(os.getpid()) or 0)
    pid, started = _me
    data = _record_bytes(listed, pid, started)
    # One writer at a time (the lock; threads.py keeps a signal handler's
    # publish from nesting in another): one temporary name per process.
    tmp = f"cpupin-tmp-{pid}.tmp"
    try:
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=dir_fd,
        )
        try:
            os.fchmod(fd, 0o644)
            _write_all(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        _unlink(dir_fd, tmp)
        _warn_once(where, f"cannot write a record there: {exc.strerror}")
        return
    names = _names(pid, started)
    if _written is not None and _written[1] in names:
        names.remove(_written[1])
        names.insert(0, _written[1])
    why = ""
    for name in names:
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            why = why or f"{name} is taken ({exc.strerror})"
            continue
        if _written is not None and _written != (where, name):
            _remove(dir_fd)
        _written = (where, name)
        return
    _unlink(dir_fd, tmp)
    _warn_once(where, f"no record: {why}; another user has squatted every name of it")


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _warn_once(where: str, why: str) -> None:
    if where in _warned:
        return
    _warned.add(where)
    log.warning(
        "cpupin: this process's pins are not in the lock directory %s (cpupin ps and "
        "audit will not see them): %s",
        printable(where, 120),
        why,
    )


def _remove(dir_fd: int | None = None) -> None:
    """Remove this process's record; ``dir_fd``: its directory, already open."""
    global _written
    if _written is None:
        return
    where, name = _written
    _written = None
    if dir_fd is not None:
        _unlink(dir_fd, name)
        return
    try:
        dir_fd = open_lock_dir(where)
    except OSError:
        return
    try:
        _unlink(dir_fd, name)
    finally:
        os.close(dir_fd)


def _remove_at_exit() -> None:
    # Daemon threads still run while atexit handlers do: once closed, they
    # write nothing, and the lock waits out a write under way.
    global _closed
    with _lock:
        _closed = True
        _remove()


def _after_fork_in_child() -> None:
    # The child is another process: its parent's record is not its own, and
    # a lock another thread held at the fork would never be released.
    global _written, _lock, _me, _closed
    _written = _me = None
    _closed = False
    _lock = threading.RLock()


def prune(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the stale process records in the lock directory that this
    user owns (a process killed before it could remove its own), however
    many; returns their paths. Staleness comes from each name's pid and
    start time, as :func:`read_registry` judges it; nothing is parsed. Lock
    files are never removed (see :mod:`cpupin.lock`): a stale server record
    there is harmless and is overwritten by the next server that takes the
    lock."""
    where = lock_dir(directory)
    removed = []
    me = os.geteuid()
    dir_fd = open_lock_dir(where)
    try:
        for name in sorted(os.listdir(dir_fd)):
            found = _PROC_NAME.fullmatch(name)
            if not found or not _alive(int(found.group(1)), int(found.group(2))):
                continue
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if info.st_uid != me or not stat.S_ISREG(info.st_mode):
                    continue
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                continue
            removed.append(os.path.join(where, name))
    finally:
        os.close(dir_fd)
    return removed


atexit.register(_remove_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
