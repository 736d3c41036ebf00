"""The build: without a C compiler or Python's headers, one sentence says
what is missing; the sdist carries what the build needs (CI builds the sdist
and the wheel, and runs a smoke test of the wheel outside the checkout)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "csrc"))
from build import missing_prerequisites  # noqa: E402


def test_nothing_is_missing_here():
    assert missing_prerequisites() is None


def test_a_missing_compiler_and_headers_are_named_in_one_sentence(tmp_path):
    said = missing_prerequisites(cc="/nonexistent/cc -O2", include=str(tmp_path))
    assert said is not None and "\n" not in said
    assert "a C compiler (/nonexistent/cc is not on PATH)" in said
    assert f"no Python.h in {tmp_path}" in said and "apt install gcc python3-dev" in said


def test_the_test_extra_carries_the_builds_setuptools_floor():
    """setup.py runs here with this environment's setuptools, so the test
    extra asks for the build's own floor (a venv's bundled 65 cannot read
    pyproject.toml's license form)."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'requires = \[[^]]*"setuptools>=(\d+)"', text).group(1)
    test = re.search(r"^test = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert f'"setuptools>={floor}"' in test


def test_setup_py_build_ext_without_a_compiler_ends_with_that_sentence(tmp_path):
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    shutil.copytree(ROOT / "cpupin", tmp_path / "cpupin", ignore=shutil.ignore_patterns("*.so"))
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "CC": "/nonexistent/cc", "HOME": str(tmp_path)},
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("cpupin cannot build its native layer: it needs a C compiler")
    assert "Traceback" not in out.stderr


def _other_pythons():
    """CPython interpreters of another minor version than this one, where
    pyenv or Debian has them."""
    import glob
    import shutil

    found = {}
    for path in [*glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")),
                 *(shutil.which(f"python3.{m}") or "" for m in range(10, 15))]:  # fmt: skip
        if not path or not os.path.exists(path):
            continue
        out = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, check=False)  # fmt: skip
        if out.returncode != 0:
            continue
        version = tuple(int(x) for x in out.stdout.split())
        if version >= (3, 10) and version != tuple(sys.version_info[:2]):
            found.setdefault(version, path)
    return [found[v] for v in sorted(found)]


def test_one_abi3_wheel_installs_and_runs_on_another_python(tmp_path):
    """The wheel is tagged cp310-abi3 (its extension is built against the
    stable ABI), and the same file installs and pins on another CPython."""
    others = _other_pythons()
    if not others:
        pytest.skip("no other CPython 3.10+ here (pyenv or Debian's python3.x)")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("cpupin-*.whl")
    assert "-cp310-abi3-" in wheel.name, wheel.name
    other = others[-1]
    venv = tmp_path / "venv"
    subprocess.run([other, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-2000:]
    code = (
        "import sys, cpupin; cpus = cpupin.process_cpus(); "
        "pin = cpupin.pin_current_thread({min(cpus)}); "
        "assert cpupin.get_affinity() == {min(cpus)}; print(sys.version_info[:2])"
    )
    ran = subprocess.run([str(venv / "bin/python"), "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() != str(sys.version_info[:2])


def test_the_sdist_ships_what_messages_point_to_and_tests_that_run(tmp_path):
    """The sdist carries examples/ and bench/ (the doctor names files there)
    and the tests whole (conftest, helpers, the captured hosts), so an
    unpacked sdist's tests collect."""
    import tarfile

    # The README's command, in the checkout (where a `build/` folder may
    # stand), with this environment's setuptools rather than a download.
    out = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (sdist,) = tmp_path.glob("cpupin-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("examples/runtime.py", "bench/runtime.py", "tests/conftest.py",
                   "tests/support/helpers.py", "tests/data/hwloc", "csrc/cpupin.c"):  # fmt: skip
        assert any(n == needed or n.startswith(needed + "/") for n in names), needed
    assert not any("__pycache__" in n or n.endswith(".so") for n in names)
