"""The host's change journals: what cpupin changed on the host, what it
was before, and who owns each change, written before the change is made.

A change to the host (a CPU's PM QoS resume latency, an IRQ's affinity) is
a transaction: under one lock (``flock`` on the journal's lock file), the
journal is read, the intent written (to a new file, flushed, renamed over
the old one, the directory flushed), and only then the host written; the
entry goes once the host is back. Whatever kills the process between any
two steps, the journal names what may have changed and the value to put
back, and whoever takes the lock next (a holder, ``cpupin ps --prune``,
``cpupin irqs --restore``) finishes or undoes it.

A journal is kept per kind of change and per root (a tree standing for
``/``, in tests), in the lock directory. It is read as any file there is,
hostile: no link followed, regular, one link, bounded
(:data:`MAX_JOURNAL`), this user's (or, read only, root's), its checksum,
this boot's."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cpupin.errors import printable
from cpupin.host._sysfs import Reader
from cpupin.registry._record import VERSION, decode, encode, lock_dir, open_lock_dir

__all__ = ["MAX_JOURNAL", "Journal", "journal_name", "journals", "locked", "read_journal"]

#: The most bytes a journal may hold; the writer refuses past it, before
#: changing anything, so that a reader never meets one it cannot read
#: (16,384 IRQs with long CPU lists fit).
MAX_JOURNAL = 8 * 1024 * 1024
_EARLIER_BOOT = "was written before the last boot: what it names is as booted"
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NAME = re.compile(r"cpupin-journal-(wake|irq)-(host|[0-9a-f]{16})\.json")


def _key(root: str) -> str:
    path = os.path.abspath(root)
    return "host" if path == "/" else hashlib.sha256(path.encode()).hexdigest()[:16]


def journal_name(kind: str, root: str = "/") -> str:
    """The file name of the ``kind`` journal of ``root`` in the lock directory."""
    return f"cpupin-journal-{kind}-{_key(root)}.json"


def boot_id(root: str = "/") -> str:
    """This boot's id (under ``root``), or empty: a journal of an earlier
    boot names changes the reboot undid."""
    with Reader(root) as r:
        text = (r.text("proc/sys/kernel/random/boot_id", 64) or "").strip()
    return text if len(text) <= 40 and all(c in "0123456789abcdef-" for c in text) else ""


@dataclass
class Journal:
    """One journal, read under its lock: :attr:`entries` to change, then
    :meth:`save` (durable before it returns)."""

    kind: str
    root: str
    where: str
    dir_fd: int
    entries: dict[str, dict[str, object]] = field(default_factory=dict)
    why_empty: str = ""
    """Why a journal found was not read (empty: read, or none yet)."""

    @property
    def name(self) -> str:
        return journal_name(self.kind, self.root)

    def encoded(self, entries: dict[str, dict[str, object]] | None = None) -> bytes:
        """The journal's bytes; :class:`ValueError` past :data:`MAX_JOURNAL`."""
        data = encode(
            {
                "version": VERSION,
                "kind": self.kind,
                "root": os.path.abspath(self.root),
                "boot_id": boot_id(self.root),
                "time": round(time.time(), 3),
                "entries": self.entries if entries is None else entries,
            },
            None,
        )
        if len(data) > MAX_JOURNAL:
            raise ValueError(
                f"the {self.kind} journal would hold {len(data)} bytes, more than the "
                f"{MAX_JOURNAL} a reader reads: nothing was changed; change fewer at once "
                "(put back earlier changes first)"
            )
        return data

    def save(self, data: bytes | None = None) -> None:
        """Write :attr:`entries` durably (a new file flushed and renamed over
        the old, the directory flushed); with none left, remove the file.
        ``data``: :meth:`encoded` already, where the caller checked its size."""
        if not self.entries:
            try:
                os.unlink(self.name, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            os.fsync(self.dir_fd)
            return
        if data is None:
            data = self.encoded()
        tmp = f"cpupin-tmp-{os.getpid()}-{os.urandom(8).hex()}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self.dir_fd,
        )
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.dir_fd)
            except OSError:
                pass
            raise
        os.fsync(self.dir_fd)


