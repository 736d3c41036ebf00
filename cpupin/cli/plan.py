"""``cpupin plan``: a dry run of the placement, drawn node by node."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from cpupin.act.server import OPENMP_AFFINITY_VARS, cuda_gpus, resolve_devices
from cpupin.cli import _args
from cpupin.cli.topo import heads
from cpupin.cpulist import format_cpulist
from cpupin.errors import PlanError, excerpt
from cpupin.host._pmqos import MAX_US
from cpupin.host.topology import Host, parse_pci_address
from cpupin.plan.cpuplan import CpuPlan
from cpupin.plan.k8s import K8sPlan, balloons_policy, k8s_manifest, k8s_plan, parse_quantity
from cpupin.plan.launch import MAX_RANKS, PLAN_MODES, LaunchPlan, plan_ranks, slurm_options
from cpupin.plan.placement import ENV_SETTING, Placement, parse_setting, place, setting_from_env

#: The launchers ``--emit`` writes for.
EMITS = ("slurm", "k8s", "nri-balloons")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan", help="a dry run: where each server's threads would go (takes no lock)"
    )
    _args.add_host(plan)
    plan.add_argument(
        "--mask",
        metavar="CPULIST",
        help="the process mask (default: this process's, or all of a --host/--root host's)",
    )
    plan.add_argument(
        "--setting",
        help="off, auto or a CPU number (default: what the runtime would use, "
        "CPUPIN_STEP_THREAD_CORE, else off; under off the plan shows what auto would do too)",
    )
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
        help="a worker on CUDA device INDEX: through CUDA_VISIBLE_DEVICES when set, as the "
        "runtime counts it, else the host's INDEX-th GPU (PCI order)",
    )
    plan.add_argument(
        "--all-gpus",
        action="store_true",
        help="one single-worker server per host GPU (the default)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    _add_emit_args(plan)
    plan.set_defaults(handler=run)


def _add_emit_args(plan: argparse.ArgumentParser) -> None:
    """``--emit`` and the arguments that go with it: a launcher's terms."""
    emit = plan.add_argument_group(
        "a launcher's terms (--emit)",
        "the local ranks of one node, a rank a GPU in PCI order (or, with --node, the node's "
        "cores divided among them), written as the launcher's options: docs/slurm.md",
    )
    emit.add_argument(
        "--emit",
        choices=EMITS,
        help="slurm: srun's options (--cpu-bind=mask_cpu:..., --mem-bind, --cpus-per-task); "
        "k8s: the kubelet's settings and each rank's container resources (YAML); "
        "nri-balloons: the NRI balloons policy's BalloonsPolicy (YAML)",
    )
    add_launch_args(emit)
    emit.add_argument(
        "--batch",
        action="store_true",
        help="with --emit slurm: the lines that open a batch script (#SBATCH lines, and "
        "SLURM_CPU_BIND for its srun steps: sbatch has no --cpu-bind)",
    )
    emit.add_argument(
        "--rank-memory",
        metavar="SIZE",
        help="with --emit k8s: each rank's memory requests and limits (a quantity such as "
        "64Gi; a Guaranteed pod sets both)",
    )
    emit.add_argument(
        "--wake-latency",
        type=_args.whole("--wake-latency", 0, MAX_US),
        metavar="US",
        help="with --emit nri-balloons: a CPU class for the ranks' balloons that disables the "
        "idle states slower than US µs, as cpupin exec --wake-latency holds them",
    )


