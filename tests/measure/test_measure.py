"""Measurement: sample_threads, the handoff benchmark and the doctor. These
check correctness with generous bounds; speed lives in bench/."""

import json
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cpupin
from cpupin.cli import main
from cpupin.host.shapes import HOSTS, host_named
from cpupin.host.topology import read_host
from cpupin.measure.doctor import IDLE_PENALTY_NS, IDLE_STATE_US, diagnose
from cpupin.measure.handoff import handoff, handoff_python, pair_kinds
from cpupin.measure.sampling import sample_threads
from tests.support.handoffs import fake_handoffs

two_cpus = pytest.mark.skipif(len(cpupin.process_cpus()) < 2, reason="needs two CPUs")


def test_a_spinner_and_a_sleeper():
    stop = threading.Event()
    tids = {}

    def spin():
        tids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def sleep():
        tids["sleep"] = threading.get_native_id()
        stop.wait()

    threads = [cpupin.Thread(target=spin), cpupin.Thread(target=sleep)]
    for t in threads:
        t.start()
    try:
        samples = {s.tid: s for s in sample_threads(interval=1.0)}
    finally:
        stop.set()
        for t in threads:
            t.join()
    spinner, sleeper = samples[tids["spin"]], samples[tids["sleep"]]
    # A thread that never blocks is running or waiting for a CPU all the
    # time, however busy the host: its two figures add up to the interval.
    # Above it only by what the kernel's figures lag (a scheduler tick, 10
    # ms at most, at each end); below it by what the sampler's own reads take.
    assert 800 < spinner.cpu_ms_per_s + spinner.wait_ms_per_s <= 1020
    assert spinner.cpu_ms_per_s > 100
    # A thread blocked all along neither runs nor waits.
    assert sleeper.cpu_ms_per_s + sleeper.wait_ms_per_s < 50
    assert spinner.state == sleeper.state == "process mask"
    assert spinner.mask == cpupin.process_cpus()
    assert spinner.last_cpu in cpupin.process_cpus()


SPINNER = "import os, sys; os.sched_setaffinity(0, {%d}); print(flush=True)\nwhile True: pass"


