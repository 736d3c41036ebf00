"""Each CPU's busy time from ``/proc/stat``, against psutil's reading of
the same file and against text built here."""

import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.host.cpu_busy import parse_cpu_busy, read_cpu_busy

TCK = os.sysconf("SC_CLK_TCK")


def test_busy_is_every_column_but_idle_and_iowait_and_guest_is_not_counted_twice():
    text = (
        "cpu  10 0 0 0 0 0 0 0 0 0\n"
        "cpu0 100 5 20 900 40 3 2 7 50 1\n"
        "cpu1 1 0 0 10\n"  # an old kernel: four columns
        "intr 1 2 3\n"
    )
    got = parse_cpu_busy(text)
    assert got == {0: (100 + 5 + 20 + 3 + 2 + 7) / TCK, 1: 1 / TCK}


@pytest.mark.parametrize(
    "line",
    [
        "cpu0 1 2 3",  # too few columns
        "cpu0 1 2 x 4",
        "cpux 1 2 3 4",
        "cpu-1 1 2 3 4",
        "cpu99999999 1 2 3 4",
        "cpu0 " + " ".join(["9" * 25] * 4),
        "cpu0 " + " ".join([str(1 << 63)] * 4),
    ],
)
def test_a_line_that_is_not_the_kernels_is_skipped(line):
    assert parse_cpu_busy(f"{line}\ncpu1 1 0 0 5\n") == {1: 1 / TCK}


@given(st.text(max_size=400))
def test_parse_never_raises_and_gives_cpu_numbers_and_non_negative_seconds(text):
    for cpu, seconds in parse_cpu_busy(text).items():
        assert 0 <= cpu < 1 << 16 and seconds >= 0


def test_this_hosts_busy_time_agrees_with_psutil():
    psutil = pytest.importorskip("psutil", reason="psutil is the oracle (the test extra)")
    before = psutil.cpu_times(percpu=True)
    ours = read_cpu_busy()
    after = psutil.cpu_times(percpu=True)
    assert sorted(ours) == list(range(len(before)))
    slack = 2 / TCK * 2 + 0.05  # a tick or two passes between the reads
    for cpu, seconds in ours.items():
        low, high = (
            t.user + t.nice + t.system + t.irq + t.softirq + t.steal
            for t in (before[cpu], after[cpu])
        )
        assert low - slack <= seconds <= high + slack, (cpu, low, seconds, high)


def test_a_busy_loop_shows_as_busy_time_on_its_cpu(two_cpus):
    cpu = two_cpus[1]
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        start, own = read_cpu_busy()[cpu], time.thread_time()
        # Until this thread itself has run 0.1 s, however long a busy host
        # makes that take (a fixed wall time gave it 14 ms of CPU in one).
        while time.thread_time() - own < 0.1:
            pass
        ran, own = read_cpu_busy()[cpu] - start, time.thread_time() - own
    finally:
        os.sched_setaffinity(0, saved)
    # Its CPU was busy at least while this thread ran there (the kernel
    # counts in ticks: one either side may fall out).
    assert ran >= own - 3 / TCK, (ran, own)
