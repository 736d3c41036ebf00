"""``auto`` on a busy host: the confinement of a server's other threads to
the CPUs vLLM reserves is widened while work from outside the server holds
those CPUs, and made again once it eases.

The decision is pure and tested over any sequence of loads; the wiring is
tested on real processes and real masks (an API server and a worker made
here), with the host's busy time scripted, so the test decides how busy
the host is and no test depends on how busy it really is.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.integrations.vllm.decisions import (
    FULL_BELOW,
    NARROW_AFTER,
    OUTSIDE_AT,
    OUTSIDE_GONE,
    WIDEN_AFTER,
    Confinement,
    Pressure,
    host_pressure,
    model_name_of,
    next_confinement,
)
from cpupin.measure.metrics import vllm_labels

figures = st.floats(min_value=0, max_value=4, allow_nan=False)
samples_of = st.lists(st.builds(Pressure, figures, figures), max_size=120)


@given(samples_of)
def test_widen_and_narrow_only_after_their_streaks_and_alternate(samples):
    state = Confinement()
    widened, run = False, 0
    for seen in samples:
        state, action = next_confinement(state, seen)
        # The oracle: the streak of samples that argue for a change,
        # counted from the last change.
        if not widened:
            argues = seen.outside >= OUTSIDE_AT and seen.idle < FULL_BELOW
            run = run + 1 if argues else 0
            expected = "widen" if run >= WIDEN_AFTER else None
        else:
            argues = seen.outside < OUTSIDE_GONE or seen.idle >= 1.0
            run = run + 1 if argues else 0
            expected = "narrow" if run >= NARROW_AFTER else None
        assert action == expected, (samples, seen)
        if action is not None:
            widened, run = not widened, 0
        assert state.widened == widened


@given(st.lists(st.builds(Pressure, figures, st.floats(FULL_BELOW, 4)), max_size=200))
def test_cpus_with_room_to_spare_never_widen(samples):
    state = Confinement()
    for seen in samples:
        state, action = next_confinement(state, seen)
        assert action is None


@given(st.lists(st.builds(Pressure, st.floats(OUTSIDE_GONE, 4), st.floats(0, 0.99)), max_size=200))
def test_widened_stays_widened_while_outside_work_fills_the_cpus(samples):
    state = Confinement(True)
    for seen in samples:
        state, action = next_confinement(state, seen)
        assert action is None and state.widened


cpu_sets = st.frozensets(st.integers(0, 63), max_size=8)


@given(
    cpu_sets,
    st.dictionaries(st.integers(0, 127), st.floats(0, 10, allow_nan=False), max_size=64),
    st.floats(0, 20, allow_nan=False),
    st.floats(0.1, 5),
)
def test_host_pressure_counts_only_the_launchers_cpus_and_never_goes_below_zero(
    cpus, busy, server, seconds
):
    got = host_pressure(busy, seconds, cpus, server)
    assert got.outside >= 0 and got.idle >= 0
    # Busy CPUs beyond the launcher's change nothing.
    others = {cpu + 64: s + 5 for cpu, s in busy.items()}
    assert host_pressure({**busy, **others}, seconds, cpus, server) == got
    # More of the server's own work leaves less outside, and never more idle.
    less = host_pressure(busy, seconds, cpus, server + 1)
    assert less.outside <= got.outside and less.idle == got.idle


def test_host_pressure_is_what_the_server_did_not_run_and_what_nothing_ran():
    # Two CPUs over two seconds: 3.0 s busy, 1.4 s of it the server's.
    got = host_pressure({0: 2.0, 1: 1.0, 2: 2.0}, 2.0, frozenset({0, 1}), 1.4)
    assert abs(got.outside - 0.8) < 1e-9 and abs(got.idle - 0.5) < 1e-9


# --- the wiring, on real processes -------------------------------------------

# The API server: one thread of its own confined to the reserved CPU, as
# auto's sweep leaves it; it starts the worker and waits for its report.
API_SERVER = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    kept = int(sys.argv[1])
    box = {}
    def helper():
        os.sched_setaffinity(0, {kept})
        box["tid"] = threading.get_native_id()
        threading.Event().wait()
    threading.Thread(target=helper, daemon=True).start()
    while "tid" not in box:
        pass
    from cpupin.host._proc import own_start
    env = {**os.environ, "CPUPIN_VLLM_SERVER": f"{os.getpid()}-{own_start()}"}
    worker = subprocess.run([sys.executable, "-c", sys.argv[2], str(box["tid"]), *sys.argv[3:]],
                            env=env, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(worker.stdout)
    sys.exit(worker.returncode)
    """
)

