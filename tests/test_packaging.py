"""`pip install .` builds libnpualloc.so on the installing machine and ships
it, with the headers cffi reads, the trace replayer and the simulated runtime
it drives, inside the package."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def test_pip_install_ships_a_working_library(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    probe = subprocess.run(
        [sys.executable, "-c",
         "import ctypes, npualloc; p = npualloc.library_path(); print(p); "
         "lib = ctypes.CDLL(str(p)); print(hasattr(lib, 'aclrtMalloc'), hasattr(lib, 'npualloc_get_stats'))"],
        cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        check=True)
    path, exports = probe.stdout.splitlines()
    assert path.startswith(str(target)), f"library not from the installed package: {path}"
    assert exports == "True True"
    assert (target / "npualloc" / "include" / "npualloc_shm.h").exists()
    assert (target / "npualloc" / "include" / "npualloc.h").exists()

    # replay needs no checkout: the replayer and the simulator come with the package.
    env = {"PYTHONPATH": str(target), "PATH": os.environ["PATH"]}
    replay = subprocess.run([sys.executable, "-m", "npualloc", "replay", str(ROOT / "tools" / "traces" / "tiny.pickle.gz"),
                             "--json", "--no-search"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert replay.returncode == 0, replay.stderr
    result = json.loads(replay.stdout)
    assert result["fits"] and result["replay"]["events"] == 12 and result["replay"]["raw_mallocs"] == 3
