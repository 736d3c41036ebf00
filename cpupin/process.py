"""The process mask: the CPUs this process may use as a whole.

A thread's own mask changes when it is pinned; the process mask does not. It
is recorded once, at import, from the main thread (whose tid is the pid), so
that importing cpupin from a thread that is already pinned, or pinning any
thread later, never changes it. A child started with :func:`cpupin.child_env`
takes it from ``CPUPIN_PROCESS_CPUS`` instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import _native
from ._proc import start_time
from .cpulist import cpus_phrase, format_cpulist, parse_cpulist
from .errors import excerpt

if TYPE_CHECKING:
    from .registry import Record, Registry


def _log() -> Any:
    import logging  # on the rare paths that log: importing it costs 4 ms

    return logging.getLogger("cpupin")


__all__ = [
    "BINDING_VARS",
    "ENV_PROCESS_CPUS",
    "binding_in",
    "parse_environ",
    "read_environ",
    "environ_of",
    "process_cpus",
    "process_mask_of",
    "registry_of",
    "set_process_cpus",
    "start_time",
    "thread_masks",
]

_lock = threading.Lock()


def _record() -> frozenset[int] | None:
    if not _native.HAVE_AFFINITY:
        return None
    try:
        return _native.get_affinity(os.getpid())
    except OSError:
        # The main thread has exited (a zombie leader): the caller's mask.
        return _native.get_affinity(0)


#: The environment variable that carries the process mask to a child.
ENV_PROCESS_CPUS = "CPUPIN_PROCESS_CPUS"


def _inherit() -> frozenset[int] | None:
    """The mask a parent passed in ``CPUPIN_PROCESS_CPUS``, when it applies.

    It never widens the mask a launcher gave: it applies when the main
    thread's mask is that mask already, or when the main thread's mask is
    exactly a pin that the parent process registered (a child started from
    a pinned thread inherits the pin, and would otherwise take it for its
    whole mask): the main thread then moves to it. A mask set by
    ``taskset``, ``numactl``, a container or a scheduler wins; the variable
    is then set aside, with a note at debug level."""
    text = os.environ.get(ENV_PROCESS_CPUS)
    if text is None or not _native.HAVE_AFFINITY:
        return None
    try:
        cpus = parse_cpulist(text)
        current = _native.get_affinity(os.getpid())
    except (ValueError, OSError) as exc:
        _log().warning("cpupin: %s=%s not used: %s", ENV_PROCESS_CPUS, excerpt(text), exc)
        return None
    if current == cpus:
        return cpus
    from . import registry

    if not (current < cpus and registry.parent_pinned_to(current)):
        _log().debug(
            "cpupin: %s=%s set aside: this process was started on CPU %s, which is not a pin "
            "of its parent's; the launcher's mask wins",
            ENV_PROCESS_CPUS,
            excerpt(text),
            format_cpulist(current),
        )
        return None
    try:
        _native.set_affinity(cpus, os.getpid())
    except (ValueError, OSError) as exc:
        _log().warning("cpupin: %s=%s not used: %s", ENV_PROCESS_CPUS, excerpt(text), exc)
        return None
    return cpus


_process_cpus: frozenset[int] | None = _inherit() or _record()


# This process's registered pins (tid to CPUs): cpupin.threads, which keeps
# them, installs its reader here, so that the modules that size pools read
# them without importing it (it imports them).
_own_pins: Callable[[], Mapping[int, frozenset[int]]] = dict


def own_pinned_cpus() -> frozenset[int]:
    """The CPUs this process's registered pins hold."""
    return frozenset().union(*_own_pins().values())


def process_cpus() -> frozenset[int]:
    """The CPUs this process may use as a whole (recorded at import).

    New threads started through cpupin return here; plans and pools are
    sized from it. :func:`set_process_cpus` overrides it.
    """
    cpus = _process_cpus
    if cpus is None:
        raise _native.UnsupportedPlatform("process_cpus()")
    return cpus


def set_process_cpus(cpus: Iterable[int] | str) -> frozenset[int]:
    """Override the recorded process mask, for a runtime that knows better.

    Takes CPU numbers or a list such as ``"0-15"``; each must be online.
    Affects what cpupin treats as the whole process, not any thread's mask.
    The process's record says so, so that ``cpupin threads`` and ``audit``
    see the same mask from outside. Returns the new mask.
    """
    wanted = _native.cpu_set(cpus)
    if not wanted:
        raise ValueError("an empty process mask: give at least one online CPU")
    online = _native.online_cpus(refresh=True)
    if not wanted <= online:
        raise ValueError(
            f"{cpus_phrase(wanted - online, 'is')} not online: the online CPUs are "
            f"{format_cpulist(online)}"
        )
    global _process_cpus
    with _lock:
        _process_cpus = wanted
    from .registry import describe_process

    describe_process(mask=wanted)  # so that the outside view agrees
    return wanted


def thread_masks(
    pid: int | None = None, *, last_cpu: bool = False
) -> list[tuple[_native.ThreadStat, frozenset[int]]]:
    """Every thread of a process (``None``: this one) with its CPU mask, in
    tid order. A thread that exits between the two reads is left out
    (``ProcessLookupError`` for it alone); any other error is raised."""
    out = []
    for st in _native.thread_stats(pid, last_cpu=last_cpu):
        try:
            out.append((st, _native.get_affinity(st.tid)))
        except ProcessLookupError:
            continue
    return out


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


def _launcher_view(pid: int, threads: frozenset[int]) -> frozenset[int] | None:
    """The CPUs the launcher gave ``pid``: its cgroup's cpuset within the
    online CPUs, within its parent's mask when that covers the CPUs of
    every thread (``threads``: the parent started it there)."""
    from ._sysfs import Reader
    from .cgroup import read_cgroup

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
    from . import registry

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
        found = registry.read_registry(where)
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
