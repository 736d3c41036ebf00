"""The one module that touches the compiled extension, ``cpupin._cpupin``.

Everything here is a thin wrapper: the C functions return 0 (or a count) or
``-errno``, and :func:`raise_oserror` turns a negative one into the
``OSError`` subclass the errno names (``ProcessLookupError``,
``PermissionError``, ...) with the thread or process in the message.

The calls keep the GIL, as ``os.sched_setaffinity`` does: cffi would drop it
around every call, and getting it back waits for whatever Python thread runs
meanwhile (a 300 ns affinity call took 560 µs on average with one other
thread busy). ``csrc/cpupin.c`` redefines cffi's ``Py_BEGIN_ALLOW_THREADS``
after its own code, before the wrappers cffi appends; only the long calls
(reading more than 64 tasks, the handoff benchmark) drop the GIL themselves.
``tests/test_native.py`` checks both, from inside a call and in the
generated source. A call costs about 60 ns, so the wrappers keep the calls
and allocations per operation at one: buffers are per thread and reused,
masks cross as 64-bit words, and the ``frozenset`` of a mask already seen
comes from a small cache.
"""

from __future__ import annotations

import errno
import os
from _thread import _local, allocate_lock, get_native_id
from collections.abc import Callable, Iterable

from cpupin._cpupin import ffi, lib
from cpupin._records import NamedTuple
from cpupin.cpulist import MAX_CPUS, as_cpu, cpus_phrase, format_cpulist, parse_cpulist
from cpupin.errors import UnsupportedPlatform, excerpt

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any, NoReturn


__all__ = [
    "HAVE_AFFINITY",
    "SchedStat",
    "ThreadStat",
    "UnsupportedPlatform",
    "cpu_set",
    "get_affinity",
    "getcpu",
    "gettid",
    "online_cpus",
    "raise_oserror",
    "schedstat",
    "set_affinity",
    "swap_affinity",
    "thread_stats",
]

#: Whether the extension was built with thread affinity (Linux).
HAVE_AFFINITY: bool = bool(lib.CPUPIN_HAVE_AFFINITY)

_SYS_CPU = "/sys/devices/system/cpu"
_MAX_WORDS = MAX_CPUS // 64


def raise_oserror(rc: int, what: str) -> NoReturn:
    """Raise the ``OSError`` for ``rc`` (a ``-errno`` from C) about ``what``."""
    err = -rc
    if err == errno.ENOSYS and not HAVE_AFFINITY:
        raise UnsupportedPlatform(what)
    raise OSError(err, os.strerror(err), what)


def _who(tid: int) -> str:
    return "the calling thread" if tid == 0 else f"tid {tid}"


#: One past the highest pid or tid the kernel can hand out (PID_MAX_LIMIT:
#: ``pid_max`` is at most 2**22 on 64-bit kernels).
PID_LIMIT = 1 << 22


def _as_tid(tid: object) -> int:
    if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < PID_LIMIT:
        raise ValueError(
            f"tid {excerpt(tid)} is not a thread id: give a tid from 1 to {PID_LIMIT - 1}, "
            "or 0 for the calling thread"
        )
    return int(tid)


def as_pid(pid: object) -> int:
    """``pid`` as a process id, or :class:`ValueError` naming it."""
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < PID_LIMIT:
        raise ValueError(
            f"pid {excerpt(pid)} is not a process id: give a pid from 1 to {PID_LIMIT - 1}"
        )
    return int(pid)


def _read_cpulist(name: str) -> frozenset[int] | None:
    try:
        with open(f"{_SYS_CPU}/{name}") as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return None


# --- the calling thread ----------------------------------------------------

_tls = _local()


def _forget_thread_state() -> None:
    # A forked child's only thread has a new tid.
    global _tls
    _tls = _local()


def gettid() -> int:
    """The calling thread's kernel tid (``threading.get_native_id()``).

    Cached per thread: a thread's tid never changes (a forked child's thread
    gets its own).
    """
    try:
        return _tls.tid  # type: ignore[no-any-return]
    except AttributeError:
        tid = lib.cpupin_gettid()
        if tid < 0:
            tid = get_native_id()
        _tls.tid = tid
        return tid


def _getcpu_unsupported() -> int:
    raise UnsupportedPlatform("getcpu()")


