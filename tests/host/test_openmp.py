"""Where libgomp puts an OpenMP team, read as libgomp reads the
environment: against libgomp itself (a probe built with gcc -fopenmp that
prints its places and its team's masks), over a table of environments and
random ones, and against libgomp's documented rules on shipped hosts."""

import json
import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin.host.openmp import libgomp_binding, omp_team_cpus
from cpupin.host.shapes import host_named
from cpupin.host.topology import read_host
from tests.support.probe import build_omp_probe

#: omp_get_proc_bind()'s numbers (primary is master's new name).
BIND = {"true": 1, "master": 2, "primary": 2, "close": 3, "spread": 4}


@pytest.fixture(scope="module")
def libgomp(tmp_path_factory):
    """Run the probe under an environment: (bind, places, team masks or
    None when libgomp ended the program: a place with no CPU of the mask)."""
    probe = build_omp_probe(tmp_path_factory.mktemp("omp"))

    def ask(env):
        out = subprocess.run([probe], env=env, capture_output=True, text=True, timeout=30)
        first, _, rest = out.stdout.partition("\n")
        head = json.loads(first)
        team = json.loads(rest) if out.returncode == 0 else None
        assert team is not None or "Thread creation failed" in out.stderr, out.stderr
        return head["bind"], [frozenset(p) for p in head["places"]], team

    return ask


def agree(ask, env):
    mask = frozenset(os.sched_getaffinity(0))
    bind, places, team = ask(env)
    found = libgomp_binding(env, mask, read_host("/"))
    assert (0 if found is None else BIND[found.bind]) == bind, (env, found)
    assert ([] if found is None else list(found.places)) == places, (env, found)
    if team is not None:
        cpus = frozenset(c for mask_ in team for c in mask_)
        assert (mask if found is None else found.cpus) == cpus, (env, found, team)


