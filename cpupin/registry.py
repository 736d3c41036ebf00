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

Everything read here is hostile: files are opened read-only, non-blocking,
without following a symlink, regular files only, at most :data:`MAX_SIZE`
bytes, and every field is checked before use; anything else is "unknown
holder" with a short reason. A record is **live** only while its process
exists with the same start time (a pid is reused) and, for a lock record,
while ``/proc/locks`` shows an exclusive ``flock`` on that file's inode. A
reader never takes the lock itself: even a shared lock held for an instant
would make a server that starts at that moment stand aside.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import stat
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ._native import PID_LIMIT
from .cpulist import MAX_CPUS, format_cpulist
from .errors import excerpt
from .process import start_time

__all__ = [
    "MAX_SIZE",
    "SLOT",
    "VERSION",
    "Record",
    "Registry",
    "decode",
    "encode",
    "lock_dir",
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
#: The most pins one process record lists.
MAX_PINS = 4096


def lock_dir(directory: str | os.PathLike[str] | None = None) -> str:
    """The shared lock directory: ``directory``, else ``$CPUPIN_LOCK_DIR``,
    else ``/tmp``. The locks, the servers' records and the pin records all
    live there."""
    if directory is not None:
        return os.fspath(directory)
    return os.environ.get(ENV_LOCK_DIR) or "/tmp"


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


def decode(raw: bytes) -> dict[str, object]:
    """The record in ``raw``, checked; :class:`ValueError` with a short
    reason for anything else (torn, foreign, malformed)."""
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
        record = json.loads(body)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(record, dict) or record.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} record")
    return record