#: ``getcpu() -> int``: the CPU the calling thread runs on now
#: (``sched_getcpu``, from the vDSO without a syscall where the kernel offers
#: it). The C function itself, so a call costs one cffi call and no more.
getcpu = lib.cpupin_getcpu if HAVE_AFFINITY and lib.cpupin_getcpu() >= 0 else _getcpu_unsupported


# --- affinity --------------------------------------------------------------

_online: frozenset[int] | None = _read_cpulist("online")


def online_cpus(refresh: bool = False) -> frozenset[int]:
    """The CPUs online now (``/sys/devices/system/cpu/online``).

    Read once and cached; ``refresh=True`` reads it again. Where sysfs is
    missing, the CPUs of the calling thread's mask stand in.
    """
    global _online
    if refresh or _online is None:
        _online = _read_cpulist("online")
    if _online is None:
        if hasattr(os, "sched_getaffinity"):
            return frozenset(os.sched_getaffinity(0))
        return frozenset(range(os.cpu_count() or 1))
    return _online


def _initial_words() -> int:
    possible = _read_cpulist("possible")
    top = max(possible) + 1 if possible else 1024
    return min(max(1, -(-top // 64)), _MAX_WORDS)


# The kernel's CPU-set size in 64-bit words; grown on EINVAL.
_nwords = _initial_words()
_WORDS = ffi.typeof("uint64_t[]")


def _thread_io(nwords: int = 0) -> Any:
    """This thread's buffer for the affinity calls: [tid, nwords, mask...]."""
    n = max(nwords, _nwords)
    io = ffi.new(_WORDS, 2 + n)
    io[1] = n
    _tls.io = io
    return io


# frozensets of masks already seen, keyed by their significant words.
_masks: dict[object, frozenset[int]] = {}


def _bits_of(words: Iterable[int]) -> frozenset[int]:
    """The numbers set in 64-bit words, word i holding 64*i to 64*i+63: a
    CPU mask or a node mask as the C layer passes it."""
    out = []
    for i, word in enumerate(words):
        while word:
            bit = word & -word
            out.append(64 * i + bit.bit_length() - 1)
            word ^= bit
    return frozenset(out)


def _words_of(numbers: Iterable[int], nwords: int) -> list[int]:
    """The 64-bit words of a set of numbers, at least ``nwords`` of them."""
    wanted = list(numbers)
    words = [0] * max(nwords, max(wanted, default=-1) // 64 + 1)
    for n in wanted:
        words[n >> 6] |= 1 << (n & 63)
    return words


def _key_set(key: int | tuple[int, ...]) -> frozenset[int]:
    cpus_set = _bits_of((key,) if isinstance(key, int) else key)
    if len(_masks) >= 4096:
        _masks.clear()
    _masks[key] = cpus_set
    return cpus_set


def _grow_words(tid: int) -> None:
    global _nwords
    if _nwords >= _MAX_WORDS:
        raise_oserror(-errno.EINVAL, _who(tid))
    _nwords = min(max(1, 2 * _nwords), _MAX_WORDS)
    _thread_io()
    _encoded.clear()
    _wanted.clear()


def get_affinity(tid: int = 0) -> frozenset[int]:
    """The CPUs a thread may run on.

    ``tid`` 0 is the calling thread (``pthread_getaffinity_np``); any other is
    a kernel tid (``sched_getaffinity``). Raises ``ProcessLookupError`` naming
    the tid when it is gone.
    """
    if type(tid) is not int or not 0 <= tid < PID_LIMIT:
        tid = _as_tid(tid)
    try:
        io = _tls.io
    except AttributeError:
        io = _thread_io()
    io[0] = tid
    rc = lib.cpupin_get_affinity(io)
    if rc == 1:
        key = io[2]
    elif rc > 1:
        key = tuple(io[2 : 2 + rc])
    else:
        return _get_affinity_slow(tid, rc)
    cpus = _masks.get(key)
    return cpus if cpus is not None else _key_set(key)


# Masks to compare with, as [nwords, words...], for on_mask.
_wanted: dict[frozenset[int], object] = {}


def _want(cpus: frozenset[int]) -> Any:
    want = _wanted.get(cpus)
    if want is None:
        words = (_encoded.get(cpus) or _encode(cpus, 0))[0]
        want = ffi.new(_WORDS, [len(words), *words])
        if len(_wanted) >= 64:
            _wanted.clear()
        _wanted[cpus] = want
    return want


def enter_thread(cpus: frozenset[int], name: bytes | None) -> int:
    """A new thread's first call: onto ``cpus`` unless there already, then
    (``name`` not ``None``: the thread's name in UTF-8, cut in C as
    :func:`thread_name_bytes` cuts it) named in the kernel, in one native
    call: 1 moved, 0 already there, or ``-errno`` (nothing named: the
    caller takes the slow way)."""
    want = _want(cpus)
    if name is None:
        return int(lib.cpupin_thread_enter(want, ffi.NULL, 0))
    return int(lib.cpupin_thread_enter(want, name, len(name)))


def mask_words(cpus: frozenset[int]) -> Any:
    """``cpus`` as the words the C calls take (one object kept per mask,
    for :data:`enter_thread_words`)."""
    return _want(cpus)


#: :func:`enter_thread`'s C call, for a new thread that must make no
#: Python call before it: (:func:`mask_words`, the name in UTF-8, its
#: length in bytes), or (:func:`mask_words`, :data:`NO_NAME`, 0) to leave
#: the name alone.
enter_thread_words = lib.cpupin_thread_enter
NO_NAME = ffi.NULL


def on_mask(cpus: frozenset[int]) -> bool:
    """Whether the calling thread's mask is ``cpus``, in one native call with
    no per-thread buffer: the cheapest check a new thread can make."""
    want = _wanted.get(cpus)
    if want is None:
        want = _want(cpus)
    rc = lib.cpupin_mask_is(want)
    if rc >= 0:
        return rc == 1
    return get_affinity() == cpus


def _get_affinity_slow(tid: int, rc: int) -> frozenset[int]:
    if rc == 0:
        return frozenset()
    if rc == -errno.EINVAL:
        _grow_words(tid)
        return get_affinity(tid)
    raise_oserror(rc, _who(tid))


# Encoded masks: frozenset -> (its words, the significant ones as a key).
_encoded: dict[frozenset[int], tuple[list[int], object]] = {}


def cpu_set(cpus: Iterable[int] | str) -> frozenset[int]:
    """``cpus`` (CPU numbers or a list such as ``"0-3"``) as a frozenset,
    with ``ValueError`` for anything that is not a CPU number."""
    kind = type(cpus)
    if kind is frozenset or kind is set:
        for cpu in cpus:  # type: ignore[union-attr]
            if type(cpu) is not int or cpu < 0:
                break
        else:
            return cpus if kind is frozenset else frozenset(cpus)  # type: ignore[return-value,arg-type]
    if isinstance(cpus, str):
        return parse_cpulist(cpus)
    try:
        items = iter(cpus)
    except TypeError:
        raise ValueError(
            f"{cpus!r} is not a set of CPUs: give CPU numbers or a list like '0-3'"
        ) from None
    return frozenset(map(as_cpu, items))


def _encode(cpus: frozenset[int], tid: int) -> tuple[list[int], object]:
    if not cpus:
        raise ValueError(f"an empty set of CPUs for {_who(tid)}: give at least one online CPU")
    online = online_cpus()
    if not cpus <= online:
        online = online_cpus(refresh=True)
        offline = cpus - online
        if offline:
            raise ValueError(
                f"{cpus_phrase(offline, 'is')} not online: the online CPUs are "
                f"{format_cpulist(online)}"
            )
    # Wide enough for the kernel (_nwords) and for the highest CPU asked.
    words = _words_of(cpus, _nwords)
    used = len(words)
    while words[used - 1] == 0:
        used -= 1
    key: object = words[0] if used == 1 else tuple(words[:used])
    if len(_encoded) >= 1024:
        _encoded.clear()
    _encoded[cpus] = entry = (words, key)
    return entry


def set_affinity(cpus: Iterable[int] | str, tid: int = 0) -> None:
    """Let a thread run only on ``cpus``.

    ``cpus`` is any iterable of CPU numbers or a CPU list such as ``"0-3"``;
    ``tid`` 0 is the calling thread (``pthread_setaffinity_np``), any other a
    kernel tid (``sched_setaffinity``). Affects that one thread only.

    Validates before it acts: an empty set, a negative number, a bool or a
    CPU that is not online raises ``ValueError`` naming it and the online
    CPUs. The kernel silently drops CPUs outside the process's cpuset, so the
    mask is read back, and a mask that differs raises ``ValueError`` saying
    which CPUs were dropped and where the thread now runs.
    """
    if type(cpus) is frozenset and tid == 0 and type(tid) is int:
        # A mask moved to before was checked then: one call, no walk of it.
        want = _wanted.get(cpus)
        if want is not None and lib.cpupin_set_mask(want) == 0:
            return
    if type(tid) is not int or not 0 <= tid < PID_LIMIT:
        tid = _as_tid(tid)
    wanted = cpu_set(cpus)
    entry = _encoded.get(wanted)
    if entry is None:
        entry = _encode(wanted, tid)
    words, key = entry
    n = len(words)
    try:
        io = _tls.io
    except AttributeError:
        io = _thread_io(n)
    if io[1] != n:
        io = _thread_io(n)
        io[1] = n
    io[0] = tid
    if n == 1:
        io[2] = key
    else:
        io[2 : 2 + n] = words
    rc = lib.cpupin_set_affinity(io)
    if rc == 1:
        if io[2] == key:
            return
    elif rc > 1:
        if tuple(io[2 : 2 + rc]) == key:
            return
    _set_affinity_slow(wanted, tid, rc, io)


def swap_affinity(cpus: frozenset[int]) -> frozenset[int]:
    """Move the calling thread onto ``cpus`` (checked as by
    :func:`set_affinity`, which raises the same errors) and return the mask
    it had: a pin's calls in one native call."""
    want = _wanted.get(cpus)
    if want is None:
        want = _want(cpus)
    try:
        old = _tls.old
    except AttributeError:
        old = _tls.old = ffi.new(_WORDS, _MAX_WORDS)
    rc = lib.cpupin_swap_mask(want, old)
    if rc & 0x10000 and rc > 0:
        had = rc & 0xFFFF
        key: Any = old[0] if had == 1 else tuple(old[0:had])
        known = _masks.get(key)
        return known if known is not None else _key_set(key)
    if rc >= 0:  # moved, but the kernel kept less: put back, then say why
        had = rc & 0xFFFF
        previous = _key_set(old[0] if had == 1 else tuple(old[0:had]))
        set_affinity(cpus)
        return previous
    # Nothing moved: the two calls grow the set size or raise, naming why.
    previous = get_affinity()
    set_affinity(cpus)
    return previous


def _set_affinity_slow(wanted: frozenset[int], tid: int, rc: int, io: object) -> None:
    if rc == -errno.EINVAL:
        online = online_cpus(refresh=True)
        if not wanted <= online:
            _encoded.pop(wanted, None)
            _encode(wanted, tid)  # raises, naming the CPU that went offline
        nwords = _nwords
        try:
            get_affinity(tid)  # grows the set size if that was the reason
        except OSError:
            pass
        if _nwords != nwords:
            set_affinity(wanted, tid)
            return
        raise ValueError(
            f"none of {cpus_phrase(wanted)} is in this process's cpuset, so "
            f"{_who(tid)} cannot run there: use CPUs this process may run on "
            "(cpupin.process_cpus())"
        )
    if rc < 0:
        raise_oserror(rc, _who(tid))
    got = _key_set(io[2] if rc == 1 else tuple(io[2 : 2 + rc]))  # type: ignore[index]
    raise ValueError(
        f"the kernel dropped {cpus_phrase(wanted - got)} from the mask of "
        f"{_who(tid)} (outside this process's cpuset); the thread now runs on "
        f"{format_cpulist(got)}: pin to CPUs of cpupin.process_cpus()"
    )


# --- schedstat -------------------------------------------------------------


class SchedStat(NamedTuple):
    """One thread's ``/proc/<pid>/task/<tid>/schedstat``."""

    run_ns: int
    """Time spent running on a CPU."""
    wait_ns: int
    """Time spent runnable, waiting in a run queue."""
    timeslices: int
    """Times it was put on a CPU."""


class ThreadStat(NamedTuple):
    """One thread of a process, as :func:`thread_stats` reads it."""

    tid: int
    name: str
    run_ns: int
    wait_ns: int
    timeslices: int
    last_cpu: int | None
    """The CPU it last ran on (field 39 of ``stat``); ``None`` unless asked."""


_ULL3 = ffi.typeof("unsigned long long[3]")


def schedstat(tid: int = 0, pid: int | None = None) -> SchedStat:
    """A thread's CPU time, run-queue wait and timeslices from schedstat.

    ``tid`` 0 is the calling thread; ``pid`` ``None`` is this process. Raises
    ``ProcessLookupError`` naming the tid when the thread is gone.
    """
    if type(tid) is not int or not 0 <= tid < PID_LIMIT:
        tid = _as_tid(tid)
    pid = 0 if pid is None else as_pid(pid)
    if tid == 0 and pid:
        raise ValueError(f"tid 0 means the calling thread: name a tid of pid {pid}")
    try:
        out = _tls.ull3
    except AttributeError:
        out = _tls.ull3 = ffi.new(_ULL3)
    rc = lib.cpupin_schedstat(pid, tid, out)
    if rc < 0:
        if tid < 0:
            _as_tid(tid)
        raise_oserror(rc, _who(tid) + (f" of pid {pid}" if pid else ""))
    return SchedStat(out[0], out[1], out[2])


def thread_start_time() -> int | None:
    """The calling thread's start time in clock ticks since boot (what
    ``cpupin.host._proc.start_time`` reads from ``stat``), read once a thread in
    one C call and then kept: it never changes while the thread lives, and
    the kept value is checked against the tid (a forked child's thread is
    another thread). ``None`` where ``/proc`` cannot say."""
    tid = lib.cpupin_gettid()
    kept = getattr(_tls, "start", None)
    if kept is not None and kept[0] == tid:
        return kept[1]  # type: ignore[no-any-return]
    out = ffi.new("unsigned long long *")
    if lib.cpupin_thread_start(out) != 0:
        return None
    _tls.start = (tid, int(out[0]))
    return int(out[0])


class _Tasks:
    """The C reader of one process's tasks; its descriptors stay open."""

    __slots__ = ("handle", "lock", "cap", "vals", "names", "need")

    def __init__(self, pid: int) -> None:
        err = ffi.new("int *")
        handle = lib.cpupin_tasks_open(pid, _fd_budget(), err)
        if handle == ffi.NULL:
            raise_oserror(err[0], f"pid {pid}")
        self.handle = ffi.gc(handle, lib.cpupin_tasks_close)
        self.lock = allocate_lock()
        self.need = ffi.new("int *")
        self._size(64)

    def _size(self, threads: int) -> None:
        self.cap = threads
        self.vals = ffi.new("long long[]", 5 * threads)
        self.names = ffi.new("char[]", 65 * threads)

    def read(self, last_cpu: bool) -> tuple[list[int], list[str]] | int:
        with self.lock:
            while True:
                rc = lib.cpupin_tasks_read(
                    self.handle, last_cpu, self.vals, self.names, 65 * self.cap, self.cap, self.need
                )
                if rc != -errno.ENOSPC:
                    break
                self._size(2 * self.need[0])
            if rc < 0:
                return rc
            vals = ffi.unpack(self.vals, 5 * rc)
            names = ffi.buffer(self.names, self.need[0])[:].decode("utf-8", "replace")
        return vals, names.split("\0")


def _fd_budget() -> int:
    # Descriptors one reader may keep open: an eighth of the soft limit, so
    # that two readers never take more than a quarter of the process's.
    soft = nofile_limit()
    return 8192 if soft is None else max(0, soft // 8)


def nofile_limit() -> int | None:
    """The soft limit on this process's open descriptors (``None``:
    unlimited), as ``resource.getrlimit(RLIMIT_NOFILE)[0]`` gives it,
    without importing ``resource`` at a start."""
    soft = ffi.new("long long *")
    rc = lib.cpupin_nofile_limit(soft)
    if rc < 0:
        raise_oserror(rc, "the limit on open descriptors")
    return None if soft[0] < 0 else int(soft[0])


_readers: dict[int, _Tasks] = {}
_readers_lock = allocate_lock()


def _forget_readers() -> None:
    # A forked child must not read its parent's tasks through inherited fds.
    global _readers_lock
    _readers.clear()
    _readers_lock = allocate_lock()


def _reader(pid: int) -> _Tasks:
    reader = _readers.get(pid)
    if reader is None:
        reader = _Tasks(pid)
        with _readers_lock:
            if len(_readers) >= 2:
                # Keep this process's reader; drop the oldest other one.
                own = os.getpid()
                for other in list(_readers):
                    if other != own:
                        del _readers[other]
                        break
            _readers[pid] = reader
    return reader


def thread_stats(pid: int | None = None, *, last_cpu: bool = False) -> list[ThreadStat]:
    """Every thread of a process, in one native call, sorted by tid.

    Each :class:`ThreadStat` has the tid, the name (``comm``), the CPU time,
    run-queue wait and timeslices of ``schedstat`` and, with
    ``last_cpu=True``, the CPU the thread last ran on (field 39 of ``stat``,
    which costs the kernel about four times as much to produce as
    ``schedstat``, so it is read only when asked).

    The descriptors of each task stay open between calls (within an eighth of
    the open-files limit), so a repeated call costs one ``pread`` a file. A
    thread that exits while being read is left out, never an exception;
    ``ProcessLookupError`` means the process itself is gone.
    """
    pid = os.getpid() if pid is None else as_pid(pid)
    result = _reader(pid).read(last_cpu)
    if isinstance(result, int):
        _readers.pop(pid, None)
        if result != -errno.ESRCH:
            raise_oserror(result, f"pid {pid}")
        # The process is gone, or its pid now names another one: open afresh.
        result = _reader(pid).read(last_cpu)
        if isinstance(result, int):
            _readers.pop(pid, None)
            raise_oserror(result, f"pid {pid}")
    vals, names = result
    it = iter(vals)
    new = tuple.__new__
    if last_cpu:
        return [
            new(ThreadStat, (tid, name, run, wait, slices, None if cpu < 0 else cpu))
            for (tid, run, wait, slices, cpu), name in zip(zip(it, it, it, it, it), names)
        ]
    return [
        new(ThreadStat, (tid, name, run, wait, slices, None))
        for (tid, run, wait, slices, _), name in zip(zip(it, it, it, it, it), names)
    ]


# --- a step clock's marks ---------------------------------------------------

#: Where a step clock's state keeps what (see ``cpupin_step_end``).
STEP_LAST, STEP_COUNT, STEP_SUMS, STEP_SLOW, STEP_BOUNDS, STEP_COUNTS, STEP_RING = (
    4,
    13,
    14,
    17,
    20,
    52,
    88,
)
STEP_MAX_BOUNDS = 32
#: The keys of a step clock's two files, and why its cpu.stat was dropped.
STEP_SCHED_KEY, STEP_STAT_KEY, STEP_STAT_ERR = 85, 86, 87
#: What a mark made by any thread but the clock's owner (:func:`step_own`,
#: kept at ``state[19]`` by C alone) returns, below every ``-errno``: it
#: touches nothing.
STEP_OTHER_THREAD = -4096


def file_key(fd: int) -> int:
    """The device and inode of the file open at ``fd`` in one number (as
    the step marks check it), or 0 when ``fd`` is not open."""
    try:
        st = os.fstat(fd)
    except (OSError, ValueError):
        return 0
    return (st.st_ino ^ (st.st_dev << 40)) & ((1 << 63) - 1)


def step_marker(
    keep: int, bounds_ns: Iterable[int] = (), slow_ns: int = -1
) -> tuple[Callable[[], int], Callable[[], int], Any]:
    """The begin and end marks of a step clock and the state they keep
    (give it its files with :func:`step_files`).

    The marks read the monotonic clock, the schedstat and the cgroup's
    ``cpu.stat`` named by :func:`step_files`; a begin within its join window
    of the last end returns 1 and takes that end as its start. An end
    stores the step's wall, run, wait and throttled ns at ``state[4:8]`` and
    in a ring of ``keep`` steps from ``state[88]``, counts it in
    ``state[13]``, adds it to the sums at ``state[14:17]``, counts its wait
    in the first of ``bounds_ns`` it does not exceed (``state[52:]``), and
    returns 2 when the wait reached ``slow_ns`` (>= 0). Each returns 0 or
    ``-errno`` otherwise, or :data:`STEP_OTHER_THREAD` when the calling
    thread is not the one :func:`step_own` named (none until then). One
    call into C a mark, one argument, no Python frame between
    (``functools.partial``): a step costs about one read of each file."""
    import functools  # here: `import cpupin` does without it (1 ms with types)

    bounds = sorted(bounds_ns)[:STEP_MAX_BOUNDS]
    state = ffi.new("long long[]", STEP_RING + 4 * keep)
    step_files(state, -1)
    state[12], state[STEP_SLOW], state[18] = keep, slow_ns, len(bounds)
    for i, bound in enumerate(bounds):
        state[STEP_BOUNDS + i] = bound
    return (
        functools.partial(lib.cpupin_step_begin, state),
        functools.partial(lib.cpupin_step_end, state),
        state,
    )


def step_own(state: Any) -> None:
    """Make the calling thread the only one whose marks a step clock's
    state takes (C's ``pthread_self``, compared in each mark without a
    system call)."""
    lib.cpupin_step_own(state)


def step_files(
    state: Any, sched_fd: int, stat_fd: int = -1, stat_kind: int = 0, join_ns: int = 0
) -> None:
    """What a step clock's marks read: the schedstat open at ``sched_fd``,
    the cgroup's ``cpu.stat`` open at ``stat_fd`` (``stat_kind`` 2: cgroup
    v2, 1: v1, 0: not read), and the window (ns) within which a begin takes
    the last end as its start. ``-1``: closed. The files' keys
    (:func:`file_key`) are taken now: a step's readings are used only while
    its descriptor names the same file (an end checks before it reads, and
    vouches for its begin's readings: a number that stopped naming the file
    never names it again)."""
    state[8], state[9], state[10], state[11] = sched_fd, stat_fd, stat_kind, join_ns
    state[STEP_SCHED_KEY] = file_key(sched_fd) if sched_fd >= 0 else 0
    state[STEP_STAT_KEY] = file_key(stat_fd) if stat_fd >= 0 else 0
    state[STEP_STAT_ERR] = 0


# --- memory policy ---------------------------------------------------------

#: The kernel's memory policy modes (``linux/mempolicy.h``).
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL = 0, 1, 2, 3, 4


#: Node masks are passed as at most this many 64-bit words (16,384 nodes; the
#: kernel allows 1,024).
class SharedFile:
    """A file mapped shared for stores (``MAP_SHARED``): a store reaches
    every reader of the file with no system call, and no descriptor is kept
    (a runtime that closes descriptors it did not open cannot close it, nor
    make cpupin write to a file of its own under a reused number). The file
    must keep its size while mapped: only its owner (or root) could cut it,
    and a store past a cut end would be a ``SIGBUS``."""

    __slots__ = ("size", "view", "_addr")

    def __init__(self, fd: int, size: int) -> None:
        out = ffi.new("void **")
        rc = lib.cpupin_map_shared(fd, size, out)
        if rc < 0:
            raise_oserror(rc, f"mapping {size} bytes of a record file")
        self._addr: Any = out[0]
        self.size = size
        #: The bytes, for slice stores (``view[a:b] = data``).
        self.view = memoryview(ffi.buffer(self._addr, size))

    def close(self) -> None:
        """Unmap the file (once; a store afterwards raises ``TypeError``)."""
        view, self.view = self.view, memoryview(b"")
        if view.nbytes:
            view.release()
            lib.cpupin_unmap(self._addr, self.size)


_NODE_WORDS = 16


def set_mempolicy(mode: int, nodes: Iterable[int] = ()) -> int:
    """Set the calling thread's memory policy: 0, or ``-errno`` (the caller
    decides what a refusal means; see :mod:`cpupin.plan.binding`)."""
    wanted = set(nodes)
    if wanted and max(wanted) >= 64 * _NODE_WORDS:
        return -errno.EINVAL
    words = _words_of(wanted, 0)
    return int(lib.cpupin_set_mempolicy(mode, ffi.new(_WORDS, words or [0]), len(words)))


def get_mempolicy() -> tuple[int, frozenset[int]]:
    """The calling thread's memory policy: (mode, its nodes). Raises
    ``OSError`` where the kernel refuses (``ENOSYS``: built without NUMA)."""
    mode = ffi.new("int *")
    words = ffi.new(_WORDS, _NODE_WORDS)
    rc = lib.cpupin_get_mempolicy(mode, words, _NODE_WORDS)
    if rc < 0:
        raise_oserror(rc, "the memory policy of the calling thread")
    return int(mode[0]), _bits_of(ffi.unpack(words, _NODE_WORDS))


#: The longest kernel thread name, in bytes (TASK_COMM_LEN less the NUL).
THREAD_NAME_BYTES = 15


def thread_name_bytes(name: str) -> bytes:
    """``name`` as the kernel takes it: 15 bytes of UTF-8 at most, cut on a
    character boundary, no NUL (for :data:`set_thread_name_bytes`)."""
    if len(name) <= THREAD_NAME_BYTES and name.isascii() and "\0" not in name:
        return name.encode()
    raw = name.encode("utf-8", "replace")[:THREAD_NAME_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8").replace(b"\0", b"?")


def thread_name_cut(raw: bytes) -> bytes:
    """The kernel name C makes of ``raw``, a name in UTF-8 (what
    :func:`enter_thread` names a thread): :func:`thread_name_bytes`'s cut,
    made without Python's codecs."""
    out = ffi.new("char[16]")
    n = lib.cpupin_thread_name_cut(raw, len(raw), out)
    return bytes(ffi.buffer(out, n))


#: The C call that names the calling thread, for bytes made by
#: :func:`thread_name_bytes` ahead of time: a new thread's first step pays
#: one call and nothing else (returns 0 or -errno).
set_thread_name_bytes = lib.cpupin_set_thread_name


def set_thread_name(name: str) -> int:
    """Give the calling thread the kernel name ``name`` (what ``top -H``,
    ``ps -L``, ``perf`` and ``py-spy`` show), cut as :func:`thread_name_bytes`
    cuts it: 0, or ``-errno``."""
    return int(set_thread_name_bytes(thread_name_bytes(name)))


#: The signals Python ignores for itself, which a program it execs should
#: find at their default (as a shell leaves them): SIGPIPE and SIGXFSZ.
IGNORED_BY_PYTHON = (int(lib.CPUPIN_SIGPIPE), int(lib.CPUPIN_SIGXFSZ))


def default_signal(signum: int) -> None:
    """Give signal ``signum`` its default action before an exec, without
    importing the ``signal`` module; ``OSError`` naming it when refused.
    Python's ``signal.getsignal`` is not told: call it just before the
    process becomes another program."""
    rc = int(lib.cpupin_default_signal(signum))
    if rc < 0:
        raise_oserror(rc, f"signal {signum}")


def holds_gil() -> bool:
    """Whether a call into the extension runs with the GIL held (it should:
    see the module docstring). A check for the tests."""
    return bool(lib.cpupin_holds_gil())


_UINT = ffi.typeof("unsigned int *")


def open_in_root(root_fd: int, path: str, want_dir: bool) -> tuple[int, int]:
    """``path`` opened for reading as if ``root_fd`` were ``/`` (``openat2``
    with ``RESOLVE_IN_ROOT``), only when it is a regular file (or, with
    ``want_dir``, a directory): ``(fd, 0)``, or ``(-errno, st_mode)``, with
    ``-EMEDIUMTYPE`` when the type is wrong. See :mod:`cpupin.host._sysfs`."""
    mode = ffi.new(_UINT)
    rc = lib.cpupin_open_in_root(root_fd, path.encode("utf-8", "surrogateescape"), want_dir, mode)
    return rc, mode[0]


def handoff_rounds(
    cpu_a: int, cpu_b: int, rounds: int, warmup: int, idle_us: int, spin: bool
) -> tuple[list[int], list[int]]:
    """The C handoff benchmark: (round trips, wake times) in ns, one a round.
    ``-1`` leaves a side unpinned. Drops the GIL while it runs."""
    rtt = ffi.new(_WORDS, rounds)
    wake = ffi.new(_WORDS, rounds)
    rc = lib.cpupin_handoff(cpu_a, cpu_b, rounds, warmup, idle_us, int(spin), rtt, wake)
    if rc < 0:
        raise_oserror(rc, f"the handoff between CPU {cpu_a} and CPU {cpu_b}")
    return ffi.unpack(rtt, rc), ffi.unpack(wake, rc)


os.register_at_fork(after_in_child=_forget_thread_state)
os.register_at_fork(after_in_child=_forget_readers)
