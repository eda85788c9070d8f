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
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


# Installed at the top of site-packages, where the interpreter runs it at
# start (see _npualloc_startup.py): it hands MindTorch v2's allocator to npualloc.
STARTUP_PTH = "npualloc-mindtorch.pth"


class BuildWithLibrary(build_py):
    def run(self):
        subprocess.check_call(["make", "-C", HERE, "package", f"PYTHON={sys.executable}"])
        super().run()
        self.copy_file(os.path.join(HERE, STARTUP_PTH), os.path.join(self.build_lib, STARTUP_PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, STARTUP_PTH)]


class CompiledDistribution(Distribution):
    """The package carries code compiled here: libnpualloc.so, the reader and
    the replayer for this machine, and the simulator's `acl` module for this
    Python. So its wheel is tagged for this interpreter and platform (e.g.
    cp311-cp311-linux_x86_64), as wheels with extension modules are, never
    py3-none-any, which pip would install on an aarch64 host or another Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=CompiledDistribution)
