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
BENCH_HOTPATH_OBJ := $(BENCH_OUT)/hotpath.o
$(BENCH_HOTPATH_OBJ): tools/bench/hotpath.c
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -Itools/aclsim/include -MMD -MP -c $< -o $@
-include $(BENCH_HOTPATH_OBJ:.o=.d)

$(BENCH_HOTPATH): $(BENCH_HOTPATH_OBJ) $(NPA_CORE_OBJS) $(SIM_IMPL) $(SIM_FRONTS)
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -o $@ $(BENCH_HOTPATH_OBJ) $(NPA_CORE_OBJS) -L$(SIM_LIB64) \
	    -Wl,-rpath,'$$ORIGIN/../aclsim/lib64' -lascendcl -laclsim $(SANFLAGS) $(LDFLAGS_BASE) -ldl

# libnpualloc.so without the two tests every aclrtMalloc makes for features
# a program may never use (a memory_saver region, record_stacks), compiled
# out of exports.c: section 1 runs it beside the real library, so "available
# but unused costs nothing measurable" is a figure of every run.
BENCH_BARE_LIB := $(BENCH_OUT)/bare/libnpualloc.so
$(BENCH_OUT)/bare/exports.o: interpose/src/hook/exports.c
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -DNPA_BENCH_WITHOUT_IDLE_FEATURES -MMD -MP -c $< -o $@
-include $(BENCH_OUT)/bare/exports.d
$(BENCH_BARE_LIB): $(NPA_CORE_OBJS) $(filter-out %/hook/exports.o,$(NPA_HOOK_OBJS)) $(BENCH_OUT)/bare/exports.o
	$(NPA_LINK_LIB)

bench: all $(BENCH_HOTPATH) $(VENV_STAMP)
	$(VENV)/bin/python tools/bench/run.py --build $(BUILD) --out $(BENCH_OUT)/results
	BUILD=$(BUILD) $(VENV)/bin/python tools/bench/mindtorch.py

bench-record: all $(BENCH_HOTPATH) $(VENV_STAMP)
	$(VENV)/bin/python tools/bench/run.py --build $(BUILD) --out bench/results

.PHONY: bench-record

# Built with everything, so the smoke test (tests/test_demo_bench.py) finds them.
all: $(BENCH_HOTPATH) $(BENCH_BARE_LIB)
