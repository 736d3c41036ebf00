"""``cpupin topo``: the host as cpupin reads it."""

from __future__ import annotations

import argparse

from cpupin.cli import _args
from cpupin.cpulist import format_cpulist
from cpupin.host.topology import Core, Host
from cpupin.plan.cpuplan import CpuPlan


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    topo = sub.add_parser("topo", help="show the host: nodes, cores, SMT, GPUs, idle states, mask")
    _args.add_host(topo)
    topo.add_argument("--json", action="store_true", help="print JSON")
    topo.set_defaults(handler=run)


def heads(host: Host) -> dict[int, Core]:
    """Each core by its first CPU: with ``node.cpus & heads.keys()`` (a set
    operation in C) a node's cores are found without a Python loop over every
    core for every node (a 65,536-CPU host has 2,048 nodes)."""
    return {core.cpus[0]: core for core in host.cores}


def class_lines(host: Host) -> list[str]:
    """The core classes, highest first, where cores differ; else one line
    saying they are alike (or that sysfs gives no figures)."""
    if not host.classes:
        return ["class  no per-core performance figures (CPPC, cpufreq, capacity): one class"]
    if len(host.classes) == 1:
        return [f"class  every core alike ({host.classes[0].describe()}): one class"]
    lines = []
    for c in host.classes:
        cpus = [cpu for core in host.cores if core.rank == c.rank for cpu in core.cpus]
        what = "0 (highest)" if c.rank == 0 else str(c.rank)
        lines.append(
            f"class  {what}: {c.describe(host.class_keys())}; {c.cores} core(s), "
            f"CPUs {format_cpulist(cpus)}"
        )
    return lines


def cache_line(host: Host) -> str:
    """The last-level cache domains: how many, and the first few."""
    if not host.caches:
        return "cache  last-level cache domains unknown"
    sizes = sorted({len(d) for d in host.caches})
    shown = " | ".join(format_cpulist(d) for d in host.caches[:4])
    more = f" | ... ({len(host.caches) - 4} more)" if len(host.caches) > 4 else ""
    return (
        f"cache  L{host.cache_level}: {len(host.caches)} domain(s) of "
        f"{'/'.join(map(str, sizes))} CPUs: {shown}{more}"
    )


def run(args: argparse.Namespace) -> int:
    host, title, mask = _args.load_host(args)
    plan = CpuPlan.for_host(host, mask)
    if args.json:
        data = {"host": title, **host.as_dict()}
        data.update(mask=sorted(plan.mask), usable_cpus=plan.usable_cpus)
        _args.print_json(data)
        return 0
    threads = {len(core.cpus) for core in host.cores}
    smt = {True: "SMT on", False: "SMT off", None: "SMT unknown"}[host.smt]
    print(title)
    print(
        f"CPUs   {len(host.cpus)} online ({format_cpulist(host.cpus)}), {len(host.cores)} "
        f"cores, {smt} ({'/'.join(map(str, sorted(threads)))} thread(s) a core)"
    )
    firsts = frozenset(heads(host))
    for node in host.nodes:
        gpus = [g.address for g in host.gpus if g.node == node.id]
        cores = len(node.cpus & firsts)
        cpus = f"CPUs {format_cpulist(node.cpus)} ({cores} cores)" if node.cpus else "no CPUs"
        if host.memory_nodes is not None:
            cpus += ", memory" if node.id in host.memory_nodes else ", no memory"
        print(f"node {node.id:<3} {cpus}" + (f"; GPUs {' '.join(gpus)}" if gpus else ""))
    for g in host.gpus:
        local = format_cpulist(g.local_cpus) if g.local_cpus is not None else "unknown"
        where = g.node if g.node is not None else "none"
        print(
            f"GPU    {g.address} {g.vendor} class {g.class_code:#08x} node {where}, "
            f"local CPUs {local}"
        )
    if not host.gpus:
        print("GPUs   none")
    for line in class_lines(host):
        print(line)
    print(cache_line(host))
    deepest = host.deepest_idle_state()
    if deepest:
        vm = " (a virtual machine: its guest sees only what the hypervisor shows)"
        print(
            f"idle   deepest state {deepest.name}, exit latency {deepest.latency_us} µs"
            + (vm if host.hypervisor else "")
        )
    else:
        print("idle   no idle states listed")
    quota = (
        f"{host.quota.quota_us}/{host.quota.period_us} µs = {host.quota.cpus} CPU(s)"
        if host.quota
        else "none"
    )
    print(
        f"mask   {format_cpulist(plan.mask)} ({len(plan.mask)} CPUs); cgroup quota {quota}; "
        f"usable CPUs {plan.usable_cpus}"
    )
    for reason in host.reasons:
        print(f"note   {reason}")
    return 0
