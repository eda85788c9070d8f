# The allocator core's hit-path micro-benchmark (not a test). Use with the
# main Makefile for its variables and the core objects:
#   make -f Makefile -f tools/bench/core.mk bench-core
BENCH_CORE := $(BUILD)/bench/bench_core

$(BENCH_CORE): tools/bench/bench_core.c $(NPA_CORE_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -o $@ $^ $(LDFLAGS_BASE)

bench-core: $(BENCH_CORE)
	$(BENCH_CORE)

.PHONY: bench-core
