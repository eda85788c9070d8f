# libnpualloc_reader.so: how another process reads a stats region and posts
# it commands (interpose/src/reader, API: interpose/include/npualloc_reader.h),
# with the acquire/release orderings that match the allocator's writes. The
# Python package loads it through cffi for the CLI and the pid= API calls.
# Its own library, never libnpualloc.so: loading that one into a reader would
# interpose the reader's own runtime calls.
NPA_READER_SRCS := $(sort $(wildcard interpose/src/reader/*.c))
NPA_READER_OBJS := $(NPA_READER_SRCS:%.c=$(BUILD)/obj/%.o)
NPA_READER_LIB := $(BUILD)/lib/libnpualloc_reader.so

$(NPA_READER_LIB): $(NPA_READER_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libnpualloc_reader.so $(CFLAGS_BASE) -fvisibility=hidden $(NPA_LTO) $(SANFLAGS) $(LDFLAGS_BASE) -o $@ $^

npualloc/lib/libnpualloc_reader.so: $(NPA_READER_LIB)
	@mkdir -p $(dir $@)
	cp $< $@

lib: $(NPA_READER_LIB) $(call NPA_PACKAGE_LIBS,$(NPA_READER_LIB)) npualloc/include/npualloc_reader.h

# The C tests of the reader (a writer thread of the real core against reader
# threads; the device figures' reading rule) link the reader's objects beside
# the core's, and so does the thread stats test, whose reader copies the stats
# storage as the CLI does.
$(BUILD)/ctest/test_reader $(BUILD)/ctest/test_device_figures $(BUILD)/ctest/test_thread_stats: $(NPA_READER_OBJS)
# The exports' stress test loads it to copy its own region (build.mk).
exports-stress: $(NPA_READER_LIB)

-include $(NPA_READER_OBJS:.o=.d)
