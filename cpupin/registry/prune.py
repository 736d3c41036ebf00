"""Pruning the host's registry: removing the records that dead processes
left, and first putting back what they changed (a wake-latency hold through
sysfs outlives its holder). Every file is opened and parsed as the reader
opens any record: hostile."""

from __future__ import annotations

import os
import stat
import time

from cpupin.host._proc import exited
from cpupin.registry._files import (
    PROC_NAME,
    decode_file,
    gone_because,
    open_record,
    patience_ends,
)
from cpupin.registry._record import MAX_RECORDS, lock_dir, open_lock_dir

__all__ = ["prune", "prune_members"]


def _restore_holds(directory: str | None) -> list[str]:
    """Settle the wake journals (root only: only root could have written
    the values): each CPU whose holders all died goes back to the value the
    host had. A line for each."""
    from cpupin.registry.holds import settle_all

    return settle_all(directory) if os.geteuid() == 0 else []


def prune_members(
    server: tuple[int, int], directory: str | None = None, wait_s: float = 0.0
) -> list[str]:
    """Remove the records of exited processes that name ``server`` (pid,
    start time) as theirs (:func:`cpupin.registry.writer.describe_process`'s
    ``server``) and that this user owns: what a server's processes that were
    killed (vLLM's engine core and workers get ``SIGKILL`` at shutdown, or
    the whole group a ``SIGTERM``) left behind. Returns the paths removed.
    Each file is opened as a live record is (no link followed, regular,
    bounded) and parsed before it goes.

    With ``wait_s``, members still alive are given that long to exit first
    (polled every 20 ms): a group stopped at once by one signal (systemd's
    ``KillMode=control-group``, a terminal's Ctrl-C) may outlive the server
    by a moment, and a member killed by a signal removes nothing itself."""
    where = lock_dir(directory)
    removed: list[str] = []
    try:
        dir_fd = open_lock_dir(where)
    except OSError:
        return removed
    try:
        members = _members(dir_fd, server)
        deadline = time.monotonic() + wait_s
        while any(not exited(pid, started) for _, pid, started in members):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        for name, pid, started in members:
            if not exited(pid, started):
                continue  # alive: its own exit removes it
            try:
                os.unlink(name, dir_fd=dir_fd)
                removed.append(os.path.join(where, name))
            except OSError:
                continue
    finally:
        os.close(dir_fd)
    if removed:
        _restore_holds(directory)  # a killed worker's CPUs come back
    return removed


def _members(dir_fd: int, server: tuple[int, int]) -> list[tuple[str, int, int]]:
    """The records this user owns that name ``server``: (name, pid, start)."""
    out = []
    until = patience_ends()
    for count, name in enumerate(os.listdir(dir_fd)):
        if count >= MAX_RECORDS:
            break
        match = PROC_NAME.fullmatch(name)
        if match is None:
            continue
        pid, started = int(match.group(1)), int(match.group(2))
        try:
            fd, info = open_record(dir_fd, name)
            if info.st_uid != os.geteuid():
                os.close(fd)
                continue
            record = decode_file(fd, until)
        except (OSError, ValueError):
            continue
        if record is not None and record.get("server") == list(server):
            out.append((name, pid, started))
    return out


def prune(
    directory: str | os.PathLike[str] | None = None, restored: list[str] | None = None
) -> list[str]:
    """Remove the stale process records in the lock directory that this
    user owns (a process killed before it could remove its own), however
    many; returns their paths. Staleness comes from each name's pid and
    start time, as :func:`read_registry` judges it. Lock files are never
    removed (see :mod:`cpupin.registry.lock`): a stale server record there is
    harmless and is overwritten by the next server that takes the lock.

    A dead process's wake-latency holds through sysfs outlive it: the wake
    journals are settled (:func:`cpupin.registry.holds.settle_all`, root
    only), so each CPU whose holders all died gets back the value the host
    had, where it still holds one cpupin wrote. What was put back, or why
    not, goes to ``restored``."""
    where = lock_dir(directory)
    removed = []
    me = os.geteuid()
    dir_fd = open_lock_dir(where)
    try:
        for name in sorted(os.listdir(dir_fd)):
            found = PROC_NAME.fullmatch(name)
            if not found or not gone_because(int(found.group(1)), int(found.group(2))):
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
    notes = _restore_holds(where)
    if restored is not None:
        restored.extend(notes)
    return removed
