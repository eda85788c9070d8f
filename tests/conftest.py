"""Shared test plumbing: where the builds live and how to start a process on
the simulated runtime, with or without npualloc preloaded.

Every scenario that calls aclInit runs in its own subprocess: the runtime is
per process (a second aclInit is an error), and a preloaded library must be in
place before the program starts, exactly as a user runs it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tools" / "demo")]
import devenv  # noqa: E402  (tools/ is not a package)
import launch  # noqa: E402  (the one way to build the simulator's environment)

BUILD = Path(os.environ.get("NPUALLOC_TEST_BUILD", ROOT / "build"))
SIM_LIB = BUILD / "aclsim" / "lib64"
NPUALLOC_LIB = BUILD / "lib" / "libnpualloc.so"


# The simulated devices' capacity is shared by the processes of one
# NPUSIM_SHARED_DIR, as a real NPU's memory is by the processes of a node.
# Each test gets a directory of its own (set by _own_device_capacity), so its
# processes share devices with one another and never with another test's.
_device_dir: list[str] = []


@pytest.fixture(autouse=True)
def _own_device_capacity(tmp_path_factory: pytest.TempPathFactory):
    _device_dir.append(str(tmp_path_factory.mktemp("devices")))
    yield
    _device_dir.pop()


def sim_env(**extra: str) -> dict[str, str]:
    """Environment of a process on the simulator, latency model off (tests
    assert on behaviour, not on time), npualloc not loaded, its devices shared
    with the other processes of the same test."""
    env = launch.sim_environment(BUILD)
    env["NPUSIM_MALLOC_US"] = "0"
    env["NPUSIM_FREE_US"] = "0"
    if _device_dir:
        env["NPUSIM_SHARED_DIR"] = _device_dir[-1]
    env.update(extra)
    return env


MINDTORCH_SRC = devenv.MINDTORCH_SRC
CANN_ROOT = ROOT / "tools" / "aclsim" / "cann-root"
_cann_root_ok: list[str] = []


def cann_root_command(argv: list[str]) -> list[str]:
    """argv run with the simulator's tree at /usr/local/Ascend/ascend-toolkit/latest
    (tools/aclsim/cann-root: a private mount namespace, for that process tree
    only), which programs such as MindTorch v2 load CANN from. Skips the test
    where that cannot be arranged."""
    if not _cann_root_ok:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("needs root and unshare(1) to put the simulator at /usr/local/Ascend in a private "
                        "mount namespace")
        probe = subprocess.run([str(CANN_ROOT), str(BUILD / "aclsim"), "test", "-f",
                                "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot mount the simulator at /usr/local/Ascend here: {probe.stderr.strip()}")
        _cann_root_ok.append("ok")
    return [str(CANN_ROOT), str(BUILD / "aclsim"), *argv]


def mindtorch_env(**extra: str) -> dict[str, str]:
    """sim_env with the pinned MindTorch v2 importable (skips without it)."""
    if not (MINDTORCH_SRC / "mindtorch_v2" / "__init__.py").is_file():
        pytest.skip(f"pinned MindTorch v2 not found at {MINDTORCH_SRC} (set NPUALLOC_MINDTORCH)")
    env = sim_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(MINDTORCH_SRC), env["PYTHONPATH"]])
    return env


def installed_python() -> str:
    """An interpreter with this checkout installed as `pip install .` would
    (npualloc-mindtorch.pth in its site-packages): tools/devenv.py."""
    return str(devenv.ensure(BUILD))


def preload_env(**extra: str) -> dict[str, str]:
    """sim_env with libnpualloc.so preloaded, as `LD_PRELOAD=libnpualloc.so prog`."""
    env = sim_env(**extra)
    env["LD_PRELOAD"] = str(NPUALLOC_LIB)
    return env


# The start of a script: heap_in_use() is the host memory malloc has handed
# out, its arenas' bytes in use and its mmapped blocks (mallinfo2), for a
# test that a table or list of npualloc's stays bounded over a long run.
HEAP_IN_USE = """
import ctypes
class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2
def heap_in_use():
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd
"""


def run_python(code: str, env: dict[str, str], timeout: float = 60, check: bool = True,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs a dedented Python snippet in a fresh interpreter; returns the
    completed process (stdout/stderr as text). check=True fails the test with
    both streams when the exit code is not 0."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *(args or [])], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def _builds_exist():
    missing = [p for p in (SIM_LIB / "libascendcl.so", NPUALLOC_LIB) if not p.exists()]
    if missing:
        pytest.exit(f"build first (make all): missing {', '.join(map(str, missing))}", returncode=2)


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """NPUALLOC_SHM_DIR for the region tests: a base directory like /dev/shm
    and /tmp, sticky and writable by everyone (other users' attacks need both)."""
    path = Path(tempfile.mkdtemp(prefix="npualloc-base-", dir="/tmp"))
    path.chmod(0o1777)
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(path))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def sleeper():
    """The pid of a live process that is not running under npualloc."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _c_compiler() -> str:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def compile_c(tmp_path_factory: pytest.TempPathFactory, name: str, source: str) -> Path:
    """Builds a small C test program (linked with -ldl) in a fresh temp dir;
    skips the test when there is no C compiler."""
    cc = _c_compiler()
    directory = tmp_path_factory.mktemp(name)
    (directory / "prog.c").write_text(source)
    subprocess.run([cc, "-O1", "-o", str(directory / "prog"), str(directory / "prog.c"), "-ldl"], check=True)
    return directory / "prog"


def compile_shim(directory: Path, name: str, source: str) -> Path:
    """Builds lib<name>.so (linked with -ldl) from source in directory: a
    test's own interposer, preloaded beside or instead of npualloc; skips the
    test when there is no C compiler."""
    cc = _c_compiler()
    src, lib = directory / f"{name}.c", directory / f"lib{name}.so"
    src.write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def real_npu_env() -> dict[str, str] | None:
    """Environment of a process on a real Ascend install with npualloc
    preloaded, or None when this machine has no NPU (device nodes
    /dev/davinci<N> and a CANN runtime under $ASCEND_HOME_PATH)."""
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home or not list(Path("/dev").glob("davinci[0-9]*")):
        return None
    if not (Path(home) / "lib64" / "libascendcl.so").exists():
        return None
    env = dict(os.environ)
    env["LD_PRELOAD"] = str(NPUALLOC_LIB)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def pytest_configure(config):
    config.addinivalue_line("markers", "npu: needs a real Ascend NPU and CANN; skipped without one")


def pytest_collection_modifyitems(config, items):
    if real_npu_env() is not None:
        return
    skip = pytest.mark.skip(reason="no Ascend NPU on this machine (/dev/davinci* and $ASCEND_HOME_PATH)")
    for item in items:
        if "npu" in item.keywords:
            item.add_marker(skip)
