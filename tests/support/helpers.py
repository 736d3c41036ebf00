"""Small helpers the tests share: oracles read from /proc in plain Python."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager


def proc_schedstat(tid, pid="self"):
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return tuple(int(x) for x in f.read().split())


def proc_last_cpu(tid, pid="self"):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2 :].split()[36])


def proc_comm(tid, pid="self"):
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().rstrip("\n")


def proc_tids(pid="self"):
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


# The read syscall's number, for kernels that show no wchan.
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63", "ppc64le": "3", "s390x": "3"}.get(
    os.uname().machine
)


def blocked_in_pipe_read(tid):
    """Whether the thread sleeps in a pipe read, not on the GIL or a lock."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            wchan = f.read()
        with open(f"/proc/self/task/{tid}/syscall") as f:
            syscall = f.read().split()[0]
    except OSError:
        return False
    return wchan.endswith("pipe_read") or (wchan == "0" and syscall == _READ_SYSCALL)


@contextmanager
def parked_threads(count, name="parked"):
    """``count`` threads asleep in a pipe read; yields their tids.

    Each is known to be asleep in the kernel (not waiting for the GIL), so
    its schedstat cannot change until it is released.
    """
    read, write = os.pipe()
    tids = []
    lock = threading.Lock()

    def park():
        with lock:
            tids.append(threading.get_native_id())
        os.read(read, 1)

    threads = [threading.Thread(target=park, name=f"{name}-{i}") for i in range(count)]
    for t in threads:
        t.start()
    try:
        for _ in range(100000):
            if len(tids) == count and all(blocked_in_pipe_read(t) for t in tids):
                break
            time.sleep(0.0005)
        else:
            raise AssertionError("the parked threads never blocked")
        yield sorted(tids)
    finally:
        os.write(write, b"x" * count)
        for t in threads:
            t.join()
        os.close(read)
        os.close(write)


def in_forked_child(check, uid=None):
    """Whether ``check()`` is true in a forked child of this process (which
    first drops to ``uid``, user and group, when given)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            ok = bool(check())
        except BaseException:  # noqa: BLE001 - the child must exit whatever happens
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"


def run(cmd, env=None, timeout=120):
    """A process run to its end: its CompletedProcess, output as text."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def run_python(code, env=None):
    """The output of ``python -c code`` (dedented), which must exit 0;
    ``env`` adds to this process's environment."""
    out = run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


@contextmanager
def sleeper_on(cpu):
    """A child process asleep on CPU ``cpu`` alone; yields it, kills it after."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.sched_setaffinity(child.pid, {cpu})
        yield child
    finally:
        child.kill()
        child.wait()


def ready_child(code, lock_dir, *args, env=None):
    """A Python child running ``code`` with ``CPUPIN_LOCK_DIR`` at
    ``lock_dir`` (and ``env`` over the rest), text pipes on stdin and
    stdout, once it has printed ``ready`` (its first line)."""
    child = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "CPUPIN_LOCK_DIR": str(lock_dir), **(env or {})},
    )  # fmt: skip
    first = child.stdout.readline()
    if first != "ready\n":
        child.kill()
        raise AssertionError(f"the child said {first!r}, not ready")
    return child


def interruptible():
    """``preexec_fn`` for a child a test interrupts with SIGINT: the child
    starts with SIGINT at its default, as from a terminal, even when the
    suite runs as a background job (whose shell ignores SIGINT, and Python
    then keeps it ignored)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def strays_now(before=frozenset(), ended=()):
    """cpupin.stray_threads() less the tids in ``before``: another test's
    thread in this process (torch's pool, a daemon still ending) may sit on
    a narrower mask already; only what a test starts is its own.

    ``ended``: the native ids of threads the test has joined. Python's
    ``join`` returns when a thread's Python state ends, a moment before the
    kernel removes the thread, so a joined thread on a narrow mask can
    still be listed; wait (at most 30 s) until the kernel has removed each."""
    import time

    import cpupin

    deadline = time.monotonic() + 30
    left = [tid for tid in ended if os.path.exists(f"/proc/self/task/{tid}")]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [tid for tid in left if os.path.exists(f"/proc/self/task/{tid}")]
    assert not left, f"joined threads {left} still listed after 30 s"
    return [info for info in cpupin.stray_threads() if info.tid not in before]
