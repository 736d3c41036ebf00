"""Local ranks planned for a launcher: plan --emit slurm and verify, against
the shipped hosts, random ones, and the binding each rank's GPU gets alone."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpupin import PlanError
from cpupin.act.server import cuda_gpus
from cpupin.host.shapes import host_named
from cpupin.plan.binding import decide_binding
from cpupin.plan.launch import (
    hex_mask,
    parse_hex_mask,
    plan_ranks,
    slurm_options,
)
from tests.support.launchers import SHIPPED, cpupin
from tests.support.specs import spec_host
from tests.support.strategies import host_specs, masks


@given(st.frozensets(st.integers(0, 9000), min_size=1, max_size=200))
def test_a_hex_mask_reads_back_as_written(cpus):
    assert parse_hex_mask(hex_mask(cpus)) == cpus
    assert hex_mask(cpus).startswith("0x")


@pytest.mark.parametrize("text", ["", "0x", "0xg", "3,1", "-1", "0x" + "f" * 20000, "0x 1"])
def test_a_bad_hex_mask_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="not a CPU mask"):
        parse_hex_mask(text)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "cache"])
def test_each_rank_is_what_its_gpu_alone_would_get(name, mode):
    host = host_named(name)
    gpus = cuda_gpus(host)
    plan = plan_ranks(host, host.cpus, len(gpus), mode=mode)
    assert len(plan.ranks) == len(gpus) and plan.whole_host
    for gpu, binding in zip(gpus, plan.ranks):
        assert binding == decide_binding(host, host.cpus, device=gpu.address, cpus=mode)
    opts = slurm_options(plan)
    bind = next(o for o in opts if o.startswith("--cpu-bind=mask_cpu:"))
    listed = bind.partition(":")[2].split(",")
    assert [parse_hex_mask(m) for m in listed] == [b.cpus for b in plan.ranks]
    assert "--exclusive" in opts and f"--gres=gpu:{len(gpus)}" in opts
    assert "--gres-flags=enforce-binding" in opts
    assert f"--ntasks-per-node={len(gpus)}" in opts


def test_dgx_h100_exclusive_is_slurms_exact_options():
    """A golden line: 8 ranks, 14 cores and their siblings each, memory on
    each GPU's node."""
    plan = plan_ranks(host_named("dgx-h100"), host_named("dgx-h100").cpus, 8, mode="exclusive")
    opts = slurm_options(plan)
    assert opts[:7] == [
        "--nodes=1",
        "--ntasks-per-node=8",
        "--cpus-per-task=28",
        "--exclusive",
        "--gres=gpu:8",
        "--gres-flags=enforce-binding",
        "--mem-bind=prefer,map_mem:0,0,0,0,1,1,1,1",
    ]
    first = opts[7].partition(":")[2].split(",")[0]
    assert parse_hex_mask(first) == frozenset(range(14)) | frozenset(range(112, 126))
    batch = slurm_options(plan, batch=True)
    assert batch[0] == "#SBATCH --nodes=1" and batch[-1] == "export " + opts[7][2:].replace(
        "cpu-bind", "SLURM_CPU_BIND"
    )


def test_interleave_is_a_plan_slurm_cannot_express():
    host = host_named("dgx-h100")
    plan = plan_ranks(host, host.cpus, 2, memory="interleave")
    with pytest.raises(PlanError, match="cannot interleave"):
        slurm_options(plan)


