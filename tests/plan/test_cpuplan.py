"""The CPU plan: usable CPUs under a quota, the pinned CPUs left out, and pool
sizes that never drop below one."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpupin.host.shapes import host_named
from cpupin.host.topology import Quota
from cpupin.plan.cpuplan import POOLS, CpuPlan


def quota(cpus_times_100):
    return Quota(cpus_times_100 * 1000, 100_000, "cpu.max")


def test_capacity_is_the_mask_capped_by_the_quota():
    mask = frozenset(range(16))
    assert CpuPlan(mask).capacity == 16
    assert CpuPlan(mask, quota(250)).capacity == 3  # ceil(2.5)
    assert CpuPlan(mask, quota(10)).capacity == 1
    assert CpuPlan(frozenset({0, 1}), quota(800)).capacity == 2


def test_usable_cpus_is_the_capacity_less_the_pinned_cpus():
    mask = frozenset(range(16))
    assert CpuPlan(mask, pinned=frozenset({0, 1})).usable_cpus == 14
    assert CpuPlan(mask, quota(250), frozenset({0, 1})).usable_cpus == 1  # 3 - 2
    assert CpuPlan(mask, quota(250), frozenset({0, 1, 2, 3})).usable_cpus == 1  # never 0


def test_pools_are_sized_from_what_the_pinned_cpus_leave():
    plan = CpuPlan(frozenset(range(16))).with_pinned({0, 8, 15, 99})
    assert plan.pinned == {0, 8, 15}
    assert plan.free_cpus == frozenset(range(16)) - {0, 8, 15}
    assert plan.pool_size() == 13
    assert plan.pool_size("encode") == 6
    assert plan.pool_size("copy") == 4
    assert plan.pool_size("intra_op", at_most=5) == 5


def test_a_quota_smaller_than_the_pinned_cpus_still_leaves_one():
    plan = CpuPlan(frozenset(range(8)), quota(200), frozenset({0, 1, 2}))
    assert plan.usable_cpus == plan.cpus_left == 1
    assert all(plan.pool_size(pool) == 1 for pool in POOLS)


def test_an_unknown_pool_names_the_pools():
    with pytest.raises(ValueError, match="intra_op"):
        CpuPlan(frozenset({0})).pool_size("decode")


@given(
    st.frozensets(st.integers(0, 300), min_size=1),
    st.frozensets(st.integers(0, 300)),
    st.one_of(st.none(), st.integers(1, 50_000)),
    st.sampled_from(sorted(POOLS)),
)
def test_a_pool_is_never_below_one_nor_above_the_usable_cpus(mask, pinned, q, pool):
    """1 <= pool_size <= usable_cpus <= capacity <= len(mask)."""
    plan = CpuPlan(mask, Quota(q, 100_000, "x") if q else None).with_pinned(pinned)
    assert 1 <= plan.pool_size(pool) <= plan.usable_cpus <= plan.capacity <= len(mask)


def test_for_host_takes_the_hosts_mask_and_quota():
    host = host_named("dgx-h100")
    plan = CpuPlan.for_host(host, range(0, 300))
    assert plan.mask == host.cpus
    assert CpuPlan.for_host(host).mask == host.cpus
    assert CpuPlan.for_host(host, {0, 1}, pinned={1, 5}).pinned == {1}
