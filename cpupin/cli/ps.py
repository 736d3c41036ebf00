"""``cpupin ps``: every cpupin-managed process on the host, from the records
in the lock directory, with each pinned thread's CPU and run-queue wait."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from cpupin.cli import _args
from cpupin.cli._pools import memory_lines, pool_lines, throttle_text
from cpupin.cpulist import format_cpulist
from cpupin.errors import printable
from cpupin.host._proc import argv_of
from cpupin.measure.sampling import host_view
from cpupin.registry.prune import prune
from cpupin.registry.reader import Registry, read_registry
from cpupin.registry.writer import lock_dir


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ps = sub.add_parser(
        "ps",
        help="every server's pins on this host, and whether its pinned threads wait",
        description="Every server's pins on this host, and whether its pinned threads wait. "
        "Processes with a record in the lock directory are listed (those that pinned "
        "through cpupin, or that a plugin describes); --all adds every other process that "
        "shows a finding, and cpupin threads PID or cpupin audit PID tells more of any.",
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
    ps.add_argument(
        "--prune",
        action="store_true",
        help="first remove the stale process records you own (a process killed before it "
        "could remove its own), and, as root, put back what dead processes left applied (a "
        "CPU's wake latency, the IRQs of an apply killed half way); lock files are never "
        "removed",
    )
    ps.add_argument(
        "--all",
        action="store_true",
        help="also list every other process of the host that shows a finding (a narrowed "
        "mask, a CPU quota, a spinning thread, a pool that does not fit, a GPU device open), "
        "marked 'no record': sampled over the same interval",
    )
    out = ps.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument(
        "--prometheus",
        action="store_true",
        help="print every registered process's thread metrics in the text exposition format",
    )
    ps.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    where = lock_dir(args.lock_dir)
    if args.prune:
        restored: list[str] = []
        for path in prune(where, restored):
            print(f"pruned   {printable(path, 200)}", file=sys.stderr)
        restored += _prune_irqs(where)
        for line in restored:
            print(f"restored {printable(line, 200)}", file=sys.stderr)
    registry = read_registry(where)
    if args.prometheus:
        return _prometheus(registry)
    data = host_view(registry, args.interval)
    data["vllm_servers"] = _vllm_servers(data["processes"])
    data["unrecorded"] = None
    if args.all:
        from cpupin.measure.unrecorded import unrecorded

        known = [r.pid for r in registry.records if r.kind == "process" and r.live]
        data["unrecorded"] = unrecorded(known, args.interval)
    if args.json:
        _args.print_json(data)
        return 0
    _text(data)
    return 0


def _vllm_servers(processes: object) -> list[dict[str, object]]:
    """The vLLM servers among the records, each with its API server's
    command line and port (read from /proc, short and printable)."""
    from cpupin.registry.servers import server_groups, server_port

    groups = server_groups(processes if isinstance(processes, list) else [])
    for group in groups:
        pid = group["api_pid"]
        argv = argv_of(pid) if group["api_live"] and isinstance(pid, int) else []
        group["command"] = printable(" ".join(argv), 160) if argv else None
        group["port"] = server_port(argv)
    return groups


def _prune_irqs(where: str) -> list[str]:
    """Put back the IRQ moves of an apply that died half way (root only)."""
    from cpupin.act.irq_steer import restore_moves
    from cpupin.registry.journal import journals

    if os.geteuid() != 0:
        return []
    lines = []
    for root in journals("irq", where):
        if root == "/" or os.path.isdir(root):
            lines += restore_moves(root=root, directory=where, dead_only=True)
    return lines


def _text(data: dict[str, object]) -> None:
    servers = data["servers"]
    processes = data["processes"]
    assert isinstance(servers, list) and isinstance(processes, list)
    live_servers = [s for s in servers if s["live"]]
    live_procs = [p for p in processes if p["live"]]
    print(_headline(data, live_servers, live_procs))
    print(f"{'SERVER':8} {'pid':>8}  {'setting':8} {'result':>6}  GPUs and step CPUs")
    for s in live_servers:
        steps = "; ".join(
            f"{printable(w['device'], 24)} on {format_cpulist(w['cpus'])}" for w in s["workers"]
        )
        result = s["result_cpu"] if s["result_cpu"] is not None else "-"
        print(f"{'':8} {s['pid']:>8}  {printable(s['setting'], 8):8} {result!s:>6}  {steps or '-'}")
    print(
        f"{'PROCESS':8} {'pid':>8}  {'tid':>8} {'name':16} {'role':8} {'CPUs':12} "
        f"{'cpu ms/s':>9} {'wait ms/s':>10}"
    )
    by_pid = {p["pid"]: p for p in live_procs}
    shown: set[int] = set()
    groups = data.get("vllm_servers") or []
    assert isinstance(groups, list)
    for group in groups:
        print(_server_line(group))
        for pid in group["members"]:
            shown.add(pid)
            _print_process(by_pid[pid])
    for p in live_procs:
        if p["pid"] not in shown:
            _print_process(p)
    for line in _unrecorded_lines(data):
        print(line)
    for line in _still_applied_lines(data):
        print(line)
    for line in _left_out_lines(data, [*servers, *processes]):
        print(line)


def _server_line(group: dict[str, Any]) -> str:
    """A vLLM server's line: its API server and command, or its orphans."""
    if group["api_live"]:
        port = f" (port {group['port']})" if group["port"] is not None else ""
        return f"{'VLLM':8} {group['api_pid']:>8}  {group['command'] or '?'}{port}"
    pids = " ".join(str(pid) for pid in group["orphans"])
    gone = f"API server pid {group['api_pid']}" if group["api_pid"] else "its API server"
    return (
        f"{'VLLM':8} {'-':>8}  orphans: {gone} is gone, and vLLM's shutdown never reached "
        f"them; they still hold their CPUs and memory: kill {pids}"
    )


