"""``cpupin doctor``: whether pinning pays on this host, and why."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cpupin.act.binding import memory_binding_check
from cpupin.cli import _args
from cpupin.cli._pools import pool_lines
from cpupin.cpulist import format_cpulist
from cpupin.errors import PlanError, printable
from cpupin.host.irqs import MAX_LISTED, IrqOnPin, irqbalance_advice, read_irqs
from cpupin.host.launcher import CpuOrigin, explain_cpus
from cpupin.host.topology import Host, read_host
from cpupin.measure.doctor import (
    Diagnosis,
    diagnose,
    load_text,
    measure_hold,
    measure_host,
    read_load,
)
from cpupin.plan.cpuplan import CpuPlan
from cpupin.pools.limits import cpu_plan, environment_advice
from cpupin.process.mask import process_cpus

if TYPE_CHECKING:
    from cpupin.measure.sampling import Sampler, ThreadSample


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="whether pinning pays on this host, and why",
        description="Whether pinning pays on this host, and why: its idle states, a handoff "
        "to a running and to an idle core (measured three times, the quietest kept), and "
        "the pools a process started from here would run. It reads the cgroup (cpuset, "
        "quota) and pool variables of the shell that runs it: run it inside the workload's "
        "container or cgroup, or judge a running process with --pid.",
    )
    _args.add_host(doctor)
    doctor.add_argument(
        "--measure-here",
        action="store_true",
        help="with --host/--root: measure handoffs on this machine instead",
    )
    doctor.add_argument(
        "--irq-interval",
        type=_args.seconds(0.0, 10.0),
        default=0.5,
        metavar="S",
        help="seconds between the two reads of /proc/interrupts that give IRQ rates "
        "(0: one read, no rates; default 0.5)",
    )
    doctor.add_argument(
        "--pid",
        type=_args.pid,
        help="judge a running process instead of this command's: its own cgroup (cpuset, "
        "quota, weight), its mask and where it came from (an OpenMP binding), its record, its "
        "pool variables and what to set, and over a 0.5 s sample its pools, spinning threads "
        "and what its threads wanted",
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
    pinned: frozenset[int]
    pinned_by: str
    irqs: list[IrqOnPin]
    irq_notes: list[str]
    process: dict[str, object] | None = None
    """With ``--pid``: the process judged (pid, command, mask and its
    source, environment note, threads crowding a bound CPU)."""
    wake_left: list[str] = field(default_factory=list)
    """This machine's CPUs whose wake latency no live holder answers for."""


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
    process = None
    environ: dict[str, str] | None = dict(os.environ)
    if args.pid is not None:
        if not here:
            raise ValueError("--pid judges a process on this machine: leave out --host and --root")
        process, mask, environ = _process_facts(args.pid)
        host = _with_cgroup_of(host, args.pid, process)
        title = f"pid {args.pid} on this machine"
    diagnosis = _measured_diagnosis(args, host, here)
    if process is not None:
        plan = cpu_plan(args.pid, mask=mask)
    else:
        plan = cpu_plan() if here else CpuPlan.for_host(host, mask)
    if environ is None:
        assert process is not None
        problems = [
            f"its pool variables are unknown: {process['environment']}; read them inside the "
            "process (cpupin.census())"
        ]
        advice: dict[str, int] = {}
    else:
        problems, advice = environment_advice(plan, len(host.cpus), environ)
    if process is not None:
        problems, advice = _judged_in_process(process, plan, problems, advice)
    memory_ok: bool | None = None
    memory_why = "binding not checked (not this machine)"
    if here:
        memory_ok, memory_why = memory_binding_check()
    origin = explain_cpus(host, mask, _visible_gpus(host, environ or {}) if here else ())
    pinned, pinned_by = _pinned_cpus(host, mask, here)
    irqs, irq_notes = _irqs_on(args, host, pinned, pinned_by)
    wake_left: list[str] = []
    if here:
        from cpupin.registry.holds import left_applied

        wake_left = left_applied(host.cpus)  # the lock directory of $CPUPIN_LOCK_DIR
    return _Report(
        host,
        title,
        mask,
        diagnosis,
        plan,
        problems,
        advice,
        memory_ok,
        memory_why,
        origin,
        pinned,
        pinned_by,
        irqs,
        irq_notes,
        process,
        wake_left,
    )


