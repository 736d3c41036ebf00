"""What starting costs: ``import cpupin`` and ``cpupin exec`` against a bare
Python and the tools a launcher would otherwise use, in the same rounds.

Each case is a whole process, timed from the parent; medians of
``--rounds``, the cases interleaved. cpupin's bytecode is compiled first, as
a wheel's install compiles it (a machine that sets PYTHONDONTWRITEBYTECODE
would otherwise compile every module at every start). ``numactl`` is timed
where it is installed, ``taskset`` always. ``--against PYTHON`` times cpupin's
cases again with the Python of another environment, where another build of
cpupin is installed (``pip install`` of a checkout of another commit), in
the same rounds: what a change cost at start. Run it from an environment
where cpupin is installed as users install it (``pip install .``, not
editable): an editable install's finder runs at every start, ``python -c
pass`` included, and the ratios then read low; the script says which. It
also says whether the console script imports ``re`` (pip before 25.0 writes
that line into every script; current pip does not).

    python bench/startup.py [--rounds 31] [--against PYTHON]
"""

from __future__ import annotations

import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _env import start  # noqa: E402


def main() -> None:
    args = start(
        __doc__ or "",
        extra=[
            ("--against", str, None, "another environment's Python, to time in the same rounds")
        ],
    )
    import cpupin

    package = Path(cpupin.__file__).parent
    compileall.compile_dir(str(package), quiet=1)
    print(f"bytecode    compiled under {package}")
    print(f"install     {_install_kind(sys.executable)}")
    script = Path(sys.executable).with_name("cpupin")
    print(f"script      {script} ({_script_kind(script)})")
    python = [sys.executable]
    cases = {
        "python -c pass": [*python, "-c", "pass"],
        "python -c 'import cpupin'": [*python, "-c", "import cpupin"],
        "cpupin exec --node 0 -- true": [str(script), "exec", "--node", "0", "--", "true"],
        "python -m cpupin exec --node 0 -- true": [
            *python,
            "-m",
            "cpupin",
            "exec",
            "--node",
            "0",
            "--",
            "true",
        ],
        "taskset -c 0 true": ["taskset", "-c", str(min(os.sched_getaffinity(0))), "true"],
    }
    if shutil.which("numactl"):
        cases["numactl --cpunodebind=0 --preferred=0 true"] = [
            "numactl",
            "--cpunodebind=0",
            "--preferred=0",
            "true",
        ]
    if args.against:
        other = Path(args.against)
        print(f"against     {other} ({_install_kind(str(other))})")
        if not os.access(other.with_name("cpupin"), os.X_OK):
            raise SystemExit(
                f"{other.with_name('cpupin')} is missing: --against takes the python of a "
                "venv where cpupin is installed (its bin/ has both)"
            )
        for name in [n for n in cases if "cpupin" in n]:
            swap = {sys.executable: str(other), str(script): str(other.with_name("cpupin"))}
            cases[f"{name} [against]"] = [swap.get(part, part) for part in cases[name]]
        where = subprocess.run(
            [str(other), "-c", "import cpupin, os; print(os.path.dirname(cpupin.__file__))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        subprocess.run([str(other), "-m", "compileall", "-q", where], check=True)
        print(f"bytecode    compiled under {where}")
    # Away from any checkout: `python -c` puts the working directory first
    # on sys.path, and run from a source tree it times that tree's cpupin
    # (its bytecode, its build), not the installed one.
    away = tempfile.mkdtemp(prefix="cpupin-startup-")
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, cmd in cases.items():
            t = time.perf_counter_ns()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True, cwd=away)
            samples[name].append((time.perf_counter_ns() - t) / 1e6)
    os.rmdir(away)
    base = statistics.median(samples["python -c pass"])
    print()
    print("| process | median | over python -c pass | / python -c pass |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        m = statistics.median(values)
        print(f"| `{name}` | {m:.1f} ms | {m - base:+.1f} ms | {m / base:.2f}x |")


def _script_kind(script: Path) -> str:
    """Who wrote the console script, as far as its start goes: pip before
    25.1 writes ``import re`` into every one (about 6 ms of its start, more
    than cpupin's own), current pip does not."""
    try:
        text = script.read_text(errors="replace")
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if "import re\n" in text:
        return "imports re, as pip before 25.0 writes it"
    return "no import re, as current pip writes it"


def _install_kind(python: str) -> str:
    """How cpupin is installed for ``python``. An editable install's finder
    (a ``.pth`` hook that imports pathlib, re and more at every start) runs
    in ``python -c pass`` too, which pads the baseline by 10-15 ms and makes
    every ratio here look smaller than a plain ``pip install .`` gives."""
    probe = (
        "import sys, cpupin; print(any(m.startswith('__editable__') for m in sys.modules), "
        "any(p in cpupin.__file__ for p in ('site-packages', 'dist-packages')))"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    except OSError as exc:
        raise SystemExit(f"{python}: cannot run it ({exc.strerror}): name a Python") from None
    if out.returncode != 0 or len(out.stdout.split()) != 2:
        raise SystemExit(
            f"{python} cannot import cpupin: `pip install .` a checkout with that Python first"
        )
    finder, installed = out.stdout.split()
    if finder == "True":
        return "editable, its finder run at every start: ratios read low (measure `pip install .`)"
    if installed == "False":
        return "from a source tree (editable or on sys.path), not as `pip install .` installs it"
    return "installed (`pip install .`): what users run"


if __name__ == "__main__":
    main()
