# npualloc-replay: the C trace replayer (tools/replay/replay.c). It links
# nothing of ACL or npualloc: the runtime is dlopen'ed at run time, so it
# builds without the simulator. A copy goes beside the Python package (as
# libnpualloc.so does) so that `python -m npualloc replay` finds it once installed.

REPLAY_BIN := $(BUILD)/tools/npualloc-replay

REPLAY_OBJ := $(BUILD)/obj/tools/replay/replay.o

$(REPLAY_OBJ): tools/replay/replay.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -MMD -MP -c $< -o $@
-include $(REPLAY_OBJ:.o=.d)

$(REPLAY_BIN): $(REPLAY_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -o $@ $< $(LDFLAGS_BASE) -ldl

npualloc/lib/npualloc-replay: $(REPLAY_BIN)
	@mkdir -p $(dir $@)
	cp $< $@

replay: $(REPLAY_BIN) npualloc/lib/npualloc-replay
all: replay

.PHONY: replay
