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
  ``result``, or the runtime's word). It is a file mapped shared
  (``MAP_SHARED``; no descriptor kept): a head, framed like a server's
  record (what the process says of itself, and where its pin slots are),
  then a slot of :data:`PIN_SLOT` bytes for each pin, framed with its own
  CRC-32. A pin made or released is one store into its slot, with no system
  call; a reader that races it sees that slot's checksum fail and reads
  again, never a torn pin that parses. The whole record is rewritten, with
  every check (the file still under its name, the lock directory, the
  pools), when the process says something new of itself, when a thread
  starts through cpupin, when the slots run out, and at most every
  :data:`FULL_EVERY_S` seconds when pins change; a new file (written whole,
  then renamed into place) when it is made or outgrows its layout. It is
  removed at exit.

Reading lives in :mod:`cpupin.registry.reader` (with the removal of what
dead processes left in :mod:`cpupin.registry.prune`), which a process that
only pins never imports. Everything read is hostile
(:func:`cpupin.registry.reader.read_registry` says how): only
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
import os
import sys
import time
from _thread import RLock
from collections.abc import Iterable

from cpupin import _native
from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.host._proc import start_time
from cpupin.registry._record import (
    ENV_LOCK_DIR,
    MAX_HOLDS,
    MAX_LISTED,
    MAX_NAME,
    MAX_PINS,
    MAX_RECORDS,
    MAX_SIZE,
    PIN_SLOT,
    PROC_LOCKS,
    SLOT,
    VERSION,
    Pinned,
    _names,
    compact,
    decode,
    encode,
    fit,
    frame,
    lock_dir,
    open_lock_dir,
)

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from typing import Any

# The format's names are this module's too (cpupin.registry._record holds them so
# that the reader does not import the writer).
__all__ = [
    "ENV_LOCK_DIR",
    "MAX_LISTED",
    "MAX_NAME",
    "MAX_PINS",
    "MAX_RECORDS",
    "MAX_SIZE",
    "PROC_LOCKS",
    "SLOT",
    "VERSION",
    "Pinned",
    "decode",
    "encode",
    "fit",
    "lock_dir",
    "open_lock_dir",
    "add_note",
    "describe_process",
    "register_pins",
    "step_figures",
]

# --- this process's record --------------------------------------------------

# One lock for the record, re-entrant: a signal handler that releases a pin
# runs in the thread it interrupted, which may be inside register_pins.
_lock = RLock()
# Where this process's record is (directory, name), when it has one.
_written: tuple[str, str] | None = None
# The record file, mapped shared, and its device and inode. No descriptor is
# kept: a runtime that daemonizes or calls os.closerange() can neither close
# it nor have cpupin write into a file of its own under a reused number.
_file: _native.SharedFile | None = None
_file_id: tuple[int, int] | None = None
# Its layout: a head of _head bytes (the JSON of everything but the pins
# that have slots), then _nslots pin slots of PIN_SLOT bytes; which slot
# holds which thread's pin, and the slots free (the lowest last).
_head = 0
_nslots = 0
_slot_of: dict[int, int] = {}
_free: list[int] = []
# The threads whose pins are in the head (no slot held them).
_in_head: set[int] = set()
# When a pin's update next rewrites the whole record with its checks (the
# file still under its name, the pools, the time), and the lock directory
# variable the record was last written under: a pin between two such
# rewrites is one store into its slot.
_full_due = 0.0
_env_seen: object = None
#: How often, at most, a pin's update waits for the whole record's checks.
FULL_EVERY_S = 1.0
#: The pin slots of a new record (doubled as pins need them).
MIN_SLOTS = 16
_BLANK = b" " * PIN_SLOT
# This process's pid, start time and uid, read once (a forked child reads its own).
_me: tuple[int, int, int] | None = None
# Set at exit: threads still pinning (daemons) write no record afterwards.
_closed = False
# The lock directories already warned about, so that each says why once.
_warned: set[str] = set()
# Each pin's JSON, made once (a record is these joined), plain and compact;
# and its slot's bytes (framed and padded), or None when it fits no slot.
_fragments: dict[tuple[Pinned, bool], str] = {}
_slot_texts: dict[Pinned, bytes | None] = {}
#: ``CPUPIN_REGISTRY=0`` keeps this process from writing its record.
_disabled = os.environ.get("CPUPIN_REGISTRY") == "0"
# The pins last registered, and what the process says of itself beside them
# (its role, its step clocks' figures, its notes): a record carries both.
_pins: dict[int, Pinned] = {}
_about: dict[str, Any] = {}
#: The most notes a record keeps, and the longest one.
MAX_NOTES = 16
MAX_NOTE = 240
#: The most step clocks a record carries.
MAX_CLOCKS = 8


