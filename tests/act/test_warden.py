"""The warden (cpupin/registry/warden.py): a holder killed in any way has
its CPUs put back by its warden, with nobody else taking the journal's
lock; a holder that lets go ends its warden and leaves no zombie; a child
it forks never keeps it; a later process under the holder's pid is never
taken for it; a warden killed itself leaves the lazy settle. Fake sysfs
trees, and the real files in a private mount namespace."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpupin
from cpupin.host._proc import exited, own_start, start_time
from cpupin.registry import warden
from cpupin.registry.holds import entries, settle_all
from cpupin.registry.journal import read_journal
from tests.support.helpers import run
from tests.support.wake import (
    NAMESPACE,
    REAL,
    STEPPED_HOLDER,
    namespace_refusal,
    tree,
    values,
)

pytestmark = pytest.mark.xdist_group("host")

#: How long a test waits for a warden to act: it never takes this long
#: (tens of ms on a quiet host); a loaded CI host may take seconds.
PATIENCE_S = 120


def until(done, what):
    """Wait for ``done()``, at most PATIENCE_S: no test asserts a speed."""
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {PATIENCE_S} s"
        time.sleep(0.01)


#: A holder that says its warden's pid, then waits to be killed or let go.
HOLDER = """
import sys
import cpupin
root, cpus = sys.argv[1], sys.argv[2]
hold = cpupin.hold_wake_latency({int(c) for c in cpus.split(",")}, 0, root=root)
print("ready", hold.warden, flush=True)
sys.stdin.readline()
hold.release()
"""


def holder(root, locks, cpus, prefix=(), env=None):
    """A child holding ``cpus`` of ``root`` at 0 µs, stderr kept (its
    warden writes there), and its warden's pid (None: it has none), once
    it says it holds them."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", HOLDER, str(root), cpus],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": str(locks), **(env or {})},
    )  # fmt: skip
    said = proc.stdout.readline().split()
    if said[:1] != ["ready"]:
        proc.kill()
        raise AssertionError(f"the holder said {said}: {proc.stderr.read()}")
    return proc, None if said[1] == "None" else int(said[1])


def shown(locks, pid):
    out = run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval", "0.01",
               "--lock-dir", str(locks)])  # fmt: skip
    assert out.returncode == 0, out.stderr
    (record,) = [p for p in json.loads(out.stdout)["processes"] if p["pid"] == pid]
    return record


def watching(pid):
    """Whether warden ``pid`` waits on its holder's pidfd (up and past its
    start: a signal in the interpreter's own start is the interpreter's)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any("pidfd" in link for link in links)


def parent_of(pid):
    text = Path(f"/proc/{pid}/stat").read_bytes()
    return int(text[text.rfind(b")") + 2 :].split()[1])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGABRT])
def test_a_killed_holder_is_put_back_by_its_warden_alone(tmp_path, sig):
    original = {0: "0", 1: "7", 2: "n/a"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    proc, guard = holder(root, locks, "1,2")
    try:
        assert values(root, [1, 2]) == {1: "n/a", 2: "n/a"}
        assert guard is not None and parent_of(guard) == proc.pid  # the holder started it...
        assert os.getsid(guard) == guard != os.getsid(proc.pid)  # ...in a session of its own
        guard_start = start_time(guard)
        proc.send_signal(sig)
        assert proc.wait(timeout=PATIENCE_S) == -sig
        # Nobody else takes the journal's lock: no hold, no release, no prune.
        until(lambda: values(root, original) == original, "the CPUs put back")
        until(lambda: exited(guard, guard_start), "the warden ended")
        assert entries(read_journal("wake", str(root), str(locks))[0]) == {}
        said = proc.stderr.read()  # the holder's stderr, which the warden had too
    finally:
        proc.kill()
    assert f"cpupin warden: pid {proc.pid}: wake latency of CPU 1 put back to 7" in said, said
    assert f"pid {proc.pid}: wake latency of CPU 2 put back to n/a" in said, said


@pytest.mark.parametrize("phase", ["hold", "release"])
def test_a_holder_killed_at_any_step_is_put_back_by_its_warden(tmp_path, phase):
    """The warden starts before the hold's first journal write: SIGKILL at
    each step of the hold or of its release, and the warden alone puts the
    host's values back and empties the journal."""
    original = {0: "0", 1: "7", 2: "n/a", 3: "250"}

    def go(locks, root, kill_at):
        env = {**os.environ, "CPUPIN_LOCK_DIR": str(locks)}
        # Its warden has the same stderr: run() returns once both are gone.
        return subprocess.run(
            [sys.executable, "-c", STEPPED_HOLDER, str(root), "1,2,3", "0", phase, str(kill_at)],
            env=env, capture_output=True, text=True, timeout=PATIENCE_S,
        )  # fmt: skip

    steps = None
    at = 0
    while steps is None or at < steps:
        at += 0 if steps is None else 1
        root = tree(tmp_path / f"root{at}", original)
        locks = tmp_path / f"locks{at}"
        locks.mkdir()
        out = go(locks, root, at)
        if steps is None:  # the run that counts the steps, killed at none
            assert out.returncode == 0, out.stderr
            steps = int(out.stdout.split()[-1])
            assert steps >= 2, steps  # the journal, then each CPU not yet at the bound
            continue
        assert out.returncode == -signal.SIGKILL, (at, out.stderr)
        until(
            lambda root=root: values(root, original) == original,
            f"step {at} of the {phase} put back (said: {out.stderr[-600:]!r})",
        )
        assert entries(read_journal("wake", str(root), str(locks))[0]) == {}, at