def test_two_spinners_on_one_cpu_each_wait_half_the_time():
    cpu = min(cpupin.process_cpus())
    children = [
        subprocess.Popen([sys.executable, "-c", SPINNER % cpu], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        for child in children:
            child.stdout.readline()
        time.sleep(0.2)
        samples = [sample_threads(child.pid, interval=1.0)[0] for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    for s in samples:
        # Never blocked: running or waiting all the interval, busy host or not
        # (the two schedstat reads and the clock are a few ms apart on a busy
        # host: a rate a few percent past 1000 is that skew, not more time).
        assert 800 < s.cpu_ms_per_s + s.wait_ms_per_s <= 1050
        # Its one CPU is shared with the other spinner, which runs as much
        # (and with whatever else the host runs there): at most about half
        # of it for each, and a wait of at least about half.
        assert s.cpu_ms_per_s < 600 and s.wait_ms_per_s > 400
        assert s.last_cpu == cpu and s.mask == {cpu}


def test_sample_threads_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        sample_threads(interval=0)


@two_cpus
@pytest.mark.parametrize("cpus", [(0, 0), (0, 1), (None, None), (1, 0)])
def test_the_handoff_core_completes_and_counts_every_round(cpus):
    result = handoff(cpus, rounds=300, warmup=30)
    assert result.rounds == 300 and result.cpus == cpus and result.mode == "futex"
    assert 0 < result.median_ns <= result.p90_ns <= result.p99_ns
    assert result.wake_median_ns > 0


@two_cpus
def test_the_handoff_with_an_idle_sender_and_spinning():
    idle = handoff((0, 1), rounds=50, warmup=5, idle_us=100)
    assert idle.rounds == 50 and idle.idle_us == 100
    spin = handoff((0, 1), rounds=500, spin=True)
    assert spin.rounds == 500 and spin.mode == "spin"


def test_spinning_on_one_cpu_is_refused_with_a_message():
    first = min(cpupin.process_cpus())
    with pytest.raises(ValueError, match="two different CPUs"):
        handoff((first, first), spin=True)
    with pytest.raises(ValueError, match="two different CPUs"):
        handoff((None, None), spin=True)


def test_a_cpu_outside_the_mask_is_refused_with_a_message():
    outside = max(cpupin.online_cpus()) + 1
    first = min(cpupin.process_cpus())
    with pytest.raises(ValueError, match=f"CPU {outside} is outside the process mask"):
        handoff((first, outside))
    with pytest.raises(ValueError, match="outside the process mask"):
        handoff_python((outside, first), rounds=10)


@pytest.mark.parametrize("kind", ["event", "queue"])
def test_the_python_handoff(kind):
    cpu = min(cpupin.process_cpus())
    result = handoff_python((cpu, cpu), rounds=200, kind=kind)
    assert result.rounds == 200 and result.mode == f"python-{kind}" and result.median_ns > 0


def test_pair_kinds_of_the_dgx_h100():
    host = host_named("dgx-h100")
    kinds = pair_kinds(host, host.cpus)
    assert kinds == {
        "same CPU": (0, 0),
        "SMT sibling": (0, 112),
        "other core": (0, 1),
        "other node": (0, 56),
        "unpinned": (None, None),
    }
    assert "other node" not in pair_kinds(host, range(56))


def test_pair_kinds_split_other_core_by_last_level_cache_on_the_epyc():
    """The EPYC's node has an L3 every 8 cores (CPUs c and c+192): the pairs
    are one under CPU 0's L3 and one under the next."""
    host = host_named("amd-8gpu")
    assert pair_kinds(host, host.cpus) == {
        "same CPU": (0, 0),
        "SMT sibling": (0, 192),
        "same L3": (0, 1),
        "other L3": (0, 8),
        "other node": (0, 96),
        "unpinned": (None, None),
    }
    # One complex in the mask: one L3, so no split.
    assert "other core" in pair_kinds(host, range(8))
    assert "other L3" not in pair_kinds(host, range(8))
    # Only CPUs under other L3s than CPU 0's besides it: no same-L3 pair.
    kinds = pair_kinds(host, [0, 8, 16])
    assert kinds["other L3"] == (0, 8) and "same L3" not in kinds


def test_the_doctor_compares_handoffs_within_and_across_l3():
    host = host_named("amd-8gpu")
    fake = {
        k: cpupin.measure.handoff.HandoffResult((0, 1), "futex", i, 100, m, m, m, m, m)
        for k, i, m in [
            ("same CPU busy", 0, 4_000),
            ("same L3 busy", 0, 5_000),
            ("same L3 idle", 200, 9_000),
            ("other L3 busy", 0, 7_000),
            ("other L3 idle", 200, 11_000),
        ]
    }
    d = diagnose(host, fake)
    assert d.verdict == "off" and "(same L3)" in d.why
    assert any("7.0 µs against 5.0 µs" in note for note in d.notes)


# --- the doctor -------------------------------------------------------------------


def doctor_json(*args, capsys):
    assert main(["doctor", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_doctor_on_this_machine_follows_its_own_numbers(capsys):
    data = doctor_json(capsys=capsys)
    assert {"verdict", "why", "deepest_idle_state", "handoff_ns"} <= set(data)
    assert data["verdict"] in ("auto", "off", "hold", "unknown")
    host = read_host("/")
    deepest = host.deepest_idle_state()
    if deepest is None:  # a VM that lists no idle states: the doctor says so
        assert data["deepest_idle_state"] is None and "no idle states" in data["why"]
    else:
        assert data["deepest_idle_state"] == {
            "name": deepest.name,
            "latency_us": deepest.latency_us,
        }
    handoffs = data["handoff_ns"]
    kind = next((k for k in ("other core", "same L3", "other L3") if f"{k} idle" in handoffs), None)
    if data["verdict"] == "unknown":  # a busy host: the runs' spread could turn it
        assert data["why"].startswith("host too busy to judge: rerun on a quiet host")
        idle_kind = next(
            k for k in data["spread_ns"] if k.endswith(" idle") and k != "same CPU idle"
        )
        busy_lo, busy_hi = data["spread_ns"][idle_kind.replace("idle", "busy")]
        idle_lo, idle_hi = data["spread_ns"][idle_kind]
        held = data["spread_ns"].get(idle_kind.replace("idle", "held"))
        assert (idle_lo - busy_hi < IDLE_PENALTY_NS <= idle_hi - busy_lo) or held is not None
        kind = None  # the quietest runs' figures no longer decide
    if kind is not None:
        idle = handoffs[f"{kind} idle"]
        penalty = (idle["wake_median_ns"] or idle["median_ns"]) - handoffs[f"{kind} busy"][
            "median_ns"
        ]
        if penalty >= IDLE_PENALTY_NS:
            assert data["verdict"] == "auto"
        else:  # pinning does not pay; the hold, where it was measured and pays, does
            pays = (data["hold"] or "").startswith("pays")
            assert data["verdict"] == ("hold" if pays else "off"), data["hold"]
            held = handoffs.get(f"{kind} held")
            assert (held is not None) or not pays
    if host.hypervisor:
        assert any("virtual machine" in note for note in data["notes"])


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_the_doctor_on_a_shipped_host_follows_the_idle_state_rule(name, capsys):
    data = doctor_json("--host", name, capsys=capsys)
    deepest = max(lat for _, lat in HOSTS[name].idle_states)
    assert data["verdict"] == ("auto" if deepest >= IDLE_STATE_US else "off")
    assert data["handoff_ns"] == {} and data["measured_on"] == "nowhere"
    assert "not measured" in data["why"]


def test_the_doctor_can_measure_here_for_a_shipped_host_and_says_so(capsys):
    data = doctor_json("--host", "dgx-h100", "--measure-here", capsys=capsys)
    assert data["measured_on"] == "this machine, not dgx-h100"
    assert data["handoff_ns"]


def test_the_doctor_from_numbers_alone():
    host = host_named("xeon6-b300")
    fake = fake_handoffs(
        [
            ("same CPU busy", 0, 4_500, 4_500),
            ("other core busy", 0, 5_000, 5_000),
            ("other core idle", 200, 90_000, 140_000),
        ]
    )
    d = diagnose(host, fake)
    assert d.verdict == "auto" and "140 µs" in d.why and "C6 at 170 µs" in d.why
    fake["other core idle"] = cpupin.measure.handoff.HandoffResult(
        (0, 1), "futex", 200, 100, 20_000, 1, 1, 22_000, 1
    )
    assert diagnose(host, fake).verdict == "off"


# --- the commands -------------------------------------------------------------------


def test_a_wake_that_came_out_faster_than_a_running_core_is_called_noise():
    """The idle handoff measured below the running one: never "within 0.0
    µs" (a clamped difference shown as a finding), but noise, said so."""
    host = host_named("h100-vm")
    fake = fake_handoffs(
        [
            ("same CPU busy", 0, 4_000, 4_000),
            ("other core busy", 0, 30_000, 30_000),
            ("other core idle", 200, 20_000, 20_000),
        ]
    )
    d = diagnose(host, fake)
    assert d.verdict == "off" and "0.0 µs" not in d.why and "noise" in d.why


@pytest.mark.parametrize("medians", [[700_000, 5_000, 6_000], [5_000, 5_500, 6_000]])
def test_the_doctor_keeps_the_quietest_of_its_repeats_and_says_when_they_disagree(
    medians, monkeypatch
):
    """Right after an install the first handoff can be 700 µs and the next
    5 µs: the doctor measures each pair three times, keeps the lowest, and
    names a pair whose runs disagree by more than twice."""
    from cpupin.measure import doctor

    calls = []

    def fake_handoff(cpus, rounds, warmup, idle_us=0):
        key = (tuple(cpus), idle_us)  # each pair's runs go through the medians in turn
        m = medians[calls.count(key) % len(medians)]
        calls.append(key)
        return cpupin.measure.handoff.HandoffResult(tuple(cpus), "futex", idle_us, rounds, m, m, m)

    monkeypatch.setattr(doctor, "handoff", fake_handoff)
    noise = []
    got = doctor.measure_host(host_named("h100-vm"), frozenset({0, 1}), noise=noise)
    assert all(r.median_ns == min(medians) for r in got.values())
    assert bool(noise) == (max(medians) > 2 * min(medians))
    assert all("the lowest kept" in line for line in noise)


# --- the verdict against the measurement's own spread ---------------------------

LOAD = {"load1": 9.5, "running": 6, "cpus": 2}


def _vm(idle_ns, held_ns=None):
    rows = [
        ("same CPU busy", 0, 4_500, 4_500),
        ("other core busy", 0, 5_000, 5_000),
        ("other core idle", 200, idle_ns, idle_ns),
    ]
    if held_ns is not None:
        rows.append(("other core held", 200, held_ns, held_ns))
    return fake_handoffs(rows)


def test_a_spread_that_straddles_the_penalty_gives_no_verdict():
    """Idle 60 µs over a running core in the quietest run (auto), but 40 µs
    in another: the runs fall either side of the 50 µs that decides."""
    host = host_named("h100-vm")
    fake = _vm(65_000)
    spread = {"other core idle": (45_000, 65_000), "other core busy": (5_000, 5_500)}
    quiet = diagnose(host, fake)
    busy = diagnose(host, fake, spread=spread, load=LOAD)
    assert quiet.verdict == "auto"
    assert busy.verdict == "unknown", busy.why
    assert busy.why.startswith("host too busy to judge: rerun on a quiet host")
    assert "load 9.5" in busy.why and "said auto" in busy.why
    data = busy.as_dict()
    assert data["spread_ns"]["other core idle"] == [45_000, 65_000] and data["load"] == LOAD


def test_a_spread_within_one_side_keeps_the_verdict():
    host = host_named("h100-vm")
    fake = _vm(140_000)
    tight = {"other core idle": (135_000, 150_000), "other core busy": (5_000, 6_000)}
    assert diagnose(host, fake, spread=tight, load=LOAD).verdict == "auto"
    low = _vm(20_000)
    tight = {"other core idle": (19_000, 22_000), "other core busy": (5_000, 6_000)}
    assert diagnose(host, low, spread=tight, load=LOAD).verdict == "off"


def test_a_hold_that_pays_in_one_run_and_not_another_gives_no_verdict():
    host = host_named("h100-vm")
    fake = _vm(30_000, held_ns=6_000)
    quiet = diagnose(host, fake)
    assert quiet.verdict == "hold", quiet.why
    spread = {
        "same CPU busy": (4_500, 4_600),
        "other core busy": (5_000, 5_200),
        "other core idle": (30_000, 31_000),
        "other core held": (6_000, 29_000),  # one run held nothing back
    }
    judged = diagnose(host, fake, spread=spread, load=LOAD)
    assert judged.verdict == "unknown" and "the hold saved" in judged.why


@given(
    idle=st.integers(5_000, 400_000),
    lo=st.integers(0, 100_000),
    hi=st.integers(0, 100_000),
)
def test_the_verdict_is_given_only_when_both_ends_of_the_spread_agree(idle, lo, hi):
    host = host_named("h100-vm")
    fake = _vm(idle)
    spread = {"other core idle": (max(1, idle - lo), idle + hi), "other core busy": (5_000, 5_000)}
    d = diagnose(host, fake, spread=spread)
    ends = {diagnose(host, _vm(v)).verdict for v in spread["other core idle"]}
    if d.verdict == "unknown":
        assert len(ends) == 2, (ends, d.why)
    else:
        assert d.verdict == diagnose(host, fake).verdict
