"""Interrupts on pinned cores: /proc/interrupts and /proc/irq read as hostile
input, rates from two reads, the doctor's list and its irqbalance advice."""

import json
import os
import re
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.cli import main
from cpupin.host import irqs
from cpupin.host.irqs import classify, irqbalance_advice, parse_interrupts, read_irqs
from cpupin.host.shapes import HOSTS, build_tree
from tests.support.helpers import run

# The host's own PM QoS and interrupts: with pytest-xdist, these tests run
# one at a time on one worker, never beside another that reads or sets them.
pytestmark = pytest.mark.xdist_group("host")


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def interrupts(cpus, rows):
    """A /proc/interrupts: rows of (irq, counts by CPU, description)."""
    lines = ["     " + "".join(f"CPU{c:<8}" for c in cpus)]
    for irq, counts, name in rows:
        lines.append(f"{irq:>4}: " + "".join(f"{n:>10} " for n in counts) + name)
    lines.append(" NMI: " + "".join(f"{0:>10} " for _ in cpus) + "Non-maskable interrupts")
    return "\n".join(lines) + "\n"


ROWS = [
    ("24", [5, 0, 0, 0], "IR-PCI-MSIX-0000:3b:00.0 0-edge nvme0q0"),
    ("25", [0, 900, 0, 0], "IR-PCI-MSIX-0000:3b:00.0 1-edge nvme0q1"),
    ("40", [0, 0, 70, 0], "IR-PCI-MSIX-0000:18:00.0 0-edge nvidia"),
    ("41", [0, 10, 0, 0], "IR-PCI-MSIX-0000:19:00.0 3-edge mlx5_comp2@pci:0000:19:00.0"),
    ("42", [1, 1, 1, 1], "IO-APIC 4-edge ttyS0"),
]


def tree(root, later=None):
    write(root, "proc/interrupts", interrupts([0, 1, 2, 3], ROWS))
    for irq, aff in (("24", "0"), ("25", "1"), ("40", "2"), ("41", "1"), ("42", "0-3")):
        write(root, f"proc/irq/{irq}/smp_affinity_list", "0-3\n")
        write(root, f"proc/irq/{irq}/effective_affinity_list", aff + "\n")
    return root


def test_rates_come_from_two_reads_and_only_pinned_cpus_count(tmp_path):
    root = tree(str(tmp_path))
    later = [(i, [n * 3 for n in counts], name) for i, counts, name in ROWS]
    clock = iter([100.0, 102.0])

    def sleep(_):
        write(root, "proc/interrupts", interrupts([0, 1, 2, 3], later))

    found, reasons = read_irqs(root, {1}, sleep=sleep, clock=lambda: next(clock))
    assert reasons == []
    by = {i.irq: i for i in found}
    assert set(by) == {"25", "41", "42"}  # the IRQs whose effective affinity holds CPU 1
    assert by["25"].per_s == 900.0 and by["25"].kind == "NVMe" and by["25"].managed
    assert by["41"].per_s == 10.0 and by["41"].kind == "NIC" and not by["41"].managed
    assert by["42"].per_s == 1.0 and by["42"].kind == "other"
    assert [i.irq for i in found] == ["25", "41", "42"]  # the busiest first


def test_smp_affinity_stands_in_for_a_missing_effective_affinity(tmp_path):
    root = tree(str(tmp_path))
    os.unlink(os.path.join(root, "proc/irq/40/effective_affinity_list"))
    found, _ = read_irqs(root, {3}, interval=0)
    assert {i.irq: i.affinity for i in found} == {"40": "smp", "42": "effective"}
    assert all(i.per_s is None for i in found)