def _open_lock(dir_fd: int, name: str, where: str) -> int:
    path = printable(os.path.join(where, name), 160)
    try:
        fd = os.open(
            name,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise OSError(exc.errno, f"{path}: {what}: remove it, or name another --lock-dir") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(
            errno.EPERM,
            f"{path} is not a file of this user's: remove it, or name another --lock-dir",
        )
    return fd


@contextmanager
def locked(kind: str, root: str = "/", directory: str | None = None) -> Iterator[Journal]:
    """The ``kind`` journal of ``root``, read under its lock, held until the
    block ends (across every write to the host the block makes). ``OSError``
    when the lock directory or the lock file cannot be opened as this
    user's."""
    where = lock_dir(directory)
    dir_fd = open_lock_dir(where)
    try:
        journal = Journal(kind, root, where, dir_fd)
        lock = _open_lock(dir_fd, journal.name[: -len(".json")] + ".lock", where)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            journal.entries, journal.why_empty = _load(dir_fd, journal.name, kind, root, True)
            if journal.why_empty and not journal.why_empty.endswith(_EARLIER_BOOT):
                # It may name changes still to put back: never written over.
                raise OSError(
                    errno.EBADMSG,
                    f"the {kind} journal cannot be read ({journal.why_empty}); it may name "
                    f"changes still to put back: check {printable(where, 120)} (cpupin ps), "
                    "then move it aside",
                )
            yield journal
        finally:
            os.close(lock)  # the lock goes with the descriptor
    finally:
        os.close(dir_fd)


def _load(
    dir_fd: int, name: str, kind: str, root: str, mine_only: bool
) -> tuple[dict[str, dict[str, object]], str]:
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return {}, f"{name}: {'a symbolic link' if exc.errno == errno.ELOOP else exc.strerror}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return {}, f"{name}: not a regular file of one link"
        owners = {os.geteuid()} if mine_only else {os.geteuid(), 0}
        if info.st_uid not in owners:
            return {}, f"{name}: owned by uid {info.st_uid}, not this user"
        if info.st_size > MAX_JOURNAL:
            return {}, f"{name}: larger than {MAX_JOURNAL} bytes"
        chunks = []
        left = MAX_JOURNAL + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > MAX_JOURNAL:
        return {}, f"{name}: larger than {MAX_JOURNAL} bytes"
    try:
        record = decode(raw)
    except ValueError as exc:
        return {}, f"{name}: {exc}"
    if record.get("kind") != kind or record.get("root") != os.path.abspath(root):
        return {}, f"{name}: another journal's record"
    if record.get("boot_id") != boot_id(root):
        return {}, f"{name} {_EARLIER_BOOT}"
    entries = record.get("entries")
    if not isinstance(entries, dict):
        return {}, f"{name}: its entries are not an object"
    return {k: v for k, v in entries.items() if isinstance(v, dict)}, ""


def read_journal(
    kind: str, root: str = "/", directory: str | None = None
) -> tuple[dict[str, dict[str, object]], str]:
    """The ``kind`` journal of ``root`` as it is now, without its lock (a
    journal is replaced whole, so a reader sees one or the other), and why
    it is empty where it is. For ``ps`` and ``doctor``: root's journals are
    read by any user."""
    where = lock_dir(directory)
    try:
        dir_fd = open_lock_dir(where)
    except OSError as exc:
        return {}, str(exc.strerror or exc)
    try:
        return _load(dir_fd, journal_name(kind, root), kind, root, False)
    finally:
        os.close(dir_fd)


def journals(kind: str, directory: str | None = None, limit: int = 64) -> list[str]:
    """The roots that have a ``kind`` journal in the lock directory (each
    file's own ``root``, read as any journal is), at most ``limit``."""
    where = lock_dir(directory)
    try:
        dir_fd = open_lock_dir(where)
    except OSError:
        return []
    roots: list[str] = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            found = NAME.fullmatch(name)
            if found is None or found.group(1) != kind:
                continue
            if found.group(2) == "host":
                roots.append("/")
            else:
                root = _root_named(dir_fd, name)
                if root is not None and journal_name(kind, root) == name:
                    roots.append(root)
            if len(roots) >= limit:
                break
    finally:
        os.close(dir_fd)
    return roots


def _root_named(dir_fd: int, name: str) -> str | None:
    """The ``root`` a journal file says it is for, read as any journal is."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_JOURNAL:
            return None
        if info.st_uid not in (os.geteuid(), 0):
            return None
        raw = os.pread(fd, MAX_JOURNAL, 0)
    finally:
        os.close(fd)
    try:
        root = decode(raw).get("root")
    except ValueError:
        return None
    return root if isinstance(root, str) and os.path.isabs(root) and len(root) < 4096 else None
