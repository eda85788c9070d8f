# libnpualloc.so = the allocator core (interpose/src/core, pure policy) +
# the hook layer (interpose/src/hook: exported ACL symbols, dlsym, backend over
# the real runtime) + the stats region (interpose/src/region).
# Only symbols marked NPA_EXPORT leave the library (-fvisibility=hidden).

# -flto: the hit path crosses files (alloc.c -> pool.c, block_map.c, sizes.c,
# slab.c) on every call; link-time optimisation inlines across them.
NPA_LTO ?= -flto=auto
NPA_CFLAGS := $(CFLAGS_BASE) -Iinterpose/src -fvisibility=hidden $(NPA_LTO) $(SANFLAGS)
NPA_CORE_SRCS := $(sort $(wildcard interpose/src/core/*.c))
NPA_HOOK_SRCS := $(sort $(wildcard interpose/src/hook/*.c) $(wildcard interpose/src/region/*.c))
NPA_CORE_OBJS := $(NPA_CORE_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_HOOK_OBJS := $(NPA_HOOK_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_LIB := $(BUILD)/lib/libnpualloc.so

$(BUILD)/obj/interpose/%.o: interpose/%.c
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -MMD -MP -c $< -o $@

# No vectorizing in the core: its hot path is the stats' scattered 8-byte
# read-modify-writes, which the SLP vectorizer pairs across neighbouring
# fields of different stats into 16-byte loads, shuffles and stores, several
# instructions for each two it replaces (about 14 more per malloc+free pair
# by callgrind, `make bench`'s hot path). The core has no loop that gains.
$(NPA_CORE_OBJS): NPA_CFLAGS += -fno-tree-vectorize

# Our exported dlsym runs inside the sanitizer runtimes' start-up and must
# reach the real dlsym by a tail call (see hook/dlsym.c): never instrumented,
# always optimised for sibling calls, in every build tree.
$(BUILD)/obj/interpose/src/hook/dlsym.o: NPA_CFLAGS += -fno-sanitize=all -O2 -foptimize-sibling-calls -fno-lto

# Links libnpualloc.so from the objects in $^ (the bench links a variant too).
NPA_LINK_LIB = $(CC) -shared -Wl,-soname,libnpualloc.so -Wl,-z,nodelete $(CFLAGS_BASE) -fvisibility=hidden $(NPA_LTO) \
               $(SANFLAGS) $(LDFLAGS_BASE) -o $@ $^ -ldl

$(NPA_LIB): $(NPA_CORE_OBJS) $(NPA_HOOK_OBJS)
	@mkdir -p $(dir $@)
	$(NPA_LINK_LIB)

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

# Only an uninstrumented build's libraries go into the package: one built
# with SANFLAGS (BUILD=build-asan ...) would need its sanitizer's runtime
# preloaded into every process that loads it, the CLI's included.
NPA_PACKAGE_LIBS = $(if $(SANFLAGS),,npualloc/lib/$(notdir $(1)))
lib: $(NPA_LIB) $(call NPA_PACKAGE_LIBS,$(NPA_LIB)) $(NPA_PY_HEADERS)

# C unit tests: each interpose/tests/test_*.c links the core objects and the
# shared fake backend (interpose/tests/fake_backend.c), never the hooks.
NPA_CTEST_SRCS := $(sort $(wildcard interpose/tests/test_*.c))
NPA_CTEST_BINS := $(NPA_CTEST_SRCS:interpose/tests/%.c=$(BUILD)/ctest/%)
NPA_CTEST_SUPPORT := $(filter-out $(NPA_CTEST_SRCS),$(wildcard interpose/tests/*.c))
# Each test and its support compile to objects of their own (the pattern rule
# above), so each gets the dependency file that rebuilds it when a header it
# includes changes.
NPA_CTEST_OBJS := $(NPA_CTEST_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_CTEST_SUPPORT_OBJS := $(NPA_CTEST_SUPPORT:%.c=$(BUILD)/obj/%.o)
$(NPA_CTEST_OBJS) $(NPA_CTEST_SUPPORT_OBJS): NPA_CFLAGS += -Iinterpose/tests

$(NPA_CTEST_BINS): $(BUILD)/ctest/%: $(BUILD)/obj/interpose/tests/%.o $(NPA_CTEST_SUPPORT_OBJS) $(NPA_CORE_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -o $@ $^ $(LDFLAGS_BASE) -lm

# CTEST_RUNNER runs each binary: empty here, qemu-aarch64 for a cross-built
# tree (interpose/aarch64.mk).
ctest-core: $(NPA_CTEST_BINS)
	@set -e; for t in $(NPA_CTEST_BINS); do echo "== $(CTEST_RUNNER) $$t"; $(CTEST_RUNNER) $$t; done

# The exported entry points under threads: a C program on the simulated
# runtime with this tree's libnpualloc.so preloaded (interpose/tests/preload),
# reading its own stats region with this tree's libnpualloc_reader.so.
# In a sanitizer tree SANLIB names the sanitizer runtime, which must come
# first in LD_PRELOAD (ASan refuses to start otherwise).
NPA_EXPORTS_STRESS := $(BUILD)/ctest/preload/exports_stress
NPA_EXPORTS_STRESS_OBJ := $(BUILD)/obj/interpose/tests/preload/exports_stress.o
$(NPA_EXPORTS_STRESS): $(NPA_EXPORTS_STRESS_OBJ) $(SIM_LIB64)/libascendcl.so
	@mkdir -p $(dir $@)
	$(CC) $(NPA_CFLAGS) -o $@ $< -L$(SIM_LIB64) -lascendcl -Wl,-rpath,$(abspath $(SIM_LIB64)) -ldl $(LDFLAGS_BASE)

NPA_SAN_RUNTIME = $(if $(SANLIB),$(shell $(CC) -print-file-name=$(SANLIB)))
# How a test binary gets libraries preloaded: through the environment here;
# through qemu's -E in a cross-built tree (aarch64.mk), so that the x86-64
# qemu binary itself is not handed aarch64 libraries.
CTEST_PRELOAD ?= LD_PRELOAD=
# Twice: plain segments, then expandable ones (the hook layer's VMM calls).
exports-stress: $(NPA_LIB) $(NPA_EXPORTS_STRESS)
	@set -e; for conf in "" expandable_segments:True; do \
	    echo "== $(NPA_EXPORTS_STRESS) $$conf"; \
	    PYTORCH_NPU_ALLOC_CONF="$$conf" NPUSIM_MALLOC_US=0 NPUSIM_FREE_US=0 \
	        NPUALLOC_STRESS_READER=$(abspath $(NPA_READER_LIB)) \
	        $(CTEST_PRELOAD)"$(NPA_SAN_RUNTIME) $(abspath $(NPA_LIB))" $(NPA_EXPORTS_STRESS) $(STRESS_OPS); \
	done

ctest: ctest-core exports-stress

# The same C tests under AddressSanitizer and ThreadSanitizer, each in its own
# build tree so the objects never mix; without LTO, so a report points at the
# source as written.
ctest-asan:
	$(MAKE) --no-print-directory BUILD=build-asan OPT=-O1 SANLIB=libasan.so NPA_LTO= \
	    SANFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ctest
ctest-tsan:
	$(MAKE) --no-print-directory BUILD=build-tsan OPT=-O1 SANLIB=libtsan.so SANFLAGS="-fsanitize=thread" NPA_LTO= \
	    STRESS_OPS=150 ctest

.PHONY: ctest-core ctest-asan ctest-tsan exports-stress

-include $(patsubst %.o,%.d,$(NPA_CORE_OBJS) $(NPA_HOOK_OBJS) $(NPA_CTEST_OBJS) $(NPA_CTEST_SUPPORT_OBJS) \
                               $(NPA_EXPORTS_STRESS_OBJ))
