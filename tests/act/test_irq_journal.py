"""IRQ steering as a transaction (issue 34): every move journaled before
its write, so an apply killed after any write is put back; a put-back that
fails keeps its entry; concurrent applies lose nothing; a journal per root;
every size apply takes, restore reads. Fake /proc trees stand for the
host's IRQs (the real ones are moved in test_irq_steer.py)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from cpupin.act.irq_steer import IrqMove, apply_moves, restore_moves
from cpupin.host._sysfs import Reader
from cpupin.registry.journal import journal_name, read_journal
from cpupin.registry.moves import irq_entries
from tests.support.helpers import run

BOOT = "3f1c2a55-0d6e-4b8f-9a71-2c4e5d6f7a8b"


def proc_tree(root, irqs, before="0-3"):
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(BOOT + "\n")
    for irq in irqs:
        (root / f"proc/irq/{irq}").mkdir(parents=True)
        (root / f"proc/irq/{irq}/smp_affinity_list").write_text(before + "\n")
    return root


def smp(root, irq):
    return (root / f"proc/irq/{irq}/smp_affinity_list").read_text().strip()


def moves(irqs, before=frozenset(range(4)), after=frozenset({0, 1})):
    return [IrqMove(str(i), f"dev{i}", "NIC", before, after, "its CPUs less the kept")
            for i in irqs]  # fmt: skip


APPLY = """
import os, signal, sys
from cpupin.act import irq_steer
from cpupin.act.irq_steer import IrqMove
root, first, count, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
steps = []
def checkpoint(what):
    steps.append(what)
    if len(steps) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
irq_steer.checkpoint = checkpoint
todo = [IrqMove(str(i), "dev", "NIC", frozenset(range(4)), frozenset({0, 1}), "")
        for i in range(first, first + count)]
if len(sys.argv) > 5:
    sys.stdin.readline()