def _write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """Every byte of ``data`` (at ``offset``, with pwrite), or ``OSError``
    (a full disk writes short)."""
    view = memoryview(data)
    at = offset
    while view:
        n = os.write(fd, view) if at is None else os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        if at is not None:
            at += n


def register_pins(pins: Iterable[Pinned], directory: str | None = None) -> None:
    """Write this process's record of its deliberate pins (all of them; none
    left is a record with no pins, kept until exit).

    The whole record is written: its head and every pin's slot, each with
    the CRC-32 of its JSON, stored into the mapped file (a reader that races
    a store sees a bad checksum and reads again, never a torn record that
    parses). The file is made (and remade, when the record outgrows its
    layout or someone moved or removed it) as a new file written whole,
    mapped, and renamed into place, in the lock directory opened
    without following a symbolic link; a name another user squats is passed
    over for the next of :func:`_names`. Best effort: a directory that
    cannot take the record logs why once, at warning level, and the pins
    stand."""
    with _lock:
        _pins.clear()
        for pin in sorted(pins):
            _pins[pin.tid] = pin
        _write(directory)


def update_pin(tid: int, pin: Pinned | None, now: float) -> bool:
    """Record that thread ``tid`` is now pinned as ``pin`` (``None``: no
    longer pinned) with one store into the record's mapping: its slot, or a
    free one. ``now`` is :func:`time.monotonic`'s. Called with :data:`_lock`
    held (:mod:`cpupin.threads.pins` holds it: its pins' lock is this one).

    ``False`` when that cannot be (no record yet, no free slot, a pin too
    long for a slot, the lock directory variable changed, or the whole
    record's checks are due: at most every :data:`FULL_EVERY_S` seconds):
    the caller then writes the whole record with :func:`register_pins`. A
    reader that races the store sees the slot's checksum fail and reads
    again."""
    global _busy
    file = _file
    if now >= _full_due or file is None or _busy or _env_get(_ENV_KEY) != _env_seen:
        return False  # (closed at exit: no file)
    # From here to the store, a signal handler that writes the whole record
    # waits for the end (it would lay the slots out anew under this store).
    _busy = True
    try:
        done = _store_pin(file, tid, pin)
    finally:
        _busy = False
    if _deferred:  # what a signal handler asked meanwhile
        _write(_deferred.pop())
        _deferred.clear()
    return done


def _store_pin(file: _native.SharedFile, tid: int, pin: Pinned | None) -> bool:
    if tid in _in_head:
        return False  # its pin is in the head: the whole record, or both show
    if pin is None:
        text = _BLANK
    else:
        made = _slot_texts.get(pin, _BLANK)
        if made is _BLANK:
            made = _slot_text(pin)
        if made is None:
            return False
        text = made
    at = _slot_of.get(tid)
    if at is None:
        if pin is None:
            return True  # not pinned: nothing to record
        if not _free:
            return False
        # A slot of its own, kept when it is released (a thread that pins
        # again stores into it again) until the record is next laid out.
        at = _free.pop()
        _slot_of[tid] = at
    start = _head + at * PIN_SLOT
    file.view[start : start + PIN_SLOT] = text
    if pin is None:
        _pins.pop(tid, None)
    else:
        _pins[tid] = pin
    return True


