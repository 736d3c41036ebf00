"""``cpupin verify``: inside a launched rank, whether it got what the plan
gives it (its CPUs, memory policy and GPU), and the launcher's setting
that explains it where not."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from cpupin import _native
from cpupin.cli import _args
from cpupin.cli.bind import LOCAL_RANK_VARS
from cpupin.cli.plan import add_launch_args, launch_k8s_plan, launch_plan
from cpupin.cpulist import cpus_phrase, format_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host.launcher import launcher_of, qos_class
from cpupin.host.topology import Host
from cpupin.plan.k8s import check_k8s_rank
from cpupin.plan.launch import ENV_PLAN_MASK, LaunchPlan, check_rank, parse_hex_mask

#: get_mempolicy's modes by number, as the binding modes name them.
_POLICY = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local", 5: "preferred"}
#: The mode flags get_mempolicy may return with the mode (static, relative,
#: numa balancing).
_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)
#: OpenMP's binding variables, named as a cause.
_OPENMP = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = sub.add_parser(
        "verify",
        help="inside a launched rank: its CPUs, memory policy and GPU against the plan",
        description="Run inside a process a launcher started (srun, torchrun, a Kubernetes "
        "container, cpupin exec): plan the node as cpupin plan --emit does, with the same "
        "--ranks, --node, --mode and --memory, and compare this rank's share with what the "
        "process has. The rank comes from --rank, else SLURM_LOCALID or LOCAL_RANK (or Open "
        "MPI's, MVAPICH's). The plan is made within --mask, else the mask "
        f"{ENV_PLAN_MASK} carries (plan --emit inside an allocation exports it), else every "
        "online CPU. Exit 0 and one line when they agree; exit 1 and a line a difference, "
        "with the launcher's setting that explains it where the environment names one.",
    )
    add_launch_args(cmd)
    cmd.add_argument(
        "--rank",
        type=_args.whole("--rank", 0, 4095),
        metavar="R",
        help="this process's local rank (default: SLURM_LOCALID, LOCAL_RANK, ...)",
    )
    _args.add_host(cmd)
    cmd.add_argument("--mask", metavar="CPULIST", help="the CPUs the plan was made within")
    cmd.add_argument(
        "--launcher",
        choices=("auto", "k8s", "nri", "exact"),
        default="auto",
        help="k8s: the plan of plan --emit k8s, and Kubernetes chooses which CPUs (a rank "
        "agrees when it has as many as planned, of its own, on its GPU's node); nri: the "
        "same for a container the NRI balloons policy placed (any QoS class); exact: the "
        "rank's very CPUs (srun, torchrun, cpupin exec); auto (the default): k8s where the "
        "cgroup is a Kubernetes pod's, else exact",
    )
    cmd.add_argument("--json", action="store_true", help="print JSON")
    cmd.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    rank, rank_from = _rank(args.rank, os.environ)
    host, _title, own = _args.load_host(args)
    live = not (args.host or args.root)
    within = _within(args.mask, host, own)
    k8s = args.launcher in ("k8s", "nri") or (
        args.launcher == "auto" and launcher_of(host.cgroup) == "kubernetes"
    )
    if k8s:
        return _run_k8s(args, host, own, within, rank, rank_from, live)
    plan = launch_plan(args, host, within)
    _has_rank(plan, rank, rank_from)
    cpus = _native.get_affinity() & host.cpus if live else own
    policy = _policy() if live else None
    visible = _visible(host) if live else None
    findings = check_rank(
        plan, rank, cpus, policy, visible, host, os.environ, causes=_causes(host, os.environ)
    )
    want = plan.ranks[rank]
    memory = (
        f"memory {want.memory_policy} on node {format_cpulist(want.memory_nodes)}"
        if want.memory_policy != "none"
        else "no memory policy"
    )
    gpu = f", GPU {want.device}" if want.device else ""
    return _report(
        args.json,
        findings,
        {
            "rank": rank,
            "rank_from": rank_from,
            "launcher": "exact",
            "has": {
                "cpus": sorted(cpus),
                "memory": None
                if policy is None
                else {"policy": policy[0], "nodes": sorted(policy[1])},
                "gpus": None if visible is None else list(visible),
                "qos": qos_class(host.cgroup),
            },
            "plan": {"rank": rank, **want.as_dict()},
            "reserved": None,
            "mask": sorted(plan.mask),
        },
        f"rank {rank}: {cpus_phrase(cpus)}, {memory}{gpu}: as planned "
        f"({len(plan.ranks)} rank(s), --mode {plan.mode}, within {format_cpulist(plan.mask)})",
    )


def _within(text: str | None, host: Host, own: frozenset[int]) -> frozenset[int]:
    """The CPUs the plan is made within: ``--mask``, else the mask
    ``CPUPIN_PLAN_MASK`` carries, else every online CPU."""
    if text is not None:
        return _args.mask_arg(text, host, own)
    carried = os.environ.get(ENV_PLAN_MASK)
    if carried is None:
        return host.cpus
    try:
        within = parse_hex_mask(carried) & host.cpus
    except ValueError as exc:
        raise ValueError(f"{ENV_PLAN_MASK}: {exc}") from None
    if not within:
        raise ValueError(f"{ENV_PLAN_MASK}={excerpt(carried)} names no online CPU of the host")
    return within


def _has_rank(plan: LaunchPlan, rank: int, rank_from: str) -> None:
    if rank >= len(plan.ranks):
        raise ValueError(
            f"rank {rank} ({rank_from}) is past the plan's {len(plan.ranks)} rank(s): give "
            f"--ranks {rank + 1} or more"
        )


def _report(as_json: bool, findings: list[str], doc: dict[str, object], agreed: str) -> int:
    """The verdict: JSON (``doc`` with ``agrees`` and the findings), else a
    line a finding, or the one line that says the rank agrees. Exit 1 on a
    finding, 0 otherwise."""
    if as_json:
        _args.print_json({**doc, "agrees": not findings, "findings": findings})
    elif findings:
        for line in findings:
            print(line)
    else:
        print(agreed)
    return 1 if findings else 0


def _run_k8s(
    args: argparse.Namespace,
    host: Host,
    own: frozenset[int],
    within: frozenset[int],
    rank: int,
    rank_from: str,
    live: bool,
) -> int:
    """verify in a Kubernetes container: the count, ownership and node of
    its CPUs against the plan of ``plan --emit k8s``."""
    k = launch_k8s_plan(args, host, within)
    plan = k.plan
    _has_rank(plan, rank, rank_from)
    cpus = _native.get_affinity() & host.cpus if live else own
    visible = _visible(host) if live else None
    gpu_node = None
    if visible is not None and len(visible) == 1:
        gpu_node = next((g.node for g in host.gpus if g.address == visible[0]), None)
    qos = qos_class(host.cgroup)
    balloons = args.launcher == "nri"
    findings = check_k8s_rank(k, rank, cpus, qos, host, gpu_node, balloons=balloons)
    want = plan.ranks[rank]
    nodes = sorted({n for n in map(host.node_of, cpus) if n is not None})
    return _report(
        args.json,
        findings,
        {
            "rank": rank,
            "rank_from": rank_from,
            "launcher": "nri" if balloons else "k8s",
            "has": {
                "cpus": sorted(cpus),
                "memory": None,
                "gpus": None if visible is None else list(visible),
                "qos": qos,
            },
            "plan": {"rank": rank, **want.as_dict()},
            "reserved": sorted(k.reserved),
            "mask": sorted(plan.mask),
        },
        f"rank {rank}: {cpus_phrase(cpus)} of its own on node {format_cpulist(nodes) or '?'} "
        + ("(a balloon)" if balloons else f"(QoS {qos})")
        + f": as planned ({len(want.cpus)} CPU(s) of {len(plan.ranks)} rank(s), "
        f"--mode {plan.mode}; " + ("the policy" if balloons else "Kubernetes") + " chooses which)",
    )


def _rank(given: int | None, environ: Mapping[str, str]) -> tuple[int, str]:
    if given is not None:
        return given, "--rank"
    # Slurm's first: a task srun starts may carry a LOCAL_RANK of its own job.
    order = sorted(LOCAL_RANK_VARS, key=lambda item: item[0] != "SLURM_LOCALID")
    for name, _who in order:
        text = environ.get(name)
        if text is not None:
            body = text.strip()
            if not (body.isascii() and body.isdigit() and len(body) <= 6):
                raise ValueError(f"{name}={excerpt(text)} is not a local rank: give --rank")
            return int(body), name
    names = ", ".join(name for name, _ in order)
    raise ValueError(f"which rank is this? none of {names} is set: give --rank")


def _policy() -> tuple[str, frozenset[int]] | None:
    try:
        mode, nodes = _native.get_mempolicy()
    except OSError:
        return None  # a kernel without NUMA: nothing to compare
    mode &= ~_MODE_FLAGS
    return _POLICY.get(mode, f"mode {mode}"), nodes if mode else frozenset()


def _visible(host: Host) -> tuple[str, ...] | None:
    """The GPUs this process sees (PCI addresses), ``None`` for all of them."""
    from cpupin.act.server import cuda_gpus, parse_visible_devices, resolve_devices

    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None or not host.gpus:
        return None
    count = len(parse_visible_devices(text))
    try:
        return resolve_devices(list(range(count)), host) if count else ()
    except PlanError:
        return None if cuda_gpus(host) else ()


def _causes(host: Host, environ: Mapping[str, str]) -> list[str]:
    """What else narrows or binds this process's CPUs, as causes."""
    out = []
    if launcher_of(host.cgroup) == "kubernetes":
        qos = qos_class(host.cgroup)
        if qos == "Guaranteed":
            out.append("its CPUs are the exclusive CPUs Kubernetes' static CPU manager gave")
        else:
            out.append(
                f"its CPUs are Kubernetes' shared pool (QoS {qos or 'unknown'}): only a "
                "Guaranteed pod's containers with whole CPUs get CPUs of their own"
            )
    if host.quota is not None:
        out.append(f"a cgroup quota of {host.quota.cpus} CPU(s) caps it too")
    for name in _OPENMP:
        if name in environ:
            out.append(f"{name}={excerpt(environ[name], 30)} binds its OpenMP threads")
    return out
