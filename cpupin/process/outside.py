"""Another process, read from outside: its environment as it started, the
mask its threads share, and the record it keeps in the host's registry. A
pid names another process once its own is gone: each reader says what it
found for the pid it was given, and a caller that must be sure compares
start times (:func:`cpupin.host._proc.start_time`)."""

from __future__ import annotations

import os

from cpupin import _native
from cpupin.cpulist import format_cpulist, parse_cpulist
from cpupin.errors import excerpt
from cpupin.process.mask import ENV_PROCESS_CPUS

TYPE_CHECKING = False  # typing costs 4 ms at start (cpupin/_records.py)
if TYPE_CHECKING:
    from cpupin.registry.reader import Record, Registry

__all__ = [
    "BINDING_VARS",
    "binding_in",
    "openmp_collapse",
    "environ_of",
    "parse_environ",
    "process_mask_of",
    "read_environ",
    "record_of",
    "registry_of",
]


_ENVIRON_LIMIT = 4 << 20


def environ_of(pid: int, name: str) -> str | None:
    """One variable of another process's environment as it started
    (``/proc/<pid>/environ``, bounded: an environment is at most a quarter
    of the stack limit, 2 MiB by default; past this it counts as unset)."""
    key = name.encode() + b"="
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read(_ENVIRON_LIMIT).split(b"\0"):
                if item.startswith(key):
                    return item[len(key) :].decode("utf-8", "replace")
    except OSError:
        pass
    return None


#: The variables with which an OpenMP runtime binds its threads itself: a
#: process started with one of them has every thread on the CPUs it names
#: (libgomp binds the initial thread when it loads; later threads inherit).
BINDING_VARS = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")


