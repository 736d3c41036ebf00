"""The record format of the host's registry, shared by its writer
(:mod:`cpupin.registry.writer`) and its reader (:mod:`cpupin.registry.reader`): the
lock directory, a record's bytes (JSON with a CRC-32, in a fixed slot), its
names and its limits."""

from __future__ import annotations

import errno
import math
import os
import zlib
from collections.abc import Mapping

from cpupin._records import NamedTuple
from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.host._proc import START_CWD

#: The upper bounds (seconds) of a step clock's wait histogram, as Prometheus
#: buckets: a record holds one count a bucket and one above.
BUCKETS_S = (
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)
#: The record format's version.
VERSION = 1
#: The bytes a lock file's record occupies (one page: one pwrite), and the
#: unit a process record's head grows by.
SLOT = 4096
#: The bytes of one pin's slot in a process record (after its head): a pin
#: made or released is a store of one slot.
PIN_SLOT = 256
#: The most bytes read of any record file.
MAX_SIZE = 64 * 1024
#: The environment variable naming the shared lock directory.
ENV_LOCK_DIR = "CPUPIN_LOCK_DIR"
#: Where the kernel lists every file lock.
PROC_LOCKS = "/proc/locks"
#: The most pins one process record lists.
MAX_PINS = 4096
#: The longest thread name or role a record keeps (longer ones are cut).
MAX_NAME = 64
#: The most record files one read opens; past this they are counted.
MAX_RECORDS = 4096
#: The most stale records and ignored files a read lists; past this, counted.
MAX_LISTED = 200
#: The most pools a process record names, and thread ids in all of them.
MAX_POOLS = 32
MAX_POOL_TIDS = 512
#: The most wake-latency holds a process record carries.
MAX_HOLDS = 16


def lock_dir(directory: str | os.PathLike[str] | None = None) -> str:
    """The shared lock directory: ``directory``, else ``$CPUPIN_LOCK_DIR``
    (a relative one taken from the working directory the process had when
    it imported cpupin), else ``/tmp``. The locks, the servers' records and
    the pin records all live there."""
    if directory is not None:
        return os.fspath(directory)
    value = os.environ.get(ENV_LOCK_DIR) or "/tmp"
    if not os.path.isabs(value):
        value = os.path.normpath(os.path.join(START_CWD, value))
    return value


# --- the record format ------------------------------------------------------


def encode(record: Mapping[str, object], size: int | None = SLOT) -> bytes:
    """A record as bytes: its JSON, a line with the JSON's CRC-32, and (with
    ``size``) spaces up to that size. :class:`ValueError` when it does not
    fit."""
    import json  # here: a process that only pins never needs it

    return frame(json.dumps(record, sort_keys=True, separators=(",", ":")).encode(), size)


def frame(body: bytes, size: int | None = None) -> bytes:
    """A record's JSON ``body`` framed as :func:`decode` reads it: a line
    with its CRC-32 after it, and (with ``size``) spaces up to that size."""
    data = body + b"\n" + f"crc32={zlib.crc32(body):08x}\n".encode()
    if size is None:
        return data
    if len(data) > size:
        raise ValueError(f"a record of {len(data)} bytes does not fit in {size}")
    return data.ljust(size, b" ")


#: The keys whose values are CPU lists: written as ranges (``"0-999"``)
#: when a record would outgrow one slot; a reader takes either form.
CPU_KEYS = frozenset({"cpus", "process_mask"})