def _whole(value: object, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{what} {excerpt(value)} is not a whole number from {lo} to {hi}")
    return value


def _cpus(value: object, what: str) -> frozenset[int]:
    if not isinstance(value, list) or len(value) > MAX_CPUS:
        raise ValueError(f"{what} is not a list of CPUs")
    return frozenset(_whole(c, 0, MAX_CPUS - 1, f"{what} CPU") for c in value)


def _text(value: object, what: str, size: int = 64) -> str:
    if not isinstance(value, str) or len(value) > size:
        raise ValueError(f"{what} is not a short text")
    return "".join(c if c.isprintable() else "?" for c in value)


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
    """A record found in the lock directory, checked, with its liveness."""

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
            "pid": self.pid,
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
    ignored with why."""

    directory: str
    records: list[Record] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)

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


def _flock_holders() -> dict[tuple[int, int, int], int] | None:
    """(major, minor, inode) -> pid of every exclusive flock, from
    ``/proc/locks``; ``None`` where it cannot be read."""
    try:
        with open("/proc/locks", "rb") as f:
            text = f.read(4 << 20).decode("ascii", "replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" for a waiter)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[3] == "WRITE":
            try:
                major, minor, inode = parts[5].split(":")
                out[(int(major, 16), int(minor, 16), int(inode))] = int(parts[4])
            except ValueError:
                continue
    return out


def _read_file(dir_fd: int, name: str) -> tuple[bytes, os.stat_result]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_SIZE:
            raise ValueError(f"larger than {MAX_SIZE} bytes")
        return os.pread(fd, MAX_SIZE + 1, 0), info
    finally:
        os.close(fd)


def _common(record: dict[str, object]) -> tuple[int, int, int, float]:
    pid = _whole(record.get("pid"), 1, PID_LIMIT - 1, "pid")
    started = _whole(record.get("start_time"), 0, 1 << 62, "start_time")
    uid = _whole(record.get("uid"), 0, (1 << 32) - 1, "uid")
    when = record.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise ValueError("time is not a number")
    return pid, started, uid, float(when)


def _alive(pid: int, started: int) -> str:
    now = start_time(pid)
    if now is None:
        return f"pid {pid} has exited"
    if now != started:
        return f"pid {pid} now names another process (a reused pid)"
    return ""


def _server(path: str, record: dict[str, object], info: os.stat_result, holders: object) -> Record:
    pid, started, uid, when = _common(record)
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
        workers.append((_text(w.get("device"), "device"), _cpus(w.get("cpus"), "worker")))
    result = record.get("result_cpu")
    result_cpu = None if result is None else _whole(result, 0, MAX_CPUS - 1, "result_cpu")
    mask = _cpus(record.get("process_mask"), "process_mask")
    why = _alive(pid, started)
    if not why and isinstance(holders, dict):
        key = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        if holders.get(key) is None:
            why = "nobody holds its lock"
    return Record(
        "server",
        path,
        pid,
        started,
        uid,
        why,
        setting,
        tuple(_text(d, "device") for d in devices),
        tuple(workers),
        result_cpu,
        mask,
        time=when,
    )


def _process(path: str, record: dict[str, object], info: os.stat_result) -> Record:
    pid, started, uid, when = _common(record)
    if info.st_uid not in (0, uid):
        raise ValueError(f"written by uid {info.st_uid}, not by its process's uid {uid}")
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
                _cpus(p.get("cpus"), "pin"),
                _text(p.get("role"), "role", 32),
            )
        )
    why = _alive(pid, started)
    if not why:
        status = _uid_of(pid)
        if status is not None and status not in (0, uid):
            why = f"pid {pid} runs as uid {status}, not the record's uid {uid}"
    return Record("process", path, pid, started, uid, why, pins=tuple(pins), time=when)


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(16384).splitlines():
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_registry(directory: str | os.PathLike[str] | None = None) -> Registry:
    """Every record in the lock directory, checked and classified; never
    raises for what the directory holds."""
    where = lock_dir(directory)
    registry = Registry(where)
    try:
        dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        registry.ignored.append((where, f"cannot open the lock directory: {exc.strerror}"))
        return registry
    holders = _flock_holders()
    try:
        names = sorted(os.listdir(dir_fd))[:100_000]
        for name in names:
            server = name.startswith("cpupin-gpu-") and name.endswith(".lock")
            proc = name.startswith("cpupin-proc-") and name.endswith(".json")
            if not (server or proc):
                continue
            path = os.path.join(where, name)
            try:
                raw, info = _read_file(dir_fd, name)
                if server and not raw.strip(b" \n\0"):
                    continue  # a lock file whose holder wrote no record (yet)
                record = decode(raw)
                if server:
                    registry.records.append(_server(path, record, info, holders))
                else:
                    registry.records.append(_process(path, record, info))
            except (OSError, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
                    reason = "a symbolic link"
                registry.ignored.append((excerpt(path, 120), excerpt(reason, 120).strip("'")))
    finally:
        os.close(dir_fd)
    return registry


# --- this process's record --------------------------------------------------

_lock = threading.Lock()
_written: str | None = None
# This process's record path in each directory: its pid and start time do
# not change (a forked child starts afresh).
_paths: dict[str, tuple[str, int]] = {}
#: ``CPUPIN_REGISTRY=0`` keeps this process from writing its record.
_disabled = os.environ.get("CPUPIN_REGISTRY") == "0"


def _record_path(directory: str) -> tuple[str, int]:
    found = _paths.get(directory)
    if found is None:
        pid = os.getpid()
        started = start_time(pid) or 0
        found = _paths[directory] = (
            os.path.join(directory, f"cpupin-proc-{pid}-{started}.json"),
            started,
        )
    return found


def register_pins(pins: Iterable[Pinned], directory: str | None = None) -> None:
    """Write this process's record of its deliberate pins (all of them: the
    record is replaced whole), or remove it when there are none. Best effort:
    a directory that cannot take it logs at debug level and moves on."""
    global _written
    listed = sorted(pins, key=lambda p: p.tid)
    with _lock:
        if _disabled:
            return
        where = lock_dir(directory)
        path, started = _record_path(where)
        tmp = None
        try:
            if not listed:
                if _written is not None:
                    os.unlink(_written)
                    _written = None
                return
            record = {
                "version": VERSION,
                "pid": os.getpid(),
                "start_time": started,
                "uid": os.geteuid(),
                "time": round(time.time(), 3),
                "pins": [
                    {"tid": p.tid, "name": p.name, "cpus": sorted(p.cpus), "role": p.role}
                    for p in listed
                ],
            }
            data = encode(record, size=None)
            tmp = f"{path}.{threading.get_native_id()}.tmp"
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # readers see the old record or the new one
            _written = path
        except OSError as exc:
            log.debug("cpupin: no process record in %s: %s", where, exc.strerror)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def _remove_at_exit() -> None:
    global _written
    if _written is not None:
        try:
            os.unlink(_written)
        except OSError:
            pass
        _written = None


def _after_fork_in_child() -> None:
    # The child is another process: its parent's record is not its own.
    global _written, _lock
    _written = None
    _paths.clear()
    _lock = threading.Lock()


atexit.register(_remove_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
