# Only the cffi extension is built here; the metadata is in pyproject.toml.
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
from build import missing_prerequisites  # noqa: E402


class CheckedBuildExt(build_ext):
    """build_ext that first says, in one sentence, what the machine lacks
    (a C compiler, Python's headers) instead of a compiler's traceback."""

    def run(self) -> None:
        missing = missing_prerequisites()
        if missing:
            sys.exit(missing)
        super().run()


# cffi builds the extension against the stable ABI (_cpupin.abi3.so): the
# wheel says so, one wheel for every CPython from 3.10 (cp310-abi3).
setup(
    cffi_modules=["csrc/build.py:ffi"],
    cmdclass={"build_ext": CheckedBuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
