# libnpualloc.so = the allocator core (interpose/src/core, pure policy) +
# the hook layer (interpose/src/hook: exported ACL symbols, dlsym, backend over
# the real runtime) + the stats region (interpose/src/region).
# Only symbols marked NPA_EXPORT leave the library (-fvisibility=hidden).

NPA_CFLAGS := $(CFLAGS_BASE) -Iinterpose/src -fvisibility=hidden $(SANFLAGS)
NPA_CORE_SRCS := $(sort $(wildcard interpose/src/core/*.c))
NPA_HOOK_SRCS := $(sort $(wildcard interpose/src/hook/*.c) $(wildcard interpose/src/region/*.c))
NPA_CORE_OBJS := $(NPA_CORE_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_HOOK_OBJS := $(NPA_HOOK_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_LIB := $(BUILD)/lib/libnpualloc.so

$(BUILD)/obj/interpose/%.o: interpose/%.c
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -MMD -MP -c $< -o $@

$(NPA_LIB): $(NPA_CORE_OBJS) $(NPA_HOOK_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libnpualloc.so -Wl,-z,nodelete $(SANFLAGS) $(LDFLAGS_BASE) -o $@ $^ -ldl

# The Python package finds the library and the region header beside itself,
# both in a checkout and once installed (setup.py runs `make lib`).
npualloc/lib/libnpualloc.so: $(NPA_LIB)
	@mkdir -p $(dir $@)
	cp $< $@
# Python's cffi reads both headers at run time (the region layout and the
# in-process API), so an installed package carries them.
NPA_PY_HEADERS := npualloc/include/npualloc_shm.h npualloc/include/npualloc.h
npualloc/include/%.h: interpose/include/%.h
	@mkdir -p $(dir $@)
	cp $< $@

lib: $(NPA_LIB) npualloc/lib/libnpualloc.so $(NPA_PY_HEADERS)

# C unit tests: each interpose/tests/test_*.c links the core objects and the
# shared fake backend (interpose/tests/fake_backend.c), never the hooks.
NPA_CTEST_SRCS := $(sort $(wildcard interpose/tests/test_*.c))
NPA_CTEST_BINS := $(NPA_CTEST_SRCS:interpose/tests/%.c=$(BUILD)/ctest/%)
NPA_CTEST_SUPPORT := $(filter-out $(NPA_CTEST_SRCS),$(wildcard interpose/tests/*.c))

$(BUILD)/ctest/%: interpose/tests/%.c $(NPA_CTEST_SUPPORT) $(NPA_CORE_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -Iinterpose/tests -o $@ $^ $(LDFLAGS_BASE) -lm

ctest-build: $(NPA_CTEST_BINS)
ctest: $(NPA_CTEST_BINS)
	@set -e; for t in $(NPA_CTEST_BINS); do echo "== $$t"; $$t; done

# The same C tests under AddressSanitizer and ThreadSanitizer, each in its own
# build tree so the objects never mix.
ctest-asan:
	$(MAKE) --no-print-directory BUILD=build-asan OPT=-O1 SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer" ctest
ctest-tsan:
	$(MAKE) --no-print-directory BUILD=build-tsan OPT=-O1 SANFLAGS="-fsanitize=thread" ctest

.PHONY: ctest-build ctest-asan ctest-tsan

-include $(NPA_CORE_OBJS:.o=.d) $(NPA_HOOK_OBJS:.o=.d)
