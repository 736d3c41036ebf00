"""Steering IRQs off the step CPUs: the plan as a property of what was read,
a captured host's tree moved and put back, hostile records, and, as root,
this machine's own IRQs, each put back."""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.act import irq_steer
from cpupin.act.irq_steer import apply_moves, plan_moves
from cpupin.cpulist import parse_cpulist
from cpupin.host._sysfs import Reader
from cpupin.host.irqs import IrqOnPin
from cpupin.registry.journal import journal_name
from tests.support.helpers import run

# The host's own PM QoS and interrupts: with pytest-xdist, these tests run
# one at a time on one worker, never beside another that reads or sets them.
pytestmark = pytest.mark.xdist_group("host")

DATA = Path(__file__).resolve().parents[1] / "data" / "irq-host"
CPUS = st.frozensets(st.integers(0, 15), min_size=1, max_size=16)


@given(
    st.lists(st.tuples(CPUS, CPUS, st.booleans()), max_size=8),
    st.frozensets(st.integers(0, 15), min_size=1),
    CPUS,
)
def test_no_move_lands_on_a_cpu_kept_clear(irqs, keep, online):
    listed = [
        IrqOnPin(str(n), f"dev{n}", "NIC", managed, smp, "smp", smp & keep, None)
        for n, (smp, _, managed) in enumerate(irqs)
    ]
    smp = {str(n): s for n, (s, _, _) in enumerate(irqs)}
    nodes = {str(n): node for n, (_, node, _) in enumerate(irqs)}
    for m, (before, node, managed) in zip(plan_moves(listed, keep, smp, nodes, online), irqs):
        assert m.before == before
        if managed:
            assert m.after is None and "managed" in m.reason
        elif m.after is None:
            assert online <= keep and "nowhere" in m.reason
        else:
            assert m.after and not m.after & keep
            # Its own CPUs first, then its node's, then any online one.
            assert m.after in (before - keep, node - keep, online - keep)
            assert before - keep == m.after or not before - keep


