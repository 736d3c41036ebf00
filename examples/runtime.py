"""A toy model-serving runtime that uses cpupin end to end.

The shape of the reference review's server: an API-server process starts one
worker process per device entry (multiprocessing, spawn) and receives every
token from them on its result thread. Each worker runs a decode loop on three
threads, main, "GPU" and plan, which hand work to each other five times a
step; the step's work is a small CPU matmul (torch or numpy, whichever is
installed). The API server plans at startup with ``cpupin.plan_server`` and
passes the plan, pool caps included, to its workers (``plan.child_env()``);
each worker caps its pools (``cpupin.limit_pools``), pins its step threads
with ``cpupin.pin_step_thread`` and times each step with a
``cpupin.StepClock`` (the wait per step, p50 and p99, is in the report);
every other thread is a ``cpupin.Thread`` or ``cpupin.ThreadPool``.

    python examples/runtime.py --setting off|auto|N [--devices 0,1] [--steps 300] [--json]
    python examples/runtime.py --host dgx-h100 --devices 0000:18:00.0   # the plan it would apply

On a host without GPUs the devices are worker slots: ``auto`` pins nothing
and says why, a CPU number pins as docs/placement.md says. ``--root DIR`` plans
from a host tree instead of this machine's sysfs (the threads are still
really pinned, so its CPUs must be this machine's).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from multiprocessing.connection import wait

import cpupin
from cpupin import Sampler

log = logging.getLogger("runtime")

STEP_HANDOFFS = 5
MATRIX = 48


def name_thread(name: str) -> None:
    """Give the OS thread a name that schedstat readers show (Python before
    3.14 leaves it as the process's)."""
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def make_work():  # type: ignore[no-untyped-def]
    """The step's work: a small matmul in torch or numpy, else pure Python."""
    try:
        import torch

        a = torch.rand(MATRIX, MATRIX)
        return lambda: float((a @ a).sum())
    except ImportError:
        pass
    try:
        import numpy

        a = numpy.random.rand(MATRIX, MATRIX)
        return lambda: float((a @ a).sum())
    except ImportError:
        rows = [[float(i + j) for j in range(16)] for i in range(16)]
        return lambda: sum(sum(x * y for x, y in zip(r, c)) for r in rows for c in zip(*rows))


# --- the worker process -------------------------------------------------------


def wait_for(path: str | None, timeout: float = 120.0) -> None:
    """Block until ``path`` exists (an outside tool has looked), at most
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def worker_main(  # type: ignore[no-untyped-def]
    index: int,
    cpus: tuple[int, ...] | None,
    steps: int,
    conn,
    linger_file: str | None = None,
    cap_pools: bool = True,
) -> None:
    """One worker: a decode loop on its main, GPU and plan threads."""
    name_thread(f"worker{index}")  # what the pool threads it starts inherit
    if cap_pools:
        cpupin.limit_pools()  # before the first parallel op: the caps the server passed on
    work = make_work()
    to_plan: queue.SimpleQueue[object] = queue.SimpleQueue()
    to_gpu: queue.SimpleQueue[object] = queue.SimpleQueue()
    to_main: queue.SimpleQueue[object] = queue.SimpleQueue()
    pinned = threading.Barrier(3)

    def step_thread(name: str) -> None:
        if cpus:  # OpenMP's threads start before the pin; the role goes to the registry
            cpupin.pin_step_thread(cpus, name=f"worker{index}-{name}", role="step")
        name_thread(f"worker{index}-{name}")
        pinned.wait()

    def plan_loop() -> None:
        step_thread("plan")
        while (item := to_plan.get()) is not None:
            to_gpu.put(item)  # schedule the step, then sample its output

    def gpu_loop() -> None:
        step_thread("gpu")
        while (item := to_gpu.get()) is not None:
            if item[0] == "launch":
                to_plan.put(("sample", work()))
            else:
                to_main.put(item[1])

    threads = [
        cpupin.Thread(target=plan_loop, name="plan"),
        cpupin.Thread(target=gpu_loop, name="gpu"),
    ]
    for t in threads:
        t.start()
    pin = cpupin.pin_step_thread(cpus, name=f"worker{index}-main") if cpus else None
    name_thread(f"worker{index}-main")
    pinned.wait()
    detok_pool = cpupin.ThreadPool(
        1, thread_name_prefix="detok", initializer=name_thread, initargs=(f"worker{index}-detok",)
    )
    detok_pool.submit(int).result()  # its thread exists before the sample starts
    clock = cpupin.StepClock("decode")  # made in the step thread: it times this thread
    with detok_pool as detok, Sampler() as sampler:
        for step in range(steps):
            with clock.step():
                to_plan.put(("launch", step))  # main -> plan -> gpu -> plan -> gpu -> main
                value = to_main.get()
            detok.submit(format, value, ".3f")  # a helper pool, on the process mask
            conn.send((index, step, time.monotonic_ns()))
    wait_for(linger_file)  # the step threads stay up, pinned, until it exists
    to_plan.put(None)
    to_gpu.put(None)
    for t in threads:
        t.join()
    stray = [
        info._asdict() | {"mask": cpupin.format_cpulist(info.mask)}
        for info in cpupin.stray_threads()
    ]
    conn.send(("done", index, [s.as_dict() for s in sampler.samples], stray, clock.summary()))
    conn.close()
    if pin is not None:
        pin.release()


# --- the API server -------------------------------------------------------------


def run_server(args: argparse.Namespace) -> tuple[dict[str, object], cpupin.Claim | None]:
    """Run the server; returns its report and its claim, still held (the
    caller releases it, after --hold)."""
    name_thread("api-main")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    plan = cpupin.plan_server(args.setting, devices, root=args.root or "/", lock_dir=args.lock_dir)
    placement = plan.placement
    print(
        f"runtime: {'pinned' if placement.pinned else 'not pinned'}: {placement.reason}",
        file=sys.stderr,
        flush=True,
    )
    # The spawned workers' environment: the plan's decision and its pool caps.
    os.environ.update(plan.child_env(pools=args.pools == "cap"))
    if args.lock_dir:  # where this server and its workers record their pins
        os.environ["CPUPIN_LOCK_DIR"] = args.lock_dir
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for i, _ in enumerate(devices):
        cpus = placement.workers[i].cpus if placement.pinned else None
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=worker_main,
            name=f"worker{i}",
            args=(i, cpus, args.steps, child, args.linger_file, args.pools == "cap"),
        )
        proc.start()
        print(f"runtime: worker {i} pid {proc.pid}", file=sys.stderr, flush=True)
        child.close()
        conns.append(parent)
        procs.append(proc)
    arrivals: list[list[int]] = [[] for _ in devices]
    reports: dict[
        int, tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]
    ] = {}

    server_samples: list[dict[str, object]] = []

    def result_loop() -> None:
        name_thread("api-result")
        if placement.pinned and placement.result_cpu is not None:
            cpupin.pin_current_thread({placement.result_cpu}, name="api-result", role="result")
        with Sampler() as sampler:
            receive()
        server_samples.extend(s.as_dict() for s in sampler.samples)

    def receive() -> None:
        open_conns = list(conns)
        while open_conns:
            for conn in wait(open_conns):
                try:
                    message = conn.recv()
                except EOFError:
                    open_conns.remove(conn)
                    continue
                if message[0] == "done":
                    reports[message[1]] = (message[2], message[3], message[4])
                else:
                    arrivals[message[0]].append(time.monotonic_ns())

    result = cpupin.Thread(target=result_loop, name="result")
    result.start()
    result.join()
    for proc in procs:
        proc.join()
    gaps = [(b - a) / 1e6 for times in arrivals for a, b in zip(times, times[1:])]
    q = statistics.quantiles(gaps, n=100) if len(gaps) >= 2 else [0.0] * 99
    # Each worker's rate from its first token to its last: start-up is not decoding.
    rate = sum(
        (len(t) - 1) / ((t[-1] - t[0]) / 1e9) for t in arrivals if len(t) > 1 and t[-1] > t[0]
    )
    threads = [{"process": "api-server", **s} for s in server_samples]
    stray = [
        {"process": "api-server", **info._asdict(), "mask": cpupin.format_cpulist(info.mask)}
        for info in cpupin.stray_threads()
    ]
    step_clocks = []
    for i in sorted(reports):
        samples, worker_stray, clock = reports[i]
        threads += [{"process": f"worker{i}", **s} for s in samples]
        stray += [{"process": f"worker{i}", **s} for s in worker_stray]
        step_clocks.append({"process": f"worker{i}", **clock})
    report = {
        "setting": str(placement.setting),
        "devices": list(placement.devices),
        "pinned": placement.pinned,
        "reason": placement.reason,
        "workers": [{"device": w.device, "cpus": list(w.cpus)} for w in placement.workers],
        "result_cpu": placement.result_cpu,
        "process_mask": cpupin.format_cpulist(cpupin.process_cpus()),
        "worker_pids": [p.pid for p in procs],
        "exitcodes": [p.exitcode for p in procs],
        "steps": args.steps,
        "steps_per_s": rate,
        "itl_ms": {"p50": q[49], "p95": q[94], "p99": q[98]},
        "step_clocks": step_clocks,
        "threads": threads,
        "stray": stray,
    }
    return report, plan.claim


def print_report(report: dict[str, object]) -> None:
    itl = report["itl_ms"]
    print(
        f"setting {report['setting']}: {'pinned' if report['pinned'] else 'not pinned'} "
        f"({report['reason']})"
    )
    print(
        f"{report['steps_per_s']:.0f} steps/s; inter-token latency p50 {itl['p50']:.3f} ms, "
        f"p95 {itl['p95']:.3f} ms, p99 {itl['p99']:.3f} ms"
    )
    for c in report["step_clocks"]:
        wait, wall = c["wait_us"], c["wall_us"]
        print(
            f"{c['process']}: {c['steps']} steps; wait for a CPU a step p50 "
            f"{wait.get('p50', 0):.1f} µs, p99 {wait.get('p99', 0):.1f} µs; "
            f"step p50 {wall.get('p50', 0):.1f} µs, p99 {wall.get('p99', 0):.1f} µs"
        )
    print(f"{'process':11} {'thread':16} {'cpu ms/s':>9} {'wait ms/s':>10}  mask")
    for t in report["threads"]:
        print(
            f"{t['process']:11} {t['name'][:16]:16} {t['cpu_ms_per_s']:>9.1f} "
            f"{t['wait_ms_per_s']:>10.1f}  {t['mask_list']}"
        )
    stray = report["stray"]
    print(f"stray threads: {len(stray)}" + "".join(f"\n  {s}" for s in stray))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="off", help="off (default), auto, or a CPU number")
    parser.add_argument(
        "--devices",
        default="0",
        help="comma-separated PCI addresses, device "
        "indexes or (on a host without GPUs) worker slots; one worker each",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--pools",
        choices=("cap", "leave"),
        default="cap",
        help="cap the workers' pools to their usable CPUs (default), or leave them as the "
        "libraries size them (for comparison)",
    )
    parser.add_argument("--root", help="plan from the host tree under DIR")
    parser.add_argument("--host", help="print the plan a shipped host would get, and exit")
    parser.add_argument(
        "--lock-dir", help="the per-GPU lock directory (default: $CPUPIN_LOCK_DIR or /tmp)"
    )
    parser.add_argument(
        "--linger-file",
        metavar="PATH",
        help="workers keep their threads after the run until PATH exists",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=0.0,
        help="keep the server (and its locks) this many seconds after the run",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(levelname)s: %(message)s"
    )
    try:
        if args.host:
            from cpupin.hosts import host_named

            host = host_named(args.host)
            devices = cpupin.resolve_devices(args.devices.split(","), host, {})
            placement = cpupin.place(host, host.cpus, devices, args.setting)
            print(
                json.dumps(
                    {
                        "host": args.host,
                        "pinned": placement.pinned,
                        "reason": placement.reason,
                        "workers": [list(w.cpus) for w in placement.workers],
                        "result_cpu": placement.result_cpu,
                    },
                    indent=2,
                )
            )
            return 0
        if args.steps < 2:
            raise ValueError(f"--steps {args.steps}: give at least 2")
        report, claim = run_server(args)
    except (ValueError, OSError) as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    sys.stdout.flush()
    if args.hold:  # the locks stay held while it holds
        print("runtime: holding", file=sys.stderr, flush=True)
        time.sleep(args.hold)
    if claim is not None:
        claim.close()
    return 0 if all(code == 0 for code in report["exitcodes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
