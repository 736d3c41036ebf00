"""``cpupin ps``: every cpupin-managed process on the host, from the records
in the lock directory, with each pinned thread's CPU and run-queue wait."""

from __future__ import annotations

import argparse
import sys
import time

from cpupin.cpulist import format_cpulist
from cpupin.registry import Record, Registry, lock_dir, read_registry
from cpupin.sampling import Sampler, ThreadSample

from . import _args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ps = sub.add_parser(
        "ps", help="every server's pins on this host, and whether its pinned threads wait"
    )
    ps.add_argument(
        "--interval", type=_args.seconds(0.01, 60), default=1.0, help="seconds a sample (1)"
    )
    ps.add_argument(
        "--lock-dir",
        type=_args.nonempty("--lock-dir"),
        metavar="DIR",
        help="the lock directory (default: $CPUPIN_LOCK_DIR, else /tmp)",
    )
    out = ps.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument(
        "--prometheus",
        action="store_true",
        help="print every registered process's thread metrics in the text exposition format",
    )
    ps.set_defaults(handler=run)


def _sample(processes: list[Record], interval: float) -> dict[int, list[ThreadSample] | str]:
    """Each live process sampled over the same interval; a reason for one
    that exited meanwhile."""
    samplers: dict[int, Sampler | str] = {}
    for record in processes:
        try:
            samplers[record.pid] = Sampler(record.pid).start()
        except (OSError, ValueError) as exc:
            samplers[record.pid] = str(exc)
    time.sleep(interval)
    out: dict[int, list[ThreadSample] | str] = {}
    for pid, sampler in samplers.items():
        if isinstance(sampler, str):
            out[pid] = sampler
            continue
        try:
            out[pid] = sampler.stop()
        except (OSError, ValueError) as exc:
            out[pid] = str(exc)
    return out


def view(registry: Registry, interval: float) -> dict[str, object]:
    """The host's view as one JSON-ready document."""
    live = [r for r in registry.records if r.kind == "process" and r.live]
    samples = _sample(live, interval) if live else {}
    processes = []
    for record in (r for r in registry.records if r.kind == "process"):
        entry = record.as_dict()
        entry.update(threads=[], interlopers=[], sample_error=None)
        got = samples.get(record.pid)
        if record.live and isinstance(got, list):
            by_tid = {s.tid: s for s in got}
            pinned = {p.tid: p for p in record.pins}
            threads = []
            for pin in record.pins:
                s = by_tid.get(pin.tid)
                threads.append(
                    {
                        "tid": pin.tid,
                        "name": s.name if s else pin.name,
                        "role": pin.role,
                        "cpus": sorted(pin.cpus),
                        "cpus_list": format_cpulist(pin.cpus),
                        "alive": s is not None,
                        "on_its_pin": s is not None and s.mask == pin.cpus,
                        "cpu_ms_per_s": round(s.cpu_ms_per_s, 2) if s else None,
                        "wait_ms_per_s": round(s.wait_ms_per_s, 2) if s else None,
                    }
                )
            cores = frozenset().union(*(p.cpus for p in record.pins))
            interlopers = [
                {
                    "tid": s.tid,
                    "name": s.name,
                    "mask": sorted(s.mask),
                    "mask_list": format_cpulist(s.mask),
                }
                for s in got
                if s.tid not in pinned and s.mask <= cores
            ]
            entry.update(threads=threads, interlopers=interlopers)
        elif record.live:
            entry["sample_error"] = got
        processes.append(entry)
    return {
        "lock_dir": registry.directory,
        "interval_s": interval,
        "servers": [r.as_dict() for r in registry.records if r.kind == "server"],
        "processes": processes,
        "ignored": [{"path": path, "reason": reason} for path, reason in registry.ignored],
    }


def run(args: argparse.Namespace) -> int:
    registry = read_registry(lock_dir(args.lock_dir))
    if args.prometheus:
        return _prometheus(registry)
    data = view(registry, args.interval)
    if args.json:
        _args.print_json(data)
        return 0
    _text(data)
    return 0


def _text(data: dict[str, object]) -> None:
    servers = data["servers"]
    processes = data["processes"]
    assert isinstance(servers, list) and isinstance(processes, list)
    live_servers = [s for s in servers if s["live"]]
    live_procs = [p for p in processes if p["live"]]
    print(
        f"cpupin ps: lock directory {data['lock_dir']}; {len(live_servers)} server(s), "
        f"{len(live_procs)} process(es) with pins; sampled over {data['interval_s']:g} s"
    )
    print(f"{'SERVER':8} {'pid':>8}  {'setting':8} {'result':>6}  GPUs and step CPUs")
    for s in live_servers:
        steps = "; ".join(f"{w['device']} on {format_cpulist(w['cpus'])}" for w in s["workers"])
        result = s["result_cpu"] if s["result_cpu"] is not None else "-"
        print(f"{'':8} {s['pid']:>8}  {s['setting']:8} {result!s:>6}  {steps or '-'}")
    print(
        f"{'PROCESS':8} {'pid':>8}  {'tid':>8} {'name':16} {'role':8} {'CPUs':12} "
        f"{'cpu ms/s':>9} {'wait ms/s':>10}"
    )
    for p in live_procs:
        for t in p.get("threads", []):
            cpu = f"{t['cpu_ms_per_s']:.1f}" if t["cpu_ms_per_s"] is not None else "gone"
            wait = f"{t['wait_ms_per_s']:.1f}" if t["wait_ms_per_s"] is not None else "-"
            off = "" if t["on_its_pin"] or not t["alive"] else "  (moved off its pin)"
            print(
                f"{'':8} {p['pid']:>8}  {t['tid']:>8} {t['name'][:16]:16} {t['role'][:8]:8} "
                f"{t['cpus_list'][:12]:12} {cpu:>9} {wait:>10}{off}"
            )
        for t in p.get("interlopers", []):
            print(
                f"{'':8} {p['pid']:>8}  {t['tid']:>8} {t['name'][:16]:16} {'-':8} "
                f"{t['mask_list'][:12]:12}  an interloper: on a pinned CPU, not registered"
            )
    for r in [*servers, *processes]:
        if not r["live"]:
            print(f"stale    {r['path']}: {r['stale_because']}")
    ignored = data["ignored"]
    assert isinstance(ignored, list)
    for item in ignored:
        print(f"ignored  {item['path']}: {item['reason']}")


def _prometheus(registry: Registry) -> int:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ValueError(
            "--prometheus needs prometheus_client: pip install 'cpupin[prometheus]'"
        ) from None
    from cpupin.metrics import ThreadCollector

    collectors = CollectorRegistry()
    pids = sorted({r.pid for r in registry.records if r.kind == "process" and r.live})
    for pid in pids:
        collectors.register(_Safe(ThreadCollector(pid, registry)))
    sys.stdout.write(generate_latest(collectors).decode())
    return 0


class _Safe:
    """A process's collector that yields nothing once the process is gone."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def collect(self):  # type: ignore[no-untyped-def]
        try:
            yield from list(self.inner.collect())  # type: ignore[attr-defined]
        except (OSError, ValueError):
            return