def test_ps_shows_a_holds_warden_while_it_holds(tmp_path):
    # CPU 0 alone: ps takes a record's CPUs only where this host has them.
    root = tree(tmp_path / "root", {0: "7"})
    locks = tmp_path / "locks"
    locks.mkdir()
    proc, guard = holder(root, locks, "0")
    try:
        (hold,) = shown(locks, proc.pid)["wake_holds"]
        assert hold["warden"] == guard
        text = run([sys.executable, "-m", "cpupin", "ps", "--lock-dir", str(locks),
                    "--interval", "0.01"]).stdout  # fmt: skip
        assert "holds CPUs 0: no wake latency (pm_qos_resume_latency_us) since " in text
        assert f", warden pid {guard}\n" in text
        proc.stdin.write("\n")  # let go
        proc.stdin.close()
        assert proc.wait(timeout=PATIENCE_S) == 0
        assert not os.path.exists(f"/proc/{guard}")  # reaped by the holder as it let go
        assert proc.stderr.read() == ""
        assert values(root, [0]) == {0: "7"}
    finally:
        proc.kill()


def test_a_released_hold_ends_its_warden_and_leaves_no_zombie(tmp_path, monkeypatch):
    original = {0: "0", 1: "7", 2: "8"}
    root = tree(tmp_path / "root", original)
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    first = cpupin.hold_wake_latency({1}, 0, root=str(root))
    second = cpupin.hold_wake_latency({2}, 5, root=str(root))
    try:
        guard = first.warden
        assert guard is not None and second.warden == guard  # one a root
        assert first.as_record()["warden"] == guard
        assert parent_of(guard) == os.getpid()
        first.release()
        assert not exited(guard, start_time(guard) or -1)  # the second still holds
        assert values(root, [1, 2]) == {1: "7", 2: "5"}
    finally:
        first.release()
        second.release()
    # Waited for: gone from /proc, not a zombie of this process.
    assert not os.path.exists(f"/proc/{guard}")
    assert values(root, original) == original


def test_no_warden_when_asked_for_none(tmp_path, monkeypatch):
    root = tree(tmp_path / "root", {0: "0", 1: "7"})
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CPUPIN_WARDEN", "0")
    with cpupin.hold_wake_latency({1}, 0, root=str(root)) as hold:
        assert hold.warden is None and "warden" not in hold.as_record()


def test_a_forked_child_never_keeps_its_parents_warden(tmp_path, monkeypatch):
    root = tree(tmp_path / "root", {0: "0", 1: "7"})
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    hold = cpupin.hold_wake_latency({1}, 0, root=str(root))
    guard = hold.warden
    assert guard is not None
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child holds nothing and lives on while its parent lets go
        try:
            os.close(go_w)
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        os.close(go_r)
        hold.release()
        assert not os.path.exists(f"/proc/{guard}")  # ended with the child still alive
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)


