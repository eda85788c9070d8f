/* Layout of the sim's nnopbase descriptors, shared by libnnopbase.so (which
 * creates them) and libopapi.so (whose phase 1 copies what it needs out of
 * them, so a descriptor destroyed after phase 1 changes nothing, as on CANN). */
#ifndef ACLSIM_ACLNN_DESC_H
#define ACLSIM_ACLNN_DESC_H

#include <stdint.h>

#include "aclnn/aclnn_base.h"

#define SIM_MAX_DIMS 8
#define SIM_TENSOR_MAGIC 0x54656e73u /* live descriptors carry their kind's magic */
#define SIM_SCALAR_MAGIC 0x5363616cu
#define SIM_INTARRAY_MAGIC 0x496e7441u
#define SIM_BOOLARRAY_MAGIC 0x426f6f41u
#define SIM_TENSORLIST_MAGIC 0x544c6973u
#define SIM_DEAD_MAGIC 0xdeadd35cu

/* A strided view of device memory: element (i0..in) lives at
 * data + (offset + sum(ik * strides[k])) * itemsize. */
typedef struct sim_view {
    int32_t dtype;
    uint32_t ndim;
    int64_t dims[SIM_MAX_DIMS];
    int64_t strides[SIM_MAX_DIMS];
    int64_t offset;
    char *data;
} sim_view;

struct aclTensor {
    uint32_t magic;
    int32_t format;
    sim_view view;
};

struct aclScalar {
    uint32_t magic;
    int32_t dtype;
    double value;
};

struct aclIntArray {
    uint32_t magic;
    uint64_t size;
    int64_t values[];
};

struct aclBoolArray {
    uint32_t magic;
    uint64_t size;
    bool values[];
};

struct aclTensorList {
    uint32_t magic;
    uint64_t size;
    aclTensor *tensors[];
};

#endif
