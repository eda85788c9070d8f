"""A Python environment where this checkout is installed the way `pip install .`
installs it, for running programs as a user would: the checkout importable and
npualloc-mindtorch.pth in site-packages, so the interpreter runs
_npualloc_startup at start. Without writing into the interpreter's own
environment (shared, and not ours to change): a venv under the build
directory whose site-packages also holds the creating interpreter's.

`python tools/devenv.py [BUILD]` prints its interpreter; the tests use ensure().
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTUP_PTH = ROOT / "npualloc-mindtorch.pth"
# The pinned MindTorch v2 the tests, demo and bench run: beside the checkout
# in ../shared, as the workspace lays it out, unless NPUALLOC_MINDTORCH names it.
MINDTORCH_SRC = Path(os.environ.get("NPUALLOC_MINDTORCH", ROOT.parent / "shared" / "third_party"
                                    / "mindtorch-v2")) / "src"


def ensure(build: Path) -> Path:
    """The venv's python (created, or refreshed when the .pth changed)."""
    home = build / "devenv"
    python = home / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    target = Path(purelib)
    parents = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    # A .pth line naming a directory adds it to sys.path.
    wanted = {"npualloc-checkout.pth": "\n".join([str(ROOT), *dict.fromkeys(parents)]) + "\n",
              STARTUP_PTH.name: STARTUP_PTH.read_text()}
    for name, text in wanted.items():
        path = target / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return python


if __name__ == "__main__":
    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build"))
