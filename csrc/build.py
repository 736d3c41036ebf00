"""The cffi build script (API out-of-line mode): ``cpupin._cpupin``.

setup.py names ``csrc/build.py:ffi`` in ``cffi_modules``; the C text lives in
``cpupin.c`` and the declarations Python sees in ``cpupin.h``.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

ffi = FFI()
ffi.cdef((HERE / "cpupin.h").read_text())
ffi.set_source(
    "cpupin._cpupin",
    (HERE / "cpupin.c").read_text(),
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
