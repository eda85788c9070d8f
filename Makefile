# npualloc build. Each component keeps its rules in its own fragment:
#   interpose/build.mk   libnpualloc.so and the allocator's C unit tests
#   tools/aclsim/build.mk the simulated CANN runtime and the pyACL-compatible module
# `make test` is the one test command (README, .ci/run): it builds everything,
# makes its own virtual environment, then runs the C tests and pytest.

BUILD   ?= build
PYTHON  ?= python3
VENV    ?= .venv
CC      ?= cc
OPT     ?= -O2
CFLAGS_BASE := $(OPT) -g -std=gnu11 -Wall -Wextra -Werror=implicit-function-declaration \
               -fPIC -pthread -Iinclude -Iinterpose/include
LDFLAGS_BASE := -pthread

.PHONY: all lib sim ctest pytest test demo bench venv clean package
all: lib sim

# aclsim first: the interposer's tests run on the simulator and name its paths.
include tools/aclsim/build.mk
include interpose/build.mk
include interpose/reader.mk
include interpose/aarch64.mk
include tools/replay/build.mk

# A venv of our own, so nothing has to be installed by hand on a fresh
# machine: the package's own dependencies for the demo, everything the tests
# and the bench use (pytest, matplotlib, torch's memory_viz) on top of them.
PIP := $(VENV)/bin/python -m pip install -q --disable-pip-version-check
VENV_RUNTIME := $(VENV)/.npualloc-runtime
VENV_STAMP := $(VENV)/.npualloc-deps
$(VENV_RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) "cffi>=1.15" "psutil>=5.9"   # pyproject.toml's dependencies
	touch $@
$(VENV_STAMP): $(VENV_RUNTIME) tests/requirements.txt
	$(PIP) -r tests/requirements.txt
	touch $@
venv: $(VENV_STAMP)

# After the venv's variables: a rule's prerequisites are expanded where it is
# read, so a fragment naming $(VENV_STAMP) before this point would get nothing.
include tools/bench.mk

pytest: all $(VENV_STAMP)
	$(VENV)/bin/python -m pytest -q tests $(PYTEST_ARGS)

# C tests (plain, ASan, TSan, aarch64 under qemu) may run side by side; pytest runs after them so
# its summary closes the log.
test:
	$(MAKE) --no-print-directory ctest ctest-asan ctest-tsan ctest-aarch64
	$(MAKE) --no-print-directory pytest

# What `pip install .` ships (setup.py runs this): the preload library and
# headers, the trace replayer, and the simulated runtime the replayer drives,
# so `python -m npualloc replay` works on a machine with no checkout and no NPU.
# The `acl` module goes to sim/python/, on no sys.path until `npualloc run
# --sim` puts it on PYTHONPATH (npualloc/simulator.py): never where it could
# shadow a real pyACL.
PACKAGE_SIM := npualloc/sim
package: lib replay $(SIM_IMPL) $(SIM_FRONTS) $(SIM_PYACL)
	@mkdir -p $(PACKAGE_SIM)/lib64 $(PACKAGE_SIM)/python
	cp $(SIM_IMPL) $(SIM_FRONTS) $(PACKAGE_SIM)/lib64/
	cp $(SIM_PYACL) $(PACKAGE_SIM)/python/

demo: all $(VENV_STAMP)  # MindTorch v2, in the demo, needs numpy (tests/requirements.txt)
	$(VENV)/bin/python tools/demo.py

clean:
	rm -rf $(BUILD) npualloc/lib npualloc/include npualloc/sim
