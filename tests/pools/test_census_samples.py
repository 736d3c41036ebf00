"""Pools judged by what their threads wanted over a sample, over any mix of
threads: idle pools are idle whatever their size, a pool oversubscribes
only when its threads wanted more CPUs than there are (less those spinners
of other pools hold), and threads that never run change no verdict.
Prometheus judges between two scrapes the same way."""

import os
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin._native import ThreadStat
from cpupin.measure import metrics
from cpupin.pools.census import (
    FITS,
    FROM_HOST,
    IDLE,
    IDLE_CPUS,
    OVER_BY,
    OVERSUBSCRIBED,
    _judge,
    _Sizing,
    verdict,
)
from cpupin.process.stacks import library_pool


def _sample(tid, ms, spinning=False):
    return SimpleNamespace(tid=tid, runnable_ms_per_s=ms, spinning=spinning)


thread = st.tuples(st.floats(0, 1000, allow_nan=False), st.booleans())


@given(
    pool=st.lists(thread, min_size=1, max_size=24),
    others=st.lists(thread, max_size=8),
    usable=st.integers(1, 16),
    sizes=st.frozensets(st.integers(1, 64), max_size=3),
)
def test_a_pool_is_judged_by_what_its_threads_wanted(pool, others, usable, sizes):
    tids = list(range(1, len(pool) + 1))
    rest = list(range(100, 100 + len(others)))
    sampled = {t: _sample(t, ms, spin) for t, (ms, spin) in zip(tids, pool, strict=True)}
    sampled |= {t: _sample(t, ms, spin) for t, (ms, spin) in zip(rest, others, strict=True)}
    spinners = frozenset(t for t, s in sampled.items() if s.spinning)
    found = _judge(
        "pool", False, [(t, False) for t in tids], _Sizing(usable, sizes, sampled, spinners), {},
        {},
    )  # fmt: skip
    wanted = sum(ms for ms, _ in pool) / 1000
    outside = sum(spin for _, spin in others)
    room = max(1, usable - outside)  # a spinner elsewhere holds a CPU
    assert found.usable_cpus == room
    assert found.runnable == wanted
    assert found.spinning == sum(spin for _, spin in pool)
    n = len(pool)
    if n <= room:
        assert found.verdict == FITS
    elif n in sizes:
        assert found.verdict == FROM_HOST
    elif wanted < IDLE_CPUS:
        assert found.verdict == IDLE, found
        assert found.spinning or found.remedy == "", found  # nothing to do
    elif wanted >= room + OVER_BY:
        assert found.verdict == OVERSUBSCRIBED and found.remedy, found
    else:
        assert found.verdict == FITS


@given(
    threads=st.integers(1, 64),
    usable=st.integers(1, 16),
    runnable=st.floats(0, 64, allow_nan=False),
    asleep=st.integers(1, 64),
)
def test_threads_that_never_run_change_no_verdict_but_a_size_that_betrays_the_host(
    threads, usable, runnable, asleep
):
    """Eight idle ZMQ IO threads added to a pool that fits leave it fitting,
    unless the new count is a count of the host's."""
    before = verdict(threads, usable, (), runnable=runnable)
    after = verdict(threads + asleep, usable, (), runnable=runnable)
    if threads + asleep <= usable:
        assert before == after == FITS
    elif threads > usable:
        assert after == before  # the same figure judges it
    else:  # it fitted by count: now judged by what it wanted
        assert (after == OVERSUBSCRIBED) == (runnable >= usable + OVER_BY)
        assert (after == IDLE) == (runnable < IDLE_CPUS)
    host = threads + asleep
    if host > usable:
        assert verdict(host, usable, (host,), runnable=runnable) == FROM_HOST


def _stat(tid, run, wait):
    return (SimpleNamespace(tid=tid, run_ns=run, wait_ns=wait), frozenset({0}))


def test_prometheus_judges_each_scrape_by_the_interval_since_the_last(monkeypatch):
    """The first scrape of a process has no interval (its pools are judged
    by count); the next, each thread's run and wait since; a thread new
    since, or a tid whose counters went back (reused), is left out."""
    monkeypatch.setattr(metrics, "_last_scrape", {})
    first = [_stat(1, 0, 0), _stat(2, 10**9, 0)]
    assert metrics._between_scrapes(4242, first, 1_000_000_000) is None
    second = [_stat(1, 250_000_000, 250_000_000), _stat(2, 0, 0), _stat(3, 10**8, 0)]
    found = {
        b.tid: b.runnable_ms_per_s for b in metrics._between_scrapes(4242, second, 1_500_000_000)
    }
    assert found == {1: 1000.0}  # 0.5 s run + wait over 0.5 s: a whole CPU
    # No time between two scrapes: no interval to judge by.
    assert metrics._between_scrapes(4242, second, 1_500_000_000) is None


