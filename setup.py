"""Builds libnpualloc.so with make and ships it inside the package.

`pip install .` runs this on the installing machine: the library must be
compiled there (it is a C shared library preloaded into other programs), so the
only build requirement beyond Python is a C compiler. `make package` leaves
the library and the trace replayer in npualloc/lib/, the headers in
npualloc/include/ and the simulated runtime (for `npualloc replay` and
`npualloc run --sim`; its `acl` extension built for the installing Python) in
npualloc/sim/, the same places a source checkout uses, and package-data ships
them.
"""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithLibrary(build_py):
    def run(self):
        subprocess.check_call(["make", "-C", HERE, "package", f"PYTHON={sys.executable}"])
        super().run()


setup(cmdclass={"build_py": BuildWithLibrary})
