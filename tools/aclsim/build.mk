# The simulated CANN runtime (`make sim`), laid out like $ASCEND_HOME_PATH so
# ASCEND_HOME_PATH=$(BUILD)/aclsim works:
#   lib64/libaclsim.so    the implementation: all state, aclsim_* introspection, simrt_* entry points
#   lib64/libascendcl.so  thin aclrt*/acl* forwarders to simrt_* ...
#   lib64/libacl_rt.so    ... the same source compiled a second time (CANN 8 exports both)
#   lib64/libnnopbase.so  aclnnInit/Finalize and the aclOpExecutor lifecycle
#   lib64/libopapi.so     the simulated two-phase aclnn ops
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

$(SIM_LIB64)/libopapi.so: $(SIM_OBJ)/src/opapi/sim_ops.o $(SIM_IMPL)
	$(CC) $(SIM_SHARED) -Wl,-soname,libopapi.so -Wl,-z,nodelete -o $@ $< -L$(SIM_LIB64) -laclsim \
	    -Wl,-rpath,'$$ORIGIN'

# Linked against the simulated libascendcl.so (not libaclsim.so) so that, as
# with the real pyACL, its aclrt* calls are resolved by the dynamic linker.
# No --no-undefined: the Python C API comes from the interpreter at load time.
$(SIM_PYACL): $(SIM_PYACL_OBJS) $(SIM_LIB64)/libascendcl.so
	@mkdir -p $(dir $@)
	$(CC) -shared $(SANFLAGS) $(LDFLAGS_BASE) -o $@ $(SIM_PYACL_OBJS) -L$(SIM_LIB64) -lascendcl \
	    -Wl,-rpath,'$$ORIGIN/../lib64'

-include $(SIM_IMPL_OBJS:.o=.d) $(SIM_PYACL_OBJS:.o=.d) $(SIM_OBJ)/forward/ascendcl/acl_forward.d \
         $(SIM_OBJ)/forward/acl_rt/acl_forward.d $(SIM_OBJ)/src/nnopbase/nnopbase.d $(SIM_OBJ)/src/opapi/sim_ops.d
