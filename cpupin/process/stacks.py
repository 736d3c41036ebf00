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

The first return address that falls in a library's code, past the C
library that makes every system call, names the library that waits:
libgomp's team waits in libgomp, OpenBLAS's server in libopenblas, a Rayon
pool in the extension that built it. A running thread shows no stack
(``None``), nor does a process this user may not trace.

A word of a stack is not always a return address: a frame's locals lie
between them, and a number such as ``0x7f..00000189`` (a futex operation
beside a pointer's high half) can fall inside libtorch's 400 MB of code.
So a word counts only where the instruction before it is a call: on x86-64
a ``call rel32`` whose target lies in the same file, or an indirect
``call`` whose encoding ends exactly there; on arm64 a ``bl`` into the same
file or a ``blr``. Random data passes that test about once in a thousand
words.

Everything read is hostile: the maps text is bounded in size and in lines,
addresses in digits, the stack in bytes; a library is quoted by its file's
base name only. Reading is passive: no thread is stopped.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import NamedTuple

from cpupin.host._sysfs import Reader

__all__ = [
    "LibraryPool",
    "follows_call",
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


def _modrm_length(code: bytes) -> int:
    """Bytes of an x86 ModRM operand (ModRM, SIB, displacement) starting
    at ``code[0]``; 0 where too few bytes are given to say."""
    if not code:
        return 0
    mod, rm = code[0] >> 6, code[0] & 7
    if mod == 3:
        return 1
    n = 1
    if rm == 4:
        if len(code) < 2:
            return 0
        n += 1
        if mod == 0 and code[1] & 7 == 5:
            n += 4
    if mod == 0 and rm == 5:
        n += 4
    elif mod == 1:
        n += 1
    elif mod == 2:
        n += 4
    return n


def follows_call(areas: list[_Area], address: int, before: bytes, machine: str) -> bool:
    """Whether ``address`` is where a call returns to, from the 8 bytes of
    code before it (``before``); an architecture it cannot check passes.
    Pure."""
    if machine in ("x86_64", "amd64"):
        if len(before) < 8:
            return False
        if before[3] == 0xE8:  # call rel32: its target lies in the same file
            target = address + int.from_bytes(before[4:8], "little", signed=True)
            if _area_of(areas, target) == _area_of(areas, address):
                return True
        for size in range(2, 8):  # call r/m64: FF /2, ending at the address
            start = 8 - size
            if before[start] == 0xFF and (before[start + 1] >> 3) & 7 == 2:
                if 1 + _modrm_length(before[start + 1 :]) == size:
                    return True
        return False
    if machine in ("aarch64", "arm64"):
        if len(before) < 8 or address % 4:
            return False
        insn = int.from_bytes(before[4:8], "little")
        if insn & 0xFFFFFC1F == 0xD63F0000:  # blr
            return True
        if insn & 0xFC000000 == 0x94000000:  # bl: its target lies in the same file
            offset = (insn & 0x03FFFFFF) << 2
            if offset & (1 << 27):
                offset -= 1 << 28
            return _area_of(areas, address - 4 + offset) == _area_of(areas, address)
        return False
    return True


def owner(
    areas: list[_Area],
    pc: int,
    stack: bytes,
    code_before: Callable[[int], bytes] | None = None,
    machine: str = "",
) -> str | None:
    """The library a blocked thread waits in: the one its system call was
    made from unless that is the C library, else the first return address
    on its stack in a library's code. Where ``code_before`` is given (the 8
    bytes before an address), a word counts only if a call precedes it
    (:func:`follows_call` for ``machine``). Pure but for ``code_before``."""
    first = _area_of(areas, pc)
    if first is not None and not _plumbing(first):
        return first
    usable = len(stack) // 8 * 8
    for (word,) in struct.iter_unpack("<Q", stack[:usable]):
        name = _area_of(areas, word)
        if name is None or _plumbing(name):
            continue
        if code_before is None or follows_call(areas, word, code_before(word), machine):
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
        machine = os.uname().machine

        def code_before(address: int) -> bytes:
            try:
                return os.pread(mem, 8, address - 8) if 8 <= address < 1 << 63 else b""
            except (OSError, OverflowError):
                return b""

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
                name = owner(areas, pc, stack, code_before, machine)
                if name is not None:
                    out[tid] = name
        finally:
            os.close(mem)
    return out
