"""``cpupin irqs``: move the movable device interrupts off the CPUs that
step and result threads use (a dry run unless ``--apply``), and put them
back (``--restore``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from cpupin.cli import _args
from cpupin.cli._parser import RawFormatter
from cpupin.cpulist import MAX_CPUS, format_cpulist, parse_cpulist
from cpupin.errors import printable


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = sub.add_parser(
        "irqs",
        help="move device interrupts off the step and result CPUs (a dry run unless --apply)",
        description="Move the device interrupts that may land on the CPUs step and result "
        "threads use to other CPUs: each movable IRQ's smp_affinity_list less those CPUs "
        "(else its device's node's, else the online CPUs). Managed IRQs (a multi-queue "
        "device's queues) cannot move, and say so. Without --apply, a dry run. --apply writes "
        "/proc/irq/N/smp_affinity_list (root) and records what each IRQ had in the lock "
        "directory; --restore puts back each one still where cpupin put it. irqbalance would "
        "move them again: the setting that keeps it off those CPUs is printed.",
        epilog="examples:\n  cpupin irqs                  what would move, off the CPUs "
        "auto and registered pins use\n  cpupin irqs --cpus 2,3 --apply\n  cpupin irqs "
        "--restore\nexit codes: 0 done (an IRQ the kernel refuses is left, and said); 2 bad "
        "input, or --apply/--restore without root",
        formatter_class=RawFormatter,
    )
    cmd.add_argument(
        "--cpus",
        metavar="CPULIST",
        help="the CPUs to keep clear (default: the CPUs auto pins step and result threads to "
        "on this host, and those registered processes pin now)",
    )
    what = cmd.add_mutually_exclusive_group()
    what.add_argument("--apply", action="store_true", help="move them (root)")
    what.add_argument(
        "--restore", action="store_true", help="put back what an earlier --apply moved"
    )
    cmd.add_argument(
        "--lock-dir",
        type=_args.nonempty("--lock-dir"),
        metavar="DIR",
        help="where the moves are recorded (default: $CPUPIN_LOCK_DIR, else /tmp)",
    )
    cmd.add_argument(
        "--root", type=_args.nonempty("--root"), metavar="DIR", help="a /proc and /sys under DIR"
    )
    cmd.add_argument("--json", action="store_true", help="print JSON")
    cmd.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cpupin.act.irq_steer import apply_moves, plan_moves, read_context, restore_moves
    from cpupin.host.irqs import irqbalance_advice, read_irqs

    root = _checked_root(args)
    if args.restore:
        lines = restore_moves(root=root, directory=args.lock_dir)
        if args.json:
            _args.print_json({"restored": lines})
        else:
            for line in lines:
                print(f"restore  {line}")
        return 0
    keep, source = _keep_clear(args, root)
    # Every IRQ, then those whose smp_affinity lets them land on a CPU to
    # keep clear (where the kernel delivers it today is one of those CPUs).
    every, reasons = read_irqs(root, range(MAX_CPUS), interval=0) if keep else ([], [])
    smp, nodes, online = read_context(root, every)
    irqs = [i for i in every if smp.get(i.irq, i.cpus) & keep]
    if keep and online and not keep <= online:
        raise ValueError(
            f"--cpus {format_cpulist(keep - online)} not online (online: {format_cpulist(online)})"
        )
    moves = plan_moves(irqs, keep, smp, nodes, online)
    done, left = (apply_moves(moves, root=root, directory=args.lock_dir) if args.apply
                  else ([], []))  # fmt: skip
    # The doctor's line about moving IRQs by hand is this command's job.
    advice = [a for a in irqbalance_advice(keep, irqs) if not a.startswith("without irqbalance")]
    if args.json:
        _args.print_json(
            {
                "keep_clear": sorted(keep),
                "keep_clear_list": format_cpulist(keep),
                "from": source,
                "applied": bool(args.apply),
                "moves": [m.as_dict() for m in moves],
                "moved": [m.irq for m in done],
                "left": left,
                "irqbalance": advice,
                "reasons": reasons,
            }
        )
    elif keep:
        _print_moves(args, keep, source, moves, done, left, advice, reasons)
    else:
        print(f"irqs     nothing to keep clear: {source}")
    return 0


def _checked_root(args: argparse.Namespace) -> str:
    """The root to read and write under, refused before any work where it
    is not a folder, or where writing the real one needs root."""
    root: str = args.root or "/"
    if args.root is not None and not os.path.isdir(args.root):
        raise ValueError(f"--root {printable(args.root, 80)} is not a directory")
    if (args.apply or args.restore) and root == "/" and os.geteuid() != 0:
        raise ValueError(
            "--apply and --restore write /proc/irq/N/smp_affinity_list: run them as root "
            "(without them, cpupin irqs shows what would move)"
        )
    return root


def _keep_clear(args: argparse.Namespace, root: str) -> tuple[frozenset[int], str]:
    """The CPUs to keep clear of IRQs, and where that came from."""
    if args.cpus is None:
        return _default_cpus(root)
    try:
        keep = parse_cpulist(args.cpus)
    except ValueError as exc:
        raise ValueError(f"--cpus: {exc}") from None
    if not keep:
        raise ValueError("--cpus names no CPU: name the step and result CPUs to keep clear")
    return keep, "--cpus"


def _print_moves(
    args: argparse.Namespace,
    keep: frozenset[int],
    source: str,
    moves: list[Any],
    done: list[Any],
    left: list[str],
    advice: list[str],
    reasons: list[str],
) -> None:
    print(f"irqs     keep CPUs {format_cpulist(keep)} clear ({source})")
    for m in moves:
        to = format_cpulist(m.after) if m.after is not None else "stays"
        name = m.name.strip("'").split()[-1:] or ["?"]  # the device, of the quoted line
        print(
            f"  IRQ {m.irq:>5} {printable(name[0], 20):20} {m.kind:5} "
            f"{format_cpulist(m.before):>12} -> {to:12} {m.reason}"
        )
    if not moves:
        print("  no device IRQ may land on them")
    for line in left:
        print(f"left     {line}")
    if args.apply:
        print(f"moved    {len(done)} IRQ(s); cpupin irqs --restore puts them back")
    elif any(m.after is not None for m in moves):
        print("dry run  nothing written: --apply moves them (root)")
    for line in advice:
        print(f"advice   {line}")
    for reason in reasons[:8]:
        print(f"note     {printable(reason, 200)}")


def _default_cpus(root: str) -> tuple[frozenset[int], str]:
    from cpupin.cli.doctor import _pinned_cpus
    from cpupin.host.topology import read_host
    from cpupin.process.mask import process_cpus

    host = read_host(root)
    mask = process_cpus() & host.cpus if root == "/" else host.cpus
    return _pinned_cpus(host, mask, root == "/")