# A store under way (update_pin), and the whole-record writes asked for
# meanwhile (their directories), done when it ends.
_busy = False
_deferred: list[str | None] = []


def _text_of(pin: Pinned) -> bytes | None:
    text = _slot_texts.get(pin, _BLANK)
    return _slot_text(pin) if text is _BLANK else text


def _slot_text(pin: Pinned) -> bytes | None:
    """A pin's slot: its JSON (CPU lists as ranges) framed with its CRC-32
    and padded, or ``None`` when it is longer than :data:`PIN_SLOT`."""
    framed = frame(_fragment(pin, compact=True).encode())
    text = framed.ljust(PIN_SLOT, b" ") if len(framed) <= PIN_SLOT else None
    if len(_slot_texts) > MAX_PINS:
        _slot_texts.clear()
    _slot_texts[pin] = text
    return text


# os.environ.get costs a microsecond when the variable is unset (a KeyError
# inside); CPython's mapping of bytes under it, which it keeps up to date,
# does not.
_ENV_KEY: Any = ENV_LOCK_DIR.encode()
_env_get: Any = getattr(getattr(os.environ, "_data", None), "get", None)
if _env_get is None or not isinstance(next(iter(os.environ._data), b""), bytes):  # type: ignore[attr-defined]
    _ENV_KEY, _env_get = ENV_LOCK_DIR, os.environ.get


def _env_lock_dir() -> object:
    """The lock directory variable as it is now, cheaply."""
    return _env_get(_ENV_KEY)


def describe_process(
    *,
    role: str | None = None,
    notes: Iterable[str] | None = None,
    steps: Iterable[dict[str, Any]] | None = None,
    server: tuple[int, int] | None = None,
    mask: Iterable[int] | None = None,
    wake_holds: Iterable[dict[str, Any]] | None = None,
    pin_drift: dict[str, Any] | None = None,
    auto: dict[str, Any] | None = None,
    directory: str | None = None,
) -> None:
    """Say in this process's record what it is beside its pins: its
    ``role`` (a short word, such as ``vllm-worker``), ``notes`` (one line for
    each decision made for it, with why; at most :data:`MAX_NOTES`), its
    step clocks' figures (``steps``: :func:`step_figures` of each clock) and
    the ``server`` it belongs to (the pid and start time of the process that
    prunes its record should it be killed: :func:`cpupin.registry.prune.prune_members`), and its
    process ``mask`` where cpupin changed it (:func:`cpupin.bind_process`,
    :func:`cpupin.set_process_cpus`): the outside view takes it over the
    ``CPUPIN_PROCESS_CPUS`` the process started with. ``wake_holds``: the
    wake-latency holds in force (:func:`cpupin.hold_wake_latency`), with
    the values to put back should the process die. ``pin_drift``: how many
    drifts :func:`cpupin.check_pins` found, and the last. ``auto``: what
    the vLLM plugin's ``auto`` did (``moved``, ``confined``, ``widened``).
    ``None`` leaves that part as it was. A record written only for this
    (no pins) is still the process's record: ``cpupin ps`` lists it. Best
    effort, as :func:`register_pins`."""
    with _lock:
        if role is not None:
            _about["role"] = printable(str(role), 32)
        if notes is not None:
            _about["notes"] = [printable(str(n), MAX_NOTE) for n in list(notes)[:MAX_NOTES]]
        if steps is not None:
            _about["steps"] = list(steps)[:MAX_CLOCKS]
        if server is not None:
            _about["server"] = [int(server[0]), int(server[1])]
        if mask is not None:
            _about["process_mask"] = sorted({int(c) for c in mask})
        if pin_drift is not None:
            _about["pin_drift"] = {
                "total": int(pin_drift["total"]),
                "last": printable(str(pin_drift["last"]), MAX_NOTE),
            }
        if auto is not None:
            _about["auto"] = {
                "moved": min(int(auto["moved"]), 1 << 20),
                "confined": format_cpulist(frozenset(int(c) for c in auto["confined"])),
                "widened": bool(auto["widened"]),
            }
        if wake_holds is not None:
            listed = list(wake_holds)[:MAX_HOLDS]
            if listed:
                _about["wake_holds"] = listed
            else:
                _about.pop("wake_holds", None)
        _write(directory)


