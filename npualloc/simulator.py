"""The simulated CANN runtime (tools/aclsim) as a place to run programs: where
it is and the one environment that puts it in front of a process tree.

A simulator home is laid out like $ASCEND_HOME_PATH: lib64/ holds the runtime
libraries (libaclsim.so tells it from a real CANN install), python/ the
pyACL-compatible `acl` extension. A checkout's is build/aclsim; `make package`
(run by `pip install .`) copies it into the package as npualloc/sim/. Neither
python/ directory is on any sys.path: only simulated_env adds it, to
PYTHONPATH, for the one process tree that asked (`npualloc run --sim`), so
installing npualloc never shadows a real pyACL.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .errors import NpuallocError

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_HOME = PACKAGE_DIR.parent / "build" / "aclsim"
PACKAGED_HOME = PACKAGE_DIR / "sim"


def is_simulator(home: Path) -> bool:
    lib64 = home / "lib64"
    return (lib64 / "libascendcl.so").is_file() and (lib64 / "libaclsim.so").is_file()


def find_home() -> Path:
    """A checkout's build tree before the package's copy, which is only as
    fresh as the last `make package`."""
    for home in (CHECKOUT_HOME, PACKAGED_HOME):
        if is_simulator(home):
            return home
    raise NpuallocError(f"no simulated runtime in {CHECKOUT_HOME} or {PACKAGED_HOME}: "
                        "build it with `make sim` or install the package with `pip install .`")


def _prepend(path: Path, current: str | None) -> str:
    return os.pathsep.join(filter(None, [str(path), current]))


def simulated_env(home: Path, env: Mapping[str, str]) -> dict[str, str]:
    """env with the simulator at home in front: its libraries found first
    (LD_LIBRARY_PATH, ASCEND_HOME_PATH) and its `acl` module importable."""
    out = dict(env)
    out["LD_LIBRARY_PATH"] = _prepend(home / "lib64", out.get("LD_LIBRARY_PATH"))
    out["ASCEND_HOME_PATH"] = str(home)
    out["PYTHONPATH"] = _prepend(home / "python", out.get("PYTHONPATH"))
    return out
