"""Handoff results made from numbers, for the doctor's pure verdicts."""

from cpupin.measure.handoff import HandoffResult


def fake_handoffs(rows):
    """HandoffResults by pair kind from (kind, idle_us, median_ns, wake_ns)
    rows, for the doctor's pure verdict (every quantile the median)."""
    return {k: HandoffResult((0, 1), "futex", i, 100, m, m, m, w, w) for k, i, m, w in rows}