def _print_process(p: dict[str, Any]) -> None:
    prefix = f"{'':8} {p['pid']:>8}  "
    for line in [*_about_lines(p), *_thread_lines(p)]:
        print(prefix + line)
    _print_pools(p, prefix)


def _headline(data: dict[str, object], servers: list[Any], processes: list[Any]) -> str:
    roles = sum(1 for p in processes if p.get("role"))
    sampled = data["sampled_s"]
    return (
        f"cpupin ps: lock directory {printable(str(data['lock_dir']), 120)}; "
        f"{len(servers)} server(s), "
        f"{sum(1 for p in processes if p['pins'])} process(es) with pins"
        + (f", {roles} with a role" if roles else "")
        + "; "
        + (
            f"sampled over {sampled:.3g} s (asked {data['interval_s']:g} s)"
            if sampled
            else "nothing live to sample"
        )
    )


def _about_lines(p: dict[str, Any]) -> list[str]:
    """A process's role, notes, drift, wake-latency holds and step clocks."""
    out = []
    if p.get("role"):
        out.append(printable(p["role"], 32))
    if p.get("out_of_date"):
        out.append(
            f"record out of date ({printable(p['out_of_date'], 120)}): "
            "its pins may have changed since"
        )
    out += [f"  {printable(note, 240)}" for note in p.get("notes", [])]
    if p.get("pin_drift"):
        drift = p["pin_drift"]
        out.append(
            f"pins found off their CPUs {drift['total']} time(s); "
            f"last: {printable(drift['last'], 200)}"
        )
    for h in p.get("wake_holds", []):
        what = "no wake latency" if h["max_us"] == 0 else f"wakes within {h['max_us']} µs"
        where = "pm_qos_resume_latency_us" if h["mechanism"] == "sysfs" else "cpu_dma_latency"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
        warden = "" if h.get("warden") is None else f", warden pid {h['warden']}"
        out.append(f"holds CPUs {h['cpus_list']}: {what} ({where}) since {since}{warden}")
    for s in p.get("steps", []):
        out.append(
            f"steps {s['clock']}: {s['steps']} on tid {s['tid']}, "
            f"wait p50 {_us(s['wait_p50_us'])} p99 {_us(s['wait_p99_us'])}, "
            f"wall p99 {_us(s['wall_p99_us'])}, throttled {s['throttled_s']:.3f} s"
        )
    return out