def test_a_scrape_times_its_interval_when_it_read_the_threads_not_after(monkeypatch):
    """What a scrape does after reading the threads may take long (the
    registry, the pools' stacks): the interval is the reads' own, so that a
    slow first scrape never inflates the next one's rates."""
    pytest.importorskip("prometheus_client", reason="the exporter is the prometheus extra")
    monkeypatch.setattr(metrics, "_last_scrape", {})
    now = [0]
    tid = os.getpid()

    def thread_masks(target):  # each scrape reads its threads 1 s after the last
        now[0] += 10**9
        run = now[0] // 2  # a thread that runs half of the time, all along
        return [(ThreadStat(tid, "python", run, 0, 1, None), frozenset({0}))]

    slow = iter([4 * 10**8])  # the first scrape's later work takes 0.4 s

    def pinned_roles():
        now[0] += next(slow, 0)
        return {}

    monkeypatch.setattr(metrics, "thread_masks", thread_masks)
    monkeypatch.setattr(metrics, "pinned_roles", pinned_roles)
    monkeypatch.setattr(metrics.time, "monotonic_ns", lambda: now[0])
    seen = []
    real = metrics._between_scrapes
    monkeypatch.setattr(metrics, "_between_scrapes", lambda *a: seen.append(real(*a)) or seen[-1])
    for _ in range(2):
        list(metrics._collect([None], None, skip_gone=False, memory_too=False))
    assert seen[0] is None and [b.runnable_ms_per_s for b in seen[1]] == [500.0]


def test_each_library_names_its_pool_and_what_sizes_it():
    cases = {
        "libgomp-a34b3233.so.1": ("OpenMP (libgomp)", "OMP_NUM_THREADS"),
        "libiomp5.so": ("OpenMP (Intel)", "OMP_NUM_THREADS"),
        "libmkl_gnu_thread.so.2": ("MKL", "MKL_NUM_THREADS"),
        "libscipy_openblas64_-32a4b2a6.so": ("OpenBLAS", "OPENBLAS_NUM_THREADS"),
        "libblis.so.4": ("BLIS", "BLIS_NUM_THREADS"),
        "tokenizers.abi3.so": ("Rayon (tokenizers)", "RAYON_NUM_THREADS"),
        "libzmq-2f02442c.so.5.2.5": ("ZMQ", None),
    }
    for library, (label, variable) in cases.items():
        pool = library_pool(library)
        assert pool is not None and pool.label.startswith(label.split(" (")[0]), (library, pool)
        assert pool.variable == variable or (variable is None and pool.knob), (library, pool)
    assert library_pool("libpython3.11.so.1.0") is None
    assert library_pool("_ssl.cpython-311-x86_64-linux-gnu.so") is None


def test_a_spinning_openmp_pool_gets_the_knob_that_stops_it():
    sampled = {t: _sample(t, 1000.0, spinning=True) for t in (1, 2)}
    gomp = {1: "libgomp.so.1", 2: "libgomp.so.1"}
    sizing = _Sizing(4, frozenset(), sampled, frozenset(sampled))
    env = {"OMP_NUM_THREADS": "2"}
    found = _judge("python", False, [(1, False), (2, False)], sizing, gomp, env)
    assert found.spinning == 2 and found.setting == "'2'"
    assert "OMP_WAIT_POLICY=passive" in found.remedy, found.remedy


@pytest.mark.parametrize(
    ("pool", "says", "never"),
    [
        (
            dict(name="OpenBLAS", threads=8, verdict=FROM_HOST, variable="OPENBLAS_NUM_THREADS"),
            "OPENBLAS_NUM_THREADS=2 where vllm serve starts",
            "cpupin.limit_pools",
        ),
        (
            dict(name="pt_gloo_runloop", threads=4, verdict=FITS, stray=4, stray_cause="GOMP"),
            "CPUPIN_VLLM=auto moves them to the CPUs vLLM reserves",
            "OMP_PROC_BIND=false",
        ),
        (
            dict(name="gloo_tcp_loop", threads=4, verdict=FITS, stray=4),
            "CPUPIN_VLLM=auto moves them",
            "cpupin.Thread",
        ),
        (
            dict(name="python", threads=8, verdict=FROM_HOST),
            "2 thread(s) (a library vLLM loads sized it from the host's CPUs)",
            "cpupin.usable_cpus",
        ),
    ],
)
def test_a_vllm_process_gets_remedies_in_a_vllm_operators_terms(pool, says, never):
    """What an operator of vLLM can set (the server's environment, vLLM's
    and the plugin's variables), never cpupin's Python API that vLLM's code
    does not call."""
    from cpupin.pools.census import Pool, remedy, vllm_remedy

    ours = remedy(Pool(usable_cpus=2, **pool))
    assert never in ours  # cpupin's own terms, for a process that uses cpupin
    theirs = vllm_remedy(ours)
    assert says in theirs and never not in theirs, theirs
