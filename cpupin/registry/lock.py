"""The lock per GPU of docs/placement.md, safe in a directory anyone can write to.

Under ``auto`` the API server claims every GPU of its deployment before
anything starts: one ``flock(LOCK_EX | LOCK_NB)`` per GPU on
``<lock dir>/cpupin-gpu-<address>.lock``, held for the process's life. The
kernel drops a lock however its holder exits, so a dead server never blocks
the next; the file is never unlinked (unlinking would let two servers lock
two different files of one name).

The threat model. The lock directory is shared by every server on the
host, and in the default ``/tmp`` by every user. A lock is only as good as
the name that leads to it: whoever can rename or unlink a lock file while a
server holds it lets a second server create and lock a fresh file of the
same name, and both then hold the GPU. In a directory, the owner of the
directory can rename anything in it, anyone with write access can too
unless the sticky bit is set, and with the sticky bit the owner of each
file still can. So cpupin trusts:

- a lock directory owned by root or by the claiming user, and not
  world-writable unless it has the sticky bit (``/tmp`` is root's, 1777);
- in a world-writable directory, only lock files owned by root or by the
  claiming user; one owned by another user is refused with a reason that
  names the owner;
- in a directory that is not world-writable (a group-shared directory such
  as ``root:gpu 2770`` named by ``CPUPIN_LOCK_DIR``), every lock file: only
  the users the operator let write there can touch them.

A shared ``/tmp`` is hostile ground in other ways too, so the directory is opened with
``O_DIRECTORY | O_NOFOLLOW`` and everything happens relative to it; a lock
file is created with ``O_EXCL | O_NOFOLLOW`` and ``fchmod`` to 0644 (the
umask is never touched), an existing one is opened read-only with
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block it), whatever is not a
regular file is refused, and after locking the path must still name the
locked inode. Every failure means: hold nothing, say why with the path.
Nothing here blocks.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cpupin._native import PID_LIMIT
from cpupin.host.topology import parse_pci_address
from cpupin.registry import writer as registry
from cpupin.registry.writer import ENV_LOCK_DIR

__all__ = ["ENV_LOCK_DIR", "Claim", "claim_gpus", "lock_path"]


def _file_name(address: str) -> str:
    return f"cpupin-gpu-{address}.lock"


def lock_path(address: str, lock_dir: str | os.PathLike[str] | None = None) -> str:
    """The lock file of a GPU (``address`` in any spelling)."""
    return os.path.join(registry.lock_dir(lock_dir), _file_name(parse_pci_address(address)))


@dataclass
class _Held:
    fd: int
    count: int
    path: str
    ident: tuple[int, int] = (0, 0)
    """The lock file's device and inode: the descriptor is trusted (written
    to, closed) only while it still names that file. A runtime that calls
    ``os.closerange()`` closes it (and so drops the lock), and the number
    then names whatever the application opens next."""

    def ours(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident


# The locks this process holds, by GPU address, shared by its claims.
_held: dict[str, _Held] = {}
# Re-entrant: a signal handler that closes a claim runs in the thread it
# interrupted, which may be claiming.
_held_lock = threading.RLock()
_generation = 0


def _after_fork_in_child() -> None:
    # The child shares the parent's open file descriptions: closing its copies
    # leaves the parent's locks in place (LOCK_UN would release them).
    global _generation, _held_lock
    for held in _held.values():
        if held.ours():
            try:
                os.close(held.fd)
            except OSError:
                pass
    _held.clear()
    _held_lock = threading.RLock()
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Refused(Exception):
    pass


def _open_lock_file(dir_fd: int, name: str, path: str) -> int:
    """An open descriptor of the regular lock file, created if need be."""
    for _ in range(3):
        try:
            fd = os.open(
                name,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=dir_fd,
            )
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise _Refused(f"cannot create {path}: {exc.strerror}") from None
            # A directory we cannot write to may still hold the file.
        else:
            try:
                os.fchmod(fd, 0o644)  # others must be able to open it to lock it
            except OSError:
                pass
            return fd
        try:
            # Read-write to hold the server's record; read-only still locks.
            flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                return os.open(name, os.O_RDWR | flags, dir_fd=dir_fd)
            except (PermissionError, IsADirectoryError):
                # Another user's file, or not a file at all: the checks below.
                return os.open(name, os.O_RDONLY | flags, dir_fd=dir_fd)
        except FileNotFoundError:
            if not os.access(_dir_path(dir_fd), os.W_OK):
                raise _Refused(
                    f"cannot create {path}: the directory is not writable; point "
                    f"{ENV_LOCK_DIR} at a directory every server can write"
                ) from None
            continue  # removed between the two opens: try again
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Refused(f"{path} is a symbolic link; remove it") from None
            raise _Refused(
                f"cannot open {path}: {exc.strerror}; remove it, or point {ENV_LOCK_DIR} elsewhere"
            ) from None
    raise _Refused(f"{path} keeps disappearing while it is opened")


def _dir_path(dir_fd: int) -> str:
    return f"/proc/self/fd/{dir_fd}"


def _holder(fd: int) -> str:
    """`` (pid N)`` from the holder's record in the lock file, when it has a
    valid one; nothing otherwise (a record is never trusted beyond naming)."""
    try:
        record = registry.decode(os.pread(fd, registry.SLOT, 0))
        pid = record.get("pid")
    except (OSError, ValueError):
        return ""
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < PID_LIMIT:
        return f" (pid {pid})"
    return ""


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _trusted(uid: int) -> bool:
    return uid == 0 or uid == os.geteuid()


def _check_owner(info: os.stat_result, path: str, shared: bool) -> None:
    """Refuse a lock file another user could rename away (see the module's
    threat model): in a world-writable directory, only one owned by root or
    by this user is trusted."""
    if shared and not _trusted(info.st_uid):
        raise _Refused(
            f"{path} is owned by {_who(info.st_uid)}, who could rename it away while a "
            f"server holds its lock; remove it, or set {ENV_LOCK_DIR} to a directory "
            "that only the servers' users can write (a group-shared directory that is "
            "not world-writable)"
        )


def _check_dir(dir_fd: int, directory: str) -> bool:
    """Refuse a lock directory whose files others could rename; return
    whether it is world-writable (sticky, like /tmp), where each lock file's
    owner is checked too."""
    info = os.fstat(dir_fd)
    if not _trusted(info.st_uid):
        raise _Refused(
            f"the lock directory {directory} is owned by {_who(info.st_uid)}, who can "
            f"rename the lock files in it; set {ENV_LOCK_DIR} to a directory owned by root "
            "or by this user"
        )
    world = bool(info.st_mode & stat.S_IWOTH)
    if world and not info.st_mode & stat.S_ISVTX:
        raise _Refused(
            f"the lock directory {directory} is world-writable without the sticky bit, so "
            f"anyone can rename its lock files; chmod +t it, or set {ENV_LOCK_DIR} to a "
            "directory that is not world-writable"
        )
    return world


def _lock_one(dir_fd: int, address: str, path: str, shared: bool) -> int:
    name = _file_name(address)
    for _ in range(3):
        fd = _open_lock_file(dir_fd, name, path)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _Refused(f"{path} is not a regular file; remove it")
            if info.st_nlink != 1:
                # A second name for the lock's inode lets whoever made it
                # lock or rewrite the file under another name.
                raise _Refused(
                    f"{path} has {info.st_nlink} hard links, so it can be reached by another "
                    "name; remove it"
                )
            _check_owner(info, path, shared)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _Refused(
                    f"another server{_holder(fd)} holds GPU {address} (its lock is {path})"
                ) from None
            except OSError as exc:
                raise _Refused(
                    f"cannot lock {path}: {exc.strerror} (locks do not work on that "
                    f"filesystem); point {ENV_LOCK_DIR} at a local directory"
                ) from None
            try:
                now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                now = None
            if now is not None and (now.st_ino, now.st_dev) == (info.st_ino, info.st_dev):
                return fd
            # Replaced while we locked it: our lock is on a file nobody else sees.
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise _Refused(f"{path} keeps being replaced while it is locked")


@dataclass
class Claim:
    """The locks of a server's GPUs. True when it holds every GPU asked for.

    A refused claim holds nothing and says why in :attr:`reason`, naming the
    GPU and the lock's path. :meth:`close` (or process exit) releases; locks
    shared with another claim of this process stay until that one closes too.
    """

    addresses: tuple[str, ...]
    held: bool
    reason: str
    paths: dict[str, str] = field(default_factory=dict)
    _generation: int = -1
    _closed: bool = False

    def __bool__(self) -> bool:
        return self.held and not self._closed

    def close(self) -> None:
        """Release this claim's share of its locks (idempotent)."""
        if self._closed or not self.held:
            self._closed = True
            return
        self._closed = True
        if self._generation != _generation:
            return  # claimed before a fork: this process never held it
        with _held_lock:
            for address in self.addresses:
                _release(address)

    def write_record(self, record: Mapping[str, object]) -> str:
        """Write the server's record into every lock file this claim holds
        (one ``pwrite`` of a fixed slot each: a reader never sees it torn);
        returns why it could not, or an empty string."""
        if not self or self._generation != _generation:
            return "the claim holds nothing"
        try:
            data = registry.fit(record)
        except ValueError as exc:
            return str(exc)
        failed = []
        with _held_lock:
            for address in self.addresses:
                held = _held.get(address)
                if held is None:
                    continue
                if not held.ours():
                    failed.append(
                        f"{held.path}: its descriptor was closed under cpupin (the lock "
                        "went with it); the record is not written"
                    )
                    continue
                try:
                    if os.fstat(held.fd).st_size != len(data):
                        os.ftruncate(held.fd, len(data))  # ours alone: we hold the lock
                    # The slot's blocks are reserved first, so that a full
                    # disk refuses here and the pwrite below cannot be short.
                    try:
                        os.posix_fallocate(held.fd, 0, len(data))
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                            raise
                    if os.pwrite(held.fd, data, 0) != len(data):
                        raise OSError(errno.ENOSPC, "a short write")
                except OSError as exc:
                    failed.append(f"{held.path}: {exc.strerror}")
        return "; ".join(failed)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(address: str) -> None:
    held = _held.get(address)
    if held is None:
        return
    held.count -= 1
    if held.count == 0:
        del _held[address]
        if held.ours():  # never close a number that now names another file
            os.close(held.fd)  # releases the lock


