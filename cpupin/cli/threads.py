"""``cpupin threads`` and ``cpupin audit``: a process's threads and masks."""

from __future__ import annotations

import argparse
import os
import time
from typing import NamedTuple

from cpupin._native import ThreadStat
from cpupin.cli import _args
from cpupin.cli._pools import memory_lines, pool_lines
from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.host._proc import descendants
from cpupin.host.numa_memory import memory_summary
from cpupin.measure.sampling import Audit, Sampler, ThreadSample, audit, process_mask_of
from cpupin.pools.census import Census, census, pool_name
from cpupin.process.mask import process_cpus, thread_masks
from cpupin.process.outside import openmp_collapse, read_environ


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    threads = sub.add_parser(
        "threads",
        help="list a process's threads with CPU time, run-queue wait and last CPU",
        description="List a process's threads with CPU time, run-queue wait and last CPU, "
        "sampled over --interval (a thread that spins, busy in the kernel and never blocking, "
        "is marked spinning), then its census: its threads grouped into pools by name, or by "
        "the library they wait in (OpenMP, OpenBLAS, Rayon, ZMQ) with the variable that "
        "sizes each, each judged against the CPUs the process can keep busy (its mask under "
        "its cgroup's quota, less pinned CPUs) by what its threads wanted over the sample: "
        "fits, idle, oversubscribed, or sized from the host, with what to do.",
    )
    threads.add_argument(
        "pid",
        nargs="?",
        type=_args.pid_or_self,
        help="process id, or self for this command's own threads (the default)",
    )
    threads.add_argument("--json", action="store_true", help="print JSON")
    threads.add_argument(
        "--interval",
        type=_args.seconds(0.0, 60.0),
        default=0.5,
        metavar="S",
        help="seconds to sample the threads over: a pool is judged by the CPUs its threads "
        "want, not by how many exist, and a thread that spins is named (0: no sample, "
        "judged by count; default 0.5)",
    )
    threads.add_argument(
        "--tree",
        action="store_true",
        help="the process and every descendant (a server's API server, engine core and "
        "workers), a summary line each: role, threads, mask and where it came from",
    )
    threads.set_defaults(handler=run_threads)

    check = sub.add_parser(
        "audit", help="group another process's threads by CPU mask; list the narrower ones"
    )
    check.add_argument("pid", type=_args.pid, help="process id")
    check.add_argument("--json", action="store_true", help="print JSON")
    check.add_argument(
        "--fail-on-narrow",
        action="store_true",
        help=f"exit {FINDING} when a thread is on a narrower mask than the process's and is "
        "not a registered pin (every narrower thread when the process has no record)",
    )
    check.add_argument(
        "--lock-dir",
        type=_args.nonempty("--lock-dir"),
        metavar="DIR",
        help="where the process registers its pins (default: look in its CPUPIN_LOCK_DIR as "
        "it started, this command's, and /tmp)",
    )
    check.set_defaults(handler=run_audit)


class _Seen(NamedTuple):
    """A process's threads as ``threads`` read and judged them."""

    pid: int
    threads: list[tuple[ThreadStat, frozenset[int]]]
    samples: list[ThreadSample] | None
    mask: frozenset[int]
    source: str
    pools: Census
    memory: dict[str, object] | None
    shared: dict[str, object] | None
    collapse: dict[str, object] | None


def run_threads(args: argparse.Namespace) -> int:
    if args.tree:
        return _run_tree(os.getpid() if args.pid is None else args.pid, args.json)
    seen = _seen(args.pid, args.interval)
    if args.json:
        _print_threads_json(seen, args.interval)
    else:
        _print_threads_text(seen)
    return 0


def _seen(target: int | None, interval: float) -> _Seen:
    """Read the process's threads (over a sample of ``interval`` s, none
    for 0), its mask, and judge its pools and bindings."""
    samples: list[ThreadSample] | None = None
    if interval:
        sampler = Sampler(target).start()
        time.sleep(interval)
        samples = sampler.stop()
        threads = sampler.threads
    else:
        threads = thread_masks(target, last_cpu=True)
    if target is None or target == os.getpid():
        pid, mask, source = os.getpid(), process_cpus(), "cpupin.process_cpus()"
    else:
        pid = target
        mask, source = process_mask_of(pid, [m for _, m in threads])
    shared = (
        shared_narrow(pid, [(st.tid, st.name, m) for st, m in threads], mask)
        if source.startswith("the launcher's view")
        else None
    )
    return _Seen(
        pid,
        threads,
        samples,
        mask,
        source,
        census(target, threads=threads, samples=samples),
        memory_summary(pid, mask),
        shared,
        collapse_of(pid, threads, mask),
    )


