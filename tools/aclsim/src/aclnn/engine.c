/* Building (phase 1) and running (on the stream worker) the sim's aclnn ops;
 * see engine.h. */
#define _GNU_SOURCE /* qsort_r */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>

#include "dtype.h"
#include "engine.h"

/* A live descriptor of the expected kind, or NULL: a destroyed or foreign
 * descriptor passed to an op is a use after free on CANN, so abort. */
static const void *live(const void *desc, uint32_t magic, const char *api)
{
    if (desc != NULL && *(const uint32_t *)desc != magic) {
        fprintf(stderr, "aclsim: %s: %p is not a live descriptor of the expected kind\n", api, desc);
        abort();
    }
    return desc;
}

static void fail(sim_op *op, aclnnStatus status)
{
    if (op->error == ACLNN_SUCCESS)
        op->error = status;
}

void sim_op_begin(sim_op *op, const sim_op_def *def)
{
    memset(op, 0, sizeof *op);
    op->def = def;
}

void sim_op_input(sim_op *op, const aclTensor *t)
{
    if (live(t, SIM_TENSOR_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    if (op->nin == SIM_OP_MAX_INPUTS)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->in[op->nin++] = t->view;
}

void sim_op_input_scalar(sim_op *op, const aclScalar *s)
{
    if (live(s, SIM_SCALAR_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    if (op->nin == SIM_OP_MAX_INPUTS)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->in_kind[op->nin] = SIM_IN_CONST;
    op->in_value[op->nin] = s->value;
    op->in[op->nin++] = (sim_view){.dtype = s->dtype};
}

void sim_op_input_optional(sim_op *op, const aclTensor *t, double fallback)
{
    if (t != NULL)
        return sim_op_input(op, t);
    if (op->nin == SIM_OP_MAX_INPUTS)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->in_kind[op->nin] = SIM_IN_CONST;
    op->in_value[op->nin] = fallback;
    op->in[op->nin++] = (sim_view){.dtype = ACL_DOUBLE};
}

void sim_op_input_index(sim_op *op, int64_t dim)
{
    if (op->nin == SIM_OP_MAX_INPUTS)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->in_kind[op->nin] = SIM_IN_INDEX;
    op->in_value[op->nin] = (double)dim; /* resolved against out's rank by the shape check */
    op->in[op->nin++] = (sim_view){.dtype = ACL_INT64};
}

void sim_op_input_flat_index(sim_op *op)
{
    if (op->nin == SIM_OP_MAX_INPUTS)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->in_kind[op->nin] = SIM_IN_FLAT_INDEX;
    op->in[op->nin++] = (sim_view){.dtype = ACL_INT64};
}

void sim_op_channel_input(sim_op *op, uint32_t i)
{
    sim_view *v = &op->in[i];
    if (op->error != ACLNN_SUCCESS || op->out.ndim < 2)
        return;
    if (v->ndim != 1)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    for (uint32_t k = 1; k < op->out.ndim - 1; k++)
        v->dims[k] = 1, v->strides[k] = 0;
    v->ndim = op->out.ndim - 1;
}

void sim_op_flip(sim_op *op, const aclIntArray *dims)
{
    if (op->nin != 1 || live(dims, SIM_INTARRAY_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    sim_view *v = &op->in[0];
    uint32_t flipped = 0;
    for (uint64_t i = 0; i < dims->size; i++) {
        int64_t d = dims->values[i] < 0 ? dims->values[i] + v->ndim : dims->values[i];
        if (d < 0 || d >= (int64_t)v->ndim || (flipped >> d) & 1)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        flipped |= 1u << d;
        v->offset += v->strides[d] * (v->dims[d] - 1);
        v->strides[d] = -v->strides[d];
    }
}

void sim_op_param(sim_op *op, int i, double value) { op->p[i] = value; }

void sim_op_param_scalar(sim_op *op, int i, const aclScalar *s)
{
    if (live(s, SIM_SCALAR_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    op->p[i] = s->value;
}

void sim_op_param_optional(sim_op *op, int i, const aclScalar *s, double fallback)
{
    if (s == NULL)
        op->p[i] = fallback;
    else
        sim_op_param_scalar(op, i, s);
}

void sim_op_output(sim_op *op, const aclTensor *t)
{
    if (live(t, SIM_TENSOR_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    op->out = t->view;
}

void sim_op_extra_output(sim_op *op, int i, const aclTensor *t)
{
    if (live(t, SIM_TENSOR_MAGIC, op->def->kind.name) != NULL)
        op->extra_out[i] = t->view;
}

void sim_op_layer_norm(sim_op *op, const aclIntArray *normalized_shape, double eps)
{
    if (live(normalized_shape, SIM_INTARRAY_MAGIC, op->def->kind.name) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    const sim_view *in = &op->in[0];
    uint64_t k = normalized_shape->size;
    if (op->nin != 3 || k == 0 || k > in->ndim)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    for (uint64_t j = 0; j < k; j++)
        if (normalized_shape->values[j] != in->dims[in->ndim - k + j])
            return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->p[0] = eps;
    op->p[1] = (double)k;
}

void sim_op_reduce_dims(sim_op *op, const aclIntArray *dims, int keepdim)
{
    uint32_t ndim = op->nin > 0 ? op->in[0].ndim : 0;
    op->p[0] = keepdim;
    if (live(dims, SIM_INTARRAY_MAGIC, op->def->kind.name) == NULL || dims->size == 0) {
        op->reduce_mask = (1u << ndim) - 1;
        return;
    }
    for (uint64_t i = 0; i < dims->size; i++) {
        int64_t d = dims->values[i] < 0 ? dims->values[i] + ndim : dims->values[i];
        if (d < 0 || d >= (int64_t)ndim)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        op->reduce_mask |= 1u << d;
    }
}

static int64_t normalize_dim(int64_t dim, uint32_t ndim)
{
    return dim < 0 ? dim + (int64_t)ndim : dim;
}

void sim_op_softmax_dim(sim_op *op, int64_t dim)
{
    dim = normalize_dim(dim, op->in[0].ndim);
    if (op->nin != 1 || dim < 0 || dim >= (int64_t)op->in[0].ndim)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->p[0] = (double)dim;
}

void sim_op_gather(sim_op *op, int64_t dim, int embedding)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    sim_view *self = &op->in[0], *index = &op->in[1], *out = &op->out;
    dim = normalize_dim(dim, self->ndim);
    if (op->nin != 2 || dim < 0 || dim >= (int64_t)self->ndim || sim_dtype_is_float(index->dtype))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->gather_stride = self->strides[dim];
    op->gather_size = self->dims[dim];
    if (embedding) {
        /* out = index dims + [cols]: the index repeats along cols, the table walks cols */
        if (self->ndim != 2 || out->ndim != index->ndim + 1 || out->ndim > SIM_MAX_DIMS ||
            out->dims[index->ndim] != self->dims[1])
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        for (uint32_t k = 0; k < index->ndim; k++) {
            if (out->dims[k] != index->dims[k])
                return fail(op, ACLNN_ERR_PARAM_INVALID);
            op->gather_walk[k] = 0;
        }
        op->gather_walk[index->ndim] = self->strides[1];
        index->dims[index->ndim] = out->dims[index->ndim];
        index->strides[index->ndim] = 0;
        index->ndim++;
        return;
    }
    if (index->ndim != self->ndim || out->ndim != index->ndim)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    for (uint32_t k = 0; k < out->ndim; k++) {
        if (out->dims[k] != index->dims[k] || ((int64_t)k != dim && index->dims[k] > self->dims[k]))
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        op->gather_walk[k] = (int64_t)k == dim ? 0 : self->strides[k];
    }
}

static int64_t numel(const sim_view *v)
{
    int64_t n = 1;
    for (uint32_t k = 0; k < v->ndim; k++)
        n *= v->dims[k];
    return n;
}

/* v with a size-1 dim inserted at `dim` (stride 0); 0 when it has no room. */
static int insert_dim(sim_view *v, uint32_t dim)
{
    if (v->ndim >= SIM_MAX_DIMS || dim > v->ndim)
        return 0;
    memmove(&v->dims[dim + 1], &v->dims[dim], (v->ndim - dim) * sizeof(int64_t));
    memmove(&v->strides[dim + 1], &v->strides[dim], (v->ndim - dim) * sizeof(int64_t));
    v->dims[dim] = 1, v->strides[dim] = 0, v->ndim++;
    return 1;
}

static int same_dims(const sim_view *a, const sim_view *b)
{
    return a->ndim == b->ndim && memcmp(a->dims, b->dims, a->ndim * sizeof(int64_t)) == 0;
}

void sim_op_select(sim_op *op, int64_t dim, int64_t k, int largest, int dim_dropped)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    const sim_view *in = &op->in[0];
    sim_view *values = &op->out, *indices = &op->extra_out[0];
    if (indices->data == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    dim = normalize_dim(dim, in->ndim);
    if (op->nin == 1 && dim >= 0 && dim < (int64_t)in->ndim && k == SIM_SELECT_WHOLE_LINE)
        k = in->dims[dim];
    if (op->nin != 1 || dim < 0 || dim >= (int64_t)in->ndim || k < 0 || k > in->dims[dim] ||
        sim_dtype_is_float(indices->dtype))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    if (dim_dropped && (!insert_dim(values, (uint32_t)dim) || !insert_dim(indices, (uint32_t)dim)))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    if (values->ndim != in->ndim || indices->ndim != in->ndim)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    for (uint32_t d = 0; d < in->ndim; d++) {
        int64_t want = (int64_t)d == dim ? k : in->dims[d];
        if (values->dims[d] != want || indices->dims[d] != want)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
    }
    op->p[0] = (double)dim;
    op->p[1] = (double)k;
    op->p[2] = largest;
}

void sim_op_batch_norm(sim_op *op, const aclTensor *weight, const aclTensor *bias, const aclTensor *running_mean,
                       const aclTensor *running_var, int training, double momentum, double eps)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    const sim_view *in = &op->in[0];
    const aclTensor *channel[4] = {weight, bias, running_mean, running_var};
    if (op->nin != 1 || in->ndim < 2 || !same_dims(in, &op->out))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    if (!training && (running_mean == NULL || running_var == NULL))
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    for (int i = 0; i < 4; i++) {
        if (live(channel[i], SIM_TENSOR_MAGIC, op->def->kind.name) == NULL)
            continue;
        const sim_view *v = &channel[i]->view;
        if (v->ndim != 1 || v->dims[0] != in->dims[1])
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        op->channel[i] = *v;
    }
    for (int j = 0; j < 2; j++)
        if (op->extra_out[j].data != NULL && numel(&op->extra_out[j]) != in->dims[1])
            return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->p[0] = eps;
    op->p[1] = momentum;
    op->p[2] = training;
}

static int broadcast_strides(const sim_view *in, const sim_view *out, uint32_t ndim, int64_t *eff);

void sim_op_compact(sim_op *op)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    const sim_view *in = &op->in[0], *out = &op->out;
    int64_t eff[SIM_MAX_DIMS];
    if (op->def->variant == SIM_COMPACT_NONZERO) {
        /* out: (rows, in's rank) of int, rows enough for every element */
        if (op->nin != 1 || out->ndim != 2 || out->dims[0] < numel(in) || out->dims[1] != (int64_t)in->ndim ||
            sim_dtype_is_float(out->dtype))
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        return;
    }
    /* MaskedSelect: the mask broadcasts to self; out 1-D, room for every element */
    if (op->nin != 2 || !broadcast_strides(&op->in[1], in, in->ndim, eff) || out->ndim != 1 ||
        out->dims[0] < numel(in))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
}

void sim_op_scatter(sim_op *op, int64_t dim, int64_t reduce)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    const sim_view *self = &op->in[0], *index = &op->in[1], *src = &op->in[2];
    dim = normalize_dim(dim, self->ndim);
    if (op->nin != 3 || dim < 0 || dim >= (int64_t)self->ndim || reduce < 0 || reduce > 2 ||
        !same_dims(self, &op->out) || index->ndim != self->ndim || src->ndim != self->ndim ||
        sim_dtype_is_float(index->dtype))
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    for (uint32_t k = 0; k < self->ndim; k++)
        if (index->dims[k] > src->dims[k] || ((int64_t)k != dim && index->dims[k] > self->dims[k]))
            return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->p[0] = (double)dim;
    op->p[1] = (double)reduce;
}

void sim_op_remap(sim_op *op, const aclIntArray *a, const aclIntArray *b, int64_t n, int64_t dim, double fill)
{
    if (op->error != ACLNN_SUCCESS)
        return;
    const sim_view *in = &op->in[0], *out = &op->out;
    const char *api = op->def->kind.name;
    int variant = op->def->variant;
    if (op->nin != 1)
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    op->p[0] = fill;
    if (variant != SIM_REMAP_DIAG && variant != SIM_REMAP_INTERLEAVE && live(a, SIM_INTARRAY_MAGIC, api) == NULL)
        return fail(op, ACLNN_ERR_PARAM_NULLPTR);
    switch (variant) {
    case SIM_REMAP_ROLL:
        if (live(b, SIM_INTARRAY_MAGIC, api) == NULL)
            return fail(op, ACLNN_ERR_PARAM_NULLPTR);
        if (!same_dims(in, out))
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        if (b->size == 0) { /* over the flattened tensor */
            if (a->size != 1)
                return fail(op, ACLNN_ERR_PARAM_INVALID);
            op->p[1] = 1;
            op->p[2] = (double)a->values[0];
            return;
        }
        if (a->size != b->size)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        for (uint64_t i = 0; i < b->size; i++) {
            int64_t d = normalize_dim(b->values[i], in->ndim);
            if (d < 0 || d >= (int64_t)in->ndim)
                return fail(op, ACLNN_ERR_PARAM_INVALID);
            op->remap_offset[d] += a->values[i];
        }
        return;
    case SIM_REMAP_REPEAT: {
        if (a->size < in->ndim || a->size != out->ndim)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        uint32_t lead = out->ndim - in->ndim;
        for (uint32_t d = 0; d < out->ndim; d++) {
            int64_t base = d < lead ? 1 : in->dims[d - lead];
            if (a->values[d] < 0 || out->dims[d] != base * a->values[d])
                return fail(op, ACLNN_ERR_PARAM_INVALID);
        }
        return;
    }
    case SIM_REMAP_PAD:
        /* pairs from the last dim backwards; a negative pad crops */
        if (a->size % 2 != 0 || a->size > 2 * (uint64_t)in->ndim || out->ndim != in->ndim)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        for (uint32_t d = 0; d < in->ndim; d++) {
            uint64_t pair = in->ndim - 1 - d;
            int64_t lo = 2 * pair < a->size ? a->values[2 * pair] : 0;
            int64_t hi = 2 * pair < a->size ? a->values[2 * pair + 1] : 0;
            if (out->dims[d] != in->dims[d] + lo + hi)
                return fail(op, ACLNN_ERR_PARAM_INVALID);
            op->remap_offset[d] = lo;
        }
        return;
    case SIM_REMAP_INTERLEAVE: {
        /* out = in with each element repeated n times along dim (p[2] = -1: the
         * flattened in, out 1-D) */
        op->p[1] = (double)n;
        if (n < 0)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        if (dim == SIM_REMAP_FLAT) {
            op->p[2] = -1;
            if (out->ndim != 1 || out->dims[0] != numel(in) * n)
                return fail(op, ACLNN_ERR_PARAM_INVALID);
            return;
        }
        dim = normalize_dim(dim, in->ndim);
        if (dim < 0 || dim >= (int64_t)in->ndim || out->ndim != in->ndim)
            return fail(op, ACLNN_ERR_PARAM_INVALID);
        op->p[2] = (double)dim;
        for (uint32_t k = 0; k < in->ndim; k++)
            if (out->dims[k] != ((int64_t)k == dim ? in->dims[k] * n : in->dims[k]))
                return fail(op, ACLNN_ERR_PARAM_INVALID);
        return;
    }
    case SIM_REMAP_DIAG: {
        int64_t d = n, ad = d < 0 ? -d : d;
        op->p[1] = (double)d;
        if (in->ndim == 1 && out->ndim == 2 && out->dims[0] == in->dims[0] + ad && out->dims[1] == out->dims[0])
            return;
        if (in->ndim == 2 && out->ndim == 1) {
            int64_t rows = in->dims[0], cols = in->dims[1];
            int64_t len = d >= 0 ? (rows < cols - d ? rows : cols - d) : (rows + d < cols ? rows + d : cols);
            if (out->dims[0] == (len > 0 ? len : 0))
                return;
        }
        return fail(op, ACLNN_ERR_PARAM_INVALID);
    }
    default: return fail(op, ACLNN_ERR_PARAM_INVALID);
    }
}

/* Strides (elements) that walk `in` along out's dims: right-aligned
 * broadcasting, a size-1 or missing dim repeats (stride 0). 0 if `in` does
 * not broadcast to `out`'s first `ndim` dims. */
static int broadcast_strides(const sim_view *in, const sim_view *out, uint32_t ndim, int64_t *eff)
{
    if (in->ndim > ndim)
        return 0;
    uint32_t lead = ndim - in->ndim;
    for (uint32_t k = 0; k < ndim; k++) {
        eff[k] = 0;
        if (k < lead)
            continue;
        int64_t d = in->dims[k - lead];
        if (d != 1 && d != out->dims[k])
            return 0;
        if (d != 1)
            eff[k] = in->strides[k - lead];
    }
    return 1;
}

static aclnnStatus check_elementwise(sim_op *op)
{
    int64_t eff[SIM_MAX_DIMS];
    for (uint32_t i = 0; i < op->nin; i++) {
        if (op->in_kind[i] == SIM_IN_TENSOR && !broadcast_strides(&op->in[i], &op->out, op->out.ndim, eff))
            return ACLNN_ERR_PARAM_INVALID;
        if (op->in_kind[i] == SIM_IN_INDEX) {
            int64_t d = (int64_t)op->in_value[i];
            d = d < 0 ? d + (int64_t)op->out.ndim : d;
            if (d < 0 || d >= (int64_t)op->out.ndim)
                return ACLNN_ERR_PARAM_INVALID;
            op->in_value[i] = (double)d;
        }
    }
    return ACLNN_SUCCESS;
}

static aclnnStatus check_reduce(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    int keepdim = op->p[0] != 0;
    uint32_t o = 0;
    for (uint32_t k = 0; k < in->ndim; k++) {
        int reduced = (op->reduce_mask >> k) & 1;
        if (reduced && !keepdim)
            continue;
        if (o >= out->ndim || out->dims[o] != (reduced ? 1 : in->dims[k]))
            return ACLNN_ERR_PARAM_INVALID;
        o++;
    }
    /* torch's sum over every dim of a tensor gives a 0-d or a [1] tensor. */
    return o == out->ndim || (o == 0 && numel(out) == 1) ? ACLNN_SUCCESS : ACLNN_ERR_PARAM_INVALID;
}

static aclnnStatus check_matmul(const sim_op *op)
{
    const sim_view *a = &op->in[0], *b = &op->in[1], *out = &op->out;
    if (a->ndim < 2 || b->ndim < 2 || out->ndim < 2)
        return ACLNN_ERR_PARAM_INVALID;
    uint32_t batch = out->ndim - 2;
    int64_t eff[SIM_MAX_DIMS];
    if (a->dims[a->ndim - 1] != b->dims[b->ndim - 2] || a->dims[a->ndim - 2] != out->dims[batch] ||
        b->dims[b->ndim - 1] != out->dims[batch + 1])
        return ACLNN_ERR_PARAM_INVALID;
    sim_view a_batch = *a, b_batch = *b;
    a_batch.ndim -= 2, b_batch.ndim -= 2;
    if (!broadcast_strides(&a_batch, out, batch, eff) || !broadcast_strides(&b_batch, out, batch, eff))
        return ACLNN_ERR_PARAM_INVALID;
    if (op->nin == 3 && !broadcast_strides(&op->in[2], out, out->ndim, eff))
        return ACLNN_ERR_PARAM_INVALID;
    return ACLNN_SUCCESS;
}

aclnnStatus sim_op_create(sim_op *op, uint64_t *workspaceSize, aclOpExecutor **executor)
{
    if (workspaceSize == NULL || executor == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    if (op->error != ACLNN_SUCCESS)
        return op->error;
    if (op->out.ndim > SIM_MAX_DIMS || sim_dtype_size(op->out.dtype) == 0)
        return ACLNN_ERR_PARAM_INVALID;
    aclnnStatus st;
    uint64_t ws = 0;
    switch (op->def->shape) {
    case SIM_ELEMENTWISE: st = check_elementwise(op); break;
    case SIM_REDUCE:
        st = op->nin == 1 ? check_reduce(op) : ACLNN_ERR_PARAM_INVALID;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_MATMUL:
        st = op->nin >= 2 ? check_matmul(op) : ACLNN_ERR_PARAM_INVALID;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_SOFTMAX:
    case SIM_SCAN:
        st = op->in[0].ndim == op->out.ndim && memcmp(op->in[0].dims, op->out.dims, op->out.ndim * sizeof(int64_t)) == 0
                 ? ACLNN_SUCCESS : ACLNN_ERR_PARAM_INVALID;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_GATHER: st = ACLNN_SUCCESS; break; /* checked by sim_op_gather */
    case SIM_SELECT: /* checked by sim_op_select */
        st = ACLNN_SUCCESS;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_REMAP: st = ACLNN_SUCCESS; break; /* checked by sim_op_remap */
    case SIM_COMPACT: /* checked by sim_op_compact */
    case SIM_SCATTER: /* checked by sim_op_scatter */
        st = ACLNN_SUCCESS;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_BATCH_NORM: /* checked by sim_op_batch_norm */
        st = ACLNN_SUCCESS;
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    case SIM_LAYER_NORM:
        st = check_elementwise(op); /* weight and bias broadcast over out's trailing dims */
        ws = SIM_OP_SCRATCH_WORKSPACE;
        break;
    default: st = ACLNN_ERR_PARAM_INVALID;
    }
    if (st != ACLNN_SUCCESS)
        return st;
    *workspaceSize = ws;
    return simrt_CreateExecutor(&op->def->kind, op, sizeof *op, ws, executor);
}

/* ---- execution (stream worker, runtime lock held inside compute) ---- */

static char *element(const sim_view *v, int64_t index)
{
    return v->data + (v->offset + index) * (int64_t)sim_dtype_size(v->dtype);
}

/* The bytes a view can touch: from its lowest to its highest element. */
static simrt_range extent(const sim_view *v)
{
    if (numel(v) == 0)
        return (simrt_range){v->data, 0};
    int64_t lo = 0, hi = 0;
    for (uint32_t k = 0; k < v->ndim; k++) {
        int64_t span = v->strides[k] * (v->dims[k] - 1);
        if (span < 0)
            lo += span;
        else
            hi += span;
    }
    char *first = element(v, lo);
    return (simrt_range){first, (size_t)(element(v, hi) - first) + sim_dtype_size(v->dtype)};
}

/* Walks every index of `dims` (ndim of them) in row-major order, keeping n
 * running offsets, offs[i] = sum(index[k] * strides[i][k]). */
typedef struct walker {
    uint32_t ndim, n;
    const int64_t *dims;
    int64_t (*strides)[SIM_MAX_DIMS];
    int64_t index[SIM_MAX_DIMS];
    int64_t offs[SIM_OP_MAX_INPUTS + 2];
} walker;

static void walk_start(walker *w, uint32_t ndim, const int64_t *dims, uint32_t n, int64_t (*strides)[SIM_MAX_DIMS])
{
    *w = (walker){.ndim = ndim, .n = n, .dims = dims, .strides = strides};
}

static void walk_next(walker *w)
{
    for (int k = (int)w->ndim - 1; k >= 0; k--) {
        if (++w->index[k] < w->dims[k]) {
            for (uint32_t i = 0; i < w->n; i++)
                w->offs[i] += w->strides[i][k];
            return;
        }
        for (uint32_t i = 0; i < w->n; i++)
            w->offs[i] -= w->strides[i][k] * (w->dims[k] - 1);
        w->index[k] = 0;
    }
}

static void run_elementwise(const sim_op *op)
{
    int64_t strides[SIM_OP_MAX_INPUTS + 1][SIM_MAX_DIMS];
    uint32_t n = op->nin;
    for (uint32_t i = 0; i < n; i++)
        if (op->in_kind[i] == SIM_IN_TENSOR)
            broadcast_strides(&op->in[i], &op->out, op->out.ndim, strides[i]);
        else
            memset(strides[i], 0, sizeof strides[i]);
    memcpy(strides[n], op->out.strides, sizeof strides[n]);
    walker w;
    walk_start(&w, op->out.ndim, op->out.dims, n + 1, strides);
    double x[SIM_OP_MAX_INPUTS];
    /* Inputs are all read before the output is written, so in-place ops
     * (out aliasing an input element for element) are safe. */
    int64_t total = numel(&op->out);
    for (int64_t e = total; e > 0; e--, walk_next(&w)) {
        for (uint32_t i = 0; i < n; i++)
            x[i] = op->in_kind[i] == SIM_IN_TENSOR ? sim_load(op->in[i].dtype, element(&op->in[i], w.offs[i]))
                   : op->in_kind[i] == SIM_IN_CONST ? op->in_value[i]
                   : op->in_kind[i] == SIM_IN_INDEX ? (double)w.index[(int)op->in_value[i]]
                                                     : (double)(total - e);
        sim_store(op->out.dtype, element(&op->out, w.offs[n]), op->def->fn(x, op->p));
    }
}

static int64_t contiguous_strides(const sim_view *v, int64_t *strides)
{
    int64_t n = 1;
    for (int k = (int)v->ndim - 1; k >= 0; k--) {
        strides[k] = n;
        n *= v->dims[k];
    }
    return n;
}

static void run_reduce(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    int keepdim = op->p[0] != 0;
    int64_t out_lin[SIM_MAX_DIMS], strides[2][SIM_MAX_DIMS];
    int64_t out_count = contiguous_strides(out, out_lin);
    /* strides[0]: through the input; strides[1]: to the output's accumulator. */
    uint32_t o = 0;
    int64_t reduced = 1;
    for (uint32_t k = 0; k < in->ndim; k++) {
        strides[0][k] = in->strides[k];
        int r = (op->reduce_mask >> k) & 1;
        strides[1][k] = r ? 0 : out_lin[o];
        if (r)
            reduced *= in->dims[k];
        if (!r || keepdim)
            o++;
    }
    double *acc = calloc((size_t)out_count, sizeof *acc);
    if (acc == NULL)
        return;
    walker w;
    walk_start(&w, in->ndim, in->dims, 2, strides);
    for (int64_t e = numel(in); e > 0; e--, walk_next(&w))
        acc[w.offs[1]] += sim_load(in->dtype, element(in, w.offs[0]));
    walk_start(&w, out->ndim, out->dims, 1, (int64_t(*)[SIM_MAX_DIMS])out->strides);
    for (int64_t e = 0; e < out_count; e++, walk_next(&w))
        sim_store(out->dtype, element(out, w.offs[0]), op->def->variant ? acc[e] / (double)reduced : acc[e]);
    free(acc);
}

/* out[..., i, j] = p[1] * in2[..., i, j] + p[0] * sum_k in0[..., i, k] * in1[..., k, j]
 * (p[0] = alpha, p[1] = beta; plain matmul has no in2). */
static void run_matmul(const sim_op *op)
{
    const sim_view *a = &op->in[0], *b = &op->in[1], *out = &op->out;
    uint32_t nd = out->ndim, batch = nd - 2;
    int64_t strides[4][SIM_MAX_DIMS];
    sim_view a_batch = *a, b_batch = *b;
    a_batch.ndim -= 2, b_batch.ndim -= 2;
    broadcast_strides(&a_batch, out, batch, strides[0]);
    broadcast_strides(&b_batch, out, batch, strides[1]);
    strides[0][batch] = a->strides[a->ndim - 2], strides[0][batch + 1] = 0;
    strides[1][batch] = 0, strides[1][batch + 1] = b->strides[b->ndim - 1];
    memcpy(strides[2], out->strides, sizeof strides[2]);
    int bias = op->nin == 3;
    if (bias)
        broadcast_strides(&op->in[2], out, nd, strides[3]);
    int64_t K = a->dims[a->ndim - 1], ak = a->strides[a->ndim - 1], bk = b->strides[b->ndim - 2];
    walker w;
    walk_start(&w, nd, out->dims, bias ? 4 : 3, strides);
    for (int64_t e = numel(out); e > 0; e--, walk_next(&w)) {
        double sum = 0;
        for (int64_t k = 0; k < K; k++)
            sum += sim_load(a->dtype, element(a, w.offs[0] + k * ak)) *
                   sim_load(b->dtype, element(b, w.offs[1] + k * bk));
        double v = op->p[0] * sum;
        if (bias)
            v += op->p[1] * sim_load(op->in[2].dtype, element(&op->in[2], w.offs[3]));
        sim_store(out->dtype, element(out, w.offs[2]), v);
    }
}

/* Calls line(op, base) for every line of in0 along dim p[0], base = the
 * line's first element in in0, in out and in extra_out[0] (same dims but
 * along dim); a line's elements are strides[dim] apart in each. */
static void for_each_line(const sim_op *op, void (*line)(const sim_op *op, const int64_t *base))
{
    const sim_view *in = &op->in[0];
    uint32_t dim = (uint32_t)op->p[0];
    int64_t line_dims[SIM_MAX_DIMS], strides[3][SIM_MAX_DIMS];
    memcpy(line_dims, in->dims, sizeof line_dims);
    line_dims[dim] = 1;
    memcpy(strides[0], in->strides, sizeof strides[0]);
    memcpy(strides[1], op->out.strides, sizeof strides[1]);
    memcpy(strides[2], op->extra_out[0].strides, sizeof strides[2]);
    int64_t n = in->dims[dim];
    walker w;
    walk_start(&w, in->ndim, line_dims, 3, strides);
    for (int64_t r = n > 0 ? numel(in) / n : 0; r > 0; r--, walk_next(&w))
        line(op, w.offs);
}

/* out = exp(x - max) / sum along the line, or its log */
static void softmax_line(const sim_op *op, const int64_t *base)
{
    int64_t ib = base[0], ob = base[1];
    const sim_view *in = &op->in[0], *out = &op->out;
    uint32_t dim = (uint32_t)op->p[0];
    int64_t n = in->dims[dim], si = in->strides[dim], so = out->strides[dim];
    double max = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; i++)
        max = fmax(max, sim_load(in->dtype, element(in, ib + i * si)));
    for (int64_t i = 0; i < n; i++)
        sum += exp(sim_load(in->dtype, element(in, ib + i * si)) - max);
    for (int64_t i = 0; i < n; i++) {
        double shifted = sim_load(in->dtype, element(in, ib + i * si)) - max;
        sim_store(out->dtype, element(out, ob + i * so), op->def->variant ? shifted - log(sum) : exp(shifted) / sum);
    }
}

/* running sum (or product) along the line */
static void scan_line(const sim_op *op, const int64_t *base)
{
    int64_t ib = base[0], ob = base[1];
    const sim_view *in = &op->in[0], *out = &op->out;
    uint32_t dim = (uint32_t)op->p[0];
    int64_t n = in->dims[dim], si = in->strides[dim], so = out->strides[dim];
    double acc = op->def->variant ? 1 : 0;
    for (int64_t i = 0; i < n; i++) {
        double v = sim_load(in->dtype, element(in, ib + i * si));
        acc = op->def->variant ? acc * v : acc + v;
        sim_store(out->dtype, element(out, ob + i * so), acc);
    }
}

typedef struct ranked {
    double value;
    int64_t index;
} ranked;

/* Ascending (descending when *largest), NaN above every number as in torch;
 * ties in index order, so MaxDim/MinDim give the first of equal values. */
static int compare_ranked(const void *x, const void *y, void *largest)
{
    const ranked *a = x, *b = y;
    int a_nan = isnan(a->value) != 0, b_nan = isnan(b->value) != 0;
    int order = a_nan || b_nan ? a_nan - b_nan : (a->value > b->value) - (a->value < b->value);
    if (*(const int *)largest)
        order = -order;
    return order != 0 ? order : (a->index > b->index) - (a->index < b->index);
}

/* the line's p[1] largest (p[2] != 0) or smallest values, sorted, and their indices */
static void topk_line(const sim_op *op, const int64_t *base)
{
    const sim_view *in = &op->in[0], *out = &op->out, *indices = &op->extra_out[0];
    uint32_t dim = (uint32_t)op->p[0];
    int64_t n = in->dims[dim], k = (int64_t)op->p[1];
    int largest = op->p[2] != 0;
    ranked *line = malloc((size_t)n * sizeof *line);
    if (line == NULL)
        return;
    for (int64_t i = 0; i < n; i++)
        line[i] = (ranked){sim_load(in->dtype, element(in, base[0] + i * in->strides[dim])), i};
    qsort_r(line, (size_t)n, sizeof *line, compare_ranked, &largest);
    for (int64_t i = 0; i < k; i++) {
        sim_store(out->dtype, element(out, base[1] + i * out->strides[dim]), line[i].value);
        sim_store(indices->dtype, element(indices, base[2] + i * indices->strides[dim]), (double)line[i].index);
    }
    free(line);
}

/* running max and the index it came from: a later equal value, or a NaN
 * (which then stays), takes over, as in torch */
static void cummax_line(const sim_op *op, const int64_t *base)
{
    const sim_view *in = &op->in[0], *out = &op->out, *indices = &op->extra_out[0];
    uint32_t dim = (uint32_t)op->p[0];
    double best = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < in->dims[dim]; i++) {
        double v = sim_load(in->dtype, element(in, base[0] + i * in->strides[dim]));
        if (i == 0 || isnan(v) || (!isnan(best) && v >= best))
            best = v, at = i;
        sim_store(out->dtype, element(out, base[1] + i * out->strides[dim]), best);
        sim_store(indices->dtype, element(indices, base[2] + i * indices->strides[dim]), (double)at);
    }
}

static int64_t wrap(int64_t i, int64_t n) { return n > 0 ? ((i % n) + n) % n : 0; }

/* in0's element offset for out's index o; 0 where out takes the fill p[0]. */
static int remap_source(const sim_op *op, const int64_t *o, int64_t *offset)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    int64_t at[SIM_MAX_DIMS] = {0};
    int64_t d = (int64_t)op->p[1];
    switch (op->def->variant) {
    case SIM_REMAP_ROLL:
        if (op->p[1] != 0) { /* flattened: the row-major index moves by the shift */
            int64_t flat = 0;
            for (uint32_t k = 0; k < out->ndim; k++)
                flat = flat * out->dims[k] + o[k];
            flat = wrap(flat - (int64_t)op->p[2], numel(in));
            for (int k = (int)in->ndim - 1; k >= 0; k--)
                at[k] = flat % in->dims[k], flat /= in->dims[k];
        } else {
            for (uint32_t k = 0; k < in->ndim; k++)
                at[k] = wrap(o[k] - op->remap_offset[k], in->dims[k]);
        }
        break;
    case SIM_REMAP_REPEAT:
        for (uint32_t k = 0, lead = out->ndim - in->ndim; k < in->ndim; k++)
            at[k] = o[k + lead] % in->dims[k];
        break;
    case SIM_REMAP_PAD:
        for (uint32_t k = 0; k < in->ndim; k++) {
            at[k] = o[k] - op->remap_offset[k];
            if (at[k] < 0 || at[k] >= in->dims[k])
                return 0;
        }
        break;
    case SIM_REMAP_INTERLEAVE:
        if (op->p[2] < 0) { /* flattened: out[i] = the (i / n)th element of in, row-major */
            int64_t flat = o[0] / (int64_t)op->p[1];
            for (int k = (int)in->ndim - 1; k >= 0; k--)
                at[k] = flat % in->dims[k], flat /= in->dims[k];
        } else {
            for (uint32_t k = 0; k < in->ndim; k++)
                at[k] = (int64_t)k == (int64_t)op->p[2] ? o[k] / (int64_t)op->p[1] : o[k];
        }
        break;
    case SIM_REMAP_DIAG:
        if (in->ndim == 1) { /* out[r][c] = in[min(r, c)] on the diagonal c - r = d */
            if (o[1] - o[0] != d)
                return 0;
            at[0] = d >= 0 ? o[0] : o[1];
        } else {
            at[0] = d >= 0 ? o[0] : o[0] - d;
            at[1] = d >= 0 ? o[0] + d : o[0];
        }
        break;
    default: return 0;
    }
    *offset = 0;
    for (uint32_t k = 0; k < in->ndim; k++)
        *offset += at[k] * in->strides[k];
    return 1;
}

static void run_remap(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    walker w;
    walk_start(&w, out->ndim, out->dims, 1, (int64_t(*)[SIM_MAX_DIMS])out->strides);
    for (int64_t e = numel(out); e > 0; e--, walk_next(&w)) {
        int64_t from;
        double v = remap_source(op, w.index, &from) ? sim_load(in->dtype, element(in, from)) : op->p[0];
        sim_store(out->dtype, element(out, w.offs[0]), v);
    }
}

static double channel_at(const sim_view *v, int64_t c, double absent)
{
    return v->data != NULL ? sim_load(v->dtype, element(v, c * v->strides[0])) : absent;
}

static void channel_store(const sim_view *v, int64_t c, double value)
{
    if (v->data != NULL)
        sim_store(v->dtype, element(v, c * (v->ndim > 0 ? v->strides[v->ndim - 1] : 0)), value);
}

/* Per channel c (dim 1): the elements of in with that channel, walked with
 * dim 1 held at c. Training: the batch's mean and biased variance normalise,
 * the running stats move by momentum (variance unbiased, as torch); eval: the
 * running stats normalise. */
static void run_batch_norm(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    const sim_view *weight = &op->channel[0], *bias = &op->channel[1], *rmean = &op->channel[2],
                   *rvar = &op->channel[3];
    double eps = op->p[0], momentum = op->p[1];
    int training = op->p[2] != 0;
    int64_t dims[SIM_MAX_DIMS], strides[2][SIM_MAX_DIMS];
    memcpy(dims, in->dims, sizeof dims);
    dims[1] = 1;
    memcpy(strides[0], in->strides, sizeof strides[0]);
    memcpy(strides[1], out->strides, sizeof strides[1]);
    int64_t count = in->dims[1] > 0 ? numel(in) / in->dims[1] : 0;
    for (int64_t c = 0; c < in->dims[1]; c++) {
        int64_t ib = c * in->strides[1], ob = c * out->strides[1];
        walker w;
        double mean, var;
        if (training) {
            double sum = 0, sq = 0;
            walk_start(&w, in->ndim, dims, 1, strides);
            for (int64_t e = 0; e < count; e++, walk_next(&w))
                sum += sim_load(in->dtype, element(in, ib + w.offs[0]));
            mean = count > 0 ? sum / (double)count : 0;
            walk_start(&w, in->ndim, dims, 1, strides);
            for (int64_t e = 0; e < count; e++, walk_next(&w)) {
                double d = sim_load(in->dtype, element(in, ib + w.offs[0])) - mean;
                sq += d * d;
            }
            var = count > 0 ? sq / (double)count : 0;
            if (rmean->data != NULL)
                sim_store(rmean->dtype, element(rmean, c * rmean->strides[0]),
                          (1 - momentum) * channel_at(rmean, c, 0) + momentum * mean);
            if (rvar->data != NULL && count > 1)
                sim_store(rvar->dtype, element(rvar, c * rvar->strides[0]),
                          (1 - momentum) * channel_at(rvar, c, 0) + momentum * sq / (double)(count - 1));
        } else {
            mean = channel_at(rmean, c, 0);
            var = channel_at(rvar, c, 1);
        }
        double invstd = 1.0 / sqrt(var + eps), scale = channel_at(weight, c, 1), shift = channel_at(bias, c, 0);
        walk_start(&w, in->ndim, dims, 2, strides);
        for (int64_t e = 0; e < count; e++, walk_next(&w)) {
            double v = (sim_load(in->dtype, element(in, ib + w.offs[0])) - mean) * invstd;
            sim_store(out->dtype, element(out, ob + w.offs[1]), v * scale + shift);
        }
        channel_store(&op->extra_out[0], c, mean);
        channel_store(&op->extra_out[1], c, invstd);
    }
}

static void run_compact(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    int nonzero = op->def->variant == SIM_COMPACT_NONZERO;
    int64_t strides[2][SIM_MAX_DIMS] = {{0}};
    memcpy(strides[0], in->strides, sizeof strides[0]);
    if (!nonzero)
        broadcast_strides(&op->in[1], in, in->ndim, strides[1]);
    walker w;
    walk_start(&w, in->ndim, in->dims, 2, strides);
    int64_t row = 0;
    for (int64_t e = numel(in); e > 0; e--, walk_next(&w)) {
        double v = sim_load(in->dtype, element(in, w.offs[0]));
        if (nonzero ? v == 0 : sim_load(op->in[1].dtype, element(&op->in[1], w.offs[1])) == 0)
            continue;
        if (nonzero)
            for (uint32_t k = 0; k < in->ndim; k++)
                sim_store(out->dtype, element(out, row * out->strides[0] + k * out->strides[1]), (double)w.index[k]);
        else
            sim_store(out->dtype, element(out, row * out->strides[0]), v);
        row++;
    }
}

/* Row-major over index: a later write to the same place wins (set). An index
 * outside the dim writes nothing and is reported, as Gather's. */
static void run_scatter(const sim_op *op)
{
    const sim_view *self = &op->in[0], *index = &op->in[1], *src = &op->in[2], *out = &op->out;
    uint32_t dim = (uint32_t)op->p[0];
    int reduce = (int)op->p[1];
    int64_t strides[3][SIM_MAX_DIMS];
    walker w;
    /* out = self first (a no-op when they are the same memory) */
    memcpy(strides[0], self->strides, sizeof strides[0]);
    memcpy(strides[1], out->strides, sizeof strides[1]);
    walk_start(&w, self->ndim, self->dims, 2, strides);
    for (int64_t e = numel(self); e > 0; e--, walk_next(&w))
        sim_store(out->dtype, element(out, w.offs[1]), sim_load(self->dtype, element(self, w.offs[0])));
    memcpy(strides[0], index->strides, sizeof strides[0]);
    memcpy(strides[1], src->strides, sizeof strides[1]);
    memcpy(strides[2], out->strides, sizeof strides[2]);
    strides[2][dim] = 0; /* out's position along dim comes from the index value */
    walk_start(&w, index->ndim, index->dims, 3, strides);
    int64_t bad = 0;
    for (int64_t e = numel(index); e > 0; e--, walk_next(&w)) {
        int64_t i = (int64_t)sim_load(index->dtype, element(index, w.offs[0]));
        if (i < 0 || i >= out->dims[dim]) {
            bad++;
            continue;
        }
        char *at = element(out, w.offs[2] + i * out->strides[dim]);
        double v = sim_load(src->dtype, element(src, w.offs[1]));
        if (reduce == 1)
            v += sim_load(out->dtype, at);
        else if (reduce == 2)
            v *= sim_load(out->dtype, at);
        sim_store(out->dtype, at, v);
    }
    if (bad > 0)
        fprintf(stderr, "aclsim: %s: %lld index value(s) out of range\n", op->def->kind.name, (long long)bad);
}

static double input_at(const sim_op *op, uint32_t i, int64_t off)
{
    return op->in_kind[i] == SIM_IN_CONST ? op->in_value[i] : sim_load(op->in[i].dtype, element(&op->in[i], off));
}

/* Each row (the leading dims) normalised over the trailing p[1] dims. */
static void run_layer_norm(const sim_op *op)
{
    const sim_view *in = &op->in[0], *out = &op->out;
    uint32_t k = (uint32_t)op->p[1], lead = in->ndim - k;
    int64_t lead_strides[4][SIM_MAX_DIMS] = {{0}}, trail_strides[4][SIM_MAX_DIMS] = {{0}};
    for (uint32_t d = 0; d < lead; d++) {
        lead_strides[0][d] = in->strides[d];
        lead_strides[1][d] = out->strides[d];
        for (int j = 0; j < 2; j++)
            lead_strides[2 + j][d] = d < op->extra_out[j].ndim ? op->extra_out[j].strides[d] : 0;
    }
    int64_t wb[2][SIM_MAX_DIMS];
    for (uint32_t j = 0; j < 2; j++)
        if (op->in_kind[1 + j] == SIM_IN_TENSOR)
            broadcast_strides(&op->in[1 + j], out, out->ndim, wb[j]);
        else
            memset(wb[j], 0, sizeof wb[j]);
    for (uint32_t d = 0; d < k; d++) {
        trail_strides[0][d] = in->strides[lead + d];
        trail_strides[1][d] = out->strides[lead + d];
        trail_strides[2][d] = wb[0][lead + d];
        trail_strides[3][d] = wb[1][lead + d];
    }
    int64_t rows = 1, n = 1;
    for (uint32_t d = 0; d < in->ndim; d++)
        *(d < lead ? &rows : &n) *= in->dims[d];
    walker rw;
    walk_start(&rw, lead, in->dims, 4, lead_strides);
    for (int64_t r = n > 0 ? rows : 0; r > 0; r--, walk_next(&rw)) {
        walker w;
        double sum = 0, sq = 0;
        walk_start(&w, k, in->dims + lead, 1, trail_strides);
        for (int64_t e = 0; e < n; e++, walk_next(&w))
            sum += sim_load(in->dtype, element(in, rw.offs[0] + w.offs[0]));
        double mean = sum / (double)n;
        walk_start(&w, k, in->dims + lead, 1, trail_strides);
        for (int64_t e = 0; e < n; e++, walk_next(&w)) {
            double dv = sim_load(in->dtype, element(in, rw.offs[0] + w.offs[0])) - mean;
            sq += dv * dv;
        }
        double rstd = 1.0 / sqrt(sq / (double)n + op->p[0]);
        walk_start(&w, k, in->dims + lead, 4, trail_strides);
        for (int64_t e = 0; e < n; e++, walk_next(&w)) {
            double v = (sim_load(in->dtype, element(in, rw.offs[0] + w.offs[0])) - mean) * rstd;
            v = v * input_at(op, 1, w.offs[2]) + input_at(op, 2, w.offs[3]);
            sim_store(out->dtype, element(out, rw.offs[1] + w.offs[1]), v);
        }
        double stats[2] = {mean, rstd};
        for (int j = 0; j < 2; j++)
            if (op->extra_out[j].data != NULL)
                sim_store(op->extra_out[j].dtype, element(&op->extra_out[j], rw.offs[2 + j]), stats[j]);
    }
}

/* An index outside the indexed dim reads nothing: the element is stored as 0
 * and reported (on the device it would read whatever lies there, or fault). */
static void run_gather(const sim_op *op)
{
    const sim_view *self = &op->in[0], *index = &op->in[1], *out = &op->out;
    int64_t strides[3][SIM_MAX_DIMS];
    memcpy(strides[0], op->gather_walk, sizeof strides[0]);
    memcpy(strides[1], index->strides, sizeof strides[1]);
    memcpy(strides[2], out->strides, sizeof strides[2]);
    walker w;
    walk_start(&w, out->ndim, out->dims, 3, strides);
    int64_t bad = 0;
    for (int64_t e = numel(out); e > 0; e--, walk_next(&w)) {
        int64_t i = (int64_t)sim_load(index->dtype, element(index, w.offs[1]));
        if (i < 0)
            i += op->gather_size;
        double v = 0;
        if (i >= 0 && i < op->gather_size)
            v = sim_load(self->dtype, element(self, w.offs[0] + i * op->gather_stride));
        else
            bad++;
        sim_store(out->dtype, element(out, w.offs[2]), v);
    }
    if (bad > 0)
        fprintf(stderr, "aclsim: %s: %lld index value(s) out of range\n", op->def->kind.name, (long long)bad);
}

static void compute(void *ctx)
{
    const sim_op *op = ctx;
    switch (op->def->shape) {
    case SIM_ELEMENTWISE: run_elementwise(op); break;
    case SIM_REDUCE: run_reduce(op); break;
    case SIM_MATMUL: run_matmul(op); break;
    case SIM_SOFTMAX: for_each_line(op, softmax_line); break;
    case SIM_SCAN: for_each_line(op, scan_line); break;
    case SIM_GATHER: run_gather(op); break;
    case SIM_LAYER_NORM: run_layer_norm(op); break;
    case SIM_SELECT: for_each_line(op, op->def->variant == SIM_SELECT_CUMMAX ? cummax_line : topk_line); break;
    case SIM_REMAP: run_remap(op); break;
    case SIM_BATCH_NORM: run_batch_norm(op); break;
    case SIM_COMPACT: run_compact(op); break;
    case SIM_SCATTER: run_scatter(op); break;
    }
}

void sim_op_finish(const void *params)
{
    const sim_op *op = params;
    simrt_range ranges[SIM_OP_MAX_INPUTS + 3 + 4];
    size_t n = 0;
    for (uint32_t i = 0; i < op->nin; i++)
        if (op->in_kind[i] == SIM_IN_TENSOR)
            ranges[n++] = extent(&op->in[i]);
    for (int i = 0; i < 4; i++)
        if (op->channel[i].data != NULL)
            ranges[n++] = extent(&op->channel[i]);
    ranges[n++] = extent(&op->out);
    for (int j = 0; j < 2; j++)
        if (op->extra_out[j].data != NULL)
            ranges[n++] = extent(&op->extra_out[j]);
    simrt_DeviceAccess(ranges, n, op->def->kind.name, compute, (void *)op);
}

/* ---- Cat / Stack ---- */

static double identity(const double *x, const double *p)
{
    (void)p;
    return x[0];
}

static const sim_op_def copy_def = {{"aclnnCat", sim_op_finish}, SIM_ELEMENTWISE, identity, 0};

aclnnStatus sim_cat_create(const sim_op_def *def, const aclTensorList *tensors, int64_t dim, int stack,
                           const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)
{
    if (workspaceSize == NULL || executor == NULL ||
        live(tensors, SIM_TENSORLIST_MAGIC, def->kind.name) == NULL ||
        live(out, SIM_TENSOR_MAGIC, def->kind.name) == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    sim_cat *c = calloc(1, sizeof *c);
    if (c == NULL)
        return ACLNN_ERR_INNER_NULLPTR;
    aclnnStatus st = ACLNN_ERR_PARAM_INVALID;
    c->def = def;
    c->out = out->view;
    dim = normalize_dim(dim, c->out.ndim);
    if (tensors->size == 0 || tensors->size > SIM_CAT_MAX || dim < 0 || dim >= (int64_t)c->out.ndim)
        goto done;
    c->n = (uint32_t)tensors->size;
    c->dim = (uint32_t)dim;
    int64_t total = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        const aclTensor *t = live(tensors->tensors[i], SIM_TENSOR_MAGIC, def->kind.name);
        if (t == NULL) {
            st = ACLNN_ERR_PARAM_NULLPTR;
            goto done;
        }
        sim_view v = t->view;
        /* Stack: a new size-1 dim at `dim` */
        if (stack && (v.ndim + 1 != c->out.ndim || !insert_dim(&v, (uint32_t)dim)))
            goto done;
        /* torch.cat skips 1-D empty tensors */
        if (v.ndim == 1 && v.dims[0] == 0 && c->out.ndim != 1)
            v = (sim_view){.dtype = v.dtype, .ndim = c->out.ndim, .dims = {0}};
        if (v.ndim != c->out.ndim)
            goto done;
        for (uint32_t k = 0; k < v.ndim; k++)
            if (k != (uint32_t)dim && v.dims[k] != c->out.dims[k] && numel(&v) != 0)
                goto done;
        total += v.dims[dim];
        c->in[i] = v;
    }
    if (total != c->out.dims[dim])
        goto done;
    *workspaceSize = 0;
    st = simrt_CreateExecutor(&def->kind, c, sizeof *c, 0, executor);
done:
    free(c);
    return st;
}

static void cat_compute(void *ctx)
{
    const sim_cat *c = ctx;
    int64_t start = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        sim_op piece = {.def = &copy_def, .nin = 1, .in = {c->in[i]}, .out = c->out};
        piece.out.dims[c->dim] = c->in[i].dims[c->dim];
        piece.out.offset += start * c->out.strides[c->dim];
        start += c->in[i].dims[c->dim];
        if (numel(&c->in[i]) > 0)
            run_elementwise(&piece);
    }
}

void sim_cat_finish(const void *params)
{
    const sim_cat *c = params;
    simrt_range ranges[SIM_CAT_MAX + 1];
    size_t n = 0;
    for (uint32_t i = 0; i < c->n; i++)
        ranges[n++] = extent(&c->in[i]);
    ranges[n++] = extent(&c->out);
    simrt_DeviceAccess(ranges, n, c->def->kind.name, cat_compute, (void *)c);
}
