"""The cffi build script (API out-of-line mode): ``cpupin._cpupin``.

setup.py names ``csrc/build.py:ffi`` in ``cffi_modules``; the C text lives in
``cpupin.c`` and the declarations Python sees in ``cpupin.h``.
``make_ffi(stubs=True)`` builds the stubs a platform without thread affinity
gets, so that the tests can check that path on Linux; ``release_gil=True``
builds the control for the test that the calls keep the GIL.
"""

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


ffi = make_ffi()

if __name__ == "__main__":
    ffi.compile(verbose=True)