ENVIRONMENTS = [
    {"OMP_PLACES": "{0}:4"},
    {"OMP_PLACES": "{0},{1}"},
    {"OMP_PLACES": "{1},{0}"},
    {"OMP_PLACES": "{}"},
    {"OMP_PLACES": "{0:2}"},
    {"OMP_PLACES": "{0:2:1}"},
    {"OMP_PLACES": "{1:2:-1}"},
    {"OMP_PLACES": "0,1"},
    {"OMP_PLACES": "1"},
    {"OMP_PLACES": "!{0},{0},{1}"},
    {"OMP_PLACES": "{0},{1},!{0}"},
    {"OMP_PLACES": "{0,1,!0}"},
    {"OMP_PLACES": "cores"},
    {"OMP_PLACES": "threads"},
    {"OMP_PLACES": "threads(1)"},
    {"OMP_PLACES": "cores(0)"},
    {"OMP_PLACES": "sockets"},
    {"OMP_PLACES": "ll_caches"},
    {"OMP_PLACES": "numa_domains"},
    {"OMP_PLACES": "{70}"},
    {"OMP_PLACES": " {0} , {1} "},
    {"OMP_PLACES": "{0}:2:1"},
    {"OMP_PLACES": "{1}:2:-1"},
    {"OMP_PLACES": "{0}:3:-1"},
    {"OMP_PLACES": "x"},
    {"OMP_PLACES": "{0},"},
    {"OMP_PLACES": "{+1}"},
    {"OMP_PLACES": "{-1}"},
    {"OMP_PLACES": "{0 : 2}"},
    {"OMP_PLACES": "THREADS"},
    {"OMP_PLACES": "cores (1)"},
    {"OMP_PLACES": "{5}"},
    {"OMP_PLACES": "{0,5}"},
    {"GOMP_CPU_AFFINITY": "0"},
    {"GOMP_CPU_AFFINITY": "1"},
    {"GOMP_CPU_AFFINITY": "0 1"},
    {"GOMP_CPU_AFFINITY": "1 0"},
    {"GOMP_CPU_AFFINITY": "0-1"},
    {"GOMP_CPU_AFFINITY": "0,1"},
    {"GOMP_CPU_AFFINITY": "5"},
    {"GOMP_CPU_AFFINITY": "0x1"},
    {"GOMP_CPU_AFFINITY": "01"},
    {"GOMP_CPU_AFFINITY": "x"},
    {"GOMP_CPU_AFFINITY": "0-3:2"},
    {"GOMP_CPU_AFFINITY": "70"},
    {"GOMP_CPU_AFFINITY": "0,"},
    {"GOMP_CPU_AFFINITY": " 1"},
    {"GOMP_CPU_AFFINITY": "1-0"},
    {"GOMP_CPU_AFFINITY": "0:2"},
    {"GOMP_CPU_AFFINITY": "-1"},
    {"GOMP_CPU_AFFINITY": "0-1:0"},
    {"GOMP_CPU_AFFINITY": "0--1"},
    {"GOMP_CPU_AFFINITY": "1,,0"},
    {"OMP_PROC_BIND": "false"},
    {"OMP_PROC_BIND": "true"},
    {"OMP_PROC_BIND": "master"},
    {"OMP_PROC_BIND": "primary"},
    {"OMP_PROC_BIND": "close"},
    {"OMP_PROC_BIND": "spread"},
    {"OMP_PROC_BIND": "spread,close"},
    {"OMP_PROC_BIND": "true,close"},
    {"OMP_PROC_BIND": "FALSE"},
    {"OMP_PROC_BIND": "x"},
    {"OMP_PROC_BIND": " close "},
    {"OMP_PROC_BIND": "master,"},
    {"OMP_PROC_BIND": "close,true"},
    {"OMP_PROC_BIND": "false", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "false", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "false", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "false", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "false", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "false", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "false", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "false", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "false", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "true", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "true", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "true", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "true", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "true", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "master", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "master", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "master", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "master", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "master", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "master", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "master", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "master", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "master", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "primary", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "primary", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "primary", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "primary", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "primary", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "primary", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "primary", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "primary", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "primary", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "close", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "close", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "close", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "close", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "close", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "close", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "close", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "close", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "close", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "spread", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "spread", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "spread", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "spread", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "spread", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "spread", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "spread", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "spread", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "spread", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "spread,close", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "spread,close", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "spread,close", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "spread,close", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "spread,close", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "spread,close", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "spread,close", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "spread,close", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "spread,close", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "true,close", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "true,close", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "true,close", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "true,close", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "true,close", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "true,close", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "true,close", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "true,close", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "true,close", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "FALSE", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "FALSE", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "FALSE", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "FALSE", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "FALSE", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "FALSE", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "FALSE", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "FALSE", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "FALSE", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "x", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "x", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "x", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "x", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "x", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "x", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "x", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "x", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "x", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": " close ", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": " close ", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": " close ", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": " close ", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": " close ", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": " close ", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": " close ", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": " close ", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": " close ", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "master,", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "master,", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "master,", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "master,", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "master,", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "master,", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "master,", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "master,", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "master,", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PROC_BIND": "close,true", "OMP_PLACES": "{0}:4"},
    {"OMP_PROC_BIND": "close,true", "OMP_PLACES": "{1},{0}"},
    {"OMP_PROC_BIND": "close,true", "OMP_PLACES": "x"},
    {"OMP_PROC_BIND": "close,true", "OMP_PLACES": "threads"},
    {"OMP_PROC_BIND": "close,true", "OMP_PLACES": "{}"},
    {"OMP_PROC_BIND": "close,true", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PROC_BIND": "close,true", "GOMP_CPU_AFFINITY": "1 0"},
    {"OMP_PROC_BIND": "close,true", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PROC_BIND": "close,true", "GOMP_CPU_AFFINITY": "5"},
    {"OMP_PLACES": "{0}:4", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PLACES": "{0}:4", "GOMP_CPU_AFFINITY": "0 1"},
    {"OMP_PLACES": "{0}:4", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PLACES": "x", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PLACES": "x", "GOMP_CPU_AFFINITY": "0 1"},
    {"OMP_PLACES": "x", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PLACES": "{}", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PLACES": "{}", "GOMP_CPU_AFFINITY": "0 1"},
    {"OMP_PLACES": "{}", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PLACES": "{1}", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PLACES": "{1}", "GOMP_CPU_AFFINITY": "0 1"},
    {"OMP_PLACES": "{1}", "GOMP_CPU_AFFINITY": "x"},
    {"OMP_PLACES": "cores(0)", "GOMP_CPU_AFFINITY": "1"},
    {"OMP_PLACES": "cores(0)", "GOMP_CPU_AFFINITY": "0 1"},
    {"OMP_PLACES": "cores(0)", "GOMP_CPU_AFFINITY": "x"},
]


@pytest.mark.parametrize(
    "env", ENVIRONMENTS, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e in ENVIRONMENTS]
)
def test_each_environment_is_read_as_libgomp_reads_it(libgomp, env):
    agree(libgomp, env)


def _num():
    return st.sampled_from(["0", "1", "2", "3", "63", "64", "+1", "-1", " 1", "01"])


@st.composite
def _place(draw):
    bang = draw(st.sampled_from(["", "!"]))
    if draw(st.booleans()):
        body = bang + draw(_num())
    else:
        items = []
        for _ in range(draw(st.integers(0, 3))):
            item = draw(st.sampled_from(["", "!"])) + draw(_num())
            item += draw(st.sampled_from(["", "", ":1", ":2", ":0", ":", ": 2"]))
            item += draw(st.sampled_from(["", "", ":1", ":-1", ":2", ":", ":x"]))
            items.append(item)
        body = bang + "{" + ",".join(items) + "}"
    body += draw(st.sampled_from(["", "", ":2", ":3", ":0", ":", ":2:-1", ":2:2", ":2:"]))
    return body


_PLACES = st.one_of(
    st.lists(_place(), min_size=1, max_size=3).map(",".join),
    st.sampled_from(["threads", "cores", "sockets", "ll_caches", "numa_domains"]).flatmap(
        lambda w: st.sampled_from([w, w + "(1)", w + "(0)", w + " ( 2 ) ", w + "x", w.upper()])
    ),
    st.text(alphabet="{}:,!-+ 0123456789x", max_size=10),
)
_GOMP = st.one_of(
    st.lists(
        st.tuples(
            st.sampled_from(["0", "1", "2", "0x1", "01", "63", "64", "x", ""]),
            st.sampled_from(["", "", "-1", "-3", "-0", "-63", "-64", "- 1"]),
            st.sampled_from(["", "", ":2", ":0", ":1", ":"]),
        ).map("".join),
        min_size=1,
        max_size=3,
    ).flatmap(lambda parts: st.sampled_from([" ", ",", " , ", ",,"]).map(lambda s: s.join(parts))),
    st.text(alphabet="-:, 0123456789x", max_size=8),
)
_BIND = st.sampled_from(
    [
        "false",
        "true",
        "master",
        "primary",
        "close",
        "spread",
        "close,master",
        "true,close",
        "x",
        " ",
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={"OMP_PLACES": _PLACES, "GOMP_CPU_AFFINITY": _GOMP, "OMP_PROC_BIND": _BIND},
    )
)
def test_random_environments_are_read_as_libgomp_reads_them(libgomp, env):
    agree(libgomp, env)


# --- libgomp's rules, on hosts this machine is not ----------------------------

H100 = host_named("dgx-h100")  # 2 x 56 cores, siblings at +112


def test_places_replicate_and_drop_what_the_mask_lacks():
    found = libgomp_binding({"OMP_PLACES": "{0}:4"}, range(8))
    assert found.places == tuple(frozenset({c}) for c in range(4)) and found.cpus == {0, 1, 2, 3}
    found = libgomp_binding({"OMP_PLACES": "{0}:4:2"}, {0, 2, 3})
    assert found.places == (frozenset({0}), frozenset({2}))


def test_omp_places_wins_over_gomp_cpu_affinity_and_false_drops_both():
    env = {"OMP_PLACES": "{2},{3}", "GOMP_CPU_AFFINITY": "0 1"}
    assert omp_team_cpus(env, range(8)) == ({2, 3}, "OMP_PLACES")
    assert omp_team_cpus({**env, "OMP_PLACES": "{}"}, range(8)) == ({0, 1}, "GOMP_CPU_AFFINITY")
    assert omp_team_cpus({**env, "OMP_PROC_BIND": "false"}, range(8)) is None


def test_master_and_primary_keep_the_team_on_the_first_place():
    for word in ("master", "primary", "MASTER,close"):
        found = libgomp_binding({"OMP_PLACES": "{5,6},{1}", "OMP_PROC_BIND": word}, range(8))
        assert found.cpus == {5, 6}
    # OMP_PROC_BIND alone: a place a hardware thread, the first the mask's first.
    assert libgomp_binding({"OMP_PROC_BIND": "primary"}, {3, 4}).cpus == {3}
    assert libgomp_binding({"OMP_PROC_BIND": "spread"}, {3, 4}).cpus == {3, 4}


def test_abstract_places_follow_the_hosts_topology_in_libgomps_order():
    mask = frozenset(range(4)) | frozenset(range(112, 116))
    threads = libgomp_binding({"OMP_PLACES": "threads"}, mask, H100).places
    assert threads[:4] == (frozenset({0}), frozenset({112}), frozenset({1}), frozenset({113}))
    cores = libgomp_binding({"OMP_PLACES": "cores(2)"}, mask, H100).places
    assert cores == (frozenset({0, 112}), frozenset({1, 113}))
    both = frozenset(range(224))
    assert len(libgomp_binding({"OMP_PLACES": "sockets"}, both, H100).places) == 2
    assert libgomp_binding({"OMP_PLACES": "numa_domains"}, both, H100).places[1] == frozenset(
        range(56, 112)
    ) | frozenset(range(168, 224))


def test_a_cpu_past_the_masks_word_voids_omp_places_and_is_skipped_by_gomp():
    assert libgomp_binding({"OMP_PLACES": "{0},{64}"}, {0, 1}) is None
    assert libgomp_binding({"OMP_PLACES": "{0},{64}"}, {0, 64}).places == (
        frozenset({0}),
        frozenset({64}),
    )
    assert libgomp_binding({"GOMP_CPU_AFFINITY": "0 64"}, {0, 1}).places == (frozenset({0}),)


def test_kmp_affinity_counts_where_libgomp_binds_nothing():
    env = {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,1-2]"}
    assert omp_team_cpus(env, range(8)) == ({1, 2, 3}, "KMP_AFFINITY")
    assert omp_team_cpus({**env, "GOMP_CPU_AFFINITY": "5"}, range(8)) == ({5}, "GOMP_CPU_AFFINITY")
