"""The registry's files, opened as hostile input: the names of its two
shapes, a record file opened without following links or blocking and
bounded in size, decoded against a writer racing the read, whether the
process a file names still lives and runs as its owner, and who holds a
lock file's ``flock`` (from ``/proc/locks``). The reader, the pruner and
the IRQ journal open files through here."""

from __future__ import annotations

import errno
import os
import re
import stat
import time

from cpupin._native import PID_LIMIT
from cpupin.host._proc import euid_of, start_time
from cpupin.registry._record import MAX_SIZE, PROC_LOCKS, Unframed, decode


def flock_holders(inodes: set[tuple[int, int, int]]) -> dict[tuple[int, int, int], int] | None:
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


PROC_NAME = re.compile(r"cpupin-proc-([1-9][0-9]{0,6})-([0-9]{1,19})(?:-[1-9])?\.json")
GPU_NAME = re.compile(r"cpupin-gpu-([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\.lock")


def open_record(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
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


def open_owned(
    dir_fd: int, name: str, pid: int, inode: os.stat_result | None = None
) -> tuple[int, os.stat_result]:
    """:func:`open_record`, then checked to be the file ``inode`` names
    (when given) and owned by the uid ``pid`` runs as; closed on failure."""
    fd, info = open_record(dir_fd, name)
    try:
        if inode is not None and (info.st_dev, info.st_ino) != (inode.st_dev, inode.st_ino):
            raise ValueError("replaced while it was read")
        check_owner(info, pid)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


#: How long the bytes of a record that does not decode must stand still
#: before it is refused as torn or damaged. A writer preempted in the middle
#: of its store (a memcpy into the mapping, or a pwrite) leaves the same torn
#: bytes for as long as it waits for a CPU, which on a loaded host is
#: milliseconds: two equal reads a microsecond apart prove nothing.
STILL_S = 0.1

#: At most this many reads of one file, however often its bytes change (a
#: file rewritten with garbage in a loop is refused, not read forever).
READS = 200

#: How long one reading of the lock directory may wait for torn records in
#: all: past it, a torn file is refused on the second equal read. A user who
#: plants damaged records for many live processes of their own slows a
#: reading by this much, not by :data:`STILL_S` a file.
PATIENCE_S = 1.0


def patience_ends() -> float:
    """When a reading that starts now has waited :data:`PATIENCE_S` for torn
    records (:func:`time.monotonic`): the ``until`` its files share."""
    return time.monotonic() + PATIENCE_S


#: The first pause between two equal torn reads, doubled up to :data:`PAUSE_MAX_S`.
PAUSE_S = 5e-5
PAUSE_MAX_S = 0.01


def decode_file(fd: int, until: float | None = None) -> dict[str, object] | None:
    """The record in the file open at ``fd`` (closed after); ``None`` when it
    holds none yet. A read that races a writer's store mixes two records at
    any byte: a bad checksum, or a last line that is no checksum at all. So a
    file that is no whole framed record (:class:`Unframed`) is read again:
    at once while its bytes change (the writer is at work), after a pause
    that doubles while they stand still (a writer preempted mid-store needs
    the CPU the pause gives it). It is refused when they have stood still
    for :data:`STILL_S` seconds or after :data:`READS` reads: a damaged file
    costs a reader that long, once; at the second equal read once the
    reading's ``until`` (:func:`patience_ends`) has passed. Whole bytes
    (their checksum matches) whose content is refused are refused at once."""
    previous = None
    since = 0.0
    pause = PAUSE_S
    try:
        for attempt in range(READS):
            raw = os.pread(fd, MAX_SIZE, 0)
            if not raw.strip(b" \n\0"):
                return None
            try:
                return decode(raw)
            except Unframed:
                if attempt == READS - 1:
                    raise
                now = time.monotonic()
                if raw != previous:
                    previous, since, pause = raw, now, PAUSE_S
                    continue
                if now - since >= STILL_S or (until is not None and now >= until):
                    raise
                time.sleep(pause)
                pause = min(pause * 2, PAUSE_MAX_S)
    finally:
        os.close(fd)
    raise AssertionError("not reached")


def gone_because(pid: int, started: int) -> str:
    now = start_time(pid)
    if now is None:
        return f"pid {pid} has exited"
    if now != started:
        return f"pid {pid} now names another process (a reused pid)"
    return ""


def check_owner(info: os.stat_result, pid: int) -> None:
    """Refuse a file its process could not have written: its owner must be
    the uid that process runs as (another user's file naming a root process
    would otherwise vouch for it)."""
    uid = euid_of(pid)
    if uid is None:
        raise ValueError(f"pid {pid} has exited")
    if info.st_uid != uid:
        raise ValueError(f"owned by uid {info.st_uid}, but pid {pid} runs as uid {uid}")


def reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return "a symbolic link"
        return exc.strerror or str(exc)
    return str(exc)
