# The simulated CANN runtime (`make sim`), laid out like $ASCEND_HOME_PATH so
# ASCEND_HOME_PATH=$(BUILD)/aclsim works:
#   lib64/libaclsim.so    the implementation: all state, aclsim_* introspection, simrt_* entry points
#   lib64/libascendcl.so  thin aclrt*/acl* forwarders to simrt_* ...
#   lib64/libacl_rt.so    ... the same source compiled a second time (CANN 8 exports both)
#   lib64/libnnopbase.so  aclnnInit/Finalize and the aclOpExecutor lifecycle
#   lib64/libopapi.so     the simulated two-phase aclnn ops (src/opapi raw-pointer ops, src/aclnn real ones)
#   aarch64-linux/lib64/  where MindTorch looks: libnnopbase.so, libopapi.so and the legacy op
#                         libraries libaclnn_ops_infer.so, libaclnn_math.so (see the aclnn section)
#   python/acl<EXT_SUFFIX> the pyACL-compatible `acl` module, linked against libascendcl.so
# The front libraries find libaclsim.so through an $ORIGIN rpath.

SIM_DIR := $(BUILD)/aclsim
SIM_LIB64 := $(SIM_DIR)/lib64
SIM_OBJ := $(BUILD)/obj/tools/aclsim
SIM_CFLAGS := $(CFLAGS_BASE) -Itools/aclsim/include -fvisibility=hidden $(SANFLAGS)
SIM_SHARED := -shared -Wl,--no-undefined $(SANFLAGS) $(LDFLAGS_BASE)

