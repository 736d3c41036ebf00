"""Placement speed: ``place`` on the DGX H100 and on a 4096-CPU host (also
with priority cores and an L3 every 8 cores: classes and caches), and
``plan_server`` end to end from sysfs (read, place, claim).

    python bench/plan.py [--rounds 15]
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository root: host specs read back in memory live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _env import fmt_ns, paired, start  # noqa: E402

from cpupin.act.server import plan_server  # noqa: E402
from cpupin.host.shapes import HOSTS, GpuSpec, HostSpec, _built, host_named  # noqa: E402
from cpupin.plan.placement import place  # noqa: E402
from tests.support.specs import spec_host  # noqa: E402

BIG = HostSpec(
    "4096-cpus",
    "8 sockets x 4 nodes x 64 cores x 2 threads, 16 GPUs",
    sockets=8,
    nodes_per_socket=4,
    cores_per_node=64,
    threads=2,
    gpus=tuple(GpuSpec(f"0000:{0x10 + 8 * i:02x}:00.0", i % 32) for i in range(16)),
)


#: BIG with what issue 19 adds: eight priority cores a socket (two classes)
#: and an L3 every 8 cores (256 cache domains).
BIG_CLASSES = replace(
    BIG,
    name="4096-cpus-classes",
    description=BIG.description + ", 8 priority cores a socket, an L3 every 8 cores",
    perf=(("highest_perf", 38), ("max_khz", 3_800_000)),
    priority_cores=(4, 36, 68, 100, 132, 164, 196, 228),
    priority=(("highest_perf", 46), ("max_khz", 4_600_000)),
    llc_cores=8,
)


def main() -> None:
    args = start(__doc__ or "")
    dgx = host_named("dgx-h100")
    big = spec_host(BIG)
    dgx_gpu = dgx.gpus[5].address
    big_gpu = big.gpus[9].address
    classy = spec_host(BIG_CLASSES)
    assert len(classy.classes) == 2 and len(classy.caches) == 256
    root = _built("dgx-h100")
    lock_dir = tempfile.mkdtemp(prefix="cpupin-bench-lock-")
    atexit.register(shutil.rmtree, lock_dir, True)  # nothing left in /tmp

    def end_to_end() -> None:
        plan = plan_server(
            "auto", [dgx_gpu], root=root, mask=dgx.cpus, lock_dir=lock_dir, environ={}
        )
        assert plan.pinned, plan.placement.reason
        plan.claim.close()

    print(f"hosts: {HOSTS['dgx-h100'].description}; {BIG.description} ({len(big.cpus)} CPUs)")
    print()
    print("| what | median |")
    print("|---|---|")
    times = paired(
        {
            "place(dgx-h100, one GPU)": lambda: place(dgx, dgx.cpus, [dgx_gpu], "auto"),
            "place(dgx-h100, all 8 GPUs one by one)": lambda: [
                place(dgx, dgx.cpus, [g.address], "auto") for g in dgx.gpus
            ],
            "place(4096-CPU host, one GPU)": lambda: place(big, big.cpus, [big_gpu], "auto"),
            "place(4096-CPU host with classes and caches, one GPU)": lambda: place(
                classy, classy.cpus, [big_gpu], "auto"
            ),
            "place(4096-CPU host with classes and caches, all 16 GPUs)": lambda: [
                place(classy, classy.cpus, [g.address], "auto") for g in classy.gpus
            ],
            "place(dgx-h100, CPU number 5, 2 workers)": lambda: place(dgx, dgx.cpus, ["a", "b"], 5),
            "plan_server(dgx-h100 tree): read, place, claim": end_to_end,
        },
        50,
        args.rounds,
    )
    for what, ns in times.items():
        print(f"| `{what}` | {fmt_ns(ns)} |")


if __name__ == "__main__":
    main()
