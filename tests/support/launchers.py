"""What the launcher tests share: the shipped GPU hosts they emit for, and
``cpupin`` run as a launched rank would run it."""

import os
import sys

from tests.support.helpers import run

#: The shipped hosts each launcher's golden files cover.
SHIPPED = ("dgx-h100", "gh200", "h100-vm", "xeon6-pct", "amd-8gpu")


def cpupin(*argv, env=None, cpus=None):
    """``cpupin argv`` in a child (on ``cpus`` when given), with no launcher
    variable of this process's own (a Slurm job's, a rank's)."""
    code = "import os, sys\n"
    if cpus is not None:
        code += f"os.sched_setaffinity(0, {sorted(cpus)!r})\n"
    code += "from cpupin.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK"))}
    full.pop("CPUPIN_PLAN_MASK", None)
    return run([sys.executable, "-c", code, *argv], env={**full, **(env or {})})