@pytest.mark.parametrize(
    "description, kind, managed",
    [
        ("IR-PCI-MSIX-0000:3b:00.0 5-edge nvme0q5", "NVMe", True),
        ("IR-PCI-MSIX-0000:3b:00.0 0-edge nvme0q0", "NVMe", False),
        ("PCI-MSI 1-edge nvidia", "GPU", False),
        ("PCI-MSI 1-edge amdgpu", "GPU", False),
        ("IR-PCI-MSIX 3-edge mlx5_comp7@pci:0000:19:00.0", "NIC", False),
        ("IR-PCI-MSIX 3-edge ice-ens1f0-TxRx-3", "NIC", False),
        ("PCI-MSIX-0000:00:03.0 1-edge virtio2-input.0", "NIC", False),
        ("IO-APIC 4-edge ttyS0", "other", False),
        ("PCI-MSIX-0000:00:02.0 1-edge virtio1-req.0", "other", False),
    ],
)
def test_classify(description, kind, managed):
    assert classify(description) == (kind, managed)


def test_this_machines_interrupts_parse_as_python_reads_them():
    """The oracle: /proc/interrupts and /proc/irq split in plain Python."""
    with open("/proc/interrupts") as f:
        text = f.read()
    got = parse_interrupts(text)
    header = text.splitlines()[0].split()
    assert list(got.cpus) == [int(h[3:]) for h in header]
    numbered = [line for line in text.splitlines()[1:] if line.split(":")[0].strip().isdigit()]
    assert set(got.counts) == {line.split(":")[0].strip() for line in numbered}
    for line in numbered:
        irq, rest = line.split(":", 1)
        assert got.counts[irq.strip()] == tuple(int(v) for v in rest.split()[: len(header)])
    cpu = min(os.sched_getaffinity(0))
    found, _ = read_irqs("/", {cpu}, interval=0)
    expected = set()
    for irq in got.counts:
        for name in ("effective_affinity_list", "smp_affinity_list"):
            try:
                with open(f"/proc/irq/{irq}/{name}") as f:
                    listed = f.read().strip()
            except OSError:
                continue
            if listed:
                cpus = set()
                for part in listed.split(","):
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
                if cpu in cpus:
                    expected.add(irq)
                break
    assert {i.irq for i in found} == expected


@pytest.mark.parametrize(
    "damage, says",
    [
        ("fifo", "a FIFO"),
        ("symlink", None),
        ("huge", "longer than"),
        ("header", "not a CPU column"),
        ("short", "without a count for each CPU"),
        ("big number", "without a count for each CPU"),
    ],
)
def test_hostile_interrupt_files_are_reasons(tmp_path, monkeypatch, damage, says):
    root = tree(str(tmp_path))
    path = os.path.join(root, "proc/interrupts")
    if damage == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif damage == "symlink":  # an affinity that points out of the root
        outside = tmp_path.parent / f"{tmp_path.name}-out"
        outside.write_text("1\n")
        aff = os.path.join(root, "proc/irq/25/effective_affinity_list")
        os.unlink(aff)
        os.symlink(str(outside), aff)
        found, _ = read_irqs(root, {1}, interval=0)
        # The link's /... resolves inside the root, where there is no such
        # file: the outside file is never read, and smp_affinity stands in.
        (irq,) = [i for i in found if i.irq == "25"]
        assert irq.affinity == "smp" and irq.cpus == {0, 1, 2, 3}
        return
    elif damage == "huge":
        monkeypatch.setattr(irqs, "INTERRUPTS_LIMIT", 100)
    elif damage == "header":
        write(root, "proc/interrupts", "\x1b[2J CPU0 x\n  24: 1 2 nvme0q1\n")
    elif damage == "short":
        write(root, "proc/interrupts", "CPU0 CPU1\n  24: 1\n  25: 1 2 nvme0q1\n")
    elif damage == "big number":
        write(root, "proc/interrupts", "CPU0 CPU1\n  24: 1 " + "9" * 30 + " nvme0q1\n")
    found, reasons = read_irqs(root, {0, 1}, interval=0)
    assert any(says in r for r in reasons), reasons
    assert all(r.isprintable() and len(r) < 300 for r in reasons)