def _print_threads_json(seen: _Seen, interval: float) -> None:
    by_tid = {s.tid: s for s in seen.samples or ()}
    _args.print_json(
        {
            "pid": seen.pid,
            "process_mask": sorted(seen.mask),
            "process_mask_list": format_cpulist(seen.mask),
            "process_mask_from": seen.source,
            "interval_s": interval,
            "threads": [
                {
                    **st._asdict(),
                    "mask": sorted(m),
                    "mask_list": format_cpulist(m),
                    **_sampled(by_tid.get(st.tid), seen.samples is not None),
                }
                for st, m in seen.threads
            ],
            "spinning": list(seen.pools.spinning),
            "usable_cpus": seen.pools.usable_cpus,
            "pools": [p.as_dict() for p in seen.pools.pools],
            "memory": seen.memory,
            "shared_narrow": seen.shared,
            "openmp_collapse": seen.collapse,
        }
    )


def _print_threads_text(seen: _Seen) -> None:
    samples, pools = seen.samples, seen.pools
    by_tid = {s.tid: s for s in samples or ()}
    print(
        f"pid {seen.pid}: {_count(len(seen.threads), 'thread')}; process mask "
        f"{format_cpulist(seen.mask)} ({seen.source})"
    )
    print(
        f"{'tid':>8} {'name':16} {'run ms':>10} {'wait ms':>10} {'cpu':>4}  "
        + (f"{'ms/s':>7}  " if samples is not None else "")
        + "mask"
    )
    for st, m in seen.threads:
        cpu = st.last_cpu if st.last_cpu is not None else "?"
        got = by_tid.get(st.tid)
        rate = f"{got.cpu_ms_per_s:>7.1f}  " if got else (f"{'-':>7}  " if samples else "")
        print(
            f"{st.tid:>8} {printable(st.name, 16):16} {st.run_ns / 1e6:>10.1f} "
            f"{st.wait_ns / 1e6:>10.1f} {cpu!s:>4}  {rate}{format_cpulist(m)}"
            + ("  spinning" if got and got.spinning else "")
        )
    quota = pools.plan.quota
    print(
        f"pools: {pools.usable_cpus} usable CPU(s) (mask {format_cpulist(pools.plan.mask)}"
        + (f", quota {quota.quota_us / quota.period_us:g} CPUs" if quota else "")
        + (f", {format_cpulist(pools.plan.pinned)} pinned" if pools.plan.pinned else "")
        + ")"
    )
    for line in pool_lines([p.as_dict() for p in pools.pools]):
        print(line)
    for line in memory_lines(seen.memory):
        print(line)
    if seen.shared:
        _print_shared(seen.shared)
    if seen.collapse:
        print(f"finding: {seen.collapse['what']}")
        print(f"  -> {seen.collapse['remedy']}")


def collapse_of(
    pid: int, threads: list[tuple[ThreadStat, frozenset[int]]], mask: frozenset[int]
) -> dict[str, object] | None:
    """:func:`~cpupin.process.outside.openmp_collapse` of a process, its
    environment read (this one's own, or another's as it started)."""
    env = dict(os.environ) if pid == os.getpid() else read_environ(pid)[0]
    return openmp_collapse(pid, env, [(st.tid, m) for st, m in threads], mask)


def _sampled(got: ThreadSample | None, sampled: bool) -> dict[str, object]:
    """A thread's figures over the sample (``None`` each when it started
    during it, or no sample was taken)."""
    if got is None:
        return {
            "cpu_ms_per_s": None,
            "wait_ms_per_s": None,
            "spinning": None if not sampled else False,
        }
    return {
        "cpu_ms_per_s": round(got.cpu_ms_per_s, 2),
        "wait_ms_per_s": round(got.wait_ms_per_s, 2),
        "spinning": got.spinning,
    }


