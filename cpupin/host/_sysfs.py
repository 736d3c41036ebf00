"""Files under a root directory, read as hostile input.

:class:`Reader` is the one way cpupin reads a sysfs or procfs tree, whether
``/`` or a capture an operator passed with ``--root``:

- **confined to the root**: every path resolves as if the root were ``/``;
  ``..`` stops there, and a symlink, absolute or relative, in the file, in a
  folder above it or in a mount point taken from the tree's ``mounts``,
  resolves inside it. The kernel does this (``openat2`` with
  ``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS``, Linux 5.6); where ``openat2``
  is missing or refused by seccomp, :func:`_walk` resolves the path one
  component at a time with ``O_NOFOLLOW``, the same way.
- **regular files only**: the path is opened ``O_PATH`` and its type checked
  before anything is opened for reading, so a FIFO, socket, device or
  directory where a file belongs is a reason, never a wait.
- **bounded**: a file is read whole up to a limit (:data:`LIMIT`, larger for
  the few files that grow with the host); a longer one is a reason naming
  the path, never a silently cut value. A folder lists at most
  :data:`MAX_ENTRIES` names. Numbers are at most 20 characters and within
  the range the caller names before Python converts them.
- **quoted briefly**: reasons quote what they found through :func:`excerpt`,
  at most 40 characters with anything unprintable escaped.

A missing file is not a reason (sysfs omits what a machine lacks); anything
else that stops a read is. Nothing here raises for what the tree holds.
"""

from __future__ import annotations

import errno
import os
import stat

from cpupin import _native
from cpupin.cpulist import parse_cpulist, parse_cpumask
from cpupin.errors import excerpt

__all__ = ["LIMIT", "MAX_ENTRIES", "Reader", "excerpt"]

#: The most bytes read of one file. A sysfs attribute is at most a page; a
#: CPU list of 65,536 CPUs at its longest is about 200 KB.
LIMIT = 256 * 1024
#: The most names read of one folder (65,536 CPUs and their neighbours).
MAX_ENTRIES = 1 << 18
#: Symlinks followed in one path before it counts as a loop (the kernel's 40).
MAX_LINKS = 40
#: Characters of a number: a 64-bit value in decimal or hex fits.
_MAX_DIGITS = 20

_O_PATH = getattr(os, "O_PATH", 0)
_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)

# Whether the kernel resolves paths in a root (None: not yet tried). A fact
# about this kernel and its seccomp filter, found on the first read.
_openat2: bool | None = None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class _WrongType(Exception):
    def __init__(self, mode: int) -> None:
        super().__init__(mode)
        self.mode = mode


