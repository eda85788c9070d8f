# `make bench`: the measured claims of issues 6 and 14, in one run
# (tools/bench/run.py): the hot path through the exported ACL symbols, the
# core alone and glibc on the same sizes (as ratios measured side by side,
# repeated), every shipped trace raw vs npualloc, a pyACL program's time
# per step, pause/resume throughput and the cost of Python stacks in
# history. Prints the tables and the goals, and writes them under
# $(BUILD)/bench/results (never a tracked file). BUILD picks the build tree.
#   make bench-record  the same run, written to bench/results/ (the figures
#                      the README cites; commit them)

BENCH_OUT := $(BUILD)/bench
BENCH_HOTPATH := $(BENCH_OUT)/npualloc-bench-hotpath

# Linked against the simulated runtime like a real program links CANN; the
# rpath finds it beside the binary's build tree, LD_PRELOAD adds npualloc.
# The core's objects are linked in too, for --allocator core: their symbols
# are hidden in libnpualloc.so, so the preloaded library keeps its own.
$(BENCH_HOTPATH): tools/bench/hotpath.c $(NPA_CORE_OBJS) $(SIM_IMPL) $(SIM_FRONTS) interpose/include/npualloc.h \
                  interpose/include/npualloc_shm.h
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -Itools/aclsim/include -o $@ tools/bench/hotpath.c $(NPA_CORE_OBJS) -L$(SIM_LIB64) \
	    -Wl,-rpath,'$$ORIGIN/../aclsim/lib64' -lascendcl -laclsim $(SANFLAGS) $(LDFLAGS_BASE) -ldl

bench: all $(BENCH_HOTPATH) $(VENV_STAMP)
	$(VENV)/bin/python tools/bench/run.py --build $(BUILD) --out $(BENCH_OUT)/results
	BUILD=$(BUILD) $(VENV)/bin/python tools/bench/mindtorch.py

bench-record: all $(BENCH_HOTPATH) $(VENV_STAMP)
	$(VENV)/bin/python tools/bench/run.py --build $(BUILD) --out bench/results

.PHONY: bench-record

# Built with everything, so the smoke test (tests/test_demo_bench.py) finds it.
all: $(BENCH_HOTPATH)
