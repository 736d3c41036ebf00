"""The wake-latency hold as a transaction (issue 34): a holder killed at
every step leaves nothing changed once settled; the value put back is the
host's, never a dead holder's; two holders at once share a CPU under one
lock; a dead holder's holds are visible until put back. Fake sysfs trees
for the many inputs, and the real files, in a private mount namespace,
for the kernel's own answers."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import cpupin
from cpupin.act import wake
from cpupin.registry.holds import entries, settle_all
from cpupin.registry.journal import read_journal
from tests.support.helpers import run
from tests.support.wake import (
    NAMESPACE,
    REAL,
    cpuidle_refusal,
    namespace_refusal,
    tree,
    values,
)
from tests.support.wake import (
    STEPPED_HOLDER as CHILD,
)

# The host's own PM QoS and interrupts: with pytest-xdist, these tests run
# one at a time on one worker, never beside another that reads or sets them.
pytestmark = pytest.mark.xdist_group("host")


#: The holders these tests kill: no warden (tests/act/test_warden.py has
#: its own), so that what a dead holder leaves stays until the journal's
#: next settle, the lazy path every holder still has when its warden is
#: killed with it.
NO_WARDEN = {"CPUPIN_WARDEN": "0"}


def child(args, lock_dir, prefix=(), **kw):
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(lock_dir), **NO_WARDEN}
    return subprocess.run([*prefix, sys.executable, "-c", CHILD, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120, **kw)  # fmt: skip


def holding(root, locks, cpus):
    """A child holding ``cpus`` (a CPU list) of ``root`` at 0 µs, once it
    says it holds them; the test kills it or lets it go."""
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(locks), **NO_WARDEN}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), cpus, "0", "wait", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    return proc


def killed(proc):
    """SIGKILL: no release, no exit handler."""
    proc.kill()
    proc.wait()
    return proc


def kill_points(phase, cpus, run_child):
    """Every step of ``phase``, counted by a run that is not killed."""
    done = run_child(phase, 0)
    assert done.returncode == 0, done.stderr
    return range(1, int(done.stdout.split()[-1]) + 1)


@pytest.mark.parametrize("held", [[1], [1, 2], [0, 2, 3]])
@pytest.mark.parametrize("phase", ["hold", "release"])
def test_a_holder_killed_at_any_step_leaves_nothing_once_settled(tmp_path, held, phase):
    original = {0: "0", 1: "7", 2: "n/a", 3: "250"}
    points = None
    for case in range(64):
        root = tree(tmp_path / f"root{case}", original)
        locks = tmp_path / f"locks{case}"
        locks.mkdir()
        cpus = ",".join(map(str, held))

        def go(phase_, kill_at, root=root, locks=locks, cpus=cpus):
            return child([root, cpus, 0, phase_, kill_at], locks)

        if points is None:
            points = kill_points(phase, held, go)
            assert len(points) >= 2  # a journal write, then each CPU not already at the bound
            points = list(points)
        if not points:
            break
        at = points.pop(0)
        out = go(phase, at)
        assert out.returncode == -signal.SIGKILL, (at, out.stderr)
        changed = {c for c, v in values(root, original).items() if v != original[c]}
        journal = entries(read_journal("wake", str(root), str(locks))[0])
        # Whatever was changed is named in the journal with the host's value.
        assert changed <= set(journal), (phase, at, changed, journal)
        assert all(journal[c].original == original[c] for c in journal)
        shown = run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval", "0.01",
                     "--lock-dir", str(locks)])  # fmt: skip
        applied = {c["cpu"] for c in json.loads(shown.stdout)["still_applied"]}
        assert changed <= applied, (changed, applied)
        lines = settle_all(str(locks))
        assert values(root, original) == original, (phase, at, lines)
        assert entries(read_journal("wake", str(root), str(locks))[0]) == {}


@pytest.mark.parametrize("overlap", [[1, 2], [2, 3], [1, 2, 3]])
@pytest.mark.parametrize("bound", [0, 30])
@pytest.mark.parametrize("prune_first", [False, True])
def test_the_value_put_back_is_the_hosts_never_a_dead_holders(
    tmp_path, monkeypatch, overlap, bound, prune_first
):
    """A server restarted after SIGKILL holds the same CPUs before anyone
    prunes; a prune meanwhile must not write under the live hold."""
    original = {0: "0", 1: "7", 2: "8", 3: "9"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(locks))
    killed(holding(root, locks, "1,2"))
    assert values(root, [1, 2]) == {1: "n/a", 2: "n/a"}
    hold = cpupin.hold_wake_latency(set(overlap), bound, root=str(root))
    try:
        want = "n/a" if bound == 0 else str(bound)
        assert all(values(root, overlap)[c] == want for c in overlap)
        if prune_first:
            settle_all(str(locks))
            assert all(values(root, overlap)[c] == want for c in overlap)  # not under a live hold
        left = {1, 2} - set(overlap)
        if prune_first:
            assert all(values(root, left)[c] == original[c] for c in left)
    finally:
        hold.release()
    settle_all(str(locks))
    assert values(root, original) == original


RACER = """
import sys
import cpupin
root, cpus, max_us = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.stdin.readline()
hold = cpupin.hold_wake_latency({int(c) for c in cpus.split(",")}, max_us, root=root)
print("held " + " ".join(hold.notes), flush=True)
sys.stdin.readline()
hold.release()
print("released", flush=True)
"""


def test_two_holders_at_once_share_under_one_lock(tmp_path):
    """Twelve trials and more of two processes holding the same CPUs at the
    same moment, released in either order: while both live the stricter
    bound holds, and after both the host's values are back."""
    rng = random.Random(34)
    for trial in range(16):
        original = {0: "0", 1: str(rng.randint(1, 99)), 2: rng.choice(["0", "n/a", "5"])}
        root = tree(tmp_path / f"root{trial}", original)
        locks = tmp_path / f"locks{trial}"
        locks.mkdir()
        bounds = [rng.choice([0, 10, 20]), rng.choice([0, 15, 25])]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, str(root), "1,2", str(b)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "CPUPIN_LOCK_DIR": str(locks)},
            )  # fmt: skip
            for b in bounds
        ]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        said = [p.stdout.readline() for p in procs]
        assert all(s.startswith("held") for s in said), said
        assert sum("shared with pid" in s for s in said) == 1, said  # the second knows
        strict = min(bounds)
        assert set(values(root, [1, 2]).values()) == {"n/a" if strict == 0 else str(strict)}
        order = procs if rng.random() < 0.5 else procs[::-1]
        first, second = order
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.stdout.readline() == "released\n"
        other = bounds[procs.index(second)]
        assert set(values(root, [1, 2]).values()) == {"n/a" if other == 0 else str(other)}
        second.stdin.write("\n")
        second.stdin.flush()
        assert second.stdout.readline() == "released\n"
        for p in procs:
            p.wait(timeout=60)
        assert values(root, original) == original, (trial, bounds)


