"""Placement against docs/placement.md: its worked examples, the reference review's
cases, the setting's inputs, and properties over random hosts and masks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import PlanError, parse_cpulist, parse_setting, place, setting_from_env
from cpupin.host.shapes import HOSTS, host_named
from tests.support.specs import spec_host
from tests.support.strategies import host_specs, masks

B300 = host_named("xeon6-b300")  # 4 nodes of 32 cores, siblings at +128, 2 GPUs a node
GPUS = [g.address for g in B300.gpus]


def plan(mask, devices, setting="auto", host=B300):
    return place(host, parse_cpulist(mask), devices, setting)


# --- docs/placement.md's worked examples ------------------------------------------


def test_the_second_gpu_of_node_3_under_8_cores_of_node_3():
    p = plan("96-103,224-231", [GPUS[7]])
    assert p.pinned and p.step_cpus == ((97, 225),) and p.result_cpu == 102


def test_off_node_gpus_pick_from_the_cores_node_1_leaves():
    placements = [plan("32-47,160-175", [g]) for g in GPUS]
    node1 = [p for p, g in zip(placements, B300.gpus) if g.node == 1]
    assert {c for p in node1 for c in p.step_cpus[0][:1]} | {p.result_cpu for p in node1} == {
        32,
        33,
        46,
        47,
    }
    off_node = [p for p, g in zip(placements, B300.gpus) if g.node != 1]
    assert off_node[1].step_cpus == ((35, 163),) and off_node[1].result_cpu == 44
    assert all(34 <= p.step_cpus[0][0] <= 45 and 34 <= p.result_cpu <= 45 for p in off_node)


def test_eight_cpus_of_node_1_leave_too_few_cores_for_six_off_node_gpus():
    placements = {g: plan("32-39", [g]) for g in GPUS}
    for g, p in placements.items():
        if g in (GPUS[2], GPUS[3]):  # node 1's own: cores 32, 33 and 38, 39
            assert p.pinned
        else:
            assert not p.pinned
            assert "4 core(s) for 6 GPU(s), and each needs two" in p.reason
            assert "widen the mask or name a CPU" in p.reason
    assert placements[GPUS[2]].step_cpus == ((32,),) and placements[GPUS[2]].result_cpu == 39
    assert placements[GPUS[3]].step_cpus == ((33,),) and placements[GPUS[3]].result_cpu == 38


def test_a_node_local_pool_too_small_names_the_node_and_the_numbers():
    p = plan("32-34", [GPUS[2]])
    assert not p.pinned
    assert p.reason.startswith(
        "node 1: 3 core(s) for 2 GPU(s), and each needs two; widen the mask or name a CPU"
    )


def test_a_cpu_number_outside_the_mask_fails_at_startup():
    with pytest.raises(PlanError, match="step_thread_core 5 is outside the process mask 96-103"):
        plan("96-103", ["w0"], 5)


def test_a_cpu_number_too_near_the_top_fails_at_startup():
    with pytest.raises(
        PlanError, match="step_thread_core 101 leaves no allowed CPU for worker 2 in 96-103"
    ):
        plan("96-103", ["w0", "w1", "w2"], 101)


def test_a_cpu_number_places_workers_upward_and_results_on_the_top_cpu():
    p = plan("96-103,224-231", ["w0", "w1"], 97)
    assert p.step_cpus == ((97, 225), (98, 226)) and p.result_cpu == 231
    # the core holding the result CPU is left out
    p = plan("96-103", ["w0", "w1"], 101)
    assert p.step_cpus == ((101,), (102,)) and p.result_cpu == 103


def test_a_split_config_steps_through_the_middle_by_the_peer_count():
    p = plan("96-127,224-255", [GPUS[6], GPUS[6]])
    assert p.step_cpus == ((96, 224), (98, 226)) and p.result_cpu == 127


def test_a_split_worker_past_the_middle_pins_nothing():
    p = plan("96-99", [GPUS[6], GPUS[6]])
    assert not p.pinned and "runs past the middle" in p.reason


def test_a_split_worker_with_off_node_gpus_says_it_may_meet_them():
    p = plan("96-127,224-255", [GPUS[6], GPUS[6]])
    assert "may also take" in p.reason


def test_a_server_with_several_gpus_takes_its_result_cpu_from_the_first():
    p = plan("0-127,128-255", [GPUS[3], GPUS[0]])
    assert p.step_cpus == ((33, 161), (0, 128))
    assert p.result_cpu == 62


def test_nothing_pinned_for_off_an_unknown_device_or_a_host_without_gpus():
    assert not plan("0-255", [GPUS[0]], "off").pinned
    p = plan("0-255", ["0000:99:00.0"])
    assert not p.pinned and "0000:99:00.0 is not one of the host's GPUs" in p.reason
    gh = host_named("gh200")
    no_gpus = type(gh)(**{**gh.__dict__, "gpus": ()})
    assert "no GPU" in place(no_gpus, gh.cpus, ["0000:01:00.0"], "auto").reason


def test_device_spellings_are_one_gpu():
    a = plan("96-103,224-231", ["0000:fa:00.0"])
    b = plan("96-103,224-231", ["00000000:FA:00.0"])
    assert a == b and a.devices == ("0000:fa:00.0",)


def test_the_dgx_h100_gives_every_gpu_its_own_cores():
    dgx = host_named("dgx-h100")
    placements = [place(dgx, dgx.cpus, [g.address], "auto") for g in dgx.gpus]
    assert [p.step_cpus[0] for p in placements] == [
        (0, 112),
        (1, 113),
        (2, 114),
        (3, 115),
        (56, 168),
        (57, 169),
        (58, 170),
        (59, 171),
    ]
    assert [p.result_cpu for p in placements] == [55, 54, 53, 52, 111, 110, 109, 108]


# --- the setting --------------------------------------------------------------


@pytest.mark.parametrize(
    "value, setting",
    [
        (None, "off"),
        (False, "off"),
        ("off", "off"),
        (" auto\n", "auto"),
        ("AUTO", "auto"),
        ("Off", "off"),
        (5, 5),
        ("5", 5),
        (" 12 ", 12),
        ("007", 7),
        (0, 0),
    ],
)
def test_settings_accepted(value, setting):
    assert parse_setting(value) == setting


@pytest.mark.parametrize(
    "value",
    [True, "on", "-1", -1, "0x5", "5.0", "1_0", "٣", "５", "", "  ", "auto,off", 5.0, [5], "+5"],
)
def test_bad_settings_list_the_accepted_forms(value):
    with pytest.raises(PlanError) as info:
        parse_setting(value)
    assert "'off' (the default), 'auto', or a CPU number" in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_the_setting_from_the_environment():
    assert setting_from_env({}) == "off"
    assert setting_from_env({"CPUPIN_STEP_THREAD_CORE": "auto"}) == "auto"
    with pytest.raises(PlanError, match="CPUPIN_STEP_THREAD_CORE='on'"):
        setting_from_env({"CPUPIN_STEP_THREAD_CORE": "on"})


# --- properties over random hosts and masks -------------------------------------


def pools(host, allowed):
    """P(n), G(n), O and L, computed afresh from docs/placement.md's words:
    each pool in its order, the highest class first, then by lowest allowed
    CPU; reserved cores and L taken in that order."""
    rank = {cpu: core.rank for core in host.cores for cpu in core.cpus}
    cores = [tuple(c for c in core.cpus if c in allowed) for core in host.cores]
    cores = sorted((c for c in cores if c), key=lambda c: (rank[c[0]], c[0]))
    p = {n.id: [c for c in cores if c[0] in n.cpus] for n in host.nodes}
    g = {n.id: [x for x in host.gpus if x.node == n.id] for n in host.nodes}
    local = {x.address for x in host.gpus if x.node is not None and p.get(x.node)}
    off = [x for x in host.gpus if x.address not in local]
    reserved = set()
    for n in p:
        if p[n] and g[n]:
            reserved |= set(p[n][: len(g[n])]) | set(p[n][-len(g[n]) :])
    leftover = [c for c in cores if c not in reserved]
    return p, g, off, leftover, local


@st.composite
def host_and_mask(draw):
    host = spec_host(draw(host_specs(max_cores=96)))
    return host, draw(masks(host))


def all_gpus(host, mask):
    return [place(host, mask, [g.address], "auto") for g in host.gpus]


@settings(max_examples=1500)
@given(host_and_mask())
def test_properties_of_the_all_gpus_view(case):
    """Every pinned CPU is allowed; a worker's CPUs are one core's allowed
    CPUs; no two GPUs' servers share a CPU; no result CPU lies on a step core;
    a node-local GPU's CPUs are on its node; a GPU pins exactly when its pool
    has two cores for each of its peers."""
    host, mask = case
    allowed = mask & host.cpus
    p, g, off, leftover, local = pools(host, allowed)
    core_sets = {tuple(c for c in core.cpus if c in allowed) for core in host.cores}
    node_of = {cpu: n.id for n in host.nodes for cpu in n.cpus}
    seen = set()
    steps = set()
    results = set()
    for gpu, placement in zip(host.gpus, all_gpus(host, mask)):
        if gpu.address in local:
            pool, peers = len(p[gpu.node]), len(g[gpu.node])
        else:
            pool, peers = len(leftover), len(off)
        assert placement.pinned == (pool >= 2 * peers), placement.reason
        if not placement.pinned:
            assert "each needs two" in placement.reason
            assert placement.workers == () and placement.result_cpu is None
            continue
        (worker,) = placement.workers
        assert worker.cpus in core_sets
        assert placement.cpus <= allowed
        assert not placement.cpus & seen
        seen |= placement.cpus
        steps |= set(worker.cpus)
        results.add(placement.result_cpu)
        if gpu.address in local:
            assert {node_of[c] for c in placement.cpus} == {gpu.node}
    assert not results & steps


@settings(max_examples=300)
@given(host_and_mask(), st.data())
def test_a_plan_is_a_function_of_its_inputs(case, data):
    """The same inputs give the same plan, whatever container the mask is in."""
    host, mask = case
    devices = data.draw(
        st.lists(st.sampled_from([g.address for g in host.gpus] or ["x"]), min_size=1, max_size=3)
    )
    setting = data.draw(st.sampled_from(["auto", "off", *sorted(host.cpus)[:3]]))
    try:
        first = place(host, mask, devices, setting)
    except PlanError as exc:
        with pytest.raises(PlanError, match=str(exc)[:20]):
            place(host, sorted(mask), list(devices), setting)
        return
    assert place(host, sorted(mask, reverse=True), tuple(devices), str(setting)) == first
    if first.pinned:
        assert first.cpus <= mask
        assert all(w.cpus for w in first.workers)
        assert first.result_cpu not in {c for w in first.workers for c in w.cpus}


@settings(max_examples=300)
@given(host_and_mask(), st.data())
def test_a_cpu_number_pins_every_worker_or_fails_at_startup(case, data):
    """A CPU number never pins some workers and not others."""
    host, mask = case
    allowed = sorted(mask & host.cpus)
    if not allowed:
        return
    first = data.draw(st.sampled_from(allowed))
    workers = data.draw(st.integers(1, 4))
    try:
        p = place(host, mask, [f"w{i}" for i in range(workers)], first)
    except PlanError as exc:
        assert f"step_thread_core {first}" in str(exc)
        return
    assert p.pinned and len(p.workers) == workers and p.result_cpu == allowed[-1]
    shares = any(first in core.cpus and p.result_cpu in core.cpus for core in host.cores)
    assert (first in p.workers[0].cpus) != shares
    assert (
        len({c for w in p.workers for c in w.cpus} | {p.result_cpu})
        == sum(len(w.cpus) for w in p.workers) + 1
    )


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_the_shipped_hosts_under_their_whole_mask(name):
    host = host_named(name)
    placements = all_gpus(host, host.cpus)
    assert all(p.pinned for p in placements)
    cpus = [p.cpus for p in placements]
    assert sum(len(c) for c in cpus) == len(frozenset().union(*cpus))


def test_docs_placement_states_the_numbers_these_tests_compute():
    """The repository's own rulebook carries the worked examples' numbers."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "placement.md").read_text()
    first = place(B300, parse_cpulist("96-103,224-231"), ["0000:fa:00.0"], "auto")
    assert first.step_cpus == ((97, 225),) and first.result_cpu == 102
    second = place(B300, parse_cpulist("32-47,160-175"), [GPUS[1]], "auto")  # 2nd off-node
    assert second.step_cpus == ((35, 163),) and second.result_cpu == 44
    third = place(B300, parse_cpulist("32-39"), [GPUS[0]], "auto")
    assert "4 core(s) for 6 GPU(s), and each needs two" in third.reason
    for fact in ("**97,225**", "**102**", "**35,163**", "core **44**", "4 core(s) for 6 GPU(s)"):
        assert fact in text, fact
    pct = [place(PCT, PCT.cpus, [gpu], "auto") for gpu in ("0000:17:00.0", "0000:3d:00.0")]
    assert [p.step_cpus for p in pct] == [((4, 132),), ((12, 140),)]
    assert [p.result_cpu for p in pct] == [31, 30]
    bf = place(SST_BF, SST_BF.cpus, ["0000:3b:00.0"], "auto")
    assert bf.step_cpus == ((3, 51),) and bf.result_cpu == 22
    for fact in ("**4,132**", "**12,140**", "**31** and **30**", "**3,51**", "**22**"):
        assert fact in text, fact


