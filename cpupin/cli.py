"""The ``cpupin`` command: one subcommand a capability, each with ``--help``
and, where it reports, ``--json``.

A bad argument exits 2 with a message naming it; nothing reaches the user as
a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from ._native import PID_LIMIT
from .errors import excerpt
from .hosts import HOSTS

if TYPE_CHECKING:
    from .sampling import Sampler
    from .topology import Core, Host

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


#: Where to report a bug, printed with an internal error.
REPORT = "https://github.com/cpupin/cpupin/issues"


def _whole(name: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: ASCII digits naming a whole number from lo to hi."""

    def parse(text: str) -> int:
        body = text.strip()
        if not (body.isascii() and body.isdigit() and len(body) <= 12):
            raise argparse.ArgumentTypeError(
                f"{excerpt(text)} is not a whole number: {name} runs from {lo} to {hi}"
            )
        value = int(body)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{name} {value} is outside {lo} to {hi}")
        return value

    return parse


def _seconds(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds from lo to hi."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 32 else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(
                f"{excerpt(text)} is not a number of seconds from {lo:g} to {hi:g}"
            )
        return value

    return parse


_pid = _whole("pid", 1, PID_LIMIT - 1)


def _pid_or_self(text: str) -> int | None:
    if text == "self":
        return None
    try:
        return _pid(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{excerpt(text)} is not a pid: give a process id from 1 to {PID_LIMIT - 1}, or self"
        ) from None


def _nonempty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty {what}: name one")
        return text

    return parse


def _host_name(text: str) -> str:
    if text not in HOSTS:
        raise argparse.ArgumentTypeError(
            f"no shipped host {excerpt(text)}: choose one of {', '.join(sorted(HOSTS))}"
        )
    return text


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
    where.add_argument(
        "--root", type=_nonempty("--root"), metavar="DIR", help="read sysfs and procfs under DIR"
    )
    where.add_argument(
        "--host",
        type=_host_name,
        metavar="NAME",
        help="a shipped host: " + ", ".join(sorted(HOSTS)),
    )


