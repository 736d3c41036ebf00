"""The build: without a C compiler or Python's headers, one sentence says
what is missing; the sdist carries what the build needs (CI builds the sdist
and the wheel, and runs a smoke test of the wheel outside the checkout)."""

import shutil
import subprocess
import sys
from pathlib import Path

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
