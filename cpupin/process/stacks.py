"""Which library a thread of another process belongs to, from what the
kernel shows of it.

Threads that nothing named carry the name of the thread that started them,
so a process's OpenMP team, its BLAS pool and its Rayon pool all show as
``python``. The kernel still tells them apart:

- ``/proc/PID/maps`` lists the libraries mapped and where their code lies;
- ``/proc/PID/task/TID/syscall`` gives a blocked thread's stack pointer and
  the address it made its system call from;
- the first words of its stack (``/proc/PID/mem``, a few KiB from the stack
  pointer) hold the return addresses of the calls it waits in.

The first address that falls in a library's code, past the C library that
makes every system call, names the library that waits: libgomp's team waits
in libgomp, OpenBLAS's server in libopenblas, a Rayon pool in the extension
that built it. A running thread shows no stack (``None``), nor does a
process this user may not trace.

Everything read is hostile: the maps text is bounded in size and in lines,
addresses in digits, the stack in bytes; a library is quoted by its file's
base name only. Reading is passive: no thread is stopped.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

from cpupin.host._sysfs import Reader

__all__ = [
    "LibraryPool",
    "library_pool",
    "parse_maps",
    "thread_libraries",
]

#: The most bytes of ``maps`` read (a process with torch maps ~1,500 areas,
#: about 200 KB).
MAX_MAPS_BYTES = 8 << 20
#: The most executable areas kept.
MAX_AREAS = 65536
#: Bytes of stack read above the stack pointer.
STACK_BYTES = 8192

#: Libraries every thread passes through on its way to the kernel: never
#: the one that owns a pool.
_PLUMBING = ("libc.so", "libc-", "ld-linux", "ld-musl", "libpthread", "[vdso]", "libstdc++")


class LibraryPool(NamedTuple):
    """What a library's thread pool is called and what sizes it."""

    label: str
    """The pool's name in a census (``OpenMP (libgomp)``)."""
    variable: str | None
    """The environment variable that sizes the pool, ``None`` where none does."""
    knob: str | None = None
    """How to size it where no variable does (``zmq.Context(io_threads=N)``)."""


#: Library file names (a part of them, lower case) to their pools; the first
#: that matches wins.
_LIBRARIES: tuple[tuple[str, LibraryPool], ...] = (
    ("libgomp", LibraryPool("OpenMP (libgomp)", "OMP_NUM_THREADS")),
    ("libiomp5", LibraryPool("OpenMP (libiomp5)", "OMP_NUM_THREADS")),
    ("libomp", LibraryPool("OpenMP (libomp)", "OMP_NUM_THREADS")),
    ("openblas", LibraryPool("OpenBLAS", "OPENBLAS_NUM_THREADS")),
    ("libmkl", LibraryPool("MKL", "MKL_NUM_THREADS")),
    ("libblis", LibraryPool("BLIS", "BLIS_NUM_THREADS")),
    ("libzmq", LibraryPool("ZMQ I/O", None, "zmq.Context(io_threads=N)")),
    ("tokenizers", LibraryPool("Rayon (tokenizers)", "RAYON_NUM_THREADS")),
    ("libgloo", LibraryPool("gloo", None)),
    ("libtorch", LibraryPool("torch (libtorch)", None, "torch.set_num_interop_threads(N)")),
)


def library_pool(library: str) -> LibraryPool | None:
    """The pool a library's threads form, by its file's base name; ``None``
    for a library whose threads cpupin does not know (Python's own: its
    threads are told apart by name, or by what they wait in). Pure."""
    low = library.lower()
    for key, pool in _LIBRARIES:
        if key in low:
            return pool
    return None


class _Area(NamedTuple):
    lo: int
    hi: int
    name: str


def parse_maps(text: str) -> list[_Area]:
    """The executable file-backed areas of a ``maps`` text, sorted, each
    with its file's base name (at most :data:`MAX_AREAS`). Pure."""
    areas = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or "x" not in parts[1]:
            continue
        span, path = parts[0], parts[5].strip()
        lo_text, _, hi_text = span.partition("-")
        if not (0 < len(lo_text) <= 16 and 0 < len(hi_text) <= 16):
            continue
        try:
            lo, hi = int(lo_text, 16), int(hi_text, 16)
        except ValueError:
            continue
        name = os.path.basename(path.removesuffix(" (deleted)"))[:64]
        if lo < hi and name:
            areas.append(_Area(lo, hi, name))
            if len(areas) >= MAX_AREAS:
                break
    areas.sort()
    return areas


def _area_of(areas: list[_Area], address: int) -> str | None:
    lo, hi = 0, len(areas)
    while lo < hi:
        mid = (lo + hi) // 2
        if areas[mid].hi <= address:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(areas) and areas[lo].lo <= address < areas[lo].hi:
        return areas[lo].name
    return None


def _plumbing(name: str) -> bool:
    return any(p in name for p in _PLUMBING)


def owner(areas: list[_Area], pc: int, stack: bytes) -> str | None:
    """The library a blocked thread waits in: the one its system call was
    made from unless that is the C library, else the first return address
    on its stack in a library's code. Pure."""
    first = _area_of(areas, pc)
    if first is not None and not _plumbing(first):
        return first
    usable = len(stack) // 8 * 8
    for (word,) in struct.iter_unpack("<Q", stack[:usable]):
        name = _area_of(areas, word)
        if name is not None and not _plumbing(name):
            return name
    return None


def _stack_and_pc(r: Reader, pid: int, tid: int) -> tuple[int, int] | None:
    text = r.text(f"proc/{pid}/task/{tid}/syscall", 512)
    if not text:
        return None
    words = text.split()
    if len(words) < 3 or words[0] == "running":
        return None
    sp_text, pc_text = words[-2], words[-1]
    try:
        if not (sp_text.startswith("0x") and pc_text.startswith("0x")):
            return None
        if len(sp_text) > 18 or len(pc_text) > 18:
            return None
        return int(sp_text, 16), int(pc_text, 16)
    except ValueError:
        return None


def thread_libraries(pid: int, tids: list[int]) -> dict[int, str]:
    """The library each blocked thread of ``pid`` waits in, for those it
    can be read of (a running thread, one gone, a process this user may not
    trace, or a stack only through the C library: left out)."""
    if not tids:
        return {}
    out: dict[int, str] = {}
    with Reader("/") as r:
        maps = r.text(f"proc/{pid}/maps", MAX_MAPS_BYTES)
        if not maps:
            return {}
        areas = parse_maps(maps)
        try:
            mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return {}
        try:
            for tid in tids:
                found = _stack_and_pc(r, pid, tid)
                if found is None:
                    continue
                sp, pc = found
                try:
                    stack = os.pread(mem, STACK_BYTES, sp) if 0 < sp < 1 << 63 else b""
                except (OSError, OverflowError):
                    stack = b""
                name = owner(areas, pc, stack)
                if name is not None:
                    out[tid] = name
        finally:
            os.close(mem)
    return out
