/* The sim's libnnopbase.so: aclnn initialisation, the executor lifecycle
 * calls (forwarded to the shared executor registry in libaclsim.so) and the
 * tensor/scalar/array descriptors the aclnn operators take. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../aclnn/desc.h"
#include "../aclnn/dtype.h"
#include "../simrt.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT aclnnStatus aclnnInit(const char *configPath) { return simrt_nnInit(configPath); }
EXPORT aclnnStatus aclnnFinalize(void) { return simrt_nnFinalize(); }
EXPORT aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor)
{
    return simrt_SetExecutorRepeatable(executor);
}
EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) { return simrt_DestroyExecutor(executor); }

/* Destroying a descriptor twice is a double free on CANN: abort like one. */
static aclnnStatus destroy_desc(const void *desc, uint32_t magic, const char *api)
{
    if (desc == NULL)
        return ACLNN_SUCCESS;
    uint32_t *m = (uint32_t *)desc;
    if (*m != magic) {
        fprintf(stderr, "aclsim: %s: %p is not a live descriptor (double destroy?)\n", api, desc);
        abort();
    }
    *m = SIM_DEAD_MAGIC;
    free(m);
    return ACLNN_SUCCESS;
}

EXPORT aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                  const int64_t *stride, int64_t offset, aclFormat format,
                                  const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData)
{
    (void)storageDims, (void)storageDimsNum;
    if (viewDimsNum > SIM_MAX_DIMS || (viewDimsNum > 0 && viewDims == NULL) || sim_dtype_size(dataType) == 0)
        return NULL;
    aclTensor *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->magic = SIM_TENSOR_MAGIC;
    t->format = format;
    t->view.dtype = dataType;
    t->view.ndim = (uint32_t)viewDimsNum;
    t->view.offset = offset;
    t->view.data = tensorData;
    int64_t contiguous = 1;
    for (int k = (int)viewDimsNum - 1; k >= 0; k--) {
        t->view.dims[k] = viewDims[k];
        t->view.strides[k] = stride != NULL ? stride[k] : contiguous;
        contiguous *= viewDims[k];
    }
    return t;
}

EXPORT aclnnStatus aclDestroyTensor(const aclTensor *tensor)
{
    return destroy_desc(tensor, SIM_TENSOR_MAGIC, "aclDestroyTensor");
}

EXPORT aclScalar *aclCreateScalar(void *value, aclDataType dataType)
{
    if (value == NULL || sim_dtype_size(dataType) == 0)
        return NULL;
    aclScalar *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->magic = SIM_SCALAR_MAGIC;
    s->dtype = dataType;
    s->value = sim_load(dataType, value);
    return s;
}

EXPORT aclnnStatus aclDestroyScalar(const aclScalar *scalar)
{
    return destroy_desc(scalar, SIM_SCALAR_MAGIC, "aclDestroyScalar");
}

/* The array descriptors share one layout: magic, size, then the values. */
struct sim_array {
    uint32_t magic;
    uint64_t size;
    unsigned char values[];
};
_Static_assert(offsetof(struct sim_array, values) == offsetof(aclIntArray, values) &&
                   offsetof(struct sim_array, values) == offsetof(aclBoolArray, values) &&
                   offsetof(struct sim_array, values) == offsetof(aclTensorList, tensors),
               "array descriptors share struct sim_array's layout");

static void *new_array(uint32_t magic, const void *values, uint64_t size, size_t elem)
{
    if (values == NULL && size > 0)
        return NULL;
    struct sim_array *a = calloc(1, sizeof *a + size * elem);
    if (a == NULL)
        return NULL;
    a->magic = magic;
    a->size = size;
    if (size > 0)
        memcpy(a->values, values, size * elem);
    return a;
}

EXPORT aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size)
{
    return new_array(SIM_INTARRAY_MAGIC, value, size, sizeof(int64_t));
}

EXPORT aclnnStatus aclDestroyIntArray(const aclIntArray *array)
{
    return destroy_desc(array, SIM_INTARRAY_MAGIC, "aclDestroyIntArray");
}

EXPORT aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size)
{
    return new_array(SIM_BOOLARRAY_MAGIC, value, size, sizeof(bool));
}

EXPORT aclnnStatus aclDestroyBoolArray(const aclBoolArray *array)
{
    return destroy_desc(array, SIM_BOOLARRAY_MAGIC, "aclDestroyBoolArray");
}

/* The list takes ownership of the tensors (it destroys them). */
EXPORT aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size)
{
    return new_array(SIM_TENSORLIST_MAGIC, value, size, sizeof(aclTensor *));
}

EXPORT aclnnStatus aclDestroyTensorList(const aclTensorList *array)
{
    if (array != NULL && array->magic == SIM_TENSORLIST_MAGIC)
        for (uint64_t i = 0; i < array->size; i++)
            aclDestroyTensor(array->tensors[i]);
    return destroy_desc(array, SIM_TENSORLIST_MAGIC, "aclDestroyTensorList");
}