def compact(value: object) -> object:
    """``value`` with every CPU list (under :data:`CPU_KEYS`) as ranges."""
    if isinstance(value, dict):
        return {
            k: format_cpulist(v)
            if k in CPU_KEYS and isinstance(v, (list, tuple, frozenset, set))
            else compact(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def fit(record: Mapping[str, object]) -> bytes:
    """A record framed in as few :data:`SLOT`-byte slots as hold it: as
    :func:`encode` gives it where it fits one slot, else with its CPU lists
    as ranges (a process mask of 1,000 CPUs is then ``"0-999"``, not 4 KiB
    of numbers). :class:`ValueError` past :data:`MAX_SIZE`, the most a
    reader reads, so that the writer never writes what readers refuse."""
    import json

    data = encode(record, None)
    if len(data) > SLOT:
        data = frame(
            json.dumps(
                compact(dict(record)), sort_keys=True, separators=(",", ":"), ensure_ascii=False
            ).encode()
        )
    if len(data) > MAX_SIZE:
        raise ValueError(
            f"a record of {len(data)} bytes is larger than {MAX_SIZE}, the most a reader reads"
        )
    return data.ljust(-(-len(data) // SLOT) * SLOT, b" ")


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a number out of range")
    return value


def _small_int(text: str) -> int:
    if len(text) > 20:
        raise ValueError("a number of more than 20 digits")
    return int(text)


class Unframed(ValueError):
    """Bytes that are no whole framed record or slot: torn by a write that
    raced the read, or never one. A reader reads such a file again; bytes
    whose checksum matches but whose content is refused are whole, and are
    refused at once."""


def _unframe(chunk: bytes) -> bytes:
    """The JSON of a framed record or slot (its first line), checked against
    the CRC-32 on the line after it; :class:`Unframed` otherwise."""
    body, _, rest = chunk.partition(b"\n")
    check = rest[:15]
    if not check.startswith(b"crc32=") or not body.strip(b" \0"):
        raise Unframed("no record (an empty or foreign file)")
    try:
        crc = int(check[6:14], 16)
    except ValueError:
        raise Unframed("a bad checksum line") from None
    if zlib.crc32(body) != crc:
        raise Unframed("the checksum does not match (torn or edited)")
    return body


def _loads(body: bytes) -> object:
    import json

    try:
        return json.loads(
            body, parse_constant=_no_constant, parse_float=_finite, parse_int=_small_int
        )
    except (ValueError, RecursionError):
        raise ValueError("not JSON (or numbers out of range, or nested too deep)") from None


def decode(raw: bytes) -> dict[str, object]:
    """The record in ``raw``, checked; :class:`ValueError` with a short
    reason for anything else (torn, foreign, malformed). Strict JSON only:
    no NaN or Infinity, no number of more than 20 digits, no nesting deep
    enough to exhaust the parser; nothing in ``raw`` raises anything else.

    A process record may have pin slots after its head (``"slots":
    [offset, size, count]``): each is blank or one pin framed as the head
    is, with its own CRC-32; their pins join the head's ``pins``."""
    record = _loads(_unframe(raw))
    if not isinstance(record, dict) or type(record.get("version")) is not int:
        raise ValueError(f"not a version-{VERSION} record")
    if record["version"] != VERSION:
        raise ValueError(f"not a version-{VERSION} record")
    if "slots" in record:
        _read_slots(raw, record)
    return record


def _read_slots(raw: bytes, record: dict[str, object]) -> None:
    layout = record.pop("slots")
    if (
        not isinstance(layout, list)
        or len(layout) != 3
        or any(type(v) is not int for v in layout)
        or not 0 < layout[0] <= MAX_SIZE
        or not 64 <= layout[1] <= SLOT
        or not 0 <= layout[2] <= MAX_SIZE // 64
        or layout[0] + layout[1] * layout[2] > MAX_SIZE
    ):
        raise ValueError("slots is not an offset, a size and a count within the file")
    offset, size, count = layout
    if offset + size * count > len(raw):
        # a head read whole, a file not yet grown to it: a racing write, or no record
        raise Unframed("slots run past the end of the file")
    pins = record.get("pins")
    if not isinstance(pins, list):
        raise ValueError("pins is not a list")
    by_tid: dict[object, object] = {}
    for at in range(offset, offset + size * count, size):
        chunk = raw[at : at + size]
        if not chunk.strip(b" \0"):
            continue
        pin = _loads(_unframe(chunk))
        if not isinstance(pin, dict):
            raise ValueError("a pin is not an object")
        by_tid[pin.get("tid")] = pin
    if by_tid:
        # A pin is in one place; while the head is rewritten it may show in
        # both for an instant, and its slot is the newer.
        pins[:] = [p for p in pins if not isinstance(p, dict) or p.get("tid") not in by_tid]
        pins.extend(by_tid.values())


class Pinned(NamedTuple):
    """One registered pin of a process."""

    tid: int
    name: str
    cpus: frozenset[int]
    role: str


def open_lock_dir(where: str) -> int:
    """The lock directory, opened as a directory without following a
    symbolic link in its last component (as :func:`cpupin.claim_gpus` opens
    it); ``OSError`` with a sentence otherwise."""
    try:
        return os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(where):
            raise OSError(
                exc.errno,
                f"the lock directory {printable(where, 120)} is a symbolic link: name the "
                "directory it points to",
            ) from None
        raise OSError(
            exc.errno,
            f"cannot open the lock directory {printable(where, 120)}: {exc.strerror}",
        ) from None


def _names(pid: int, started: int) -> list[str]:
    """The names this process's record may take: its own, then a few
    others for when another user squats the first (readers accept each)."""
    base = f"cpupin-proc-{pid}-{started}"
    return [f"{base}.json", *(f"{base}-{i}.json" for i in range(1, 4))]