def _measured_diagnosis(args: argparse.Namespace, host: Host, here: bool) -> Diagnosis:
    """The verdict, with handoffs measured where the host is this machine
    (or --measure-here asks for it), judged on the sysfs figures elsewhere."""
    handoffs = None
    unmeasured = ""
    measured_on = "nowhere"
    noise: list[str] = []
    spread: dict[str, tuple[float, float]] = {}
    load = None
    if here or args.measure_here:
        local = host if here else read_host("/")
        before = read_load()
        handoffs = measure_host(local, process_cpus() & local.cpus, noise=noise, spread=spread)
        unmeasured = measure_hold(handoffs, spread=spread)
        load = _busier(before, read_load())
        measured_on = "this machine" if here else f"this machine, not {args.host or args.root}"
    return diagnose(host, handoffs, measured_on, noise, unmeasured, spread, load)


def _busier(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """The busier of two load readings, taken before and after measuring."""
    if before is None or after is None:
        return before or after
    return max(before, after, key=lambda d: (d["running"], d["load1"]))


def _irqs_on(
    args: argparse.Namespace, host: Host, pinned: frozenset[int], pinned_by: str
) -> tuple[list[IrqOnPin], list[str]]:
    """The device IRQs that land on the pinned CPUs, or why none were read."""
    if args.host:
        return [], ["not read: a shipped host has no proc/interrupts"]
    if not pinned:
        return [], [f"not read: {pinned_by}"]
    return read_irqs(host.root, pinned, interval=args.irq_interval)


#: Seconds the doctor samples a process's threads over (``--pid``).
SAMPLE_S = 0.5


def _with_cgroup_of(host: Host, pid: int, process: dict[str, object]) -> Host:
    """The host as the process sees it: its own cgroup's cpuset, quota
    (the strictest of its cgroup and ancestors, v1 or v2) and path, not
    this command's."""
    from cpupin.host._sysfs import Reader
    from cpupin.host.cgroup import cgroup_path, read_cgroup

    with Reader("/") as r:
        cpuset, quota = read_cgroup(r, str(pid))
        path = cgroup_path(r, str(pid))
    process["cgroup"] = path
    return dataclasses.replace(host, cpuset=cpuset, quota=quota, cgroup=path)


def _judged_in_process(
    process: dict[str, object], plan: CpuPlan, problems: list[str], advice: dict[str, int]
) -> tuple[list[str], dict[str, int]]:
    """The pool variables' verdict, where the process sized its pools
    itself: its record says it called ``cpupin.limit_pools()``, so the
    environment it started with no longer sizes them; say so, and judge the
    pools its record lists instead."""
    limited = process.get("limited")
    if not limited:
        return problems, advice
    lines = [
        f"it sized its pools itself (its record: {limited}); the variables it started with "
        "no longer size them"
    ]
    configured = process.get("configured")
    assert isinstance(configured, list)
    for name, threads in configured:
        if threads > plan.usable_cpus:
            lines.append(
                f"its record lists {name} at {threads} thread(s), more than the "
                f"{plan.usable_cpus} usable CPU(s): call cpupin.limit_pools() after the "
                "library loads"
            )
    lines.append(
        "OpenMP keeps that limit per thread: a thread other than the one that called "
        "limit_pools() runs OpenMP's default team unless started as a cpupin.Thread"
    )
    return lines, {}


def _process_facts(pid: int) -> tuple[dict[str, object], frozenset[int], dict[str, str] | None]:
    """Another process's facts for the doctor: its mask (the launcher's view
    where an OpenMP binding narrowed every thread), its environment (``None``
    when unreadable or overwritten by its title), its crowded CPUs, what its
    record says, and its pools and spinning threads over a short sample."""
    from cpupin.cli.threads import _title, collapse_of, shared_narrow
    from cpupin.measure.sampling import Sampler
    from cpupin.process.outside import process_mask_of, read_environ

    try:
        sampler = Sampler(pid).start()
        time.sleep(SAMPLE_S)
        samples = sampler.stop()
    except ProcessLookupError:
        raise ValueError(f"--pid {pid}: no such process") from None
    threads = sampler.threads
    mask, source = process_mask_of(pid, [m for _, m in threads])
    environ, note = read_environ(pid)
    bound = source.startswith("the launcher's view")
    facts: dict[str, object] = {
        "pid": pid,
        "command": _title(pid),
        "threads": len(threads),
        "mask_list": format_cpulist(mask),
        "mask_from": source,
        "environment": note or "read",
        "shared_narrow": shared_narrow(pid, [(st.tid, st.name, m) for st, m in threads], mask)
        if bound
        else None,
        "openmp_collapse": collapse_of(pid, threads, mask) if bound else None,
        "cgroup": None,
        **_sampled_facts(pid, sampler, samples, environ),
    }
    return facts, mask, environ


def _sampled_facts(
    pid: int, sampler: Sampler, samples: list[ThreadSample], environ: dict[str, str] | None
) -> dict[str, object]:
    """What the process's record says, and its weight, demand, pools and
    spinning threads over the sample."""
    from cpupin.cli.top import step_tid_of, usable_of, weight_of
    from cpupin.measure.demand import demand_of
    from cpupin.pools.census import census
    from cpupin.process.outside import record_of

    try:
        record = record_of(pid)
    except (OSError, ValueError):
        record = None
    weight = weight_of(pid)
    demand = demand_of(
        samples,
        throttled=bool(sampler.throttling and sampler.throttling.throttled_periods),
        weight=weight,
        usable_cpus=usable_of(pid),
        step_tid=step_tid_of(record),
    )
    found = census(pid, threads=sampler.threads, samples=samples, environ=environ or {})
    return {
        "weight": None if weight is None else weight.as_dict(),
        "demand": demand.as_dict(),
        "limited": next((n for n in record.notes if n.startswith("limit_pools")), None)
        if record
        else None,
        "configured": [(p.name, p.threads) for p in record.pools if p.kind == "configured"]
        if record
        else [],
        "pools": [p.as_dict() for p in found.pools],
        "spinning": [
            {"tid": s.tid, "name": s.name, "cpus_list": format_cpulist(s.mask)}
            for s in samples
            if s.spinning
        ],
    }


def _pinned_cpus(host: Host, mask: frozenset[int], here: bool) -> tuple[frozenset[int], str]:
    """The CPUs whose interrupts matter: those auto would pin a step or result
    thread to for every GPU of the host under the mask, and, on this
    machine, those registered processes pin now; and where they came from."""
    from cpupin.plan.placement import place

    planned = frozenset().union(*(place(host, mask, [g.address], "auto").cpus for g in host.gpus))
    registered: frozenset[int] = frozenset()
    if here:
        from cpupin.registry.reader import read_registry

        registered = frozenset(
            cpu
            for record in read_registry().records
            if record.live and record.kind == "process"
            for pin in record.pins
            for cpu in pin.cpus
        )
    pinned = planned | registered
    if not pinned:
        return pinned, (
            "no CPU to check: auto pins nothing on this host and mask, and no registered "
            "process pins a thread"
        )
    parts = []
    if planned:
        parts.append(f"auto's step and result CPUs {format_cpulist(planned)}")
    if registered:
        parts.append(f"registered pins {format_cpulist(registered)}")
    return pinned, " and ".join(parts)


def _visible_gpus(host: Host, environ: dict[str, str]) -> list[tuple[str, int | None]]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names, with their nodes: those the
    process will use, whose nodes its CPUs should lie on (none when unset)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if not visible or not host.gpus:
        return []
    from cpupin.act.server import parse_visible_devices, resolve_devices
    from cpupin.plan.binding import gpu_node

    try:
        count = len(parse_visible_devices(visible))
        addresses = resolve_devices(range(count), host, environ)
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
            "interrupts": {
                "pinned_cpus": sorted(r.pinned),
                "pinned_by": r.pinned_by,
                "irqs": [i.as_dict() for i in r.irqs[:MAX_LISTED]],
                "notes": r.irq_notes,
                "irqbalance": irqbalance_advice(r.pinned, r.irqs) if r.irqs else [],
            },
            "pools": {
                "usable_cpus": r.plan.usable_cpus,
                "problems": r.problems,
                "set": r.advice,
            },
            "process": r.process,
            "wake_latency_left": r.wake_left,
        }
    )


