"""Which functions exist and what they do where thread affinity is missing."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cpupin

ROOT = Path(__file__).resolve().parent.parent

NATIVE_API = [
    "gettid",
    "getcpu",
    "get_affinity",
    "set_affinity",
    "schedstat",
    "thread_stats",
    "parse_cpulist",
    "format_cpulist",
    "parse_cpumask",
    "process_cpus",
    "set_process_cpus",
    "online_cpus",
]


def test_the_public_api_is_exported():
    for name in NATIVE_API + ["SchedStat", "ThreadStat", "UnsupportedPlatform"]:
        assert name in cpupin.__all__
        assert getattr(cpupin, name) is not None
    assert set(cpupin.__all__) <= set(dir(cpupin))


def test_only_native_imports_the_compiled_module():
    for path in (ROOT / "cpupin").glob("*.py"):
        if path.name != "_native.py":
            assert "_cpupin" not in path.read_text(), path


def test_linux_has_affinity():
    assert cpupin.HAVE_AFFINITY is sys.platform.startswith("linux")


STUB_SCRIPT = """
import cpupin
assert not cpupin.HAVE_AFFINITY
assert cpupin.parse_cpulist("0-3") == {0, 1, 2, 3}
for call in (cpupin.getcpu, cpupin.get_affinity, lambda: cpupin.set_affinity({0}),
             cpupin.schedstat, cpupin.thread_stats, cpupin.process_cpus):
    try:
        call()
    except cpupin.UnsupportedPlatform as exc:
        assert "Linux" in str(exc) and isinstance(exc, OSError), exc
    else:
        raise AssertionError(call)
assert cpupin.gettid() > 0
print("ok")
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_without_affinity_import_works_and_calls_raise_unsupportedplatform(tmp_path):
    spec = importlib.util.spec_from_file_location("cpupin_build", ROOT / "csrc" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    package = tmp_path / "cpupin"
    package.mkdir()
    for path in (ROOT / "cpupin").glob("*.py"):
        shutil.copy(path, package)
    build.make_ffi(stubs=True).compile(tmpdir=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", STUB_SCRIPT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path)},
        check=False,
    )
    assert out.stdout.strip() == "ok", out.stderr