def test_a_killed_holder_is_shown_by_ps_with_its_holds(tmp_path):
    original = {0: "0", 1: "7", 2: "8"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    proc = killed(holding(root, locks, "1,2"))
    args = [sys.executable, "-m", "cpupin", "ps", "--lock-dir", str(locks), "--interval", "0.01"]
    data = json.loads(run([*args, "--json"]).stdout)
    (stale,) = [p for p in data["processes"] if p["pid"] == proc.pid]
    assert not stale["live"] and stale["wake_holds"][0]["cpus"] == [1, 2]
    assert {c["cpu"] for c in data["still_applied"]} == {1, 2}
    text = run(args).stdout
    assert f"CPU 1's wake latency, held by pid {proc.pid} (exited); the host had 7" in text
    assert "still applied; cpupin ps --prune puts it back" in text
    pruned = run([*args, "--prune"])
    assert f"pid {proc.pid}: wake latency of CPU 1 put back to 7" in pruned.stderr
    assert values(root, original) == original
    assert json.loads(run([*args, "--json"]).stdout)["still_applied"] == []


# --- the real files, in a private mount namespace ------------------------------------


@pytest.mark.parametrize("phase", ["hold", "release"])
def test_a_real_holder_killed_at_any_step_is_put_back(tmp_path, phase):
    """The kernel's own files: the holder runs in a mount namespace where
    cpuidle names a driver (this machine may list none), writes the real
    pm_qos_resume_latency_us of this machine's CPUs, and is killed at each
    step; the settle outside puts back what the host had."""
    why = namespace_refusal()
    if why:
        pytest.skip(why)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    prefix = ["unshare", "-m", "sh", "-c", NAMESPACE, "holder"]
    before = {c: Path(REAL.format(c)).read_text().strip() for c in cpus}
    try:
        count = None
        at = 1
        while count is None or at <= count:
            locks = tmp_path / ("counting" if count is None else f"locks{at}")
            locks.mkdir()
            args = ["/", ",".join(map(str, cpus)), 0, phase]
            if count is None:
                out = child([*args, 0], locks, prefix)
                assert out.returncode == 0, out.stderr
                count = int(out.stdout.split()[-1])
                assert count >= len(cpus) + 1
                continue
            out = child([*args, at], locks, prefix)
            assert out.returncode == -signal.SIGKILL, (at, out.stderr)
            settle_all(str(locks))
            assert {c: Path(REAL.format(c)).read_text().strip() for c in cpus} == before, at
            at += 1
    finally:
        for c, text in before.items():
            Path(REAL.format(c)).write_text(text)
    assert wake.holds() == []


# --- cpupin exec --wake-latency: exactly the command's lifetime --------------------

DMA = "/dev/cpu_dma_latency"
READ = "import struct; print(struct.unpack('=i', open('/dev/cpu_dma_latency', 'rb').read(4))[0])"


def dma_now():
    with open(DMA, "rb") as f:
        return int.from_bytes(f.read(4), "little", signed=True)


def _dma_refusal():
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    if os.geteuid() != 0 or not os.access(DMA, os.W_OK):
        return f"{DMA} is not writable here (root, and a host that has it)"
    if cpuidle_refusal():
        return cpuidle_refusal()
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return "unshare -m is refused here"
    return None


def exec_in_namespace(tmp_path, program, bound=0, **kw):
    """``cpupin exec --wake-latency`` in a mount namespace where cpuidle
    names a driver, running ``program`` (shell)."""
    return subprocess.Popen(
        ["unshare", "-m", "sh", "-c", NAMESPACE, "exec",
         sys.executable, "-m", "cpupin", "exec", "--node", "0", "--no-pools",
         "--wake-latency", str(bound), "--", "sh", "-c", program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("bound", [0, 7])
@pytest.mark.parametrize("ending", ["exit 0", "exit 7", "kill -TERM $$", "kill -KILL $$"])
def test_exec_holds_while_the_command_runs_and_its_daemon_holds_nothing(tmp_path, bound, ending):
    """The command starts a daemon (setsid, its own session, stdio closed)
    that outlives it, reads the request while it runs, and ends as asked.
    After: the request is gone though the daemon lives, and cpupin exec
    ends as the command did (its code, or its signal)."""
    why = _dma_refusal()
    if why:
        pytest.skip(why)
    idle = dma_now()
    program = (
        f"setsid sleep 60 </dev/null >/dev/null 2>&1 & echo daemon $!; "
        f'{sys.executable} -c "{READ}"; {ending}'
    )
    proc = exec_in_namespace(tmp_path, program, bound)
    out, err = proc.communicate(timeout=120)
    lines = out.split()
    daemon, held = int(lines[1]), int(lines[2])
    try:
        assert held == bound, err
        expected = {"exit 0": 0, "exit 7": 7}.get(ending)
        if expected is None:
            sig = signal.SIGTERM if "TERM" in ending else signal.SIGKILL
            assert proc.returncode == -sig, err
        else:
            assert proc.returncode == expected, err
        os.kill(daemon, 0)  # the daemon still runs...
        assert dma_now() == idle  # ...and holds nothing
    finally:
        try:
            os.kill(daemon, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_exec_passes_signals_on_and_shows_its_hold_in_ps(tmp_path):
    why = _dma_refusal()
    if why:
        pytest.skip(why)
    program = "trap 'echo got TERM; exit 3' TERM; echo ready; while :; do sleep 0.05; done"
    proc = exec_in_namespace(tmp_path, program, 0)
    try:
        assert proc.stdout.readline() == "ready\n"
        data = json.loads(run([sys.executable, "-m", "cpupin", "ps", "--json", "--interval",
                               "0.01", "--lock-dir", str(tmp_path)]).stdout)  # fmt: skip
        holds = [h for p in data["processes"] if p["live"] for h in p["wake_holds"]]
        assert [h["mechanism"] for h in holds] == ["dma"], data["processes"]
        proc.send_signal(signal.SIGTERM)  # to cpupin exec, as a service manager would
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "got TERM" in out and proc.returncode == 3, (out, err)


def test_the_doctor_warns_of_a_value_no_live_holder_answers_for(tmp_path):
    """The doctor's check, on a tree: a dead holder's CPU (the journal knows
    the host's value), a CPU set by hand, a live hold and an untouched CPU."""
    from cpupin.registry.holds import left_applied

    original = {0: "0", 1: "7", 2: "0", 3: "0"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    proc = holding(root, locks, "1")
    assert left_applied(range(4), str(locks), str(root)) == []  # a live holder answers
    killed(proc)
    (root / "sys/devices/system/cpu/cpu2/power/pm_qos_resume_latency_us").write_text("40\n")
    lines = left_applied(range(4), str(locks), str(root))
    assert len(lines) == 2, lines
    assert lines[0].startswith("CPU 1's wake latency is n/a, not the host's 7: pid ")
    assert "cpupin ps --prune puts it back" in lines[0]
    assert lines[1].startswith("CPU 2's wake latency is 40") and "write 0" in lines[1]
    settle_all(str(locks))
    after = left_applied(range(4), str(locks), str(root))
    # CPU 1 has the host's own 7 back (set before any hold: said, as any
    # value other than 0 is, but no longer as cpupin's); CPU 2 is not cpupin's.
    assert len(after) == 2 and all("no live cpupin hold" in line for line in after), after


def test_the_doctor_prints_what_this_machine_has_left(tmp_path):
    """On this machine: the doctor's text and JSON carry the check's lines
    (none where no CPU's value differs from 0)."""
    cpus = sorted(os.sched_getaffinity(0))
    values_now = {c: Path(REAL.format(c)).read_text().strip() for c in cpus
                  if os.path.exists(REAL.format(c))}  # fmt: skip
    args = [sys.executable, "-m", "cpupin", "doctor", "--json"]
    data = json.loads(run(args, env={**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}).stdout)
    odd = [c for c, v in values_now.items() if v != "0"]
    assert len(data["wake_latency_left"]) == len(odd), (data["wake_latency_left"], values_now)


@pytest.mark.parametrize("kind", ["garbage", "edited", "symlink", "fifo", "directory",
                                  "lock-symlink", "lock-fifo", "lock-other-user"])  # fmt: skip
def test_a_hostile_or_damaged_journal_or_lock_is_refused_never_written_over(tmp_path, kind):
    """Whoever can write the lock directory can plant the journal or its
    lock, and a journal may be damaged: a hold is then refused, naming the
    file and what to do (a journal that cannot be read may name changes
    still to put back: it is never written over), and never follows a link
    or blocks."""
    from cpupin.registry.journal import journal_name

    original = {0: "0", 1: "7"}
    root = tree(tmp_path / "root", original)
    locks = tmp_path / "locks"
    locks.mkdir()
    name = journal_name("wake", str(root))
    target = locks / (name if not kind.startswith("lock") else name[:-5] + ".lock")
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    if kind == "garbage":
        target.write_bytes(os.urandom(500))
    elif kind == "edited":
        with _held_in(locks, root):
            text = target.read_text()
        target.write_text(text.replace('"7"', '"0"'))
    elif kind in ("symlink", "lock-symlink"):
        target.symlink_to(victim)
    elif kind in ("fifo", "lock-fifo"):
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    else:
        target.write_text("")
        os.chown(target, 65534, 65534)
    env_before = os.environ.get("CPUPIN_LOCK_DIR")
    os.environ["CPUPIN_LOCK_DIR"] = str(locks)
    try:
        before = values(root, original)
        with pytest.raises(cpupin.HoldRefused) as refused:
            cpupin.hold_wake_latency({1}, 0, root=str(root))
        assert "journal" in refused.value.strerror, refused.value.strerror
        assert "move it aside" in refused.value.strerror or "remove it" in refused.value.strerror
        assert values(root, original) == before
    finally:
        if env_before is None:
            os.environ.pop("CPUPIN_LOCK_DIR", None)
        else:
            os.environ["CPUPIN_LOCK_DIR"] = env_before
    assert victim.read_text() == "keep\n"


class _held_in:
    """A hold in ``locks`` on CPU 1 of ``root``, for the journal it writes."""

    def __init__(self, locks, root):
        self.locks, self.root = locks, root

    def __enter__(self):
        self.before = os.environ.get("CPUPIN_LOCK_DIR")
        os.environ["CPUPIN_LOCK_DIR"] = str(self.locks)
        self.hold = cpupin.hold_wake_latency({1}, 0, root=str(self.root))
        return self.hold

    def __exit__(self, *exc):
        # Left in the journal: the test edits it, then the next hold settles it.
        wake._held.remove(self.hold)
        self.hold.released = True
        if self.before is None:
            os.environ.pop("CPUPIN_LOCK_DIR", None)
        else:
            os.environ["CPUPIN_LOCK_DIR"] = self.before
