# `make ctest-aarch64`: `make ctest` cross-compiled for aarch64 in
# build-aarch64/ and run under qemu-user: the core's C tests (the reader's
# seqlock and command tests among them) and the exported entry points under
# threads with the aarch64 libnpualloc.so preloaded into a program on the
# aarch64 build of the simulated runtime. Ascend hosts are aarch64 (Kunpeng),
# where loads may be reordered. qemu on an x86-64 host still runs with
# x86-64's stronger ordering, so this proves the aarch64 build and the code of
# its atomics, not the absence of a reordering only aarch64 hardware shows.
# The stress runs are shorter than natively (qemu is ~10x slower), and the
# tree is built without LTO, which would double its compile time (the native
# trees keep LTO, and the inlining it allows is the same on both targets).
# tools/aarch64-tools.sh installs the cross gcc and qemu-user with apt-get
# when they are missing (root, Debian-like, a network); where it cannot, the
# target prints why and passes. AARCH64=off skips it.
AARCH64 ?= auto
AARCH64_CC := aarch64-linux-gnu-gcc
AARCH64_SYSROOT := /usr/aarch64-linux-gnu
AARCH64_BUILD := build-aarch64

ctest-aarch64:
	@if [ "$(AARCH64)" = off ]; then echo "aarch64 tests skipped: AARCH64=off"; exit 0; fi; \
	qemu=$$(tools/aarch64-tools.sh) || exit 0; \
	NPUALLOC_STRESS_OPS=400 $(MAKE) --no-print-directory BUILD=$(AARCH64_BUILD) CC=$(AARCH64_CC) NPA_LTO= \
	    CTEST_RUNNER="$$qemu -L $(AARCH64_SYSROOT)" CTEST_PRELOAD="$$qemu -L $(AARCH64_SYSROOT) -E LD_PRELOAD=" \
	    STRESS_OPS=200 $(AARCH64_BUILD)/lib/libnpualloc_reader.so ctest

.PHONY: ctest-aarch64
