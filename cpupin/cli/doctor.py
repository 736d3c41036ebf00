"""``cpupin doctor``: whether pinning pays on this host, and why."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cpupin.binding import memory_binding_check
from cpupin.cpulist import format_cpulist
from cpupin.cpuplan import CpuPlan
from cpupin.doctor import Diagnosis, diagnose, measure_host
from cpupin.errors import PlanError
from cpupin.launcher import CpuOrigin, explain_cpus
from cpupin.pools import cpu_plan, environment_advice
from cpupin.process import process_cpus
from cpupin.topology import Host, read_host

from . import _args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser("doctor", help="whether pinning pays on this host, and why")
    _args.add_host(doctor)
    doctor.add_argument(
        "--measure-here",
        action="store_true",
        help="with --host/--root: measure handoffs on this machine instead",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(handler=run)


@dataclass
class _Report:
    """What the doctor found: the verdict and the facts behind it."""

    host: Host
    title: str
    mask: frozenset[int]
    diagnosis: Diagnosis
    plan: CpuPlan
    problems: list[str]
    advice: dict[str, int]
    memory_ok: bool | None
    memory_why: str
    origin: CpuOrigin


def run(args: argparse.Namespace) -> int:
    report = _examine(args)
    if args.json:
        _print_json(report)
    else:
        _print_text(report)
    return 0


def _examine(args: argparse.Namespace) -> _Report:
    """Read the host, measure handoffs where it is this machine (or
    --measure-here), judge, and check the pools and memory binding."""
    host, title, mask = _args.load_host(args)
    here = not (args.host or args.root)
    handoffs = None
    measured_on = "nowhere"
    if here or args.measure_here:
        local = host if here else read_host("/")
        handoffs = measure_host(local, process_cpus() & local.cpus)
        measured_on = "this machine" if here else f"this machine, not {args.host or args.root}"
    diagnosis = diagnose(host, handoffs, measured_on)
    plan = cpu_plan() if here else CpuPlan.for_host(host, mask)
    problems, advice = environment_advice(plan, len(host.cpus))
    memory_ok: bool | None = None
    memory_why = "binding not checked (not this machine)"
    if here:
        memory_ok, memory_why = memory_binding_check()
    origin = explain_cpus(host, mask, _visible_gpus(host) if here else ())
    return _Report(
        host, title, mask, diagnosis, plan, problems, advice, memory_ok, memory_why, origin
    )


def _visible_gpus(host: Host) -> list[tuple[str, int | None]]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names, with their nodes: those the
    process will use, whose nodes its CPUs should lie on (none when unset)."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible or not host.gpus:
        return []
    from cpupin.binding import gpu_node
    from cpupin.server import resolve_devices

    try:
        count = len([v for v in visible.split(",") if v.strip()])
        addresses = resolve_devices(range(count), host)
    except (PlanError, ValueError):
        return []
    return [(a, gpu_node(host, a)[0]) for a in addresses]


def _print_json(r: _Report) -> None:
    facts = r.host.as_dict()
    _args.print_json(
        {
            "host": r.title,
            **{k: facts[k] for k in ("cpus", "smt", "nodes", "gpus", "hypervisor")},
            "cores": len(r.host.cores),
            "mask": sorted(r.mask),
            "mask_list": format_cpulist(r.mask),
            "quota": facts["quota"],
            **r.diagnosis.as_dict(),
            "memory_binding": {"possible": r.memory_ok, "why": r.memory_why},
            "cpus_from": r.origin.as_dict(),
            "pools": {
                "usable_cpus": r.plan.usable_cpus,
                "problems": r.problems,
                "set": r.advice,
            },
        }
    )


def _print_text(r: _Report) -> None:
    host, diagnosis = r.host, r.diagnosis
    deepest = diagnosis.deepest_idle_state
    print(f"cpupin doctor: {r.title}")
    print(
        f"host     {len(host.cpus)} CPUs, {len(host.cores)} cores, SMT "
        f"{'on' if host.smt else 'off'}, {_nodes(host)}, "
        f"{len(host.gpus)} GPU(s)" + (", a virtual machine" if host.hypervisor else "")
    )
    print(
        "idle     "
        + (
            f"deepest state {deepest.name}, exit latency {deepest.latency_us} µs"
            if deepest
            else "no idle states listed"
        )
    )
    quota = f"{host.quota.cpus} CPU(s)" if host.quota else "none"
    print(f"mask     {format_cpulist(r.mask)}; cgroup quota {quota}")
    print(f"cpus     {r.origin.lines[0]}")
    for line in r.origin.lines[1:]:
        print(f"         {line}")
    for warning in r.origin.warnings:
        print(f"warning  {warning}")
    if r.memory_ok is None:
        print(f"memory   {r.memory_why}")
    else:
        verdict = "possible" if r.memory_ok else "not possible"
        print(f"memory   binding {verdict}: {r.memory_why}")
    _print_pools(r.plan.usable_cpus, r.problems, r.advice)
    if diagnosis.handoff:
        print(f"handoff  one way, median (p99), measured on {diagnosis.measured_on}:")
        for kind, h in diagnosis.handoff.items():
            cost = h.wake_median_ns if h.wake_median_ns and h.idle_us else h.median_ns
            print(
                f"  {kind:18} CPUs {h.cpus[0]},{h.cpus[1]}: {cost / 1000:8.1f} µs "
                f"({h.p99_ns / 1000:.1f} µs)"
            )
    else:
        print("handoff  not measured (a shipped host); --measure-here uses this machine's")
    for note in diagnosis.notes:
        print(f"note     {note}")
    action = (
        "turn step_thread_core auto on"
        if diagnosis.verdict == "auto"
        else "keep step_thread_core off"
    )
    print(f"verdict  {diagnosis.verdict}: {action}")
    print(f"why      {diagnosis.why}")


def _nodes(host: Host) -> str:
    """The host's nodes as topo counts them, with those without CPUs named."""
    total, with_cpus = len(host.nodes), len(host.cpu_nodes)
    if total == with_cpus:
        return f"{total} node(s)"
    return f"{total} node(s) ({with_cpus} with CPUs)"


def _print_pools(usable: int, problems: list[str], advice: dict[str, int]) -> None:
    """The pools' verdict for a process started from this environment."""
    if not problems:
        print(f"pools    {usable} usable CPU(s); the pool variables of this environment fit")
        return
    print(f"pools    {usable} usable CPU(s); {problems[0]}")
    for line in problems[1:]:
        print(f"         {line}")
    print(
        "         set "
        + " ".join(f"{k}={v}" for k, v in advice.items())
        + ", or call cpupin.limit_pools() at start-up, or start under cpupin exec"
    )