def _walk(root_fd: int, rel: str, want_dir: bool) -> int:
    """``rel`` opened under ``root_fd`` as ``openat2(RESOLVE_IN_ROOT)`` would,
    one component at a time with ``O_NOFOLLOW``: the fallback."""
    todo = [part for part in reversed(rel.split("/")) if part]
    chain: list[int] = []  # O_PATH descriptors of the folders below the root
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":
                if chain:
                    os.close(chain.pop())
                continue
            here = chain[-1] if chain else root_fd
            fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                try:
                    target = os.readlink(name, dir_fd=here)
                finally:
                    os.close(fd)
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                if target.startswith("/"):
                    while chain:
                        os.close(chain.pop())
                todo.extend(part for part in reversed(target.split("/")) if part)
                continue
            if todo and not stat.S_ISDIR(mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            chain.append(fd)
        last = chain.pop() if chain else os.dup(root_fd)
    finally:
        while chain:
            os.close(chain.pop())
    try:
        mode = os.fstat(last).st_mode
        if not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
            raise _WrongType(mode)
        flags = _READ | (os.O_DIRECTORY if want_dir else 0)
        return os.open(f"/proc/self/fd/{last}", flags)
    finally:
        os.close(last)


#: How many times a path is resolved again with openat2 when the kernel
#: could not be sure a ``..`` stayed inside the root (``EAGAIN``), before the
#: component walk resolves it instead.
AGAIN = 8


def _open(root_fd: int, rel: str, want_dir: bool) -> int:
    global _openat2
    if _openat2 is not False:
        for _ in range(AGAIN):
            fd, mode = _native.open_in_root(root_fd, rel, want_dir)
            # EAGAIN: a rename or a mount anywhere on the host raced a path
            # with "..", as sysfs's own relative links have (a busy host
            # renames all the time): nothing is wrong with the path.
            if fd != -errno.EAGAIN:
                break
        else:
            return _walk(root_fd, rel, want_dir)
        if fd >= 0:
            _openat2 = True
            return fd
        if fd == -errno.EMEDIUMTYPE:
            raise _WrongType(mode)
        if fd in (-errno.ENOSYS, -errno.EPERM) and _openat2 is None:
            _openat2 = False  # no openat2 here, or seccomp refuses it
        else:
            raise OSError(-fd, os.strerror(-fd))
    return _walk(root_fd, rel, want_dir)


def _show(rel: str) -> str:
    """A path as a reason may show it (its names come from the tree)."""
    return rel if len(rel) <= 160 and rel.isprintable() else excerpt(rel, 80)


class Reader:
    """Reads small files under a root; records why something is unknown.

    Use as a context manager, or call :meth:`close`: it holds the root open
    so that every read resolves against the same folder.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.reasons: list[str] = []
        self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd_of(self, rel: str, want_dir: bool, quiet: bool = False) -> int | None:
        try:
            return _open(self._fd, rel.lstrip("/"), want_dir)
        except _WrongType as wrong:
            if not quiet:
                want = "a directory" if want_dir else "a regular file"
                self.reasons.append(f"{_show(rel)}: {_kind(wrong.mode)}, not {want}; left out")
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR) and not quiet:
                what = "a symbolic link loop" if exc.errno == errno.ELOOP else exc.strerror
                self.reasons.append(f"{_show(rel)}: cannot read ({what}); left out")
        return None

    def text(self, rel: str, limit: int = LIMIT, head: bool = False) -> str | None:
        """The whole file as text, or ``None`` (with a reason unless it is
        simply missing). ``head=True`` takes the first ``limit`` bytes of a
        longer file instead, for a caller that needs only its start."""
        fd = self._fd_of(rel, False)
        if fd is None:
            return None
        chunks = []
        size = 0
        try:
            while True:
                chunk = os.read(fd, min(65536, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    if head:
                        chunks[-1] = chunk[: len(chunk) - (size - limit)]
                        break
                    self.reasons.append(f"{_show(rel)}: longer than {limit} bytes; left out")
                    return None
        except OSError as exc:
            self.reasons.append(f"{_show(rel)}: cannot read ({exc.strerror}); left out")
            return None
        finally:
            os.close(fd)
        # Some kernels (and captures) end a value with a NUL.
        return b"".join(chunks).decode("utf-8", "replace").replace("\x00", "")

    def open_file(self, rel: str) -> int | None:
        """A descriptor of the regular file ``rel`` for the caller to keep
        (and close), or ``None`` with a reason as :meth:`text` gives."""
        return self._fd_of(rel, False)

    def write(self, rel: str, text: str) -> None:
        """Write ``text`` over the regular file ``rel`` (found as :meth:`text`
        finds it, within the root, then opened again for writing: a sysfs
        or procfs attribute, say). ``OSError`` with the reason where it is
        not there, or the kernel refuses the value."""
        fd = self._fd_of(rel, False)
        if fd is None:
            why = self.reasons[-1] if self.reasons else f"{_show(rel)}: not there"
            raise OSError(errno.ENOENT, why)
        try:
            flags = os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK
            out = os.open(f"/proc/self/fd/{fd}", flags)
        finally:
            os.close(fd)
        try:
            os.write(out, text.encode())
        finally:
            os.close(out)

    def listdir(self, rel: str) -> list[str] | None:
        """The names in a folder (at most :data:`MAX_ENTRIES`), or ``None``."""
        fd = self._fd_of(rel, True)
        if fd is None:
            return None
        names: list[str] = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if len(names) == MAX_ENTRIES:
                        self.reasons.append(
                            f"{rel}: more than {MAX_ENTRIES} entries; the rest left out"
                        )
                        break
                    names.append(entry.name)
        except OSError as exc:
            self.reasons.append(f"{_show(rel)}: cannot list ({exc.strerror}); left out")
            return None
        finally:
            os.close(fd)
        return names

    def is_dir(self, rel: str) -> bool:
        return self._is(rel, True)

    def is_file(self, rel: str) -> bool:
        return self._is(rel, False)

    def _is(self, rel: str, want_dir: bool) -> bool:
        fd = self._fd_of(rel, want_dir, quiet=True)
        if fd is not None:
            os.close(fd)
        return fd is not None

    def cpus(self, rel: str, *, mask: bool = False) -> frozenset[int] | None:
        text = self.text(rel)
        if text is None:
            return None
        try:
            return parse_cpumask(text) if mask else parse_cpulist(text)
        except ValueError as exc:
            self.reasons.append(f"{_show(rel)}: {exc}")
            return None

    def node_cpus(self) -> dict[int, frozenset[int]]:
        """Each NUMA node's CPUs (``sys/devices/system/node/nodeN/cpulist``);
        a node with none listed is left out."""
        out: dict[int, frozenset[int]] = {}
        for name in self.listdir("sys/devices/system/node") or []:
            if name.startswith("node") and name[4:].isdigit():
                cpus = self.cpus(f"sys/devices/system/node/{name}/cpulist")
                if cpus:
                    out[int(name[4:])] = cpus
        return out

    def integer(self, rel: str, lo: int, hi: int) -> int | None:
        """A number from ``lo`` to ``hi`` (decimal, or hex with ``0x``)."""
        text = self.text(rel)
        if text is None:
            return None
        return self.number(rel, text, lo, hi)

    def number(self, rel: str, text: str, lo: int, hi: int) -> int | None:
        body = text.strip()
        value = None
        if len(body) <= _MAX_DIGITS and body.isascii():
            try:
                value = int(body, 0)
            except ValueError:
                pass
        if value is None:
            self.reasons.append(f"{_show(rel)}: {excerpt(body)} is not a number; left out")
            return None
        if not lo <= value <= hi:
            self.reasons.append(f"{_show(rel)}: {value} is outside {lo} to {hi}; left out")
            return None
        return value
