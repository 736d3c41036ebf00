"""The project's ruff rule: no bare thread or pool under cpupin/ outside the
threads module, since a thread inherits its creator's (perhaps pinned) mask."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BARE = """\
import threading
from concurrent.futures import ThreadPoolExecutor

threading.Thread(target=print).start()
ThreadPoolExecutor(2)
"""


def ruff(filename):
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--select",
            "TID251",
            "--stdin-filename",
            filename,
            "-",
        ],
        input=BARE,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


def test_a_bare_thread_or_pool_under_cpupin_is_refused():
    out = ruff("cpupin/anything.py")
    assert out.returncode == 1
    assert out.stdout.count("TID251") == 2
    assert "cpupin.Thread" in out.stdout and "cpupin.ThreadPool" in out.stdout


def test_the_threads_module_may_use_them():
    assert ruff("cpupin/threads/thread.py").returncode == 0