@given(st.text(max_size=2000))
def test_any_interrupts_text_parses_without_raising(text):
    got = parse_interrupts(text, [])
    assert all(len(c) == len(got.cpus) for c in got.counts.values())


def test_the_advice_names_the_pinned_cpus_and_what_cannot_move(tmp_path):
    root = tree(str(tmp_path))
    found, _ = read_irqs(root, {1, 33}, interval=0)
    lines = irqbalance_advice({1, 33}, found)
    assert "IRQBALANCE_BANNED_CPULIST=1,33" in lines[0]
    assert "IRQBALANCE_BANNED_CPUS=00000002,00000002" in lines[0]
    assert "managed IRQ(s) 25 cannot move" in lines[1] and "isolcpus=managed_irq,1,33" in lines[1]
    assert "--banirq" in lines[2] and "IRQ 41, 42" in lines[2]


def test_the_doctor_lists_irqs_on_the_cpus_auto_would_pin_and_writes_nothing(tmp_path, capsys):
    """A B300 tree with interrupts: auto pins CPUs 0,128 and 31 for the first
    GPU (and others); an IRQ on CPU 0 is listed, one on CPU 5 is not."""
    root = build_tree(HOSTS["xeon6-b300"], tmp_path)
    cpus = list(range(256))
    rows = [
        ("30", [0] * 256, "IR-PCI-MSIX-0000:17:00.0 0-edge nvidia"),
        ("31", [0] * 256, "IR-PCI-MSIX-0000:3b:00.0 1-edge nvme0q1"),
    ]
    write(root, "proc/interrupts", interrupts(cpus, rows))
    write(root, "proc/irq/30/effective_affinity_list", "0\n")
    write(root, "proc/irq/31/effective_affinity_list", "5\n")
    before = {p: os.stat(os.path.join(root, "proc/irq", p)).st_mtime_ns for p in ("30", "31")}
    assert main(["doctor", "--root", root, "--irq-interval", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^irqs     1 may land on auto's step and result CPUs 0-1,", out, re.M)
    assert re.search(r"^  IRQ    30 GPU          \? on 0 \(affinity 0\) .*nvidia'$", out, re.M)
    assert "IRQ    31" not in out and "IRQBALANCE_BANNED_CPULIST=0-1," in out
    assert main(["doctor", "--root", root, "--irq-interval", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["interrupts"]
    assert [i["irq"] for i in data["irqs"]] == ["30"] and data["irqbalance"]
    after = {p: os.stat(os.path.join(root, "proc/irq", p)).st_mtime_ns for p in ("30", "31")}
    assert before == after


def test_a_shipped_host_has_no_interrupts_to_read(capsys):
    assert main(["doctor", "--host", "dgx-h100"]) == 0
    assert "irqs     not read: a shipped host has no proc/interrupts" in capsys.readouterr().out


def test_the_doctor_here_checks_the_cpu_a_registered_process_pins(tmp_path):
    """For real: a child pins a thread (and registers it); the doctor of this
    machine lists exactly the IRQs whose affinity holds that CPU."""
    cpu = max(os.sched_getaffinity(0))
    child = textwrap.dedent(
        f"""
        import sys, cpupin
        pin = cpupin.pin_current_thread([{cpu}])
        print("pinned", flush=True)
        sys.stdin.read()
        """
    )
    env = {**os.environ, "CPUPIN_LOCK_DIR": str(tmp_path)}
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "pinned"
        out = run(
            [sys.executable, "-m", "cpupin", "doctor", "--json", "--irq-interval", "0"], env=env
        )
        data = json.loads(out.stdout)["interrupts"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert cpu in data["pinned_cpus"] and "registered pins" in data["pinned_by"]
    found, _ = read_irqs("/", {cpu}, interval=0)
    assert sorted(i["irq"] for i in data["irqs"]) == sorted(i.irq for i in found)