def add_launch_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The arguments ``plan --emit`` and ``verify`` share."""
    group.add_argument(
        "--ranks",
        type=_args.whole("--ranks", 1, MAX_RANKS),
        metavar="N",
        help="the local ranks of the node (default: the host's GPUs)",
    )
    group.add_argument(
        "--node",
        type=_args.whole("--node", 0, 65535),
        metavar="N",
        help="the ranks divide node N's cores (a host without GPUs)",
    )
    group.add_argument(
        "--mode",
        choices=PLAN_MODES,
        default="node",
        help="a rank's CPUs: its GPU's node (the default), its package (socket), its share of "
        "the node's cores (exclusive) or one last-level cache (cache), as cpupin exec --cpus",
    )
    group.add_argument(
        "--memory",
        choices=("preferred", "bind", "interleave", "none"),
        default="preferred",
        help="a rank's memory policy, as cpupin exec --memory (default: preferred)",
    )


def _tag(kind: str) -> Callable[[str], tuple[str, str]]:
    def parse(text: str) -> tuple[str, str]:
        return kind, text

    return parse


def _device(kind: str, text: str, host: Host) -> str:
    """A worker's device: a PCI address, or an index counting the devices
    ``CUDA_VISIBLE_DEVICES`` lists (else the host's GPUs) in PCI order, as
    the runtime (``plan_server``) and ``cpupin exec`` count them."""
    if kind == "gpu":
        return parse_pci_address(text)
    if not (text.isascii() and text.isdigit() and len(text) <= 6):
        raise PlanError(f"--device {excerpt(text)} is not a device index")
    if not host.gpus:
        return text  # no GPU to resolve to: a worker slot, as plan_server keeps it
    try:
        (address,) = resolve_devices([int(text)], host)
    except PlanError as exc:
        raise PlanError(
            f"--device: {exc} (indexes count CUDA_VISIBLE_DEVICES, else the host's GPUs, "
            "in PCI order)"
        ) from None
    return address


def run(args: argparse.Namespace) -> int:
    if args.emit is not None:
        return _emit(args)
    _refuse_emit_flags(args)
    _note_ignored(args)
    setting = setting_from_env() if args.setting is None else parse_setting(args.setting)
    host, title, mask = _args.load_host(args)
    allowed = _args.mask_arg(args.mask, host, mask) & host.cpus
    if not allowed:
        raise ValueError(f"the process mask names no online CPU of {title}")
    servers = _servers_to_place(args, host, title, allowed, setting)
    if servers is None:
        return 0
    placements = [place(host, allowed, devices, setting) for devices in servers]
    # Under off, what auto would do too: the question a user of off asks.
    autos = (
        [place(host, allowed, devices, "auto") for devices in servers] if setting == "off" else None
    )
    _show(args, host, title, allowed, setting, placements, autos)
    return 0


def _refuse_emit_flags(args: argparse.Namespace) -> None:
    """The arguments that mean something only with ``--emit``, refused
    without it."""
    for flag, given in (
        ("--ranks", args.ranks is not None),
        ("--node", args.node is not None),
        ("--batch", args.batch),
        ("--rank-memory", args.rank_memory is not None),
        ("--wake-latency", args.wake_latency is not None),
    ):
        if given:
            raise ValueError(f"{flag} goes with --emit: cpupin plan --emit slurm {flag} ...")


def _servers_to_place(
    args: argparse.Namespace, host: Host, title: str, allowed: frozenset[int], setting: object
) -> list[list[str]] | None:
    """The devices of each server to place: the one the arguments name, or
    one a host GPU; ``None`` (having said why) on a host with no GPU under
    ``off``, where nothing is pinned."""
    if args.entries and not args.all_gpus:
        return [[_device(kind, text, host) for kind, text in args.entries]]
    if host.gpus or args.entries:
        return [[g.address] for g in host.gpus]
    if setting != "off":
        raise ValueError(
            f"{title} has no GPU, so {setting} has no device to place by: " + _slots(host, allowed)
        )
    # What the user asked for holds: nothing is pinned. Say how to see a
    # placement here, without calling it an error.
    print(
        f"{title}: step_thread_core off (the default), so nothing is pinned. It "
        f"has no GPU for auto to place by; to see a placement, " + _slots(host, allowed)
    )
    return None


def _show(
    args: argparse.Namespace,
    host: Host,
    title: str,
    allowed: frozenset[int],
    setting: object,
    placements: list[Placement],
    autos: list[Placement] | None,
) -> None:
    """The placements as JSON or drawn, with what auto would do under off."""
    base = CpuPlan.for_host(host, allowed)
    if args.json:
        data: dict[str, object] = {
            "setting": str(setting),
            "mask": sorted(allowed),
            "mask_list": format_cpulist(allowed),
            "servers": _servers(base, placements),
        }
        if len(host.classes) > 1:
            data["highest_class"] = _class_json(host, allowed, placements)
        if autos is not None:
            data["with_auto"] = {"setting": "auto", "servers": _servers(base, autos)}
        _args.print_json(data)
        return
    print(
        f"{title}\nsetting {setting}, mask {format_cpulist(allowed)} ({len(allowed)} CPUs); "
        "a dry run: no lock taken"
    )
    _draw(host, allowed, placements, base)
    if autos is not None:
        print("with auto instead of off (what auto would do on this host and mask):")
        _draw(host, allowed, autos, base)


def _ranks(args: argparse.Namespace, host: Host) -> int:
    if args.ranks is not None:
        return int(args.ranks)
    if args.node is not None or not host.gpus:
        raise ValueError(
            "--ranks: how many local ranks? (with --node, the ranks divide the node; "
            "without it, a rank a GPU)"
        )
    return len(cuda_gpus(host))


def launch_plan(args: argparse.Namespace, host: Host, mask: frozenset[int]) -> LaunchPlan:
    """The plan of ``plan --emit slurm`` and ``verify``, from their shared
    arguments."""
    return plan_ranks(
        host, mask, _ranks(args, host), mode=args.mode, memory=args.memory, node=args.node
    )


def launch_k8s_plan(args: argparse.Namespace, host: Host, mask: frozenset[int]) -> K8sPlan:
    """The plan of ``plan --emit k8s|nri-balloons`` and of ``verify`` in a
    Kubernetes container: one core kept for the system, the ranks' CPUs
    their own."""
    return k8s_plan(
        host, mask, _ranks(args, host), mode=args.mode, memory=args.memory, node=args.node
    )


def _emit(args: argparse.Namespace) -> int:
    for flag, given in (
        ("--setting", args.setting is not None),
        ("--gpu/--device", bool(args.entries)),
        ("--all-gpus", args.all_gpus),
    ):
        if given:
            raise ValueError(
                f"{flag} plans a server's threads; --emit plans ranks: use --ranks, --node, "
                "--mode and --memory"
            )
    for flag, given, emit in (
        ("--batch", args.batch, "slurm"),
        ("--rank-memory", args.rank_memory is not None, "k8s"),
        ("--wake-latency", args.wake_latency is not None, "nri-balloons"),
    ):
        if given and args.emit != emit:
            raise ValueError(f"{flag} goes with --emit {emit}, not --emit {args.emit}")
    if args.batch and args.json:
        raise ValueError("--batch writes a script's lines; --json the plan: give one")
    memory = None
    if args.emit == "k8s":
        if args.rank_memory is None:
            raise ValueError(
                "--emit k8s needs --rank-memory SIZE (such as 64Gi): a Guaranteed pod's "
                "containers set memory requests == limits"
            )
        memory = parse_quantity(args.rank_memory)
    host, title, mask = _args.load_host(args)
    allowed = _args.mask_arg(args.mask, host, mask) & host.cpus
    if args.emit == "slurm":
        plan = launch_plan(args, host, allowed)
        options = slurm_options(plan, batch=args.batch)
        if args.json:
            _args.print_json({"launcher": "slurm", "options": options, **plan.as_dict()})
            return 0
        _notes(plan)
        print("\n".join(options) if args.batch else " ".join(options))
        return 0
    k = launch_k8s_plan(args, host, allowed)
    header = [
        f"cpupin plan --emit {args.emit}: {len(k.plan.ranks)} local rank(s) on "
        + (args.host or title),
        f"--mode {k.plan.mode}, --memory {k.plan.memory}, within {format_cpulist(allowed)}",
    ]
    if memory is not None:
        text = k8s_manifest(host, k, memory, header)
    else:
        text = balloons_policy(host, k, args.wake_latency, header)
    if args.json:
        _args.print_json({"launcher": args.emit, "yaml": text, **k.as_dict()})
        return 0
    _notes(k.plan)
    sys.stdout.write(text)
    return 0


def _notes(plan: LaunchPlan) -> None:
    for rank, binding in enumerate(plan.ranks):
        # The plan's reasons (a rank off its GPU's node), where a reader sees
        # them without breaking $(cpupin plan --emit slurm ...).
        if binding.reason:
            print(f"note: rank {rank}: {binding.reason}", file=sys.stderr)


def _note_ignored(args: argparse.Namespace) -> None:
    """Say which of cpupin's variables and OpenMP's the dry run leaves out."""
    used = set() if args.setting is not None else {ENV_SETTING}
    ignored = [
        n
        for n in os.environ
        if (n.startswith("CPUPIN_") or n in OPENMP_AFFINITY_VARS) and n not in used
    ]
    if ignored:
        print(
            f"note: the dry run plans from its arguments and {ENV_SETTING} alone; it "
            f"ignores {', '.join(ignored)}",
            file=sys.stderr,
        )


def _slots(host: Host, allowed: frozenset[int]) -> str:
    """How to plan on a host without GPUs, as a command that works under this
    mask: a CPU number, and one worker slot a worker (a label: no GPU)."""
    cores = sum(1 for core in host.cores if allowed.intersection(core.cpus))
    first = min(allowed)
    if cores < 2:
        return (
            f"and the mask {format_cpulist(allowed)} holds one core, so no worker core can "
            "be apart from the result CPU; widen the mask"
        )
    workers = min(cores - 1, 2)
    slots = " ".join(f"--device {i}" for i in range(workers))
    return (
        f"name a CPU and a worker slot for each worker, as in cpupin plan --setting {first} "
        f"{slots} (a slot is only a label where there is no GPU; this mask has room for "
        f"{cores - 1} worker(s))"
    )


def _usable(base: CpuPlan, p: Placement) -> int:
    """The CPUs a server's pools may use: the mask under the host's quota
    (``base``, made once a command: on a 65,536-CPU host it is the costly
    part), less what the placement pins."""
    return base.with_pinned(p.cpus).usable_cpus


def _servers(base: CpuPlan, placements: list[Placement]) -> list[dict[str, object]]:
    return [
        {
            **{k: v for k, v in p.as_dict().items() if k != "setting"},
            "usable_cpus": _usable(base, p),
        }
        for p in placements
    ]


def _draw(host: Host, allowed: frozenset[int], placements: list[Placement], base: CpuPlan) -> None:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    owner: dict[int, str] = {}
    reasons = {p.reason for p in placements}
    if len(placements) > 1 and not any(p.pinned for p in placements) and len(reasons) == 1:
        # Every server pins nothing for one reason (off): say it once, not a line each.
        print(f"  all {len(placements)} servers pin nothing: {placements[0].reason}")
        print(f"  (pools: {_usable(base, placements[0])} usable CPU(s) each)")
        return
    for i, p in enumerate(placements):
        letter = letters[i % 26]
        pools = f"; pools: {_usable(base, p)} usable CPU(s)"
        if p.pinned:
            steps = "; ".join(f"{w.device} on {format_cpulist(w.cpus)}" for w in p.workers)
            apart = _caches_apart(host, p)
            print(f"  {letter}  step {steps}; result on {p.result_cpu}{pools}{apart}")
        else:
            print(f"  {letter}  {', '.join(p.devices)}: pins nothing: {p.reason}{pools}")
        for w in p.workers:
            for cpu in w.cpus:
                owner[cpu] = letter if cpu not in owner else "*"
        if p.result_cpu is not None:
            owner[p.result_cpu] = letter.lower() if p.result_cpu not in owner else "*"
    if len(host.classes) > 1:
        print(_budget_line(host, _top_class_use(host, allowed, placements)))
    _draw_nodes(host, allowed, owner)


def _draw_nodes(host: Host, allowed: frozenset[int], owner: dict[int, str]) -> None:
    """The map: a line a node, a cell a core, each marked by its server."""
    top = _top_class(host)
    print(
        "cores of each node (A: a server's step core, a: its result CPU, .: free, "
        + ("+: free and of the highest class, " if top else "")
        + "' ': outside the mask)"
    )
    # One line a node, with no Python loop over the cores of a node that is
    # wholly free (a 65,536-CPU host has 2,048 nodes).
    by_first = heads(host)
    firsts_all = frozenset(by_first)
    owned = frozenset(owner)
    gpus_of: dict[int | None, list[str]] = {}
    for g in host.gpus:
        gpus_of.setdefault(g.node, []).append(g.address)
    free_rows: dict[int, str] = {}
    lines = []
    for node in host.cpu_nodes:
        firsts = node.cpus & firsts_all
        if node.cpus <= allowed and not node.cpus & owned and not node.cpus & top:
            row = free_rows.get(len(firsts))
            if row is None:
                row = free_rows[len(firsts)] = _grouped("." * len(firsts))
        else:
            cells = []
            for first in sorted(firsts):
                cell = " "  # outside the mask, unless a CPU of it is allowed
                free = "+" if first in top else "."
                for cpu in by_first[first].cpus:
                    if cpu in allowed:
                        cell = owner.get(cpu) or free
                        if cell != free:
                            break
                cells.append(cell)
            row = _grouped("".join(cells))
        gpus = gpus_of.get(node.id)
        lines.append(f"  node {node.id:<3} {row}" + (f"  GPUs {' '.join(gpus)}" if gpus else ""))
    print("\n".join(lines))


def _top_class(host: Host) -> frozenset[int]:
    """The first CPUs of the highest-class cores, where cores differ."""
    if len(host.classes) < 2:
        return frozenset()
    return frozenset(core.cpus[0] for core in host.cores if core.rank == 0)


def _top_class_use(
    host: Host, allowed: frozenset[int], placements: list[Placement]
) -> dict[int, tuple[int, int]]:
    """Where cores differ: for each package, its highest-class cores in the
    mask (the budget of docs/placement.md) and how many of them the plan's
    step threads take; empty on a host of one class."""
    if len(host.classes) < 2:
        return {}
    step = {cpu for p in placements for w in p.workers for cpu in w.cpus}
    out: dict[int, tuple[int, int]] = {}
    for core in host.cores:
        if core.rank != 0 or not allowed.intersection(core.cpus):
            continue
        package = -1 if core.package is None else core.package
        have, used = out.get(package, (0, 0))
        out[package] = (have + 1, used + bool(step.intersection(core.cpus)))
    return out


def _class_json(
    host: Host, allowed: frozenset[int], placements: list[Placement]
) -> dict[str, object]:
    use = _top_class_use(host, allowed, placements)
    return {
        "values": dict(host.classes[0].values),
        "packages": {str(p): {"cores": have, "step": used} for p, (have, used) in use.items()},
    }


def _budget_line(host: Host, use: dict[int, tuple[int, int]]) -> str:
    parts = "; ".join(f"package {p}: {used} of {have}" for p, (have, used) in sorted(use.items()))
    return (
        f"highest class ({host.classes[0].describe(host.class_keys())}): step threads take "
        f"{parts or 'none: no core of it is in the mask'}"
    )


def _caches_apart(host: Host, p: Placement) -> str:
    """A note when a server's first step core and its result CPU lie in
    different last-level caches (docs/placement.md says why that stands)."""
    if len(host.caches) < 2 or p.result_cpu is None or not p.workers:
        return ""
    step, result = host.cache_of(p.workers[0].cpus[0]), host.cache_of(p.result_cpu)
    if step is None or result is None or step == result:
        return ""
    return f"; L3 {step} and {result} (apart)"


def _grouped(row: str) -> str:
    """A node's row of core marks in groups of eight."""
    return " ".join(row[i : i + 8] for i in range(0, len(row), 8))