def claim_gpus(addresses: Iterable[str], lock_dir: str | os.PathLike[str] | None = None) -> Claim:
    """Lock every GPU in ``addresses`` for this process, or none of them.

    ``lock_dir`` defaults to ``$CPUPIN_LOCK_DIR``, else ``/tmp``. Each address
    is validated (:class:`ValueError` for one that is not a PCI address)
    before it reaches a path. Never blocks and never raises for a lock that
    cannot be taken: the :class:`Claim` is then false, with the reason.
    """
    canonical = tuple(dict.fromkeys(parse_pci_address(a) for a in addresses))
    directory = registry.lock_dir(lock_dir)
    paths = {a: os.path.join(directory, _file_name(a)) for a in canonical}
    if not canonical:
        return Claim((), True, "no GPU to claim", paths, _generation)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return Claim(
            canonical,
            False,
            f"cannot open the lock directory {directory}: "
            f"{exc.strerror}; point {ENV_LOCK_DIR} at a directory every server can "
            "write",
            paths,
        )
    taken: list[str] = []
    try:
        shared = _check_dir(dir_fd, directory)
        with _held_lock:
            for address in canonical:
                held = _held.get(address)
                if held is not None:
                    held.count += 1
                else:
                    fd = _lock_one(dir_fd, address, paths[address], shared)
                    st = os.fstat(fd)
                    _held[address] = _Held(fd, 1, paths[address], (st.st_dev, st.st_ino))
                taken.append(address)
            generation = _generation
    except _Refused as refused:
        with _held_lock:
            for address in taken:
                _release(address)
        return Claim(canonical, False, str(refused), paths)
    finally:
        os.close(dir_fd)
    gpus = ", ".join(canonical)
    return Claim(canonical, True, f"holds GPU {gpus} in {directory}", paths, generation)
