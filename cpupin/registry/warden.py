"""The warden: a dead holder's CPUs put back without waiting for anyone.

A wake-latency hold through sysfs outlives the process that wrote it, so it
is journaled before its write (:mod:`cpupin.registry.holds`), and whoever
takes the journal's lock next (a hold, a release, ``cpupin ps --prune``)
puts back what a dead holder left. On a host where nothing takes that lock
again, that next time may never come. So a process's first sysfs hold on a
root starts a warden: a Python started isolated (``-I``) on :func:`run`,
in a session of its own (the terminal's signals that end the holder do not
reach it). It waits, writing nothing, for one of two things:

- the holder ends, however it ends (``SIGKILL``, the OOM killer, a crash):
  a pidfd says so exactly, opened and checked against the holder's start
  time, so a later process under the same pid is never taken for it;
- the holder gives up its last hold on that root: it says so on the pipe
  whose read end is the warden's stdin, and closes it. A pipe closed
  unsaid is a holder dying (its files close a moment before it has ended:
  the warden then waits for that end) or one that exec'd and lives on.

When the holder has ended, the warden settles that root's wake journal
under its lock (what ``cpupin ps --prune`` does for it), says what it put
back on the stderr it was given (the holder's), and exits; when the holder
only let go, it exits. The holder's record names the warden's pid, so
``cpupin ps`` shows it beside the hold.

``CPUPIN_WARDEN=0`` starts none: the journal's lazy settling is then the
only one, as it also is when the warden itself is killed (a container, or
a systemd unit stopped with every process of its cgroup)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["main", "release", "run", "watch"]

#: ``CPUPIN_WARDEN=0`` starts no warden.
ENV = "CPUPIN_WARDEN"

_lock = threading.Lock()
#: (root, lock directory) -> the warden, the write end of its pipe, and how
#: many holds it watches (it exits when the last is released).
_wardens: dict[tuple[str, str], list[Any]] = {}
#: Every warden pid this process started -> its (root, lock directory): a
#: hold names the warden it was given, which may since have been replaced.
_keys: dict[int, tuple[str, str]] = {}


def watch(root: str, directory: str | None = None) -> int | None:
    """This process's warden for the wake journal of ``root`` (started
    unless one runs), counting one more hold it watches: its pid, or
    ``None`` when ``CPUPIN_WARDEN=0`` or it could not start (the journal's
    lazy settling then stands alone). Each pid returned is given back with
    :func:`release` once."""
    import subprocess

    from cpupin.host._proc import own_start
    from cpupin.registry._record import lock_dir

    if os.environ.get(ENV) == "0" or not sys.executable:
        return None
    where = lock_dir(directory)
    with _lock:
        known = _wardens.get((root, where))
        if known is not None and known[0].poll() is None:
            known[2] += 1
            return int(known[0].pid)
        start = own_start()
        if not start:
            return None  # no /proc to tell this process from a later one
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        read_end, write_end = os.pipe()  # neither inherited by what this process execs
        try:
            argv = [package, str(os.getpid()), str(start), root, where]
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, *argv],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError):  # no process to be had: the lazy settle
            os.close(write_end)
            return None
        finally:
            os.close(read_end)
        if known is not None:  # it died: its holds pass to this one
            os.close(known[1])
        _wardens[(root, where)] = [proc, write_end, 1 + (known[2] if known else 0)]
        _keys[proc.pid] = (root, where)
        return proc.pid


def release(pid: int) -> None:
    """One hold that warden ``pid`` (or the one that replaced it) watches
    was released, or never made; after the last, the warden exits (waited
    for, so that it leaves no zombie behind)."""
    with _lock:
        key = _keys.get(pid)
        known = None if key is None else _wardens.get(key)
        if key is None or known is None:
            return
        known[2] -= 1
        if known[2] > 0:
            return
        del _wardens[key]
        for gone in [p for p, k in _keys.items() if k == key]:
            del _keys[gone]
    proc, write_end, _ = known
    try:
        os.write(write_end, b"released\n")  # a dying holder's pipe closes too, but says nothing
    except OSError:
        pass
    os.close(write_end)
    try:
        proc.wait(timeout=10)
    except Exception:  # noqa: BLE001 - still ending: Python reaps it at the next subprocess
        pass


def _after_fork_in_child() -> None:
    # The parent's wardens watch the parent: a child closes its copies of
    # their pipes (else a parent's release would not end them while the
    # child lives) and starts its own with its first hold.
    global _lock
    _lock = threading.Lock()
    for _proc, write_end, _ in _wardens.values():
        try:
            os.close(write_end)
        except OSError:
            pass
    _wardens.clear()
    _keys.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: The warden's first lines, run isolated (``-I``: never a module from the
#: working directory or ``PYTHONPATH``, which the root that holds may not
#: own): cpupin from where the holder imported it, at the end of the path.
_BOOT = (
    "import sys; sys.path.append(sys.argv[1]); "
    "from cpupin.registry.warden import run; run(sys.argv[2:])"
)


def _wait(pid: int, start: int) -> bool:
    """Wait until the holder ends (True) or says on the pipe that it let
    go (False)."""
    from cpupin.host._proc import exited

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # a kernel or Python without pidfds: the pipe alone
        pidfd = -1
    try:
        if exited(pid, start):  # the pid already names another process, or none
            return True
        poller = select.poll()
        poller.register(0, select.POLLIN)
        if pidfd >= 0:
            poller.register(pidfd, select.POLLIN)
        released = False
        while True:
            for fd, _events in poller.poll():
                if fd == pidfd:
                    return True
                if os.read(0, 256):
                    released = True  # what release() writes before it closes the pipe
                    continue
                if released:
                    return False
                # Closed unsaid: the holder is dying (its files close before it
                # ends, and until it has ended the journal counts it alive) or
                # exec'd (it lives on): wait for its end.
                if pidfd >= 0:
                    poller.unregister(0)
                    break
                while not exited(pid, start):
                    time.sleep(0.1)
                return True
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    """``PID START ROOT LOCK_DIR``, the pipe on stdin: see the module."""
    try:
        pid, start, root, where = int(argv[0]), int(argv[1]), argv[2], argv[3]
    except (IndexError, ValueError):
        print("cpupin warden: started with PID START ROOT LOCK_DIR by cpupin", file=sys.stderr)
        return 2
    # SIGTERM (a unit or a container stopping) ends the wait as the
    # holder's end would: the settle puts back only what the dead held.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)  # even where it came ignored (a background job)
    try:
        ended = _wait(pid, start)
    except SystemExit:  # SIGTERM, SIGINT
        ended = True
    if not ended:
        return 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the settle runs to its end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from cpupin.registry.holds import settle_root

        lines = settle_root(root, where)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        from cpupin.registry._files import reason

        why = reason(exc) or type(exc).__name__
        lines = [f"the wake journal of {root} was not settled: {why}"]
    try:
        for line in lines:
            print(f"cpupin warden: {line}", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):  # the holder's stderr went with it: the settle stands
        pass
    return 0


def run(argv: list[str]) -> None:
    """:func:`main`, then out at once: an interpreter's teardown would keep
    the holder's release waiting ten times longer than the warden's work."""
    os._exit(main(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
