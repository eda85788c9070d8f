# `make bench`: the measured claims of issue 6, in one run (tools/bench/run.py):
# the hot path through the exported ACL symbols, every shipped trace raw vs
# npualloc, and a pyACL program's time per step. Prints the tables and writes
# bench/results/latest.md and latest.png. Timings depend on the machine: the
# report names it. BUILD picks the build tree, as everywhere.
#   make bench-core   the allocator core alone (no ACL, no dynamic linker)

BENCH_OUT := $(BUILD)/bench
BENCH_HOTPATH := $(BENCH_OUT)/npualloc-bench-hotpath
BENCH_CORE := $(BENCH_OUT)/bench_core

# Linked against the simulated runtime like a real program links CANN; the
# rpath finds it beside the binary's build tree, LD_PRELOAD adds npualloc.
$(BENCH_HOTPATH): tools/bench/hotpath.c $(SIM_IMPL) $(SIM_FRONTS) interpose/include/npualloc.h \
                  interpose/include/npualloc_shm.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -Itools/aclsim/include -o $@ tools/bench/hotpath.c -L$(SIM_LIB64) \
	    -Wl,-rpath,'$$ORIGIN/../aclsim/lib64' -lascendcl -laclsim $(LDFLAGS_BASE) -ldl

# The core's hit path over a no-op backend (tools/bench/bench_core.c).
$(BENCH_CORE): tools/bench/bench_core.c $(NPA_CORE_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -o $@ $^ $(LDFLAGS_BASE)

bench: all $(BENCH_HOTPATH) $(BENCH_CORE) $(VENV_STAMP)
	$(VENV)/bin/python tools/bench/run.py --build $(BUILD)

bench-core: $(BENCH_CORE)
	$(BENCH_CORE)

.PHONY: bench-core

# Built with everything, so the smoke test (tests/test_demo_bench.py) finds it.
all: $(BENCH_HOTPATH)
