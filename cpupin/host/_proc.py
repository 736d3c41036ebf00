"""Facts about a task read from ``/proc``: when it started and as whom it
runs. A pid or tid names another task once its own is gone; its start time
tells them apart."""

from __future__ import annotations

import os


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"


#: The working directory when cpupin was imported, against which a relative
#: ``CPUPIN_LOCK_DIR`` is resolved (see cpupin.registry.lock_dir): a runtime
#: that changes directory later still meets its peers in the same place.
START_CWD = _cwd()

__all__ = ["argv_of", "descendants", "euid_of", "exited", "own_start", "start_time"]


def start_time(pid: int, tid: int | None = None) -> int | None:
    """When a process (or, with ``tid``, a thread of it) started, in clock
    ticks since boot (field 22 of ``stat``); ``None`` when it is gone.

    A pid or tid is reused once its task is gone; the pair (id, start time)
    is not, so comparing it tells a task from a later one of the same id.
    ``pid`` 0 is this process (``/proc/self``), whose ``task`` folder holds
    only its own threads.
    """
    where = "self" if pid == 0 else str(pid)
    path = f"/proc/{where}/stat" if tid is None else f"/proc/{where}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            text = f.read(4096)
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def argv_of(pid: int, limit: int = 4096) -> list[str]:
    """A process's command line (``/proc/<pid>/cmdline``, its first
    ``limit`` bytes, at most 64 words; a title a process set is its first
    word), undecodable bytes replaced; empty when it is gone or has none (a
    kernel thread). Not yet printable: callers quote it through
    :func:`cpupin.errors.printable`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(limit).split(b"\0")
    except OSError:
        return []
    return [w.decode("utf-8", "replace") for w in words if w][:64]


def own_start() -> int:
    """When this process started (0 if ``/proc`` cannot say): with its pid,
    the name a journal gives an owner that no later process can take."""
    return start_time(0) or 0


def euid_of(pid: int) -> int | None:
    """The effective uid a process runs as (``/proc/<pid>/status``);
    ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(16384).splitlines():
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def exited(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` has exited:
    gone, replaced by another of the same pid, or a zombie (killed and not
    yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096)
    except OSError:
        return True
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[0] in (b"Z", b"X") or int(fields[19]) != started
    except (IndexError, ValueError):
        return True


#: The most descendants :func:`descendants` lists (``threads --tree``).
MAX_TREE = 256


def descendants(pid: int) -> list[tuple[int, int]]:
    """``pid``'s descendants as (pid, parent), parents first, read from each
    process's ``stat`` (at most :data:`MAX_TREE`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                text = f.read(4096)
            parent = int(text[text.rfind(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo and len(out) < MAX_TREE:
        parent = todo.pop(0)
        for child in sorted(children.get(parent, [])):
            out.append((child, parent))
            todo.append(child)
    return out[:MAX_TREE]