done, left = irq_steer.apply_moves(todo, root=root)
print(len(done), len(steps), flush=True)
"""


def apply_child(root, locks, first, count, kill_at, wait=False):
    return subprocess.Popen(
        [sys.executable, "-c", APPLY, str(root), str(first), str(count), str(kill_at),
         *(["wait"] if wait else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CPUPIN_LOCK_DIR": str(locks)},
    )  # fmt: skip


@pytest.mark.parametrize("count", [1, 3, 6])
def test_an_apply_killed_after_any_write_is_put_back(tmp_path, count):
    irqs = range(40, 40 + count)
    steps = count + 1  # the journal, then each IRQ
    for at in range(1, steps + 1):
        root = proc_tree(tmp_path / f"root{at}", irqs)
        locks = tmp_path / f"locks{at}"
        locks.mkdir()
        child = apply_child(root, locks, 40, count, at)
        child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, at
        moved = {i for i in irqs if smp(root, i) != "0-3"}
        assert len(moved) == at - 1  # k writes made before the kill
        journal = irq_entries(read_journal("irq", str(root), str(locks))[0])
        assert {int(i) for i in journal} == set(irqs)  # every one named before its write
        args = [sys.executable, "-m", "cpupin", "ps", "--lock-dir", str(locks),
                "--interval", "0.01"]  # fmt: skip
        shown = json.loads(run([*args, "--json"]).stdout)["still_applied"]
        assert {c["irq"] for c in shown} == set(irqs)
        assert all(c["undo"] == "cpupin ps --prune" for c in shown)
        if count > 1:
            assert "IRQs moved (an apply that died half way)" in run(args).stdout
        if at % 2:
            out = run([*args, "--prune"])
            assert out.returncode == 0, out.stderr
        else:
            out = run([sys.executable, "-m", "cpupin", "irqs", "--restore", "--root", str(root),
                       "--lock-dir", str(locks)])  # fmt: skip
            assert out.returncode == 0 and "still recorded" not in out.stdout, out.stdout
        assert [smp(root, i) for i in irqs] == ["0-3"] * count, (at, out.stdout, out.stderr)
        assert irq_entries(read_journal("irq", str(root), str(locks))[0]) == {}


def test_a_finished_apply_is_shown_until_restored(tmp_path):
    root = proc_tree(tmp_path / "root", [7, 8])
    done, _ = apply_moves(moves([7, 8]), root=str(root), directory=str(tmp_path))
    assert len(done) == 2
    args = [sys.executable, "-m", "cpupin", "ps", "--lock-dir", str(tmp_path), "--interval", "0.01"]
    shown = json.loads(run([*args, "--json"]).stdout)["still_applied"]
    assert [(c["irq"], c["undo"]) for c in shown] == [(7, "cpupin irqs --restore")] + [
        (8, "cpupin irqs --restore")
    ]
    text = run(args).stdout
    assert "applied  2 IRQs moved: 7, 8 (under " in text, text
    assert "still applied; cpupin irqs --restore puts them back" in text
    run([*args, "--prune"])  # a finished apply is the operator's: prune leaves it
    assert smp(root, 7) == "0-1"
    assert restore_moves(root=str(root), directory=str(tmp_path)) == [
        "IRQ 7: back on 0-3",
        "IRQ 8: back on 0-3",
    ]


@pytest.mark.parametrize("failing", [{"7"}, {"7", "9"}, {"8"}])
def test_a_failed_put_back_keeps_its_entry(tmp_path, monkeypatch, failing):
    root = proc_tree(tmp_path / "root", [7, 8, 9])
    apply_moves(moves([7, 8, 9]), root=str(root), directory=str(tmp_path))
    real = Reader.write

    def refuse(reader, rel, text):
        if rel.split("/")[2] in failing:
            raise PermissionError(13, "Permission denied")
        return real(reader, rel, text)

    monkeypatch.setattr(Reader, "write", refuse)
    lines = restore_moves(root=str(root), directory=str(tmp_path))
    assert sum("cannot put back" in line for line in lines) == len(failing)
    assert f"{len(failing)} IRQ(s) still recorded" in lines[-1]
    kept = irq_entries(read_journal("irq", str(root), str(tmp_path))[0])
    assert set(kept) == failing
    monkeypatch.setattr(Reader, "write", real)
    again = restore_moves(root=str(root), directory=str(tmp_path))
    assert [smp(root, i) for i in (7, 8, 9)] == ["0-3"] * 3, again
    assert read_journal("irq", str(root), str(tmp_path))[0] == {}


def test_concurrent_applies_lose_no_entry(tmp_path):
    root = proc_tree(tmp_path / "root", range(1000, 1400))
    children = [apply_child(root, tmp_path, 1000 + 200 * k, 200, 0, wait=True) for k in (0, 1)]
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
        assert out.split()[0] == "200"
    journal = irq_entries(read_journal("irq", str(root), str(tmp_path))[0])
    assert len(journal) == 400
    lines = restore_moves(root=str(root), directory=str(tmp_path))
    assert sum("back on 0-3" in line for line in lines) == 400


def test_a_journal_per_root(tmp_path):
    a = proc_tree(tmp_path / "a", range(1, 13))
    b = proc_tree(tmp_path / "b", range(1, 13))
    apply_moves(moves(range(1, 13)), root=str(a), directory=str(tmp_path))
    apply_moves(moves(range(1, 13)), root=str(b), directory=str(tmp_path))
    assert (tmp_path / journal_name("irq", str(a))).exists()
    assert journal_name("irq", str(a)) != journal_name("irq", str(b))
    restore_moves(root=str(a), directory=str(tmp_path))
    assert [smp(a, i) for i in range(1, 13)] == ["0-3"] * 12
    assert [smp(b, i) for i in range(1, 13)] == ["0-1"] * 12
    restore_moves(root=str(b), directory=str(tmp_path))
    assert [smp(b, i) for i in range(1, 13)] == ["0-3"] * 12


def test_every_size_apply_takes_restore_reads(tmp_path, fast_dir):
    """16,384 IRQs (more than hosts have) round-trip; a journal that would
    pass what a reader reads is refused before anything moves."""
    with fast_dir() as base:
        root = proc_tree(type(tmp_path)(base) / "root", range(16384))
        done, _ = apply_moves(moves(range(16384)), root=str(root), directory=base)
        assert len(done) == 16384
        lines = restore_moves(root=str(root), directory=base)
        assert sum("back on" in line for line in lines) == 16384
        assert smp(root, 16383) == "0-3"
    wide = frozenset(range(0, 8192, 2))  # 4,096 CPUs, one by one: ~19 KiB a list
    big = moves(range(600), before=wide, after=wide - {0})
    with pytest.raises(ValueError, match="more than the"):
        apply_moves(big, root=str(proc_tree(tmp_path / "big", [])), directory=str(tmp_path))
    assert read_journal("irq", str(tmp_path / "big"), str(tmp_path))[0] == {}
