"""Binding a worker to its GPU's NUMA node: cpupin against numactl.

Prints the environment, then medians: ``bind_process`` end to end on the
shipped DGX H100 tree (read the host, resolve the GPU, decide, move every
thread, set the memory policy; the tree's node 0 holds this machine's CPUs),
the decision alone, and, as processes, ``cpupin exec --dry-run`` against
``numactl --show`` and a bound ``true`` through each.

    python bench/bind.py [--rounds 15]
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import fmt_ns, paired, start, timed  # noqa: E402

from cpupin import process_cpus  # noqa: E402
from cpupin.act.binding import bind_process
from cpupin.host.shapes import _built, host_named  # noqa: E402
from cpupin.plan.binding import decide_binding


def main() -> None:
    args = start(__doc__ or "")
    root = _built("dgx-h100")
    host = host_named("dgx-h100")
    gpu = host.gpus[0].address  # node 0, which holds CPUs 0 and 1
    mask = process_cpus()
    print("| what | median |")
    print("|---|---|")
    times = paired(
        {
            "bind_process(GPU 0, dgx-h100 tree), end to end": lambda: bind_process(gpu, root=root),
            "decide_binding alone": lambda: decide_binding(host, host.cpus, device=gpu),
        },
        20,
        args.rounds,
    )
    for what, ns in times.items():
        print(f"| `{what}` | {fmt_ns(ns)} |")
    cpupin = [sys.executable, "-m", "cpupin", "exec"]
    rows = {
        "cpupin exec --node 0 --dry-run -- true": [
            *cpupin,
            "--node",
            "0",
            "--dry-run",
            "--",
            "true",
        ],
        "cpupin exec --node 0 -- true": [*cpupin, "--node", "0", "--", "true"],
    }
    numactl = shutil.which("numactl")
    if numactl:
        rows["numactl --show"] = [numactl, "--show"]
        rows["numactl --cpunodebind=0 --preferred=0 true"] = [
            numactl,
            "--cpunodebind=0",
            "--preferred=0",
            "true",
        ]
    rows["python -c pass (for scale)"] = [sys.executable, "-c", "pass"]
    for what, cmd in rows.items():
        print(f"| `{what}` (a process) | {fmt_ns(timed(cmd, args.rounds))} |")
    if not numactl:
        print("| numactl | not installed (apt-get install numactl) |")
    os.sched_setaffinity(0, mask)


if __name__ == "__main__":
    main()