def warden_of(pid, start, root, locks):
    """The warden as a holder starts it, by hand: its pipe's write end too."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpupin.registry.warden", str(pid), str(start), str(root),
         str(locks)],
        stdin=read_end, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(read_end)
    return proc, write_end


def test_a_later_process_under_the_holders_pid_is_never_taken_for_it(tmp_path):
    """The pid alone names whoever has it now: with another start time, the
    holder is gone, and the warden settles at once; with this process's own,
    it waits, and the holder's word that it let go ends it settling nothing."""
    original = {0: "0", 1: "7"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    dead, none = holder(root, locks, "1", env={"CPUPIN_WARDEN": "0"})
    assert none is None
    dead.kill()
    dead.wait()
    assert values(root, [1]) == {1: "n/a"}
    # "This process, started at another time": a holder that is gone.
    proc, write_end = warden_of(os.getpid(), own_start() + 1, root, locks)
    try:
        assert proc.wait(timeout=PATIENCE_S) == 0, proc.stderr.read()
    finally:
        os.close(write_end)
    assert values(root, original) == original  # the dead holder's CPU, put back
    dead, _ = holder(root, locks, "1", env={"CPUPIN_WARDEN": "0"})
    dead.kill()
    dead.wait()
    proc, write_end = warden_of(os.getpid(), own_start(), root, locks)
    ready = select.poll()
    ready.register(proc.stderr, select.POLLIN)
    assert ready.poll(300) == [] and proc.poll() is None  # this process lives: it waits
    os.write(write_end, b"released\n")  # as release() says it
    os.close(write_end)
    assert proc.wait(timeout=PATIENCE_S) == 0
    assert proc.stderr.read() == ""
    assert values(root, [1]) == {1: "n/a"}  # a holder that let go: nothing settled
    settle_all(str(locks))
    assert values(root, original) == original


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_warden_killed_itself_leaves_the_lazy_settle(tmp_path, sig):
    """SIGTERM (a unit stopping) or SIGINT ends a warden quietly: it settles
    what the dead held (nothing, its holder lives) and exits; the holder
    keeps its hold, and once the holder is killed too, the journal's next
    settle puts it back."""
    original = {0: "0", 1: "7"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    proc, guard = holder(root, locks, "1")
    try:
        guard_start = start_time(guard)
        until(lambda: watching(guard), "the warden up")
        os.kill(guard, sig)
        until(lambda: exited(guard, guard_start), "the warden ended")
        assert values(root, [1]) == {1: "n/a"}  # its holder lives: held still
    finally:
        proc.kill()
        proc.wait()
    assert values(root, [1]) == {1: "n/a"}  # no warden: left for the next settle
    assert proc.stderr.read() == ""  # the warden's stderr too: no traceback
    settle_all(str(locks))
    assert values(root, original) == original


def test_a_warden_refuses_arguments_it_was_not_started_with():
    out = run([sys.executable, "-m", "cpupin.registry.warden", "x"])
    assert out.returncode == 2 and out.stderr == (
        "cpupin warden: started with PID START ROOT LOCK_DIR by cpupin\n"
    )
    assert warden.main(["1", "2"]) == 2


def test_a_real_holder_killed_is_put_back_by_its_warden(tmp_path):
    """The kernel's own files, in a mount namespace where cpuidle names a
    driver: the holder and its warden write the real
    pm_qos_resume_latency_us; SIGKILL the holder, and the warden alone puts
    back what the host had."""
    why = namespace_refusal()
    if why:
        pytest.skip(why)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before = {c: Path(REAL.format(c)).read_text().strip() for c in cpus}
    locks = tmp_path / "locks"
    locks.mkdir()
    prefix = ["unshare", "-m", "sh", "-c", NAMESPACE, "holder"]
    try:
        proc, guard = holder("/", locks, ",".join(map(str, cpus)), prefix)
        assert guard is not None
        assert {Path(REAL.format(c)).read_text().strip() for c in cpus} == {"n/a"}
        proc.kill()  # unshare's sh execs the holder: the kill is the holder's
        proc.wait()
        until(
            lambda: {c: Path(REAL.format(c)).read_text().strip() for c in cpus} == before,
            "the real files put back",
        )
        assert "cpupin warden: pid" in proc.stderr.read()
    finally:
        for c, text in before.items():
            Path(REAL.format(c)).write_text(text)