def _thread_lines(p: dict[str, Any]) -> list[str]:
    """A process's pinned threads, with their sample, and its interlopers."""
    out = []
    for t in p.get("threads", []):
        cpu = f"{t['cpu_ms_per_s']:.1f}" if t["cpu_ms_per_s"] is not None else "gone"
        wait = f"{t['wait_ms_per_s']:.1f}" if t["wait_ms_per_s"] is not None else "-"
        off = "" if t["on_its_pin"] or not t["alive"] else "  (moved off its pin)"
        if t.get("stall"):
            off += f"  stalled: {t['stall']}"
        if t.get("spinning"):
            off += "  spinning"
        out.append(
            f"{t['tid']:>8} {printable(t['name'], 16):16} {printable(t['role'], 8):8} "
            f"{t['cpus_list'][:12]:12} {cpu:>9} {wait:>10}{off}"
        )
    pinned = {t["tid"] for t in p.get("threads", [])}
    for t in p.get("spinning", []):
        if t["tid"] not in pinned:
            out.append(
                f"{t['tid']:>8} {printable(t['name'], 16):16} {'-':8} {'':12}  spinning: "
                "busy in the kernel, never blocking (a sched_yield or zero-timeout poll loop)"
            )
    for t in p.get("interlopers", []):
        out.append(
            f"{t['tid']:>8} {printable(t['name'], 16):16} {'-':8} "
            f"{t['mask_list'][:12]:12}  an interloper: on a pinned CPU, not registered"
        )
    return out


def _print_pools(p: dict[str, Any], prefix: str) -> None:
    """A process's usable CPUs, throttling, pools and memory by node."""
    if p.get("usable_cpus") is None:
        return
    lines = pool_lines(p.get("pools", []), " " * len(prefix))
    print(
        f"{prefix}usable CPUs {p['usable_cpus']}; {throttle_text(p.get('throttling'))}"
        + ("; pools:" if lines else "; no pool of two threads or more")
    )
    for line in lines:
        print(line)
    for line in memory_lines(p["memory"]) if p.get("memory") else []:
        print(prefix + line)


def _unrecorded_lines(data: dict[str, object]) -> list[str]:
    """The processes without a record that show a finding (``--all``)."""
    found = data.get("unrecorded")
    if not isinstance(found, list):
        return []
    if not found:
        return ["NO RECORD: no other process of this host shows a finding"]
    out = [f"NO RECORD: {len(found)} other process(es) show a finding"]
    for p in found:
        out.append(f"{'':8} {p['pid']:>8}  {printable(str(p['command']), 60)}")
        for finding in p["findings"]:
            out.append(f"{'':18}{printable(str(finding), 160)}")
        out.append(f"{'':18}no record: cpupin threads {p['pid']} for details")
    return out


def _still_applied_lines(data: dict[str, object]) -> list[str]:
    """What cpupin changed on the host that no live process owns: a line a
    CPU, and the IRQs moved in a line for each root and way back (a host
    may have thousands)."""
    changes = data.get("still_applied")
    assert isinstance(changes, list)
    out = []
    irqs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in changes:
        where = "" if c["root"] == "/" else f" (under {printable(c['root'], 80)})"
        if c["kind"] == "irq":
            irqs.setdefault((where, c["undo"]), []).append(c)
            continue
        out.append(f"applied  {printable(c['what'], 200)}{where}: still applied; {c['undo']} "
                   "puts it back")  # fmt: skip
    for (where, undo), moved in irqs.items():
        if len(moved) == 1:
            what = printable(moved[0]["what"], 200)
        else:
            named = ", ".join(str(m["irq"]) for m in moved[:8])
            more = f" and {len(moved) - 8} more" if len(moved) > 8 else ""
            dead = " (an apply that died half way)" if undo == "cpupin ps --prune" else ""
            what = f"{len(moved)} IRQs moved{dead}: {named}{more}"
        out.append(f"applied  {what}{where}: still applied; {undo} puts them back")
    return out


def _left_out_lines(data: dict[str, object], records: list[Any]) -> list[str]:
    """The stale records, the files ignored, and how many more were not listed."""
    out = [
        f"stale    {printable(r['path'], 160)}: {printable(r['stale_because'], 160)}"
        for r in records
        if not r["live"]
    ]
    ignored = data["ignored"]
    assert isinstance(ignored, list)
    out += [
        f"ignored  {printable(item['path'], 160)}: {printable(item['reason'], 160)}"
        for item in ignored
    ]
    if data.get("not_listed"):
        out.append(f"and      {data['not_listed']} more stale or ignored file(s), not listed")
    return out


def _us(value: object) -> str:
    return "-" if value is None else f"{value:.0f} µs"


def _prometheus(registry: Registry) -> int:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ValueError(
            "--prometheus needs prometheus_client: pip install 'cpupin[prometheus]'"
        ) from None
    from cpupin.measure.metrics import ProcessesCollector

    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(ProcessesCollector(registry, memory=True))  # asked for, on demand
    sys.stdout.write(generate_latest(collectors).decode())
    return 0