SIM_IMPL_SRCS := $(sort $(wildcard tools/aclsim/src/impl/*.c))
SIM_IMPL_OBJS := $(SIM_IMPL_SRCS:tools/aclsim/%.c=$(SIM_OBJ)/%.o)
SIM_PYACL_SRCS := $(sort $(wildcard tools/aclsim/src/pyacl/*.c))
SIM_PYACL_OBJS := $(SIM_PYACL_SRCS:tools/aclsim/%.c=$(SIM_OBJ)/%.o)

SIM_IMPL := $(SIM_LIB64)/libaclsim.so
SIM_FRONTS := $(SIM_LIB64)/libascendcl.so $(SIM_LIB64)/libacl_rt.so $(SIM_LIB64)/libnnopbase.so \
              $(SIM_LIB64)/libopapi.so
SIM_PY_EXT_SUFFIX := $(shell $(PYTHON) -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')
SIM_PY_INCLUDE := $(shell $(PYTHON) -c 'import sysconfig;print(sysconfig.get_paths()["include"])')
SIM_PYACL := $(SIM_DIR)/python/acl$(SIM_PY_EXT_SUFFIX)

sim: $(SIM_IMPL) $(SIM_FRONTS) $(SIM_PYACL)

$(SIM_OBJ)/%.o: tools/aclsim/%.c
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) -MMD -MP -c $< -o $@

# One forwarder source, compiled once per library so each has its own object.
$(SIM_OBJ)/forward/%/acl_forward.o: tools/aclsim/src/forward/acl_forward.c
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) -MMD -MP -c $< -o $@

$(SIM_OBJ)/src/pyacl/%.o: tools/aclsim/src/pyacl/%.c
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) -I$(SIM_PY_INCLUDE) -MMD -MP -c $< -o $@

# Stream workers run code of libaclsim.so and callbacks of libopapi.so at any
# time, so neither may ever be unloaded (-z nodelete).
$(SIM_IMPL): $(SIM_IMPL_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(SIM_SHARED) -Wl,-soname,libaclsim.so -Wl,-z,nodelete -o $@ $^

$(SIM_LIB64)/libascendcl.so: $(SIM_OBJ)/forward/ascendcl/acl_forward.o $(SIM_IMPL)
	$(CC) $(SIM_SHARED) -Wl,-soname,libascendcl.so -o $@ $< -L$(SIM_LIB64) -laclsim -Wl,-rpath,'$$ORIGIN'

$(SIM_LIB64)/libacl_rt.so: $(SIM_OBJ)/forward/acl_rt/acl_forward.o $(SIM_IMPL)
	$(CC) $(SIM_SHARED) -Wl,-soname,libacl_rt.so -o $@ $< -L$(SIM_LIB64) -laclsim -Wl,-rpath,'$$ORIGIN'

$(SIM_LIB64)/libnnopbase.so: $(SIM_OBJ)/src/nnopbase/nnopbase.o $(SIM_IMPL)
	$(CC) $(SIM_SHARED) -Wl,-soname,libnnopbase.so -o $@ $< -L$(SIM_LIB64) -laclsim -Wl,-rpath,'$$ORIGIN'

# ---- aclnn ops and descriptors (libnnopbase.so, libopapi.so, the legacy op libraries) ----
SIM_ACLNN_OBJS := $(SIM_OBJ)/src/opapi/sim_ops.o $(SIM_OBJ)/src/aclnn/engine.o $(SIM_OBJ)/src/aclnn/ops.o
SIM_ARCH_LIB64 := $(SIM_DIR)/aarch64-linux/lib64
# CANN 8 keeps its aclnn operators in libopapi.so; libaclnn_ops_infer.so and
# libaclnn_math.so remain as names programs load (MindTorch requires them).
# Here they define nothing and depend on libopapi.so, so a symbol looked up
# through them resolves to libopapi.so's.
SIM_ACLNN_LEGACY := $(SIM_LIB64)/libaclnn_ops_infer.so $(SIM_LIB64)/libaclnn_math.so
SIM_ARCH_LIBS := $(addprefix $(SIM_ARCH_LIB64)/,libnnopbase.so libopapi.so libaclnn_ops_infer.so libaclnn_math.so)

$(SIM_LIB64)/libopapi.so: $(SIM_ACLNN_OBJS) $(SIM_IMPL)
	$(CC) $(SIM_SHARED) -Wl,-soname,libopapi.so -Wl,-z,nodelete -o $@ $(SIM_ACLNN_OBJS) -L$(SIM_LIB64) -laclsim \
	    -lm -Wl,-rpath,'$$ORIGIN'

$(SIM_ACLNN_LEGACY): $(SIM_LIB64)/libopapi.so
	$(CC) $(SIM_SHARED) -Wl,-soname,$(notdir $@) -o $@ -x c /dev/null -x none -L$(SIM_LIB64) \
	    -Wl,--no-as-needed -lopapi -Wl,-rpath,'$$ORIGIN'

# aarch64-linux/lib64 holds links to lib64's files, as on a CANN install.
$(SIM_ARCH_LIB64)/%.so: $(SIM_LIB64)/%.so
	@mkdir -p $(dir $@)
	ln -sf ../../lib64/$(notdir $<) $@

sim: $(SIM_ACLNN_LEGACY) $(SIM_ARCH_LIBS)

# Linked against the simulated libascendcl.so (not libaclsim.so) so that, as
# with the real pyACL, its aclrt* calls are resolved by the dynamic linker.
# No --no-undefined: the Python C API comes from the interpreter at load time.
$(SIM_PYACL): $(SIM_PYACL_OBJS) $(SIM_LIB64)/libascendcl.so
	@mkdir -p $(dir $@)
	$(CC) -shared $(SANFLAGS) $(LDFLAGS_BASE) -o $@ $(SIM_PYACL_OBJS) -L$(SIM_LIB64) -lascendcl \
	    -Wl,-rpath,'$$ORIGIN/../lib64:$$ORIGIN/../../lib64'

# ---- the rest of a CANN install's shape, so $(SIM_DIR) can stand in for
# /usr/local/Ascend/ascend-toolkit/latest (tools/aclsim/cann-root): pyACL under
# python/site-packages, an opp/ directory (the op model dir programs probe),
# and libraries programs load by name before libascendcl.so but need nothing
# from (libascend_protobuf.so, libplatform.so: empty here).
SIM_SITE_ACL := $(SIM_DIR)/python/site-packages/$(notdir $(SIM_PYACL))
SIM_PRELOADED := $(SIM_LIB64)/libascend_protobuf.so $(SIM_LIB64)/libplatform.so

$(SIM_SITE_ACL): $(SIM_PYACL)
	@mkdir -p $(dir $@)
	ln -sf ../$(notdir $<) $@

$(SIM_PRELOADED):
	@mkdir -p $(dir $@)
	$(CC) $(SIM_SHARED) -Wl,-soname,$(notdir $@) -o $@ -x c /dev/null

$(SIM_DIR)/opp:
	mkdir -p $@

sim: $(SIM_SITE_ACL) $(SIM_PRELOADED) $(SIM_DIR)/opp

-include $(SIM_IMPL_OBJS:.o=.d) $(SIM_PYACL_OBJS:.o=.d) $(SIM_OBJ)/forward/ascendcl/acl_forward.d \
         $(SIM_OBJ)/forward/acl_rt/acl_forward.d $(SIM_OBJ)/src/nnopbase/nnopbase.d $(SIM_ACLNN_OBJS:.o=.d)

# ---- the simulator's own C test, part of `make ctest` (and so of its ASan,
# TSan and aarch64 trees): streams destroyed while other threads submit to
# them (tools/aclsim/tests/stream_race.c). SIM_RACE_ROUNDS: calls per submitter.
# ASan is the build that sees a stream used after its free, and each race's
# window is a few instructions wide: with one part of d8a0e2e reverted at a
# time (a use outside the lock hold that resolved its stream: memset/copy,
# event, aclnn launch, destroy, synchronize; or a destroy not waiting for a
# synchronize), 5000 rounds caught 0, 1, 1, 0, 0 and 2 of 5 runs, 200,000
# caught 3 of 3 each (the destroy 4 of 4); 11 s on the ASan build.
SIM_RACE_ROUNDS ?= $(if $(findstring address,$(SANFLAGS)),200000,5000)
SIM_STREAM_RACE := $(BUILD)/ctest/aclsim/stream_race
SIM_STREAM_RACE_OBJ := $(SIM_OBJ)/tests/stream_race.o
$(SIM_STREAM_RACE): $(SIM_STREAM_RACE_OBJ) $(SIM_LIB64)/libascendcl.so $(SIM_LIB64)/libnnopbase.so \
                    $(SIM_LIB64)/libopapi.so
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) -o $@ $< -L$(SIM_LIB64) -lascendcl -lnnopbase -lopapi -Wl,-rpath,$(abspath $(SIM_LIB64)) \
	    $(SANFLAGS) $(LDFLAGS_BASE)

-include $(SIM_STREAM_RACE_OBJ:.o=.d)

sim-stream-race: $(SIM_STREAM_RACE)
	$(CTEST_RUNNER) $(SIM_STREAM_RACE) $(SIM_RACE_ROUNDS)

ctest: sim-stream-race
.PHONY: sim-stream-race