def test_more_ranks_than_gpus_or_cores_is_refused_with_what_fits():
    host = host_named("h100-vm")
    with pytest.raises(PlanError, match="--ranks 1 or fewer"):
        plan_ranks(host, host.cpus, 2)
    with pytest.raises(PlanError, match="core"):
        plan_ranks(host, frozenset({0, 1}), 3, node=0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ranks_dividing_a_node_never_share_a_cpu_and_stay_in_the_mask(data):
    host = spec_host(data.draw(host_specs(max_cores=64)))
    mask = data.draw(masks(host))
    node = data.draw(st.sampled_from([n.id for n in host.nodes] or [0]))
    ranks = data.draw(st.integers(1, 6))
    try:
        plan = plan_ranks(host, mask, ranks, node=node)
    except PlanError as exc:
        assert "node" in str(exc)
        return
    seen: set[int] = set()
    node_cpus = next(n.cpus for n in host.nodes if n.id == node)
    for binding in plan.ranks:
        assert binding.cpus and binding.cpus <= mask & node_cpus
        assert not binding.cpus & seen
        seen |= binding.cpus
    options = slurm_options(plan) if plan.memory != "interleave" else []
    assert any(o.startswith("--cpu-bind=mask_cpu:") for o in options)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gpu_ranks_are_on_their_gpus_node_or_say_why(data):
    host = spec_host(data.draw(host_specs(max_cores=64)))
    gpus = cuda_gpus(host)
    if not gpus:
        with pytest.raises(PlanError, match="--node"):
            plan_ranks(host, host.cpus, 1)
        return
    mask = data.draw(masks(host))
    mode = data.draw(st.sampled_from(["node", "exclusive", "cache", "socket"]))
    plan = plan_ranks(host, mask, data.draw(st.integers(1, len(gpus))), mode=mode)
    for binding in plan.ranks:
        assert binding.cpus <= mask & host.cpus
        if binding.node is not None and not binding.reason and mode != "socket":
            node_cpus = next(n.cpus for n in host.nodes if n.id == binding.node)
            assert binding.cpus <= node_cpus
    if mode == "exclusive" and not any(b.reason for b in plan.ranks):
        # ranks on one node never share a core
        by_node: dict[object, set[int]] = {}
        for binding in plan.ranks:
            taken = by_node.setdefault(binding.node, set())
            assert not binding.cpus & taken
            taken |= binding.cpus


# --- the commands ----------------------------------------------------------


def test_plan_emit_slurm_prints_one_line_for_srun():
    out = cpupin("plan", "--emit", "slurm", "--host", "gh200")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1
    assert out.stdout.split() == [
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=72",
        "--exclusive",
        "--gres=gpu:1",
        "--gres-flags=enforce-binding",
        "--mem-bind=prefer,map_mem:0",
        f"--cpu-bind=mask_cpu:{hex_mask(frozenset(range(72)))}",
    ]


def test_plan_emit_within_a_mask_exports_it_for_verify():
    out = cpupin("plan", "--emit", "slurm", "--host", "dgx-h100", "--ranks", "1", "--node",
                 "1", "--mask", "56-59")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--export=ALL,CPUPIN_PLAN_MASK=0xf00000000000000" in out.stdout.split()
    assert "--exclusive" not in out.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--emit", "slurm", "--host", "dgx-h100", "--ranks", "9"], "--ranks 8 or fewer"),
        (["--emit", "slurm", "--host", "dgx-h100", "--memory", "interleave"], "interleave"),
        (["--emit", "slurm", "--host", "dgx-h100", "--gpu", "0000:1b:00.0"], "--emit plans"),
        (["--ranks", "2", "--host", "dgx-h100"], "--ranks goes with --emit"),
        (["--emit", "kubernetes"], "invalid choice"),
        (["--emit", "slurm", "--ranks", "0"], "--ranks 0 is outside 1 to 4096"),
        (["--emit", "slurm", "--batch", "--json", "--host", "gh200"], "give one"),
    ],
)
def test_plan_emit_refuses_in_one_line_naming_the_value(argv, says):
    out = cpupin("plan", *argv)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_verify_on_a_shipped_host_names_the_rank_and_what_the_plan_wants():
    out = cpupin("verify", "--host", "dgx-h100", "--rank", "5", "--mode", "exclusive", "--json")
    assert out.returncode == 1, out.stderr
    got = json.loads(out.stdout)
    assert got["rank"] == 5 and not got["agrees"]
    assert got["findings"][0].startswith("rank 5: CPUs 0-223 on node 0-1, plan wants CPUs ")
    assert got["plan"]["device"] == cuda_gpus(host_named("dgx-h100"))[5].address


two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs in the mask to pin a rank to each"
)


@two_cpus
def test_verify_agrees_on_the_cpu_the_plan_gives_each_rank():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    mask = f"{a},{b}"
    for rank, cpu in ((0, a), (1, b)):
        out = cpupin("verify", "--ranks", "2", "--node", "0", "--memory", "none", "--mask", mask,
                     env={"SLURM_LOCALID": str(rank)}, cpus={cpu})  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith(f"rank {rank}: CPU {cpu}, no memory policy: as planned")


@two_cpus
def test_verify_names_the_rank_off_its_cpus_and_slurms_binding():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    out = cpupin("verify", "--ranks", "2", "--node", "0", "--memory", "none", "--mask", f"{a},{b}",
                 env={"SLURM_LOCALID": "1", "SLURM_CPU_BIND": f"quiet,map_cpu:{a},{a}"},
                 cpus={a})  # fmt: skip
    assert out.returncode == 1
    assert out.stdout == (
        f"rank 1: CPU {a} on node 0, plan wants CPU {b} on node 0; launched with "
        f"--cpu-bind=map_cpu:{a},{a}?\n"
    )


def test_verify_without_a_rank_says_where_it_looks():
    out = cpupin("verify", "--host", "gh200")
    assert out.returncode == 2 and "SLURM_LOCALID, LOCAL_RANK" in out.stderr
    out = cpupin("verify", "--host", "gh200", env={"LOCAL_RANK": "x1"})
    assert out.returncode == 2 and "LOCAL_RANK='x1' is not a local rank" in out.stderr
    out = cpupin("verify", "--host", "gh200", "--rank", "1")
    assert out.returncode == 2 and "--ranks 2 or more" in out.stderr


GOLDEN = Path(__file__).parent.parent / "data" / "slurm"


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("mode", ["node", "exclusive", "cache"])
def test_plan_emit_slurm_prints_the_golden_line_of_each_shipped_host(name, mode):
    """tests/data/slurm/HOST-MODE.txt: the line, as reviewed (each rank's
    CPUs are also checked against its GPU's own binding above)."""
    out = cpupin("plan", "--emit", "slurm", "--host", name, "--mode", mode)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GOLDEN / f"{name}-{mode}.txt").read_text()