# --- core classes -----------------------------------------------------------------

PCT = host_named("xeon6-pct")  # B300's shape; cores 4, 12, 20, 28 of each node on top
SST_BF = host_named("xeon-sst-bf")  # every third core of a socket at a higher base


@settings(max_examples=600)
@given(host_and_mask())
def test_each_gpu_takes_the_core_the_rules_name_highest_class_first(case):
    """The whole rule, computed afresh: GPU locality picks the pool, the
    pool runs from its highest class down, the GPU's rank picks the step
    core from the bottom and the result CPU from the top. With one class
    the order is the CPU order of today's rule."""
    host, mask = case
    allowed = mask & host.cpus
    p, g, off, leftover, local = pools(host, allowed)
    for gpu, placement in zip(host.gpus, all_gpus(host, mask)):
        q, k = (p[gpu.node], g[gpu.node]) if gpu.address in local else (leftover, off)
        if len(q) < 2 * len(k):
            assert not placement.pinned
            continue
        r = k.index(gpu)
        assert placement.step_cpus == (q[r],)
        assert placement.result_cpu == min(q[len(q) - 1 - r])


@settings(max_examples=300)
@given(host_and_mask())
def test_step_threads_never_take_more_highest_class_cores_than_a_package_has(case):
    """The budget: over every GPU's server, the highest-class cores that step
    threads take in a package are distinct and at most the package's; and a
    GPU whose rank is below its node's count of them gets one."""
    host, mask = case
    allowed = mask & host.cpus
    top = {cpu for core in host.cores if core.rank == 0 for cpu in core.cpus}
    package = {cpu: core.package for core in host.cores for cpu in core.cpus}
    taken: dict[object, list[int]] = {}
    p, g, _, _, local = pools(host, allowed)
    for gpu, placement in zip(host.gpus, all_gpus(host, mask)):
        if not placement.pinned:
            continue
        (cpus,) = placement.step_cpus
        if cpus[0] in top:
            taken.setdefault(package[cpus[0]], []).append(cpus[0])
        if gpu.address in local:
            on_top = [c for c in p[gpu.node] if c[0] in top]
            assert (cpus[0] in top) == (g[gpu.node].index(gpu) < len(on_top))
    for pkg, firsts in taken.items():
        budget = sum(1 for core in host.cores if core.rank == 0 and core.package == pkg)
        assert len(firsts) == len(set(firsts)) <= budget


