# Only the cffi extension is built here; the metadata is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["csrc/build.py:ffi"])