def _load_host(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(host, its title, the mask a process there has)."""
    from .hosts import host_named
    from .process import process_cpus
    from .topology import read_host

    if args.host:
        host = host_named(args.host)
        return host, f"{args.host}: {HOSTS[args.host].description}", host.default_mask()
    if args.root:
        if not os.path.isdir(args.root):
            raise ValueError(f"--root {excerpt(args.root)} is not a directory")
        host = read_host(args.root)
        if not host.cpus:
            raise ValueError(
                f"--root {excerpt(args.root)} lists no online CPU under "
                "sys/devices/system/cpu: give the root of a sysfs and procfs capture "
                "(the folder that holds sys/ and proc/)"
            )
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
                "memory_nodes": (
                    sorted(host.memory_nodes) if host.memory_nodes is not None else None
                ),
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
    heads = frozenset(_heads(host))
    for node in host.nodes:
        gpus = [g.address for g in host.gpus if g.node == node.id]
        cores = len(node.cpus & heads)
        cpus = f"CPUs {format_cpulist(node.cpus)} ({cores} cores)" if node.cpus else "no CPUs"
        if host.memory_nodes is not None:
            cpus += ", memory" if node.id in host.memory_nodes else ", no memory"
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


def _heads(host: Host) -> dict[int, Core]:
    """Each core by its first CPU: with ``node.cpus & heads.keys()`` (a set
    operation in C) a node's cores are found without a Python loop over every
    core for every node (a 65,536-CPU host has 2,048 nodes)."""
    return {core.cpus[0]: core for core in host.cores}


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
        try:
            mask = parse_cpulist(args.mask)
        except ValueError as exc:
            raise ValueError(f"--mask: {exc}") from None
    allowed = frozenset(mask) & host.cpus
    if not allowed:
        raise ValueError(
            f"--mask {excerpt(args.mask or format_cpulist(mask))} names no online CPU of "
            f"the host (its CPUs are {format_cpulist(host.cpus) or 'none'})"
        )
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
    # One line a node, with no Python loop over the cores of a node that is
    # wholly free (a 65,536-CPU host has 2,048 nodes).
    heads = _heads(host)
    head_cpus = frozenset(heads)
    owned = frozenset(owner)
    gpus_of: dict[int | None, list[str]] = {}
    for g in host.gpus:
        gpus_of.setdefault(g.node, []).append(g.address)
    free_rows: dict[int, str] = {}
    lines = []
    for node in host.cpu_nodes:
        firsts = node.cpus & head_cpus
        if node.cpus <= allowed and not node.cpus & owned:
            row = free_rows.get(len(firsts))
            if row is None:
                row = free_rows[len(firsts)] = _grouped("." * len(firsts))
        else:
            cells = []
            for first in sorted(firsts):
                cell = " "  # outside the mask, unless a CPU of it is allowed
                for cpu in heads[first].cpus:
                    if cpu in allowed:
                        cell = owner.get(cpu) or "."
                        if cell != ".":
                            break
                cells.append(cell)
            row = _grouped("".join(cells))
        gpus = gpus_of.get(node.id)
        lines.append(f"  node {node.id:<3} {row}" + (f"  GPUs {' '.join(gpus)}" if gpus else ""))
    print("\n".join(lines))
    return 0


def _grouped(row: str) -> str:
    """A node's row of core marks in groups of eight."""
    return " ".join(row[i : i + 8] for i in range(0, len(row), 8))


def _device(kind: str, text: str, host: Host) -> str:
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


def _cmd_audit(args: argparse.Namespace) -> int:
    from . import _native
    from .cpulist import format_cpulist
    from .sampling import process_mask_of

    threads = []
    for st in _native.thread_stats(args.pid):
        try:
            threads.append((st, _native.get_affinity(st.tid)))
        except ProcessLookupError:
            continue
    if not threads:
        raise ProcessLookupError(3, "No such process", f"pid {args.pid}")
    mask, source = process_mask_of(args.pid, [m for _, m in threads])
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


def _cmd_top(args: argparse.Namespace) -> int:
    import itertools

    from .sampling import Sampler

    pid = args.pid
    if pid is None:
        _demo_threads()
    sampler = Sampler(pid)
    counts = range(args.count) if args.count is not None else itertools.count()
    try:
        _top(args, sampler, counts)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how top ends
    return 0


def _top(args: argparse.Namespace, sampler: Sampler, counts: Iterable[int]) -> None:
    import time

    pid = args.pid
    for i in counts:
        sampler.start()
        time.sleep(args.interval)
        samples = sampler.stop()
        if args.json:
            json.dump([s.as_dict() for s in samples], sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
            continue
        if i:
            print()
        print(
            time.strftime("%H:%M:%S"),
            f"pid {pid or os.getpid()}, {len(samples)} threads, over {args.interval:g} s",
        )
        print(
            f"{'tid':>8} {'name':16} {'cpu ms/s':>9} {'wait ms/s':>10} {'cpu':>4}  "
            f"{'mask':14} state"
        )
        for s in samples:
            print(
                f"{s.tid:>8} {s.name[:16]:16} {s.cpu_ms_per_s:>9.1f} {s.wait_ms_per_s:>10.1f} "
                f"{s.last_cpu if s.last_cpu is not None else '?':>4}  "
                f"{_short(s.mask):14} {s.state}"
            )
        sys.stdout.flush()


def _short(cpus: frozenset[int]) -> str:
    from .cpulist import format_cpulist

    text = format_cpulist(cpus)
    return text if len(text) <= 14 else text[:13] + "…"


def _demo_threads() -> None:
    """Two threads for ``cpupin top self`` to show: one busy, one asleep."""
    import time

    from .threads import Thread

    def name(text: str) -> None:
        try:  # the OS name, which Python before 3.14 leaves as the process's
            with open("/proc/thread-self/comm", "w") as f:
                f.write(text)
        except OSError:
            pass

    def busy() -> None:
        name("demo-busy")
        while True:
            end = time.monotonic() + 0.003
            while time.monotonic() < end:
                pass
            time.sleep(0.007)

    Thread(target=busy, name="demo-busy", daemon=True).start()

    def idle() -> None:
        name("demo-idle")
        time.sleep(1e9)

    Thread(target=idle, name="demo-idle", daemon=True).start()


def _pair(text: str) -> tuple[int | None, int | None]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pair such as 0,1")
    out: list[int | None] = []
    for part in parts:
        part = part.strip()
        if part in ("any", "-"):
            out.append(None)
        elif part.isascii() and part.isdigit() and len(part) <= 6:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a CPU number")
    return out[0], out[1]


#: The most handoffs --matrix measures (a minute or so at 10 µs each).
_MATRIX_ROUNDS = 10_000_000


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'cpupin[plot]'") from None


def _cmd_handoff(args: argparse.Namespace) -> int:
    from .cpulist import format_cpulist
    from .handoff import format_pair, handoff, handoff_matrix, handoff_python, pair_kinds
    from .process import process_cpus
    from .topology import read_host

    mask = process_cpus()
    if args.plot and not args.matrix:
        raise ValueError("--plot draws the --matrix: add --matrix")
    if args.cpus is not None and args.matrix:
        raise ValueError("--cpus names one pair and --matrix measures every pair: give one")
    if args.cpus is not None:
        outside = [cpu for cpu in args.cpus if cpu is not None and cpu not in mask]
        if outside:
            raise ValueError(
                f"--cpus: CPU {format_cpulist(outside)} is outside the process mask "
                f"{format_cpulist(mask)}: name CPUs of the mask, or any"
            )
        if args.spin and (None in args.cpus or args.cpus[0] == args.cpus[1]):
            raise ValueError(
                "--spin needs two different CPUs in --cpus (two spinners on one CPU, or "
                "unpinned, wait on each other)"
            )
    if args.spin and len(mask) < 2:
        raise ValueError(
            f"--spin needs two CPUs, and this process may use only CPU {format_cpulist(mask)}"
        )
    if args.matrix and len(mask) * len(mask) * args.rounds > _MATRIX_ROUNDS:
        raise ValueError(
            f"--matrix of {len(mask)} CPUs with --rounds {args.rounds} is "
            f"{len(mask) ** 2 * args.rounds} handoffs: lower --rounds, or narrow the mask "
            "with taskset"
        )
    if args.plot:
        _need_matplotlib()
    if args.matrix:

        def progress(done: int, total: int) -> None:
            bar = "#" * (30 * done // total)
            print(f"\r[{bar:<30}] {done}/{total} pairs", end="", file=sys.stderr, flush=True)

        grid = handoff_matrix(
            mask, rounds=args.rounds, idle_us=args.idle_us, spin=args.spin, progress=progress
        )
        print(file=sys.stderr)
        cpus = sorted(mask)
        if args.plot:
            _plot(grid, cpus, args.plot)
        if args.json:
            _print_json(
                {
                    "mode": "spin" if args.spin else "futex",
                    "idle_us": args.idle_us,
                    "rounds": args.rounds,
                    "cpus": cpus,
                    "median_ns": [[grid.get((a, b)) for b in cpus] for a in cpus],
                }
            )
            return 0
        print("one-way handoff, median ns (rows: A, columns: B)")
        print("      " + "".join(f"{b:>9}" for b in cpus))
        for a in cpus:
            print(
                f"{a:>5} "
                + "".join(f"{grid[(a, b)]:>9.0f}" if (a, b) in grid else f"{'-':>9}" for b in cpus)
            )
        return 0
    if args.cpus is not None:
        pairs = {format_pair(args.cpus): args.cpus}
    else:
        pairs = pair_kinds(read_host("/"), mask)
        if args.spin:
            pairs = {k: p for k, p in pairs.items() if None not in p and p[0] != p[1]}
    results = {}
    for kind, cpus in pairs.items():
        if args.python:
            results[kind] = handoff_python(cpus, rounds=args.rounds, kind=args.python)
        else:
            results[kind] = handoff(
                cpus,
                rounds=args.rounds,
                warmup=args.rounds // 10,
                idle_us=args.idle_us,
                spin=args.spin,
            )
    if args.json:
        rows = [{"kind": kind, **r.as_dict()} for kind, r in results.items()]
        _print_json(rows[0] if args.cpus is not None else rows)
        return 0
    print(
        f"one-way handoff, ns ({next(iter(results.values())).mode}"
        + (f", sender idle {args.idle_us} µs first" if args.idle_us else "")
        + ")"
    )
    print(
        f"  {'pair':14} {'CPUs':>9} {'median':>9} {'p90':>9} {'p99':>9}"
        + (f" {'wake':>9}" if args.idle_us else "")
    )
    for kind, r in results.items():
        wake = f" {r.wake_median_ns:>9.0f}" if args.idle_us and r.wake_median_ns else ""
        print(
            f"  {kind:14} {format_pair(r.cpus):>9} {r.median_ns:>9.0f} {r.p90_ns:>9.0f} "
            f"{r.p99_ns:>9.0f}{wake}"
        )
    return 0


def _plot(grid: dict[tuple[int, int], float], cpus: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'cpupin[plot]'") from None
    data = [[grid.get((a, b), float("nan")) / 1000 for b in cpus] for a in cpus]
    fig, ax = plt.subplots(figsize=(2 + 0.4 * len(cpus), 1.5 + 0.4 * len(cpus)))
    image = ax.imshow(data, cmap="viridis")
    ax.set_xticks(range(len(cpus)), [str(c) for c in cpus])
    ax.set_yticks(range(len(cpus)), [str(c) for c in cpus])
    ax.set_xlabel("CPU B (woken)")
    ax.set_ylabel("CPU A (waking)")
    ax.set_title("one-way handoff, median µs")
    if len(cpus) <= 16:
        for i, row in enumerate(data):
            for j, value in enumerate(row):
                bright = value > (min(map(min, data)) + max(map(max, data))) / 2
                ax.text(
                    j,
                    i,
                    f"{value:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="k" if bright else "w",
                )
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .cpulist import format_cpulist
    from .doctor import diagnose, measure_host
    from .process import process_cpus
    from .topology import read_host

    host, title, mask = _load_host(args)
    here = not (args.host or args.root)
    handoffs = None
    measured_on = "nowhere"
    if here or args.measure_here:
        local = host if here else read_host("/")
        handoffs = measure_host(local, process_cpus() & local.cpus)
        measured_on = "this machine" if here else f"this machine, not {args.host or args.root}"
    diagnosis = diagnose(host, handoffs, measured_on)
    memory_ok: bool | None = None
    memory_why = "binding not checked (not this machine)"
    if here:
        from .binding import memory_binding_check

        memory_ok, memory_why = memory_binding_check()
    if args.json:
        _print_json(
            {
                "host": title,
                **diagnosis.as_dict(),
                "memory_binding": {"possible": memory_ok, "why": memory_why},
            }
        )
        return 0
    deepest = diagnosis.deepest_idle_state
    print(f"cpupin doctor: {title}")
    print(
        f"host     {len(host.cpus)} CPUs, {len(host.cores)} cores, SMT "
        f"{'on' if host.smt else 'off'}, {len(host.cpu_nodes)} node(s), "
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


def _local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        text = os.environ.get(name)
        if text is not None:
            body = text.strip()
            if not (body.isascii() and body.isdigit() and len(body) <= 6):
                raise ValueError(f"--local-rank: {name}={excerpt(text)} is not a device index")
            return int(body)
    raise ValueError(
        "--local-rank: neither LOCAL_RANK (torchrun) nor SLURM_LOCALID (Slurm) is set; "
        "name the GPU with --gpu or --device"
    )


def _cmd_exec(args: argparse.Namespace) -> int:
    from .binding import bind_process, decide_binding, read_mems_allowed
    from .cpulist import format_cpulist, parse_cpulist
    from .process import ENV_PROCESS_CPUS, process_cpus
    from .server import resolve_devices

    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("no command to run: cpupin exec --node 0 -- python serve.py")
    elsewhere = args.root or args.host or args.mask is not None
    if elsewhere and not args.dry_run:
        raise ValueError(
            "--root, --host and --mask describe another host or mask: use them with --dry-run"
        )
    device: str | int | None = None
    if args.gpu is not None:
        device = args.gpu
    elif args.device is not None:
        device = args.device
    elif args.local_rank:
        device = _local_rank()
    if args.dry_run:
        host, _, mask = _load_host(args)
        if args.mask is not None:
            try:
                mask = parse_cpulist(args.mask) & host.cpus
            except ValueError as exc:
                raise ValueError(f"--mask: {exc}") from None
            if not mask:
                raise ValueError(f"--mask {excerpt(args.mask)} names no online CPU of the host")
        address = None if device is None else resolve_devices([device], host)[0]
        binding = decide_binding(
            host,
            mask,
            device=address,
            node=args.node,
            cpus=args.cpus,
            memory=args.memory,
            mems_allowed=None if elsewhere else read_mems_allowed("/"),
        )
        if args.json:
            _print_json({**binding.as_dict(), "argv": argv})
            return 0
        print(f"device {binding.device or '-'}, node {_or_none(binding.node)}")
        print(f"cpus   {format_cpulist(binding.cpus)} ({len(binding.cpus)} CPUs)")
        memory = (
            f"{binding.memory_policy} on node {format_cpulist(binding.memory_nodes)}"
            if binding.memory_policy != "none"
            else "no policy"
        )
        print(f"memory {memory}")
        if binding.reason:
            print(f"reason {binding.reason}")
        print(f"argv   {' '.join(argv)}  (a dry run: nothing applied, nothing run)")
        return 0
    binding = bind_process(device, node=args.node, cpus=args.cpus, memory=args.memory)
    if binding.reason:
        print(f"cpupin exec: {binding.reason}", file=sys.stderr)
    env = {**os.environ, ENV_PROCESS_CPUS: format_cpulist(process_cpus())}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"cpupin exec: {excerpt(argv[0])}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached: exec replaced this process


def _or_none(value: object) -> str:
    return "none" if value is None else str(value)


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
    threads.add_argument("pid", nargs="?", type=_pid, help="process id (default: this process)")
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
    audit.add_argument("pid", type=_pid, help="process id")
    audit.add_argument("--json", action="store_true", help="print JSON")
    audit.add_argument(
        "--fail-on-narrow",
        action="store_true",
        help="exit 1 when any thread is on a narrower mask than the process's",
    )
    audit.set_defaults(handler=_cmd_audit)

    top = sub.add_parser("top", help="a live per-thread table: CPU ms/s, run-queue wait ms/s")
    top.add_argument(
        "pid", type=_pid_or_self, help="process id, or self for cpupin's own threads (a demo)"
    )
    top.add_argument(
        "--interval", type=_seconds(0.01, 3600), default=1.0, help="seconds a sample (1)"
    )
    top.add_argument(
        "--count",
        type=_whole("--count", 1, 1_000_000),
        help="samples to take (default: until interrupted)",
    )
    top.add_argument("--json", action="store_true", help="print each sample as a JSON list")
    top.set_defaults(handler=_cmd_top)

    hand = sub.add_parser("handoff", help="the cost of one thread waking another, per CPU pair")
    hand.add_argument("--cpus", type=_pair, metavar="A,B", help="one pair (any: unpinned)")
    hand.add_argument("--matrix", action="store_true", help="every pair of the process mask")
    hand.add_argument("--plot", metavar="FILE.png", help="with --matrix: a heatmap (matplotlib)")
    hand.add_argument(
        "--idle-us",
        type=_whole("--idle-us", 0, 1_000_000),
        default=0,
        metavar="N",
        help="the sender waits N µs before each handoff (idle states show)",
    )
    hand.add_argument(
        "--spin", action="store_true", help="pass the token through a cache line without sleeping"
    )
    hand.add_argument(
        "--python",
        nargs="?",
        const="event",
        choices=("event", "queue"),
        help="measure two cpupin.Threads in Python instead of C",
    )
    hand.add_argument(
        "--rounds", type=_whole("--rounds", 1, 1_000_000), default=2000, help="rounds a pair (2000)"
    )
    hand.add_argument("--json", action="store_true", help="print JSON")
    hand.set_defaults(handler=_cmd_handoff)

    run = sub.add_parser(
        "exec",
        help="run a command bound to a GPU's NUMA node: its CPUs within the mask, its memory",
        description="Bind to a GPU's NUMA node (CPUs within the process mask, memory policy "
        "where the kernel allows), set CPUPIN_PROCESS_CPUS, and exec the command: "
        "numactl --cpunodebind=N --preferred=N chosen from the GPU, respecting the launcher's "
        "CPU set. Exits 127 when the command is not found, 126 when it cannot run.",
    )
    target = run.add_mutually_exclusive_group(required=True)
    target.add_argument("--gpu", metavar="ADDR", help="the GPU's PCI address")
    target.add_argument(
        "--device",
        type=_whole("--device", 0, 65535),
        metavar="I",
        help="a CUDA device index, through CUDA_VISIBLE_DEVICES, in PCI order",
    )
    target.add_argument(
        "--local-rank",
        action="store_true",
        help="the device index from LOCAL_RANK (torchrun), else SLURM_LOCALID",
    )
    target.add_argument("--node", type=_whole("--node", 0, 65535), metavar="N", help="node N")
    run.add_argument("--cpus", choices=("node", "keep"), default="node", help="node (default)")
    run.add_argument(
        "--memory",
        choices=("preferred", "bind", "none"),
        default="preferred",
        help="the memory policy (preferred: the default)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the binding; run nothing")
    run.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    _host_arg(run)
    run.add_argument("--mask", metavar="CPULIST", help="with --dry-run: the process mask")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    run.set_defaults(handler=_cmd_exec)

    doctor = sub.add_parser("doctor", help="whether pinning pays on this host, and why")
    _host_arg(doctor)
    doctor.add_argument(
        "--measure-here",
        action="store_true",
        help="with --host/--root: measure handoffs on this machine instead",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(handler=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line: 0 done, 1 an internal error (a bug of cpupin's,
    printed as one line unless ``CPUPIN_DEBUG=1``), 2 bad input or a request
    this host cannot meet; argparse's own errors exit 2 as well."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    name = f"cpupin {args.command}"
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader went away (| head): no message, and no second error when
        # Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        what = f"{exc.filename}: " if exc.filename else ""
        print(f"{name}: {what}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - no traceback reaches a user
        if os.environ.get("CPUPIN_DEBUG") == "1":
            raise
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"{name}: internal error: {type(exc).__name__}: {excerpt(str(exc), 200)} "
            f"(at {os.path.basename(where.filename)}:{where.lineno}); please report it at "
            f"{REPORT} (CPUPIN_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
