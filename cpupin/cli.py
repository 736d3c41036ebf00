"""The ``cpupin`` command: one subcommand a capability, each with ``--help``
and, where it reports, ``--json``.

A bad argument exits 2 with a message naming it; nothing reaches the user as
a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from . import __version__

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _cmd_threads(args: argparse.Namespace) -> int:
    from . import _native
    from .process import process_cpus

    pid = args.pid
    stats = _native.thread_stats(pid, last_cpu=True)
    rows = []
    for st in stats:
        try:
            mask = _native.get_affinity(st.tid)
        except OSError:
            continue
        rows.append({**st._asdict(), "mask": sorted(mask)})
    if args.json:
        _print_json(rows)
        return 0
    from .cpulist import format_cpulist

    print(f"process mask {format_cpulist(process_cpus())}")
    print(f"{'tid':>8} {'name':16} {'run ms':>10} {'wait ms':>10} {'cpu':>4}")
    for row in rows:
        print(
            f"{row['tid']:>8} {row['name'][:16]:16} {row['run_ns'] / 1e6:>10.1f} "
            f"{row['wait_ns'] / 1e6:>10.1f} {row['last_cpu']!s:>4}"
        )
    return 0


def _host_arg(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--root", metavar="DIR", help="read sysfs and procfs under DIR")
    where.add_argument("--host", metavar="NAME", help="a shipped host: " + ", ".join(_host_names()))


def _host_names() -> list[str]:
    from .hosts import HOSTS

    return sorted(HOSTS)


def _load_host(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(host, its title, the mask a process there has)."""
    from .hosts import HOSTS, host_named
    from .process import process_cpus
    from .topology import read_host

    if args.host:
        host = host_named(args.host)
        return host, f"{args.host}: {HOSTS[args.host].description}", host.default_mask()
    if args.root:
        if not os.path.isdir(args.root):
            raise ValueError(f"--root {args.root!r} is not a directory")
        host = read_host(args.root)
        return host, f"the tree under {host.root}", host.default_mask()
    host = read_host("/")
    return host, "this machine", process_cpus() & host.cpus


