# npualloc-replay: the C trace replayer (tools/replay/replay.c). It links
# nothing of ACL or npualloc: the runtime is dlopen'ed at run time, so it
# builds without the simulator. A copy goes beside the Python package (as
# libnpualloc.so does) so that `python -m npualloc replay` finds it once installed.

REPLAY_BIN := $(BUILD)/tools/npualloc-replay

$(REPLAY_BIN): tools/replay/replay.c tools/replay/replay_format.h interpose/include/npualloc.h \
               interpose/include/npualloc_shm.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ tools/replay/replay.c $(LDFLAGS_BASE) -ldl

npualloc/lib/npualloc-replay: $(REPLAY_BIN)
	@mkdir -p $(dir $@)
	cp $< $@

replay: $(REPLAY_BIN) npualloc/lib/npualloc-replay
all: replay

.PHONY: replay
