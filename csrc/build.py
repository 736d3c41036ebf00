"""The cffi build script (API out-of-line mode): ``cpupin._cpupin``.

setup.py names ``csrc/build.py:ffi`` in ``cffi_modules``; the C text lives in
``cpupin.c`` and the declarations Python sees in ``cpupin.h``.
``make_ffi(stubs=True)`` builds the stubs a platform without thread affinity
gets, so that the tests can check that path on Linux; ``release_gil=True``
builds the control for the test that the calls keep the GIL.
"""

import os
import shlex
import shutil
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def make_ffi(stubs: bool = False, release_gil: bool = False) -> FFI:
    """The extension's FFI; ``release_gil=True`` leaves cffi's default of
    dropping the GIL around every call (a control for the tests)."""
    macros = [("CPUPIN_FORCE_STUBS", "1")] if stubs else []
    if release_gil:
        macros.append(("CPUPIN_RELEASE_GIL", "1"))
    built = FFI()
    built.cdef((HERE / "cpupin.h").read_text())
    built.set_source(
        "cpupin._cpupin",
        (HERE / "cpupin.c").read_text(),
        define_macros=macros,
        extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    )
    return built


def missing_prerequisites(cc: str | None = None, include: str | None = None) -> str | None:
    """What the build lacks, as one sentence, or ``None``: a C compiler
    (``$CC``, else the one Python was built with) and Python's headers
    (``Python.h`` in ``include``, else Python's include directory)."""
    command = cc if cc is not None else os.environ.get("CC") or sysconfig.get_config_var("CC")
    words = shlex.split(command or "cc")
    include = include if include is not None else sysconfig.get_paths()["include"]
    lacks = []
    if not words or shutil.which(words[0]) is None:
        lacks.append(f"a C compiler ({words[0] if words else 'cc'} is not on PATH)")
    if not (Path(include) / "Python.h").is_file():
        lacks.append(f"Python's headers (no Python.h in {include})")
    if not lacks:
        return None
    return (
        "cpupin cannot build its native layer: it needs "
        + " and ".join(lacks)
        + "; install them (Debian/Ubuntu: apt install gcc python3-dev; Fedora/RHEL: "
        "dnf install gcc python3-devel; Alpine: apk add gcc musl-dev python3-dev) "
        "and run pip install again"
    )


ffi = make_ffi()

if __name__ == "__main__":
    ffi.compile(verbose=True)