def _print_process(p: dict[str, object]) -> None:
    """The process --pid names: its command, threads, mask and any team
    that an OpenMP binding squeezed onto one CPU."""
    print(f"process  {p['command']}: {p['threads']} thread(s); mask from {p['mask_from']}")
    if p["environment"] != "read":
        print(f"         {p['environment']}")
    shared = p["shared_narrow"]
    if isinstance(shared, dict):
        others = shared["not_openmp"]
        assert isinstance(others, dict)
        print(
            f"shared   {shared['threads']} thread(s) on CPU {shared['cpus_list']}, "
            f"{sum(others.values())} of them not OpenMP's"
        )
        print(f"advice   {shared['advice']}")
    collapse = p.get("openmp_collapse")
    if isinstance(collapse, dict):
        print(f"finding  {collapse['what']}")
        print(f"         -> {collapse['remedy']}")
    weight = p.get("weight")
    if isinstance(weight, dict) and weight["value"] != weight["default"]:
        print(
            f"cgroup   CPU weight {weight['value']} (the default is {weight['default']}, "
            f"{printable(str(weight['source']), 80)}): when its neighbours are busy it gets "
            f"{weight['value'] / weight['default']:.2g}x a default cgroup's share"
        )
    demand = p.get("demand")
    if isinstance(demand, dict):
        print(
            f"demand   its threads wanted {demand['wanted_cpus']:.2f} CPU(s) over a "
            f"{SAMPLE_S:g} s sample: ran {demand['ran_cpus']:.2f}, waited "
            f"{demand['waited_cpus']:.2f} in the run queue"
            + (", throttled by its quota" if demand["throttled"] else "")
        )
        if demand["remedy"]:
            print(f"finding  contention: {demand['remedy']}")
    pools = p.get("pools")
    if isinstance(pools, list):
        lines = pool_lines(pools, "         ")
        if lines:
            print(f"threads  its pools over a {SAMPLE_S:g} s sample:")
            for line in lines:
                print(line)
    spinning = p.get("spinning")
    if isinstance(spinning, list) and spinning:
        named = ", ".join(f"{printable(str(t['name']), 16)} ({t['tid']})" for t in spinning[:4])
        print(
            f"finding  {len(spinning)} thread(s) spin: {named}; each holds a CPU while doing "
            "nothing (busy in the kernel, never blocking), and a wake-latency hold buys nothing "
            "on a CPU that never idles"
        )
        print(
            "         -> make it block, or sleep between checks; in OpenMP, "
            "OMP_WAIT_POLICY=passive (libgomp) or KMP_BLOCKTIME=0 (Intel's)"
        )