# The worker: a thread confined to the reserved CPU too, then the plugin's
# watcher, one sample at a time, with the host's busy time and the
# watcher's clock scripted: each sample is one second of that clock, and
# each CPU of the launcher's is as busy as the server made it plus the
# outside work the test names for the sample, spread over them (2.0: both
# full). The clock is scripted so that a worker the host delays between
# reading the clock and reading the CPUs cannot change the figures: with a
# real clock and short samples, a busy CI host once made a full second
# read as half idle.
WORKER = textwrap.dedent(
    """
    import json, os, sys, threading, types
    from cpupin.integrations.vllm import decisions, wiring
    import cpupin.host.cpu_busy as cpu_busy
    api_helper = int(sys.argv[1]); launcher = frozenset(json.loads(sys.argv[2]))
    kept = frozenset({json.loads(sys.argv[3])}); outside = json.loads(sys.argv[4])
    decisions.NARROW_AFTER = 4  # not thirty seconds in a test
    wiring._state.update(mode="auto", role="vllm-worker")
    wiring._publish = lambda *a, **k: None
    box = {}
    def helper():
        os.sched_setaffinity(0, kept)
        box["tid"] = threading.get_native_id()
        threading.Event().wait()
    threading.Thread(target=helper, daemon=True).start()
    while "tid" not in box:
        pass
    clock = {"now": 1000.0, "busy": {c: 0.0 for c in launcher}, "load": 0.0}
    def scripted():
        ours = sum(wiring._server_cpu(wiring._state["watch"]["pids"]).values()) / 1e9
        clock["ours"], grown = ours, ours - clock.get("ours", ours)
        for c in launcher:
            clock["busy"][c] += (clock["load"] + grown) / len(launcher)
        return dict(clock["busy"])
    cpu_busy.read_cpu_busy = scripted
    wiring.time = types.SimpleNamespace(monotonic=lambda: clock["now"])
    seen = []
    for load in outside:
        clock["load"] = load
        clock["now"] += 1.0
        widened = wiring._watch_pressure(kept, launcher)
        seen.append([widened, sorted(os.sched_getaffinity(api_helper)),
                     sorted(os.sched_getaffinity(box["tid"]))])
    print(json.dumps({"seen": seen, "notes": wiring._notes}))
    """
)


def _serve(two_cpus, outside):
    launcher, kept = sorted(two_cpus), two_cpus[1]
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(launcher))
    try:
        out = subprocess.run(
            [sys.executable, "-c", API_SERVER, str(kept), WORKER, json.dumps(launcher),
             json.dumps(kept), json.dumps(outside)],
            capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("CPUPIN_VLLM")},
        )  # fmt: skip
    finally:
        os.sched_setaffinity(0, saved)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), launcher, [kept]


def test_outside_work_on_the_reserved_cpu_widens_the_confined_threads_and_its_end_narrows_them(
    two_cpus,
):
    busy, quiet = 2.0, 0.0
    got, launcher, kept = _serve(two_cpus, [quiet, busy, busy, busy, quiet, quiet, quiet, quiet])
    seen = got["seen"]
    # The first sample only starts the counters; three busy ones widen.
    assert [s[0] for s in seen] == [False, False, False, True, True, True, True, False]
    assert seen[2][1:] == [kept, kept]  # still confined, both processes
    assert seen[3][1:] == [launcher, launcher]  # the API server's thread, and its own
    assert seen[7][1:] == [kept, kept]
    widened = [n for n in got["notes"] if n.startswith("confinement ")]
    assert len(widened) == 1 and widened[0].startswith("confinement back:"), got["notes"]


def test_a_quiet_host_keeps_the_confinement(two_cpus):
    # Outside work below the level, however busy the server keeps the CPUs
    # (which this test cannot script): nothing moves.
    got, launcher, kept = _serve(two_cpus, [0.0, 0.3, 0.45, 0.45, 0.45, 0.45, 0.0])
    assert all(s == [False, kept, kept] for s in got["seen"]), got
    assert not [n for n in got["notes"] if n.startswith("confinement ")]


# --- what auto did, in the metrics -------------------------------------------


@pytest.mark.parametrize(
    "title, engine, rank",
    [
        ("VLLM::APIServer", "0", "0"),
        ("VLLM::EngineCore", "0", "0"),
        ("VLLM::EngineCore_DP1", "1", "0"),
        ("VLLM::Worker_TP1", "0", "TP1"),
        ("VLLM::Worker_DP3_PP1_TP2", "3", "PP1_TP2"),
        ("VLLM::Worker_DP01", "1", "0"),
        ("python3 -m vllm.entrypoints.openai.api_server", "0", "0"),
    ],
)
def test_vllm_labels_read_vllms_own_process_titles(title, engine, rank):
    # the titles vLLM 0.32 sets (vllm/v1/executor/multiproc_executor.py,
    # vllm/v1/engine/core.py)
    assert vllm_labels(title) == (engine, rank)


@given(st.text(max_size=400))
def test_vllm_labels_never_raise_and_stay_short(title):
    engine, rank = vllm_labels(title)
    assert engine.isdigit() and len(engine) <= 5 and len(rank) <= 256


@pytest.mark.parametrize(
    "argv, name",
    [
        (["vllm", "serve", "/models/x", "--port", "8000"], "/models/x"),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/tmp/m"], "/tmp/m"),
        (["vllm", "serve", "m", "--served-model-name", "tiny", "alias"], "tiny"),
        (["vllm", "serve", "--model=m2"], "m2"),
        (["vllm", "serve"], ""),
        (["vllm", "serve", "m\x1b[31m"], "m\\x1b[31m"),
    ],
)
def test_model_name_is_what_vllm_labels_its_metrics_with(argv, name):
    assert model_name_of(argv) == name