def shared_narrow(
    pid: int, threads: list[tuple[int, str, frozenset[int]]], mask: frozenset[int]
) -> dict[str, object] | None:
    """When the process mask came from the launcher's view (an OpenMP
    binding of the main thread, which every thread started from it
    inherits): the main thread's CPUs, how many threads crowd onto them,
    which of those are not the OpenMP team (a name of their own: the team
    keeps the main thread's), which CPUs of the mask run none, and what to
    do; ``None`` when no thread but the main one and its namesakes is there."""
    main_mask = next((m for tid, _, m in threads if tid == pid), None)
    if main_mask is None or not main_mask < mask:
        return None
    # the CPUs the binding gave the main thread, and every thread crowded onto them
    narrow = [(tid, name, m) for tid, name, m in threads if m <= main_mask]
    cpus = main_mask
    idle = mask - frozenset().union(*(m for _, _, m in threads))
    main = next((name for tid, name, _ in threads if tid == pid), "")
    others: dict[str, int] = {}
    for tid, name, _ in narrow:
        if tid != pid and name != main:
            key = pool_name(name)
            others[key] = others.get(key, 0) + 1
    if not others:
        return None  # the main thread and, maybe, OpenMP's team: nothing crowds them
    vllm = main.startswith("VLLM::") or "vllm" in main.lower()
    if vllm:
        advice = (
            "vLLM binds its worker's OpenMP team with GOMP_CPU_AFFINITY and every thread "
            "inherits it: install cpupin in vLLM's environment and set CPUPIN_VLLM=auto (its "
            "plugin moves the other threads to the CPUs vLLM reserves), or choose the CPUs with "
            "VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU"
        )
    else:
        advice = (
            "start helper threads on the process mask (cpupin.Thread), or drop the binding: "
            "libgomp binds the initial thread to the first place as it loads (GOMP_CPU_AFFINITY, "
            "OMP_PLACES and OMP_PROC_BIND alike), and every later thread inherits it"
        )
    return {
        "cpus": sorted(cpus),
        "cpus_list": format_cpulist(cpus),
        "threads": len(narrow),
        "not_openmp": dict(sorted(others.items(), key=lambda kv: -kv[1])),
        "idle_cpus_list": format_cpulist(idle),
        "advice": advice,
    }


def _print_shared(shared: dict[str, object]) -> None:
    others = shared["not_openmp"]
    assert isinstance(others, dict)
    listed = ", ".join(f"{printable(str(k), 24)} ({v})" for k, v in list(others.items())[:8])
    print(
        f"shared: {shared['threads']} thread(s) share CPU {shared['cpus_list']}"
        + (f", {sum(others.values())} of them not OpenMP's: {listed}" if others else "")
        + (
            f"; CPU {shared['idle_cpus_list']} of the mask runs none"
            if shared["idle_cpus_list"]
            else ""
        )
    )
    print(f"advice: {shared['advice']}")


#: ``cpupin audit --fail-on-narrow``'s exit status for a finding (1 stays an
#: internal error, 2 bad input, as for every subcommand).
FINDING = 3


def run_audit(args: argparse.Namespace) -> int:
    report = audit(args.pid, lock_dirs=[args.lock_dir] if args.lock_dir else None)
    # With a record, only threads that are not registered pins fail; without
    # one, a deliberate pin and a stray look the same: every narrower thread.
    failing = (
        report.strays
        if report.registered
        else [
            (tid, name, cpus) for cpus, members in report.narrower.items() for tid, name in members
        ]
    )
    collapse = None
    if report.process_mask_from.startswith("the launcher's view"):
        try:
            collapse = collapse_of(args.pid, thread_masks(args.pid), report.process_mask)
        except ProcessLookupError:
            collapse = None
    if args.json:
        _args.print_json({**report.as_dict(), "openmp_collapse": collapse})
    else:
        _print_audit(args.pid, report, collapse, bool(failing))
    return FINDING if (failing or collapse) and args.fail_on_narrow else 0


