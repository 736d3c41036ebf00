"""``cpupin top``: a live per-thread table with the run-queue wait column."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cpupin.cli import _args
from cpupin.cli._pools import throttle_text
from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.measure.demand import Demand, demand_of
from cpupin.measure.sampling import Sampler, ThreadSample
from cpupin.threads.thread import Thread

if TYPE_CHECKING:
    from cpupin.host.cgroup import Weight
    from cpupin.registry.reader import Record


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser(
        "top",
        help="a live per-thread table: CPU ms/s, run-queue wait ms/s",
        description="A live per-thread table: CPU ms/s, run-queue wait ms/s, last CPU, mask "
        "and state (process mask, pinned, stray, interloper, narrower). A thread that waited "
        "10 ms/s or more is stalled: 'quota' when the cgroup's CPU quota throttled it in the "
        "sample (lower the threads, or raise the quota), else 'contention' (other threads "
        "held its CPUs: what its threads wanted, run + wait, is the CPU request that covers "
        "it, beside its cgroup's weight). Threads that spin are marked spinning. Exits 2 "
        "when the process exits, after what it sampled.",
    )
    top.add_argument(
        "pid", type=_args.pid_or_self, help="process id, or self for cpupin's own threads (a demo)"
    )
    top.add_argument(
        "--interval", type=_args.seconds(0.01, 3600), default=1.0, help="seconds a sample (1)"
    )
    top.add_argument(
        "--count",
        type=_args.whole("--count", 1, 1_000_000),
        help="samples to take (default: until interrupted)",
    )
    out = top.add_mutually_exclusive_group()
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document of every sample when done (or at Ctrl-C)",
    )
    out.add_argument("--json-lines", action="store_true", help="print each sample as one JSON line")
    top.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.pid is None:
        _demo_threads()
    sampler = Sampler(args.pid)
    record = _record(args.pid or os.getpid())
    args.role = (record.role or None) if record else None
    args.usable = usable_of(args.pid)
    args.capped = _capped(args.pid, record)
    args.weight = weight_of(args.pid)
    args.step_tid = step_tid_of(record)
    counts = range(args.count) if args.count is not None else itertools.count()
    document: list[dict[str, object]] = []
    stopped: ProcessLookupError | None = None
    try:
        _samples(args, sampler, counts, document)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how top ends: the samples taken so far still print
    except ProcessLookupError as exc:
        stopped = exc  # the process exited: what was taken still prints
    if args.json:
        _args.print_json(
            {
                "pid": args.pid or os.getpid(),
                "role": args.role,
                "interval_s": args.interval,
                "samples": document,
                "stopped": None if stopped is None else str(stopped.strerror or stopped),
            }
        )
    if stopped is not None:
        raise stopped  # said on stderr, exit 2, after the samples
    return 0


def _samples(
    args: argparse.Namespace,
    sampler: Sampler,
    counts: Iterable[int],
    document: list[dict[str, object]],
) -> None:
    for i in counts:
        sampler.start()
        time.sleep(args.interval)
        samples = sampler.stop()
        throttling = sampler.throttling.as_dict() if sampler.throttling else None
        demand = demand_of(
            samples,
            throttled=bool(sampler.throttling and sampler.throttling.throttled_periods),
            weight=args.weight,
            usable_cpus=args.usable,
            step_tid=args.step_tid,
        )
        remedies = stall_remedies(
            {s.stall for s in samples if s.stall}, args.pid, args.usable, args.capped, demand
        )
        remedies += spin_remedies(samples)
        if not (args.json or args.json_lines):
            if i:
                print()
            _print_sample(args, samples, throttling, remedies)
            continue
        sample = {
            "time": round(time.time(), 3),
            "throttled_ms_per_s": throttling and throttling["throttled_ms_per_s"],
            "throttling": throttling,
            "threads": [s.as_dict() for s in samples],
            "demand": demand.as_dict(),
            "remedies": remedies,
        }
        if args.json:
            document.append(sample)
        else:
            json.dump(sample, sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()


def _print_sample(
    args: argparse.Namespace,
    samples: list[ThreadSample],
    throttling: dict[str, object] | None,
    remedies: list[str],
) -> None:
    """One sample as a table, and what to do."""
    print(
        time.strftime("%H:%M:%S"),
        f"pid {args.pid or os.getpid()}"
        + (f" ({printable(args.role, 32)})" if args.role else "")
        + f", {len(samples)} threads, over {args.interval:g} s; "
        + throttle_text(throttling),
    )
    print(f"{'tid':>8} {'name':16} {'cpu ms/s':>9} {'wait ms/s':>10} {'cpu':>4}  {'mask':14} state")
    for s in samples:
        print(
            f"{s.tid:>8} {printable(s.name, 16):16} {s.cpu_ms_per_s:>9.1f} "
            f"{s.wait_ms_per_s:>10.1f} "
            f"{s.last_cpu if s.last_cpu is not None else '?':>4}  "
            f"{_short(s.mask):14} {s.state}"
            + (f", stalled: {s.stall}" if s.stall else "")
            + (", spinning" if s.spinning else "")
        )
    for line in remedies:
        print(f"  -> {line}")
    sys.stdout.flush()


def spin_remedies(samples: Iterable[ThreadSample]) -> list[str]:
    """What to do about the threads that spun over a sample, in a line."""
    spun = [s for s in samples if s.spinning]
    if not spun:
        return []
    names = ", ".join(f"{printable(s.name, 16)} ({s.tid})" for s in spun[:4])
    return [
        f"{len(spun)} thread(s) spin ({names}{', ...' if len(spun) > 4 else ''}): each holds a "
        "CPU while doing nothing, busy in the kernel and never blocking (a sched_yield or "
        "zero-timeout poll loop); make it block or sleep between checks, and leave its CPU "
        "out of a wake-latency hold, which buys nothing on a CPU that never idles"
    ]


def stall_remedies(
    stalls: set[str],
    pid: int | None,
    usable: int | None,
    capped: bool = False,
    demand: Demand | None = None,
) -> list[str]:
    """The one thing to do for each kind of stall seen, for the process
    sampled (its own usable CPUs, from its cgroup, not this command's).
    ``capped``: its pools are already capped (it runs under ``cpupin exec``
    or called ``limit_pools()``), so capping them is not the advice.
    ``demand``: what its threads wanted over the sample; where neighbours
    held its CPUs, the request that covers it is the advice."""
    who = str(pid or os.getpid())
    out = []
    if "quota" in stalls:
        busy = f"at most {usable} busy thread(s)" if usable else "fewer busy threads"
        if capped:
            out.append(
                "stalled by its cgroup's CPU quota, with its pools already capped to it: its "
                "own threads need more CPU time than the quota gives; raise the quota, or do "
                "less work in the process"
            )
        else:
            out.append(
                f"stalled by its cgroup's CPU quota: run {busy} in it (cpupin exec, or "
                "cpupin.limit_pools() inside the process), or raise the quota"
            )
    remedy = demand.remedy() if demand is not None else None
    if remedy is not None:
        out.append(f"stalled by contention: {remedy}; cpupin threads {who} shows who waits")
    elif "contention" in stalls:
        out.append(
            f"stalled by contention: other threads hold its CPUs; cpupin threads {who} shows "
            "who shares them, and a step thread pinned apart (CPUPIN_STEP_THREAD_CORE) keeps "
            "its core"
        )
    return out


def _capped(pid: int | None, record: Record | None) -> bool:
    """Whether the process's pools are capped already: cpupin set its pool
    variables (``cpupin exec``, ``child_env()``), or its record says it
    called ``limit_pools()``."""
    from cpupin.pools.limits import ENV_POOL_VARS
    from cpupin.process.outside import environ_of

    if pid is None:
        return bool(os.environ.get(ENV_POOL_VARS))
    if environ_of(pid, ENV_POOL_VARS):
        return True
    return record is not None and any(n.startswith("limit_pools") for n in record.notes)


def step_tid_of(record: Record | None) -> int | None:
    """The thread its record names as its step thread, if any."""
    return next((p.tid for p in (record.pins if record else ()) if p.role == "step"), None)


def weight_of(pid: int | None) -> Weight | None:
    """The CPU weight of the process's cgroup (lowest along its chain)."""
    from cpupin.host._sysfs import Reader
    from cpupin.host.cgroup import read_weight

    try:
        with Reader("/") as r:
            return read_weight(r, "self" if pid is None else str(pid))
    except (OSError, ValueError):
        return None


def usable_of(pid: int | None) -> int | None:
    """The usable CPUs of the process sampled, from its own cgroup."""
    from cpupin.pools.limits import usable_cpus

    try:
        return usable_cpus(pid)
    except (OSError, ValueError):
        return None


def _record(pid: int) -> Record | None:
    """The process's live record (its role, its notes), else ``None``."""
    from cpupin.process.outside import record_of

    try:
        return record_of(pid)
    except OSError:
        return None


def _short(cpus: frozenset[int]) -> str:
    text = format_cpulist(cpus)
    return text if len(text) <= 14 else text[:13] + "…"


def _demo_threads() -> None:
    """Two threads for ``cpupin top self`` to show: one busy, one asleep."""

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

    def idle() -> None:
        name("demo-idle")
        time.sleep(1e9)

    Thread(target=busy, name="demo-busy", daemon=True).start()
    Thread(target=idle, name="demo-idle", daemon=True).start()