def _print_handoffs(diagnosis: Diagnosis) -> None:
    if not diagnosis.handoff:
        print("handoff  not measured (a shipped host); --measure-here uses this machine's")
        return
    print(
        f"handoff  one way, median (p99) of the quietest run, and the spread of the medians "
        f"across runs, measured on {diagnosis.measured_on}"
        + (f" ({load_text(diagnosis.load)})" if diagnosis.load else "")
        + ":"
    )
    for kind, h in diagnosis.handoff.items():
        cost = h.wake_median_ns if h.wake_median_ns and h.idle_us else h.median_ns
        lo, hi = diagnosis.spread.get(kind, (cost, cost))
        print(
            f"  {kind:18} CPUs {h.cpus[0]},{h.cpus[1]}: {cost / 1000:8.1f} µs "
            f"({h.p99_ns / 1000:.1f} µs); runs {lo / 1000:.1f} to {hi / 1000:.1f} µs"
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
    if r.process is not None:
        _print_process(r.process)
    if r.memory_ok is None:
        print(f"memory   {r.memory_why}")
    else:
        verdict = "possible" if r.memory_ok else "not possible"
        print(f"memory   binding {verdict}: {r.memory_why}")
    _print_pools(
        r.plan.usable_cpus, r.problems, r.advice, "its" if r.process is not None else "this"
    )
    _print_irqs(r)
    for line in r.wake_left:
        print(f"warning  {line}")
    _print_handoffs(diagnosis)
    for note in diagnosis.notes:
        print(f"note     {note}")
    if diagnosis.hold:
        print(f"hold     {diagnosis.hold}")
    action = {
        "auto": "turn step_thread_core auto on",
        "hold": "keep step_thread_core off; hold the step CPUs' wake latency",
        "unknown": "none: host too busy to judge, rerun on a quiet host",
    }.get(diagnosis.verdict, "keep step_thread_core off")
    print(f"verdict  {diagnosis.verdict}: {action}")
    print(f"why      {diagnosis.why}")


def _print_irqs(r: _Report) -> None:
    """The device interrupts that may land on the pinned CPUs."""
    if not r.pinned or (not r.irqs and r.irq_notes):
        print(f"irqs     {'; '.join(r.irq_notes)}")
        return
    if not r.irqs:
        print(f"irqs     none may land on {r.pinned_by}")
        return
    print(f"irqs     {len(r.irqs)} may land on {r.pinned_by}:")
    for i in r.irqs[:MAX_LISTED]:
        rate = "?" if i.per_s is None else f"{i.per_s:.0f}/s"
        fixed = ", managed" if i.managed else ""
        print(
            f"  IRQ {i.irq:>5} {i.kind:5} {rate:>8} on {format_cpulist(i.pinned)} "
            f"(affinity {format_cpulist(i.cpus)}{fixed}) {i.name}"
        )
    if len(r.irqs) > MAX_LISTED:
        print(f"  ... and {len(r.irqs) - MAX_LISTED} more")
    for line in irqbalance_advice(r.pinned, r.irqs):
        print(f"         {line}")
    for note in r.irq_notes:
        print(f"note     {note}")


def _nodes(host: Host) -> str:
    """The host's nodes as topo counts them, with those without CPUs named."""
    total, with_cpus = len(host.nodes), len(host.cpu_nodes)
    if total == with_cpus:
        return f"{total} node(s)"
    return f"{total} node(s) ({with_cpus} with CPUs)"


def _print_pools(
    usable: int, problems: list[str], advice: dict[str, int], whose: str = "this"
) -> None:
    """The pools' verdict for a process started from this environment (or,
    ``whose="its"``, from the environment --pid's process started with)."""
    if not problems:
        print(f"pools    {usable} usable CPU(s); the pool variables of {whose} environment fit")
        return
    print(f"pools    {usable} usable CPU(s); {problems[0]}")
    for line in problems[1:]:
        print(f"         {line}")
    if not advice:
        return
    print(
        "         set "
        + " ".join(f"{k}={v}" for k, v in advice.items())
        + ", or call cpupin.limit_pools() at start-up, or start under cpupin exec"
    )
