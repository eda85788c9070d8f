"""Every C target is rebuilt when a header it includes changes: each compile
writes a dependency file (-MMD -MP) the makefiles include. Asked of make
itself, in the test build tree, without touching a file: once the target is
up to date, `make -n -W HEADER TARGET` (HEADER taken as just modified) must
recompile the source that includes the header."""

import os
import subprocess

import pytest

from conftest import BUILD, ROOT

# (target under the build tree, a header it includes, the source that includes it)
CASES = [
    ("lib/libnpualloc.so", "interpose/src/core/internal.h", "interpose/src/core/alloc.c"),
    ("lib/libnpualloc.so", "interpose/src/region/region.h", "interpose/src/region/region.c"),
    ("lib/libnpualloc_reader.so", "interpose/src/reader/guard.h", "interpose/src/reader/guard.c"),
    ("ctest/test_reader", "interpose/src/region/region.h", "interpose/tests/test_reader.c"),
    ("ctest/test_alloc", "interpose/tests/fake_backend.h", "interpose/tests/fake_backend.c"),
    ("ctest/test_alloc", "interpose/tests/check.h", "interpose/tests/test_alloc.c"),
    ("ctest/preload/exports_stress", "interpose/include/npualloc_reader.h",
     "interpose/tests/preload/exports_stress.c"),
    ("ctest/aclsim/stream_race", "tools/aclsim/include/aclsim_ops.h", "tools/aclsim/tests/stream_race.c"),
    ("aclsim/lib64/libaclsim.so", "tools/aclsim/src/impl/internal.h", "tools/aclsim/src/impl/stream.c"),
    ("tools/npualloc-replay", "include/acl/acl.h", "tools/replay/replay.c"),
    ("bench/npualloc-bench-hotpath", "interpose/src/core.h", "tools/bench/hotpath.c"),
]


# The tree named as `make` names it by default (build, not its absolute
# path): the dependency files hold the names the makefiles wrote.
TREE = os.path.relpath(BUILD, ROOT) if BUILD.is_relative_to(ROOT) else str(BUILD)


def _make(*args):
    # The test's own make, not a job of an outer one (`make pytest`).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", f"BUILD={TREE}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True)


@pytest.mark.parametrize("target,header,source", CASES, ids=[f"{t}<-{h}" for t, h, _ in CASES])
def test_a_changed_header_rebuilds_what_includes_it(target, header, source):
    path = f"{TREE}/{target}"
    built = _make(path)
    assert built.returncode == 0, built.stdout + built.stderr
    assert _make("-q", path).returncode == 0, f"{path} not up to date right after its build"
    plan = _make("-n", "-W", header, path)
    assert plan.returncode == 0, plan.stderr
    compiles = [line for line in plan.stdout.splitlines() if " -c " in line]
    assert any(f" -c {source} " in line for line in compiles), \
        f"{header} newer: make would not recompile {source} for {path}:\n{plan.stdout}"
