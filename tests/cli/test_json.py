"""Every --json output has the shape docs/json.md documents: the test runs
each command exactly as the page writes it and compares keys and types at
every level."""

import contextlib
import io
import json
import shlex

import pytest

import cpupin
from cpupin.cli import main
from tests.support.json_shapes import SECTIONS, same_shape


def test_the_page_documents_every_reporting_command():
    commands = {command.split()[1] for command in SECTIONS}
    assert commands == {
        "topo",
        "plan",
        "threads",
        "top",
        "audit",
        "doctor",
        "handoff",
        "exec",
        "ps",
        "irqs",
        "verify",
    }


def cpu_lists_are_lists_of_ints(value, key=""):
    """The first rule: under mask, cpus and process_mask, lists of integers."""
    if isinstance(value, dict):
        for k, v in value.items():
            cpu_lists_are_lists_of_ints(v, k)
    elif isinstance(value, list):
        if key in ("mask", "process_mask", "cpus", "local_cpus", "cpuset"):
            assert all(isinstance(c, int) or c is None for c in value), key
        else:
            for item in value:
                cpu_lists_are_lists_of_ints(item, key)


@pytest.mark.parametrize("command", sorted(SECTIONS))
def test_each_command_prints_the_documented_shape(command, monkeypatch, tmp_path):
    if "--matrix" in command or "--cpus 0,1" in command:
        if len(cpupin.process_cpus()) < 2:
            pytest.fail("the handoff examples need two CPUs in the mask")
    monkeypatch.delenv("CPUPIN_STEP_THREAD_CORE", raising=False)
    # A lock directory of the test's own, whatever /tmp holds, with a live
    # record in it (this process's pin) for ps and audit to show.
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    pin = cpupin.pin_current_thread(cpupin.process_cpus(), role="step")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main(shlex.split(command)[1:]) == 0
    finally:
        pin.release()
    real = json.loads(out.getvalue())
    same_shape(SECTIONS[command], real)
    cpu_lists_are_lists_of_ints(real)