def add_note(key: str, text: str, directory: str | None = None) -> None:
    """Add one line to this process's record's notes, in place of the line
    added before under the same ``key`` (the first word of the line), the
    others kept. Best effort, as :func:`register_pins`."""
    with _lock:
        line = printable(str(text), MAX_NOTE)
        notes = [n for n in _about.get("notes", []) if not str(n).startswith(key)]
        _about["notes"] = (notes + [line])[-MAX_NOTES:]
        _write(directory)


def step_figures(clock: Any) -> dict[str, Any]:
    """A :class:`cpupin.StepClock`'s figures as a record carries them: its
    counts and sums, the histogram of its wait, and the percentiles of the
    steps it keeps (what ``ps`` and Prometheus show of another process)."""
    p = clock.percentiles()
    return {
        "clock": printable(str(clock.name), MAX_NAME),
        "tid": clock.tid,
        "steps": clock.steps,
        "wall_s": round(clock.wall_sum_ns / 1e9, 6),
        "wait_s": round(clock.wait_sum_ns / 1e9, 6),
        "throttled_s": round(clock.throttled_sum_ns / 1e9, 6),
        "counts": clock.wait_counts,
        "wall_p50_us": p["wall_us"].get("p50"),
        "wall_p99_us": p["wall_us"].get("p99"),
        "wait_p50_us": p["wait_us"].get("p50"),
        "wait_p99_us": p["wait_us"].get("p99"),
    }


def _write(directory: str | None) -> None:
    """Write the whole record (under the lock) of :data:`_pins` and
    :data:`_about`: into its mapping when its layout still holds it and its
    file is still under its name, else as a new file."""
    global _full_due, _env_seen
    if _disabled or _closed:
        return
    if _busy:
        _deferred.append(directory)
        return
    env = _env_lock_dir()
    where = lock_dir(directory)
    if _written is not None and _written[0] != where:
        _remove()  # the directory changed: the old record goes
    if not _pins and not _about and _file is None:
        return  # no record, and nothing to record
    # A record with no pins left stays (until exit) rather than go: the
    # next pin is then one store, not a new file.
    _about["pools"] = _pools_now()
    slotted, overflow, nslots = _layout()
    head, data, about = _head_bytes(overflow, nslots)
    # The next update waits for these checks again; a pin's store goes
    # where the variable named when they were made.
    _full_due = time.monotonic() + FULL_EVERY_S
    _env_seen = env if where == lock_dir() else _NOWHERE
    if _file is not None and head == _head and nslots == _nslots and _in_place(where):
        _file.view[0:head] = data.ljust(head, b" ")
        _file.view[head : head + nslots * PIN_SLOT] = _slot_area(slotted, nslots)
        _slot_of.clear()
        _slot_of.update(slotted)
        _free[:] = _free_slots(slotted, nslots)
        _wrote(overflow, about)
        return
    try:
        dir_fd = open_lock_dir(where)
    except OSError as exc:
        _warn_once(where, exc.strerror or str(exc))
        return
    try:
        _create(dir_fd, where, head, nslots, data, slotted, overflow, about)
    finally:
        os.close(dir_fd)


_NOWHERE = object()