def _print_audit(
    pid: int, report: Audit, collapse: dict[str, object] | None, failing: bool
) -> None:
    mask, narrow = report.process_mask, report.narrower
    print(
        f"pid {pid}: {_count(report.threads, 'thread')}; process mask "
        f"{format_cpulist(mask)} ({report.process_mask_from})"
    )
    print(f"  {len(report.groups.get(mask, []))} thread(s) on the process mask")
    for cpus, members in sorted(narrow.items(), key=lambda kv: sorted(kv[0])):
        names = ", ".join(
            f"{printable(name, 64)} ({tid}{', registered' if tid in report.deliberate else ''})"
            for tid, name in members
        )
        print(f"  on {format_cpulist(cpus)}: {names}")
    if report.registered:
        print(
            f"  {len(report.deliberate)} registered pin(s) (its record in the lock "
            f"directory); {len(report.strays)} narrower thread(s) not registered"
        )
    elif narrow:
        print(
            "  No record of this process in the lock directory: from outside, a "
            "deliberate pin and a stray look the same; inside the process, "
            "cpupin.stray_threads() tells them apart."
        )
    for tid, name, pinned, now in report.off_pin:
        print(
            f"  {printable(name, 64)} ({tid}) is registered on {format_cpulist(pinned)} "
            f"but runs on {format_cpulist(now)}: its pin drifted"
        )
    if report.pin_drift:
        print(f"  the process's own checks found its pins off {report.pin_drift} time(s)")
    if report.off_pin:
        print(
            "  -> something set a pinned thread's mask after cpupin did (an OpenMP "
            "runtime, NCCL, a framework): cpupin.guard_pins() in the process names the "
            "likely cause and pins it back"
        )
    if collapse:
        print(f"  finding: {collapse['what']}")
        print(f"  -> {collapse['remedy']}")
    if failing and not collapse:
        print(
            "  -> a narrower thread not registered either inherited a pin (start it from "
            "an unpinned thread: cpupin.Thread, cpupin.ThreadPool, cpupin.Queue) or was "
            "pinned on purpose without cpupin (pin it with cpupin.pin_current_thread, "
            "which registers it)"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(512).split(b"\0")
    except OSError:
        return "?"
    return printable(b" ".join(w for w in words if w).decode("utf-8", "replace"), 60)


def _run_tree(root: int, as_json: bool) -> int:
    from cpupin.registry.reader import read_registry

    if not os.path.exists(f"/proc/{root}"):
        raise ValueError(f"threads --tree {root}: no such process")
    roles = {r.pid: r.role for r in read_registry().records if r.kind == "process" and r.live}
    rows: list[dict[str, object]] = []
    for pid, parent in [(root, 0), *descendants(root)]:
        try:
            threads = thread_masks(pid)
        except (OSError, ValueError):
            continue  # exited meanwhile
        mask, source = process_mask_of(pid, [m for _, m in threads])
        shared = (
            shared_narrow(pid, [(st.tid, st.name, m) for st, m in threads], mask)
            if source.startswith("the launcher's view")
            else None
        )
        rows.append(
            {
                "pid": pid,
                "parent": parent or None,
                "role": roles.get(pid) or None,
                "command": _title(pid),
                "threads": len(threads),
                "process_mask_list": format_cpulist(mask),
                "process_mask_from": source,
                "shared_narrow": shared,
            }
        )
    if as_json:
        _args.print_json({"pid": root, "tree": rows})
        return 0
    by_pid: dict[object, dict[str, object]] = {r["pid"]: r for r in rows}
    for row in rows:
        depth = 0
        up: object = row["parent"]
        while up in by_pid and depth < 16:
            depth += 1
            up = by_pid[up]["parent"]
        label = row["role"] or row["command"]
        print(
            f"{'  ' * depth}{row['pid']} {printable(str(label), 60)}: "
            f"{_count(int(str(row['threads'])), 'thread')}, mask {row['process_mask_list']} "
            f"({row['process_mask_from']})"
        )
        if isinstance(row["shared_narrow"], dict):
            shared = row["shared_narrow"]
            others = shared["not_openmp"]
            assert isinstance(others, dict)
            print(
                f"{'  ' * depth}  shared: {shared['threads']} thread(s) on CPU "
                f"{shared['cpus_list']}, {sum(others.values())} not OpenMP's; "
                f"advice: {shared['advice']}"
            )
    return 0
