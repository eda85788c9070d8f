"""`pip install .` builds libnpualloc.so on the installing machine and ships
it, with the headers cffi reads, the trace replayer and the simulated runtime
it drives, inside the package; `npualloc run --sim` runs a pyACL script on
that simulator with no checkout and no NPU."""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile

from conftest import ROOT


def test_pip_install_ships_a_working_library(tmp_path):
    # Built as a wheel first, as pip does for `pip install .`, to see its tag.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                    "--wheel-dir", str(wheels), str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    [wheel] = wheels.glob("npualloc-*.whl")
    # It carries .so files compiled for this machine and this Python: tagged for both, never py3-none-any.
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name == f"npualloc-0.1.0-{python}-{python}-{platform}.whl", wheel.name
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("npualloc-0.1.0.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in metadata and f"Tag: {python}-{python}-{platform}" in metadata, metadata

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--target", str(target), str(wheel)], check=True, capture_output=True, text=True, timeout=300)
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
    assert (target / "npualloc" / "include" / "npualloc_reader.h").exists()
    assert (target / "npualloc" / "lib" / "libnpualloc_reader.so").exists()

    # replay needs no checkout: the replayer and the simulator come with the package.
    env = {"PYTHONPATH": str(target), "PATH": os.environ["PATH"]}
    replay = subprocess.run([sys.executable, "-m", "npualloc", "replay", str(ROOT / "tools" / "traces" / "tiny.pickle.gz"),
                             "--json", "--no-search"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert replay.returncode == 0, replay.stderr
    result = json.loads(replay.stdout)
    assert result["fits"] and result["replay"]["events"] == 12 and result["replay"]["raw_mallocs"] == 3

    # No NPU: one command runs a pyACL script under npualloc on the shipped simulator.
    script = tmp_path / "script.py"
    # It also reads its own region the way `npualloc stats <pid>` reads another
    # process's: through the shipped libnpualloc_reader.so.
    script.write_text("import acl, npualloc, os\n"
                      "from npualloc.region import Region\n"
                      "assert acl.init() == 0 and acl.rt.set_device(0) == 0\n"
                      "ptr, ret = acl.rt.malloc(1 << 20, 0)\n"
                      "with Region(os.getpid()) as region:\n"
                      "    shared = region.read_device_stats(0).allocated_bytes[0].current\n"
                      "assert shared == npualloc.memory_allocated(), shared\n"
                      "print(acl.__file__, ret, npualloc.memory_allocated())\n")
    sim = subprocess.run([sys.executable, "-m", "npualloc", "run", "--sim", "--", sys.executable, str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert sim.returncode == 0 and sim.stderr == "", sim.stderr
    module, ret, allocated = sim.stdout.split()
    assert module.startswith(str(target / "npualloc" / "sim" / "python" / "acl")), module
    assert ret == "0" and int(allocated) >= 1 << 20  # served by the preloaded npualloc
    # ... and only with --sim: the package puts no `acl` where a real pyACL would be shadowed.
    assert not list(target.glob("acl*"))
    plain = subprocess.run([sys.executable, "-c", "import acl"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert plain.returncode == 1 and "No module named 'acl'" in plain.stderr

    # The MindTorch startup hook is installed where the interpreter runs it.
    assert (target / "npualloc-mindtorch.pth").read_text() == "import _npualloc_startup\n"
    assert (target / "_npualloc_startup.py").is_file()
