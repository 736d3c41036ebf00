"""Pinning a thread and releasing it: cpupin's registered pin against the
plain ``os`` calls a user would otherwise make.

Paired in the same rounds, the calling thread pinned to the process mask and
put back: ``pin_current_thread`` + ``release`` with the host's registry on
(its record in a fresh lock directory written at each pin and at each
release) and off (``CPUPIN_REGISTRY=0``, measured in a child), against two
``os.sched_setaffinity`` calls and a read of the old mask.

    python bench/pins.py [--rounds 15] [--number 2000]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = """
import os, sys
sys.path.insert(0, {here!r})
from _env import paired
import cpupin
cpus = cpupin.process_cpus()
mask = set(cpus)
def with_os():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, mask)
    os.sched_setaffinity(0, before)
print(repr(paired({{
    "pin_current_thread + release": lambda: cpupin.pin_current_thread(cpus).release(),
    "os: getaffinity + setaffinity x2": with_os,
}}, {number}, {rounds})))
"""


def measure(registry_on: bool, number: int, rounds: int, lock_dir: str) -> dict[str, float]:
    env = {**os.environ, "CPUPIN_LOCK_DIR": lock_dir}
    env["CPUPIN_REGISTRY"] = "1" if registry_on else "0"
    code = CASES.format(here=str(Path(__file__).resolve().parent), number=number, rounds=rounds)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, float] = eval(out.stdout)  # noqa: S307 - our own child's output
    return result


def main() -> None:
    from _env import fmt_ns, start

    args = start(__doc__ or "", rounds=15, number=2000)
    lock_dir = tempfile.mkdtemp(prefix="cpupin-bench-")
    try:
        on = measure(True, args.number, args.rounds, lock_dir)
        off = measure(False, args.number, args.rounds, lock_dir)
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)
    base = on["os: getaffinity + setaffinity x2"]
    print("| what | median | vs os |")
    print("|---|---|---|")
    rows = [
        ("pin_current_thread + release, registry on", on["pin_current_thread + release"]),
        ("pin_current_thread + release, CPUPIN_REGISTRY=0", off["pin_current_thread + release"]),
        ("os: sched_getaffinity + sched_setaffinity x2", base),
    ]
    for name, ns in rows:
        print(f"| `{name}` | {fmt_ns(ns)} | {ns / base:.1f}x |")


if __name__ == "__main__":
    main()
