"""hwloc's captured hosts, shipped in tests/data/hwloc (BSD; COPYING beside
them), and the fixture that unpacks them once a session."""

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

#: hwloc's captures, shipped with the tests (BSD; COPYING beside them).
CAPTURES = Path(__file__).resolve().parents[1] / "data" / "hwloc"


NAMES = sorted(p.name[: -len(".tar.bz2")] for p in CAPTURES.glob("*.tar.bz2"))


needs_captures = pytest.mark.skipif(not NAMES, reason=f"no hwloc captures in {CAPTURES}")


@pytest.fixture(scope="session")
def unpacked(tmp_path_factory):
    """Each capture unpacked once; its root is the one folder it makes.

    In memory where /dev/shm allows: the captures hold 40,000 small files,
    which take half a minute to create on this machine's disk."""
    if os.access("/dev/shm", os.W_OK):
        base = Path(tempfile.mkdtemp(prefix="cpupin-hwloc-", dir="/dev/shm"))
    else:
        base = tmp_path_factory.mktemp("hwloc")
    try:
        yield _unpack(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _unpack(base):
    roots = {}
    for name in NAMES:
        target = base / name
        target.mkdir()
        archive = CAPTURES / f"{name}.tar.bz2"
        if shutil.which("tar"):  # ten times faster than tarfile on these
            subprocess.run(["tar", "xjf", str(archive), "-C", str(target)], check=True)
        else:
            with tarfile.open(archive) as tar:
                tar.extractall(target)
        (top,) = [p for p in target.iterdir() if p.is_dir()]
        roots[name] = top
    return roots