def read_environ(pid: int) -> tuple[dict[str, str] | None, str]:
    """Another process's environment as it started, and a note: empty when
    it read whole; why when it did not (``None``: unreadable, or entirely
    overwritten by the process's title, as ``setproctitle`` does when the
    title is longer than the command line; the variables found when only
    part was overwritten). Bounded as :func:`environ_of`."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(_ENVIRON_LIMIT)
    except OSError as exc:
        return None, f"its environment cannot be read ({exc.strerror})"
    return parse_environ(raw)


def parse_environ(raw: bytes) -> tuple[dict[str, str] | None, str]:
    """An environment block (``NAME=value`` entries, each ending in a NUL)
    and a note, as :func:`read_environ` gives them. What a process title
    leaves where the block was (NULs or spaces, or the title's own text) is
    no entry."""
    entries = [e for e in raw.split(b"\0") if e.strip(b" ")]
    env = {}
    broken = 0
    for item in entries:
        name, eq, value = item.partition(b"=")
        if not eq or not name:
            broken += 1
            continue
        env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    if raw and not env:
        return None, (
            "its environment was overwritten by its process title (setproctitle): its "
            "variables cannot be read from outside"
        )
    if broken:
        return env, "part of its environment was overwritten by its process title"
    return env, ""


def binding_in(env: dict[str, str] | None) -> str:
    """The first OpenMP binding variable set in ``env``, as ``NAME=value``
    (short), or empty."""
    for name in BINDING_VARS:
        value = (env or {}).get(name)
        if value and not (name == "OMP_PROC_BIND" and value.lower() == "false"):
            return f"{name}={excerpt(value, 24)}"
    return ""


def _place_of(cpus: frozenset[int]) -> str:
    """One OpenMP place holding ``cpus``, in libgomp's interval syntax
    (``{0:4,8:4}``: CPUs 0-3 and 8-11)."""
    runs: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0] if ordered else 0
    for cpu in ordered[1:] + [-2]:
        if cpu != prev + 1:
            runs.append(str(start) if prev == start else f"{start}:{prev - start + 1}")
            start = cpu
        prev = cpu
    return "{" + ",".join(runs) + "}"


def openmp_collapse(
    pid: int,
    env: dict[str, str] | None,
    threads: list[tuple[int, frozenset[int]]],
    mask: frozenset[int],
) -> dict[str, object] | None:
    """The finding when an OpenMP binding variable collapsed a process: its
    main thread bound to a few CPUs of its mask (libgomp binds the initial
    thread to the first place as it loads, for ``OMP_PROC_BIND`` other than
    ``false``, ``OMP_PLACES`` or ``GOMP_CPU_AFFINITY`` alike), every thread
    started after it (``threads``: tid and mask) inheriting them while the
    rest of the mask runs none. ``None`` when the main thread has the whole
    mask, or no binding variable explains it. Pure."""
    binding = binding_in(env)
    main = next((m for tid, m in threads if tid == pid), None)
    if not binding or main is None or not main < mask:
        return None
    crowded = sum(1 for _, m in threads if m <= main)
    idle = mask - frozenset().union(*(m for _, m in threads))
    name = binding.partition("=")[0]
    unset = " and ".join(v for v in BINDING_VARS if (env or {}).get(v) and v != "KMP_AFFINITY")
    remedy = (
        f"unset {unset or name} (or set OMP_PROC_BIND=false): it binds the main thread as "
        f"OpenMP loads, and every thread started after it inherits that; to keep OpenMP on "
        f"these CPUs, give it one place of them all: OMP_PLACES='{_place_of(mask)}'"
    )
    if name == "KMP_AFFINITY":
        remedy = "unset KMP_AFFINITY (or KMP_AFFINITY=disabled): " + remedy.partition(": ")[2]
    return {
        "binding": binding,
        "cpus_list": format_cpulist(main),
        "threads": crowded,
        "idle_cpus_list": format_cpulist(idle),
        "what": (
            f"{binding} bound the main thread to CPU {format_cpulist(main)} of the mask "
            f"{format_cpulist(mask)}, and {crowded} thread(s) share it"
            + (f" while CPU {format_cpulist(idle)} runs none" if idle else "")
        ),
        "remedy": remedy,
    }


def _launcher_view(pid: int, threads: frozenset[int]) -> frozenset[int] | None:
    """The CPUs the launcher gave ``pid``: its cgroup's cpuset within the
    online CPUs, within its parent's mask when that covers the CPUs of
    every thread (``threads``: the parent started it there)."""
    from cpupin.host._sysfs import Reader
    from cpupin.host.cgroup import read_cgroup

    try:
        with Reader("/") as r:
            cpuset = read_cgroup(r, str(pid))[0]
    except (OSError, ValueError):
        cpuset = None
    online = _native.online_cpus()
    view = (cpuset or online) & online
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096)
        parent = int(text[text.rfind(b")") + 2 :].split()[1])
        theirs = _native.get_affinity(parent) if parent > 1 else None
    except (OSError, ValueError, IndexError):
        theirs = None
    if theirs is not None and threads <= theirs and theirs & view:
        view &= theirs
    return view or None


def process_mask_of(pid: int, masks: list[frozenset[int]]) -> tuple[frozenset[int], str]:
    """Another process's mask, and where it came from: its
    ``CPUPIN_PROCESS_CPUS`` when set, unless no thread is on that mask and
    its live record names the mask cpupin gave it since (``bind_process``);
    else, when its main thread is on a
    mask narrower than the launcher gave it (its cgroup's cpuset, its
    parent's mask), every thread within that, and an OpenMP binding explains
    it (``GOMP_CPU_AFFINITY`` and the like in its environment, or an
    environment its title overwrote, which hides them: libgomp binds the
    main thread, and every thread started from it inherits the binding),
    the launcher's view; else the widest mask among its threads."""
    text = environ_of(pid, ENV_PROCESS_CPUS)
    if text is not None:
        try:
            started = parse_cpulist(text)
        except ValueError:
            started = None
        if started is not None:
            if any(m == started for m in masks) or not masks:
                return started, f"its {ENV_PROCESS_CPUS}"
            # No thread is on the mask it started with: cpupin moved the
            # process since (bind_process), and its record says where.
            recorded = _recorded_mask(pid)
            if recorded:
                return recorded, "its record (the mask cpupin gave it after it started)"
            return started, f"its {ENV_PROCESS_CPUS}"
    widest = max(masks, key=len, default=frozenset())
    union = frozenset().union(*masks)
    if widest:
        try:
            main = _native.get_affinity(pid)
        except (OSError, ValueError):
            main = widest
        # Read the cgroup only for a main thread narrower than the host.
        launcher = _launcher_view(pid, union) if main < _native.online_cpus() else None
        if launcher is not None and main < launcher and union <= launcher:
            env, note = read_environ(pid)
            binding = binding_in(env)
            if binding or env is None:
                why = f"as {binding} binds it" if binding else f"and {note}"
                return launcher, (
                    f"the launcher's view (cgroup cpuset and parent): its main thread is on "
                    f"{format_cpulist(main)}, narrower, {why}"
                )
    return widest, "the widest mask among its threads"


def _recorded_mask(pid: int) -> frozenset[int]:
    """The process mask a live record of ``pid`` says it has (empty: none)."""
    try:
        found = registry_of(pid, None)
    except (OSError, ValueError):
        return frozenset()
    for record in found.records:
        if record.kind == "process" and record.pid == pid and record.live:
            return record.process_mask
    return frozenset()


def registry_of(pid: int, lock_dirs: list[str] | None) -> Registry:
    """The registry that knows ``pid``: the first of the candidate lock
    directories with a live record of it (else the first one read)."""
    from cpupin.registry import writer as registry
    from cpupin.registry.reader import read_registry

    if lock_dirs is None:
        theirs = environ_of(pid, registry.ENV_LOCK_DIR)
        if theirs and not os.path.isabs(theirs):
            try:  # relative to where it started: its working directory, best known now
                theirs = os.path.join(os.readlink(f"/proc/{pid}/cwd"), theirs)
            except OSError:
                theirs = None
        lock_dirs = [theirs or registry.lock_dir(), registry.lock_dir(), "/tmp"]
    first = None
    for where in dict.fromkeys(lock_dirs):
        found = read_registry(where)
        if found.knows(pid):
            return found
        first = first or found
    assert first is not None
    return first


def record_of(pid: int) -> Record | None:
    """The live process record of ``pid`` (in the lock directories
    :func:`registry_of` looks in), or ``None`` where it keeps none."""
    found = registry_of(pid, None)
    return next((r for r in found.records if r.kind == "process" and r.live and r.pid == pid), None)