def tree(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(DATA, root)
    return root


def smp(root, irq):
    return (root / f"proc/irq/{irq}/smp_affinity_list").read_text().strip()


def moves_file(locks, root):
    """The IRQ journal of ``root`` in ``locks``."""
    return locks / journal_name("irq", str(root))


def cli(*args):
    return run([sys.executable, "-m", "cpupin", "irqs", *args])


def test_a_captured_host_is_moved_recorded_and_put_back(tmp_path):
    root, locks = tree(tmp_path), tmp_path / "locks"
    locks.mkdir()
    dry = cli("--root", str(root), "--cpus", "2-3", "--lock-dir", str(locks), "--json")
    assert dry.returncode == 0, dry.stderr
    plan = {m["irq"]: m for m in json.loads(dry.stdout)["moves"]}
    assert [smp(root, i) for i in (120, 121, 122)] == ["2-3", "0-3", "0-7"]  # a dry run
    assert not moves_file(locks, root).exists()
    assert plan["121"]["after"] is None and "managed" in plan["121"]["reason"]
    out = cli("--root", str(root), "--cpus", "2-3", "--lock-dir", str(locks), "--apply")
    assert out.returncode == 0, out.stderr
    assert [smp(root, i) for i in (120, 121, 122)] == ["0-1", "0-3", "0-1,4-7"]
    assert "moved    2 IRQ(s)" in out.stdout
    # An operator changes one by hand: restore leaves that one.
    (root / "proc/irq/122/smp_affinity_list").write_text("5\n")
    back = cli("--root", str(root), "--lock-dir", str(locks), "--restore")
    assert back.returncode == 0, back.stderr
    assert smp(root, 120) == "2-3" and smp(root, 122) == "5"
    assert "IRQ 122: changed since" in back.stdout
    assert not moves_file(locks, root).exists()
    again = cli("--root", str(root), "--lock-dir", str(locks), "--restore")
    assert "no IRQ moved by cpupin is recorded" in again.stdout


def test_a_record_of_another_boot_is_not_restored(tmp_path):
    root, locks = tree(tmp_path), tmp_path / "locks"
    locks.mkdir()
    assert cli("--root", str(root), "--cpus", "2-3", "--lock-dir", str(locks), "--apply")
    (root / "proc/sys/kernel/random/boot_id").write_text("00000000-0000-4000-8000-000000000000\n")
    back = cli("--root", str(root), "--lock-dir", str(locks), "--restore")
    assert "before the last boot" in back.stdout and smp(root, 120) == "0-1"


@pytest.mark.parametrize("kind", ["garbage", "symlink", "fifo", "edited"])
def test_a_hostile_record_writes_nothing(tmp_path, kind):
    root, locks = tree(tmp_path), tmp_path / "locks"
    locks.mkdir()
    assert cli("--root", str(root), "--cpus", "2-3", "--lock-dir", str(locks), "--apply")
    record = moves_file(locks, root)
    if kind == "garbage":
        record.write_bytes(os.urandom(300))
    elif kind == "symlink":
        record.unlink()
        record.symlink_to("/etc/passwd")
    elif kind == "fifo":
        record.unlink()
        os.mkfifo(record)
    else:  # a number changed without the checksum
        record.write_text(record.read_text().replace('"0-1"', '"0-7"'))
    back = cli("--root", str(root), "--lock-dir", str(locks), "--restore")
    assert back.returncode == 0, back.stderr
    assert smp(root, 120) == "0-1" and "IRQ 120: back" not in back.stdout


def test_a_write_the_kernel_refuses_is_left_with_why(tmp_path, monkeypatch):
    root = tree(tmp_path)
    refusals = {"120": errno.EIO, "122": errno.EINVAL}

    def refuse(reader, rel, text):  # the kernel's answer to the write
        raise OSError(refusals[rel.split("/")[2]], os.strerror(refusals[rel.split("/")[2]]))

    monkeypatch.setattr(Reader, "write", refuse)
    moves = [
        irq_steer.IrqMove("120", "mlx5", "NIC", frozenset({2}), frozenset({0}), ""),
        irq_steer.IrqMove("122", "nvidia", "GPU", frozenset({2}), frozenset({1}), ""),
    ]
    done, left = apply_moves(moves, root=str(root), directory=str(tmp_path))
    assert done == [] and len(left) == 2
    assert "managed IRQ" in left[0] and "Invalid argument" in left[1]
    assert not moves_file(tmp_path, root).exists()


def test_bad_input_names_the_value(tmp_path):
    for args, said in [
        (["--cpus", "x"], "--cpus"),
        (["--cpus", "99", "--root", str(DATA)], "not online"),
        (["--root", str(tmp_path / "none")], "not a directory"),
        (["--apply", "--restore"], "not allowed with"),
    ]:
        out = cli(*args)
        assert out.returncode == 2 and said in out.stderr, (args, out.stderr)


def test_this_machines_irqs_move_off_a_cpu_and_come_back(tmp_path):
    """As root on two CPUs: every movable IRQ leaves the last CPU, and
    --restore puts each back. With one CPU there is nowhere to go; without
    root, nothing moves and the reason says so."""
    cpus = sorted(os.sched_getaffinity(0))
    keep = str(cpus[-1])
    irqs = sorted(p.name for p in Path("/proc/irq").iterdir() if p.name.isdigit())
    before = {i: Path(f"/proc/irq/{i}/smp_affinity_list").read_text().strip() for i in irqs}
    try:
        out = cli("--cpus", keep, "--apply", "--lock-dir", str(tmp_path), "--json")
        data = json.loads(out.stdout) if out.stdout else {}
        if os.geteuid() != 0:
            assert out.returncode == 2 or all("root" in line for line in data.get("left", []))
            return
        assert out.returncode == 0, out.stderr
        for irq in data["moved"]:
            now = parse_cpulist(Path(f"/proc/irq/{irq}/smp_affinity_list").read_text())
            assert int(keep) not in now, irq
        if len(cpus) == 1 or not data["moves"]:
            assert data["moved"] == []
            return
        back = cli("--restore", "--lock-dir", str(tmp_path))
        assert back.returncode == 0, back.stderr
        after = {i: Path(f"/proc/irq/{i}/smp_affinity_list").read_text().strip() for i in irqs}
        assert after == before
    finally:
        for irq, cpus_text in before.items():
            try:
                Path(f"/proc/irq/{irq}/smp_affinity_list").write_text(cpus_text)
            except OSError:
                pass
