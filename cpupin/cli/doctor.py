"""``cpupin doctor``: whether pinning pays on this host, and why."""

from __future__ import annotations

import argparse

from cpupin.binding import memory_binding_check
from cpupin.cpulist import format_cpulist
from cpupin.cpuplan import CpuPlan
from cpupin.doctor import diagnose, measure_host
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


def run(args: argparse.Namespace) -> int:
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
    pools = {"usable_cpus": plan.usable_cpus, "problems": problems, "set": advice}
    memory_ok: bool | None = None
    memory_why = "binding not checked (not this machine)"
    if here:
        memory_ok, memory_why = memory_binding_check()
    if args.json:
        facts = host.as_dict()
        _args.print_json(
            {
                "host": title,
                **{k: facts[k] for k in ("cpus", "smt", "nodes", "gpus", "hypervisor")},
                "cores": len(host.cores),
                "mask": sorted(mask),
                "mask_list": format_cpulist(mask),
                "quota": facts["quota"],
                **diagnosis.as_dict(),
                "memory_binding": {"possible": memory_ok, "why": memory_why},
                "pools": pools,
            }
        )
        return 0
    deepest = diagnosis.deepest_idle_state
    print(f"cpupin doctor: {title}")
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
    print(f"mask     {format_cpulist(mask)}; cgroup quota {quota}")
    if memory_ok is None:
        print(f"memory   {memory_why}")
    else:
        print(f"memory   binding {'possible' if memory_ok else 'not possible'}: {memory_why}")
    _print_pools(plan.usable_cpus, problems, advice)
    if diagnosis.handoff:
        print(f"handoff  one way, median (p99), measured on {measured_on}:")
        for kind, r in diagnosis.handoff.items():
            cost = r.wake_median_ns if r.wake_median_ns and r.idle_us else r.median_ns
            print(
                f"  {kind:18} CPUs {r.cpus[0]},{r.cpus[1]}: {cost / 1000:8.1f} µs "
                f"({r.p99_ns / 1000:.1f} µs)"
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
    return 0


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