def _cmd_topo(args: argparse.Namespace) -> int:
    from .cpulist import format_cpulist
    from .cpuplan import CpuPlan

    host, title, mask = _load_host(args)
    plan = CpuPlan.for_host(host, mask)
    deepest = host.deepest_idle_state()
    if args.json:
        _print_json(
            {
                "host": title,
                "cpus": sorted(host.cpus),
                "cores": [list(core.cpus) for core in host.cores],
                "nodes": {str(node.id): sorted(node.cpus) for node in host.nodes},
                "gpus": [
                    {
                        "address": g.address,
                        "vendor": g.vendor,
                        "class": f"{g.class_code:#08x}",
                        "node": g.node,
                        "local_cpus": sorted(g.local_cpus) if g.local_cpus is not None else None,
                    }
                    for g in host.gpus
                ],
                "idle_states": [
                    {
                        "package": package,
                        "name": s.name,
                        "latency_us": s.latency_us,
                        "disabled": s.disabled,
                    }
                    for package, states in sorted(host.idle_states.items())
                    for s in states
                ],
                "deepest_idle_state": (
                    {"name": deepest.name, "latency_us": deepest.latency_us} if deepest else None
                ),
                "smt": host.smt,
                "hypervisor": host.hypervisor,
                "mask": sorted(plan.mask),
                "cpuset": sorted(host.cpuset) if host.cpuset is not None else None,
                "quota": (
                    {
                        "quota_us": host.quota.quota_us,
                        "period_us": host.quota.period_us,
                        "cpus": host.quota.cpus,
                        "source": host.quota.source,
                    }
                    if host.quota
                    else None
                ),
                "usable_cpus": plan.usable_cpus,
                "reasons": list(host.reasons),
            }
        )
        return 0
    threads = {len(core.cpus) for core in host.cores}
    smt = {True: "SMT on", False: "SMT off", None: "SMT unknown"}[host.smt]
    print(title)
    print(
        f"CPUs   {len(host.cpus)} online ({format_cpulist(host.cpus)}), {len(host.cores)} "
        f"cores, {smt} ({'/'.join(map(str, sorted(threads)))} thread(s) a core)"
    )
    for node in host.nodes:
        gpus = [g.address for g in host.gpus if g.node == node.id]
        cores = sum(1 for core in host.cores if core.cpus[0] in node.cpus)
        cpus = f"CPUs {format_cpulist(node.cpus)} ({cores} cores)" if node.cpus else "no CPUs"
        print(f"node {node.id:<3} {cpus}" + (f"; GPUs {' '.join(gpus)}" if gpus else ""))
    for g in host.gpus:
        local = format_cpulist(g.local_cpus) if g.local_cpus is not None else "unknown"
        node = g.node if g.node is not None else "none"
        print(
            f"GPU    {g.address} {g.vendor} class {g.class_code:#08x} node {node}, "
            f"local CPUs {local}"
        )
    if not host.gpus:
        print("GPUs   none")
    if deepest:
        print(
            f"idle   deepest state {deepest.name}, exit latency {deepest.latency_us} µs"
            + (
                " (a virtual machine: its guest sees only what the hypervisor shows)"
                if host.hypervisor
                else ""
            )
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


def _tag(kind: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> tuple[str, str]:
        return kind, text

    return parse


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cpulist import format_cpulist, parse_cpulist
    from .placement import parse_setting, place
    from .server import OPENMP_AFFINITY_VARS

    ignored = [n for n in os.environ if n.startswith("CPUPIN_") or n in OPENMP_AFFINITY_VARS]
    if ignored:
        print(
            f"note: the dry run plans from its arguments alone; it ignores {', '.join(ignored)}",
            file=sys.stderr,
        )
    setting = parse_setting(args.setting)
    host, title, mask = _load_host(args)
    if args.mask is not None:
        mask = parse_cpulist(args.mask)
    allowed = frozenset(mask) & host.cpus
    if args.all_gpus or not args.entries:
        if not host.gpus and not args.entries:
            raise ValueError(f"{title} has no GPU: name worker slots with --gpu or --device")
        servers = [[g.address] for g in host.gpus]
    else:
        servers = [[_device(kind, text, host) for kind, text in args.entries]]
    placements = [place(host, allowed, devices, setting) for devices in servers]
    if args.json:
        _print_json(
            {
                "setting": str(setting),
                "mask": format_cpulist(allowed),
                "servers": [
                    {
                        "devices": list(p.devices),
                        "pinned": p.pinned,
                        "reason": p.reason,
                        "workers": [{"device": w.device, "cpus": list(w.cpus)} for w in p.workers],
                        "result_cpu": p.result_cpu,
                    }
                    for p in placements
                ],
            }
        )
        return 0
    print(
        f"{title}\nsetting {setting}, mask {format_cpulist(allowed)} ({len(allowed)} CPUs); "
        "a dry run: no lock taken"
    )
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    owner: dict[int, str] = {}
    for i, p in enumerate(placements):
        letter = letters[i % 26]
        if p.pinned:
            steps = "; ".join(f"{w.device} on {format_cpulist(w.cpus)}" for w in p.workers)
            print(f"  {letter}  step {steps}; result on {p.result_cpu}")
        else:
            print(f"  {letter}  {', '.join(p.devices)}: pins nothing: {p.reason}")
        for w in p.workers:
            for cpu in w.cpus:
                owner[cpu] = letter if cpu not in owner else "*"
        if p.result_cpu is not None:
            owner[p.result_cpu] = letter.lower() if p.result_cpu not in owner else "*"
    print(
        "cores of each node (A: a server's step core, a: its result CPU, .: free, "
        "' ': outside the mask)"
    )
    for node in host.cpu_nodes:
        cells = []
        for core in host.cores:
            if core.cpus[0] not in node.cpus:
                continue
            marks = [owner.get(cpu) for cpu in core.cpus if cpu in allowed]
            if not any(cpu in allowed for cpu in core.cpus):
                cells.append(" ")
            else:
                cells.append(next((m for m in marks if m), "."))
        groups = " ".join("".join(cells[i : i + 8]) for i in range(0, len(cells), 8))
        gpus = " ".join(g.address for g in host.gpus if g.node == node.id)
        print(f"  node {node.id:<3} {groups}" + (f"  GPUs {gpus}" if gpus else ""))
    return 0


def _device(kind: str, text: str, host) -> str:  # type: ignore[no-untyped-def]
    from .errors import PlanError
    from .topology import parse_pci_address

    if kind == "gpu":
        return parse_pci_address(text)
    if not (text.isascii() and text.isdigit()):
        raise PlanError(f"--device {text!r} is not a device index")
    index = int(text)
    if index >= len(host.gpus):
        raise PlanError(
            f"--device {index} is past the host's {len(host.gpus)} GPU(s) (indexes "
            "count them in PCI order)"
        )
    return host.gpus[index].address


def _process_mask_of(pid: int, masks: list[frozenset[int]]) -> tuple[frozenset[int], str]:
    from .cpulist import parse_cpulist
    from .process import ENV_PROCESS_CPUS

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(ENV_PROCESS_CPUS.encode() + b"="):
                    text = item.split(b"=", 1)[1].decode("ascii", "replace")
                    return parse_cpulist(text), f"its {ENV_PROCESS_CPUS}"
    except (OSError, ValueError):
        pass
    return max(masks, key=len), "the widest mask among its threads"


def _cmd_audit(args: argparse.Namespace) -> int:
    from . import _native
    from .cpulist import format_cpulist

    threads = []
    for st in _native.thread_stats(args.pid):
        try:
            threads.append((st, _native.get_affinity(st.tid)))
        except ProcessLookupError:
            continue
    if not threads:
        raise ProcessLookupError(3, "No such process", f"pid {args.pid}")
    mask, source = _process_mask_of(args.pid, [m for _, m in threads])
    groups: dict[frozenset[int], list[tuple[int, str]]] = {}
    for st, cpus in threads:
        groups.setdefault(cpus, []).append((st.tid, st.name))
    narrow = {cpus: members for cpus, members in groups.items() if cpus != mask}
    if args.json:
        _print_json(
            {
                "pid": args.pid,
                "process_mask": format_cpulist(mask),
                "process_mask_from": source,
                "groups": [
                    {
                        "mask": format_cpulist(cpus),
                        "narrower": cpus != mask,
                        "threads": [{"tid": tid, "name": name} for tid, name in members],
                    }
                    for cpus, members in sorted(
                        groups.items(), key=lambda kv: (-len(kv[0]), sorted(kv[0]))
                    )
                ],
            }
        )
    else:
        print(
            f"pid {args.pid}: {len(threads)} threads; process mask {format_cpulist(mask)} "
            f"({source})"
        )
        on_mask = groups.get(mask, [])
        print(f"  {len(on_mask)} thread(s) on the process mask")
        for cpus, members in sorted(narrow.items(), key=lambda kv: sorted(kv[0])):
            names = ", ".join(f"{name} ({tid})" for tid, name in members)
            print(f"  on {format_cpulist(cpus)}: {names}")
        if narrow:
            print(
                "  From outside, a deliberate pin and a stray look the same; inside the "
                "process, cpupin.stray_threads() tells them apart."
            )
    return 1 if narrow and args.fail_on_narrow else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpupin",
        description="Pin the threads of a GPU model-serving runtime to the right CPUs.",
    )
    parser.add_argument("--version", action="version", version=f"cpupin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    threads = sub.add_parser(
        "threads", help="list a process's threads with CPU time, run-queue wait and last CPU"
    )
    threads.add_argument("pid", nargs="?", type=int, help="process id (default: this process)")
    threads.add_argument("--json", action="store_true", help="print JSON")
    threads.set_defaults(handler=_cmd_threads)

    topo = sub.add_parser("topo", help="show the host: nodes, cores, SMT, GPUs, idle states, mask")
    _host_arg(topo)
    topo.add_argument("--json", action="store_true", help="print JSON")
    topo.set_defaults(handler=_cmd_topo)

    plan = sub.add_parser(
        "plan", help="a dry run: where each server's threads would go (takes no lock)"
    )
    _host_arg(plan)
    plan.add_argument(
        "--mask",
        metavar="CPULIST",
        help="the process mask (default: this process's, or all of a --host/--root host's)",
    )
    plan.add_argument("--setting", default="auto", help="off, auto (default) or a CPU number")
    plan.add_argument(
        "--gpu",
        dest="entries",
        action="append",
        type=_tag("gpu"),
        metavar="ADDR",
        help="a worker on this GPU; repeat for more workers",
    )
    plan.add_argument(
        "--device",
        dest="entries",
        action="append",
        type=_tag("device"),
        metavar="INDEX",
        help="a worker on the host's INDEX-th GPU (PCI order)",
    )
    plan.add_argument(
        "--all-gpus",
        action="store_true",
        help="one single-worker server per host GPU (the default)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(handler=_cmd_plan)

    audit = sub.add_parser(
        "audit", help="group another process's threads by CPU mask; list the narrower ones"
    )
    audit.add_argument("pid", type=int, help="process id")
    audit.add_argument("--json", action="store_true", help="print JSON")
    audit.add_argument(
        "--fail-on-narrow",
        action="store_true",
        help="exit 1 when any thread is on a narrower mask than the process's",
    )
    audit.set_defaults(handler=_cmd_audit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except BrokenPipeError:
        return 0
    except OSError as exc:
        what = f"{exc.filename}: " if exc.filename else ""
        print(f"cpupin {args.command}: {what}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"cpupin {args.command}: {exc}", file=sys.stderr)
        return 2