def test_priority_cores_take_the_step_threads_and_the_others_the_results():
    """docs/placement.md's worked examples on xeon6-pct and xeon-sst-bf."""
    first = place(PCT, PCT.cpus, ["0000:17:00.0"], "auto")
    assert first.step_cpus == ((4, 132),) and first.result_cpu == 31
    second = place(PCT, PCT.cpus, ["0000:3d:00.0"], "auto")
    assert second.step_cpus == ((12, 140),) and second.result_cpu == 30
    split = place(PCT, PCT.cpus, ["0000:17:00.0"] * 3, "auto")
    assert split.step_cpus == ((4, 132), (20, 148), (0, 128))
    # Only cores 0-3 of node 0 in the mask: no priority core, so the CPU order.
    narrow = place(PCT, parse_cpulist("0-3,128-131"), ["0000:3d:00.0"], "auto")
    assert narrow.step_cpus == ((1, 129),) and narrow.result_cpu == 2
    bf = place(SST_BF, SST_BF.cpus, ["0000:3b:00.0"], "auto")
    assert bf.step_cpus == ((3, 51),) and bf.result_cpu == 22


def test_a_host_of_one_class_places_as_one_without_figures():
    """Figures that are all alike change nothing: the B300 with every core at
    highest_perf 38 places exactly as the B300 without figures."""
    from dataclasses import replace

    from cpupin.host.shapes import HOSTS, build_tree
    from cpupin.host.topology import read_host

    spec = replace(HOSTS["xeon6-b300"], perf=(("highest_perf", 38), ("nominal_perf", 20)))
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        alike = read_host(build_tree(spec, root))
    assert len(alike.classes) == 1
    for mask in (B300.cpus, parse_cpulist("96-103,224-231"), parse_cpulist("32-47")):
        assert all_gpus(alike, mask) == all_gpus(B300, mask)
