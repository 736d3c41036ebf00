"""Every --json output has the shape docs/json.md documents: the test runs
each command exactly as the page writes it and compares keys and types at
every level."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

import cpupin
from cpupin.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "json.md"
SECTION = re.compile(r"^### `(cpupin [^`]+)`\n(.*?)```json\n(.*?)```", re.MULTILINE | re.DOTALL)
SECTIONS = {command: json.loads(body) for command, _, body in SECTION.findall(DOC.read_text())}


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
    }


def same_shape(documented, real, where="$"):
    """Keys equal at every level (a map of node ids: any ids); types equal
    (ints and floats alike); a documented null allows anything; a list's
    first items compared."""
    if documented is None:
        return
    if isinstance(documented, dict):
        assert isinstance(real, dict), where
        if documented and all(k.isdigit() for k in documented):  # node id -> CPUs
            first = next(iter(documented.values()))
            for key, value in real.items():
                assert key.isdigit(), (where, key)
                same_shape(first, value, f"{where}.{key}")
        elif documented or not real:  # {} documents a map whose keys vary (handoff_ns)
            assert set(real) == set(documented), (where, set(real) ^ set(documented))
            for key, value in documented.items():
                same_shape(value, real[key], f"{where}.{key}")
        return
    if isinstance(documented, list):
        assert isinstance(real, list), where
        # A pinned thread that has exited carries nulls, as documented: the
        # shape is taken from the first one alive (another test's process
        # may hold a record whose thread just ended).
        alive = [r for r in real if not (isinstance(r, dict) and r.get("alive") is False)]
        if documented and alive:
            same_shape(documented[0], alive[0], f"{where}[0]")
        return
    numbers = (int, float)
    if isinstance(documented, bool):
        assert isinstance(real, bool), where
    elif isinstance(documented, numbers):
        assert isinstance(real, numbers) and not isinstance(real, bool), where
    else:
        assert isinstance(real, type(documented)), (where, real)


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