def _layout() -> tuple[dict[int, int], list[Pinned], int]:
    """Where each pin goes: a slot (the one it has, else a free one; slots
    double as pins need them, within what a reader reads), or the head."""
    fits = {tid for tid, pin in _pins.items() if _text_of(pin) is not None}
    nslots = _nslots if _file is not None else 0
    if len(fits) > nslots:
        nslots = max(MIN_SLOTS, 1 << (len(fits) - 1).bit_length())
    nslots = max(_nslots if _file is not None else 0, min(nslots, (MAX_SIZE - SLOT) // PIN_SLOT))
    slotted = {tid: at for tid, at in _slot_of.items() if tid in _pins and at < nslots}
    slotted = {tid: at for tid, at in slotted.items() if tid in fits}
    free = _free_slots(slotted, nslots)
    overflow = []
    for tid in sorted(_pins):
        if tid in slotted:
            continue
        if free and tid in fits:
            slotted[tid] = free.pop()
        else:
            overflow.append(_pins[tid])
    return slotted, overflow, nslots


def _free_slots(slotted: dict[int, int], nslots: int) -> list[int]:
    used = set(slotted.values())
    return [at for at in range(nslots - 1, -1, -1) if at not in used]


def _slot_area(slotted: dict[int, int], nslots: int) -> bytes:
    area = bytearray(_BLANK * nslots)
    for tid, at in slotted.items():
        text = _text_of(_pins[tid])
        assert text is not None
        area[at * PIN_SLOT : (at + 1) * PIN_SLOT] = text
    return bytes(area)


def _head_bytes(overflow: list[Pinned], nslots: int) -> tuple[int, bytes, dict[str, Any]]:
    """The head's size and bytes (the pins without slots, everything else,
    and where the slots are), and what it says beside its pins. It keeps
    the size it has while that holds it, else takes whole :data:`SLOT`
    units, within what a reader reads."""
    room = MAX_SIZE - nslots * PIN_SLOT
    head = _head if _file is not None else SLOT
    for _ in range(4):
        about = {**_about, "slots": [head, PIN_SLOT, nslots]}
        data = _record_bytes(overflow, about, room)
        if len(data) <= head:
            return head, data, about
        head = min(-(-len(data) // SLOT) * SLOT, room)
    return max(head, len(data)), data, about


# The pools last recorded, the threads they were read from, and their JSON:
# a pin made or released with the same threads running writes them again
# without reading them again.
_pools_read: tuple[object, list[dict[str, Any]], str] | None = None


def _pools_now() -> list[dict[str, Any]]:
    """The process's pools for its record (the census from outside reads
    them); none when they cannot be had (a lazy import refused in a signal
    handler, say): the record is what matters."""
    global _pools_read
    try:
        from cpupin.registry import _torch_thread

        # No threading loaded: no thread but the main one to name.
        threads = getattr(sys.modules.get("threading"), "_active", ())
        key = (frozenset(threads), _torch_thread._pool_thread)
        if _pools_read is not None and _pools_read[0] == key:
            return _pools_read[1]
        from cpupin.registry._pool_names import recorded_pools

        pools = recorded_pools()
        import json  # here: a pin's store needs none of it

        _pools_read = (key, pools, json.dumps(pools, separators=(",", ":"), ensure_ascii=False))
        return pools
    except Exception:  # noqa: BLE001 - the pins' record never fails for its pools
        return []


def threads_changed() -> None:
    """Write the record again with the process's pools as they are now, when
    it has one: cpupin's threads call this as they start, so that the
    census from outside names them (a new thread changes the set the pools
    were read from, so they are read again). Best effort, as
    :func:`register_pins`."""
    if _written is None or _disabled or _closed:
        return
    with _lock:
        _write(_written[0])


def _in_place(where: str) -> bool:
    """Whether the mapped file is still this process's record under its
    name in ``where`` (not removed, renamed away, replaced, or left behind
    in a directory swapped for another): else a new record file is made,
    so that ``ps`` never loses the process for good."""
    if _file is None or _written is None:
        return False
    try:
        st = os.stat(os.path.join(where, _written[1]), follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == _file_id


def _record_bytes(listed: list[Pinned], about: dict[str, Any], room: int = MAX_SIZE) -> bytes:
    """The head of a record of ``listed`` (the pins without slots) and
    ``about``. One that would outgrow a :data:`SLOT` writes its CPU lists as
    ranges and its names unescaped; one that would still pass ``room`` (what
    a reader reads, less the slots) lists the pins that fit, with a note of
    how many it left out, so that the process never vanishes from ``ps``."""
    global _me
    if _me is None:
        pid = os.getpid()
        _me = (pid, start_time(pid) or 0, os.geteuid())
    data = _assemble([_fragment(p) for p in listed], about)
    if len(data) <= SLOT:
        return data
    pins = [_fragment(p, compact=True) for p in listed]
    about = {k: compact(v) for k, v in about.items()}
    data = _assemble(pins, about)
    if len(data) <= room:
        return data
    # Keep the pins that fit, the first first, and say how many did not.
    left = room - len(_assemble([], about)) - 2 * MAX_NOTE
    kept = 0
    for text in pins:
        left -= len(text.encode()) + 1
        if left < 0:
            break
        kept += 1
    notes = [str(n) for n in about.get("notes", [])][: MAX_NOTES - 1]
    total = max(len(_pins), len(pins))  # the others have slots
    notes.append(
        f"{len(pins) - kept} of {total} pins left out: a record holds at most {MAX_SIZE} bytes"
    )
    return _assemble(pins[:kept], {**about, "notes": notes})


def _fragment(p: Pinned, *, compact: bool = False) -> str:
    """A pin's JSON, made once (a record is these joined)."""
    key = (p, compact)
    text = _fragments.get(key)
    if text is None:
        if len(_fragments) > MAX_PINS:
            _fragments.clear()
        import json

        cpus: object = format_cpulist(p.cpus) if compact else sorted(p.cpus)
        text = _fragments[key] = json.dumps(
            {"tid": p.tid, "name": p.name[:MAX_NAME], "cpus": cpus, "role": p.role},
            separators=(",", ":"),
            ensure_ascii=not compact,
        )
    return text


def _assemble(pins: list[str], about: dict[str, Any]) -> bytes:
    assert _me is not None
    pid, started, uid = _me
    head = "".join(f'"{key}":{_json_of(about[key])},' for key in sorted(about))
    body = (
        f'{{{head}"pid":{pid},"pins":[{",".join(pins)}],"start_time":{started},'
        f'"time":{round(time.time(), 3)!r},"uid":{uid},"version":{VERSION}}}'
    ).encode()
    return frame(body)


def _json_of(value: Any) -> str:
    read = _pools_read
    if read is not None and value is read[1]:
        return read[2]
    import json

    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _create(
    dir_fd: int,
    where: str,
    head: int,
    nslots: int,
    data: bytes,
    slotted: dict[int, int],
    overflow: list[Pinned],
    about: dict[str, Any],
) -> None:
    """A new record file of ``data`` in a head of ``head`` bytes and
    ``nslots`` pin slots, mapped, then renamed into place over the old one
    (or under the next free name). Written whole before it is named: a full
    disk or a file size limit fails it whole, and the old record stays."""
    global _written, _file, _file_id, _head, _nslots
    assert _me is not None
    pid, started, _ = _me
    # An unpredictable temporary name: another user who made the name ahead
    # (for pids to come) would otherwise keep this process from ever
    # writing its record.
    tmp = f"cpupin-tmp-{pid}-{os.urandom(8).hex()}.tmp"
    try:
        fd = os.open(
            tmp,
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        _unlink(dir_fd, tmp)
        _warn_once(where, f"cannot write a record there: {exc.strerror}")
        return
    try:
        os.fchmod(fd, 0o644)
        _write_all(fd, data.ljust(head, b" ") + _slot_area(slotted, nslots))
        st = os.fstat(fd)
        mapped = _native.SharedFile(fd, head + nslots * PIN_SLOT)
    except OSError as exc:
        _unlink(dir_fd, tmp)
        _failed(where, exc)
        return
    finally:
        os.close(fd)
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
        _close()
        _written, _file, _file_id = (where, name), mapped, (st.st_dev, st.st_ino)
        _head, _nslots = head, nslots
        _slot_of.update(slotted)
        _free[:] = _free_slots(slotted, nslots)
        _wrote(overflow, about)
        return
    mapped.close()
    _unlink(dir_fd, tmp)
    _warn_once(where, f"no record: {why}; another user has squatted every name of it")


# What the head on disk says (its pins and the rest): an update that cannot
# be written marks that head out of date instead.
_good: tuple[list[Pinned], dict[str, Any]] | None = None


def _wrote(overflow: list[Pinned], about: dict[str, Any]) -> None:
    global _good
    _good = (list(overflow), about)
    _in_head.clear()
    _in_head.update(p.tid for p in overflow)


def _failed(where: str, exc: OSError) -> None:
    """An update could not be written (a full disk, a file size limit, no
    memory to map it): rewrite the head as it was, marked out of date with
    why (a store into the mapping, which no limit cuts short; the slots
    keep the pins they hold), and warn once, saying what ``ps`` shows."""
    why = f"cannot write a record there: {exc.strerror}"
    shown = "no record of this process"
    if _good is not None and _file is not None:
        listed, about = _good
        about = {**about, "out_of_date": printable(f"an update failed: {exc.strerror}", 120)}
        pins = [_fragment(p) for p in listed]
        data = _assemble(pins, about)
        while len(data) > _head and pins:
            pins.pop()  # the mark takes room: the last pins make way for it
            data = _assemble(pins, about)
        if len(data) <= _head:
            _file.view[0:_head] = data.ljust(_head, b" ")
            shown = "the record written before, marked out of date"
    _warn_once(where, f"{why}; cpupin ps shows {shown}")


def _close() -> None:
    """Unmap the record file (its name stays: see :func:`_remove`)."""
    global _file, _file_id, _head, _nslots
    if _file is not None:
        _file.close()
    _file, _file_id, _head, _nslots = None, None, 0, 0
    _slot_of.clear()
    _free.clear()
    _in_head.clear()


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _warn_once(where: str, why: str) -> None:
    if where in _warned:
        return
    _warned.add(where)
    import logging  # only here: importing it costs ``import cpupin`` 4 ms

    logging.getLogger("cpupin").warning(
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
    _close()
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
    # The child is another process: its parent's record is not its own (its
    # descriptor goes, without touching the file), and a lock another thread
    # held at the fork would never be released.
    global _written, _lock, _me, _closed, _good, _full_due, _env_seen, _busy
    _close()  # unmaps the child's copy of the mapping only
    _busy = False
    _deferred.clear()
    _written = _me = None
    _good = None
    _full_due, _env_seen = 0.0, None
    _closed = False
    _lock = RLock()
    _pins.clear()
    _about.clear()


#: What a pin and its record import on first use. A thread in the middle of
#: importing a module when another thread forks leaves the child that
#: module's import lock held by no thread: the child's first pin would wait
#: on it for ever. Before a fork, the forking thread imports them (waiting
#: out an import under way; once imported, each is a dictionary lookup).
FORK_IMPORTS = (
    "json",
    "cpupin.registry._pool_names",
    "cpupin.registry._torch_thread",
    "cpupin.threads._drift",
)


def _before_fork() -> None:
    for name in FORK_IMPORTS:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001, S112 - a fork never fails for it
            continue


atexit.register(_remove_at_exit)
os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
