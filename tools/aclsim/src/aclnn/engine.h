/* The sim's aclnn operator engine. Phase 1 of every op builds a sim_op: the
 * views of its tensors and its scalar arguments COPIED out of the caller's
 * descriptors (so they may be destroyed right after phase 1), checked for
 * dtype and shape; the executor keeps that copy. When the op's duration has
 * elapsed on the stream worker, the engine checks every device range the op
 * touches and computes in double, converting per element on load and store.
 *
 * Five op shapes cover the simulated set:
 *   elementwise  out = fn(in0, in1, in2; params) with broadcasting; an input
 *                may be a constant (an aclScalar) or the element's index
 *                along one of out's dims (Arange, Eye, Tril...)
 *   reduce       sum (or mean) of in0 over a set of dims into out
 *   matmul       out = beta * in2 + alpha * (in0 @ in1), batched, broadcast batch
 *   softmax      (log-)softmax of in0 along one dim
 *   scan         cumulative sum (or product) of in0 along one dim
 *   layer norm   in0 normalised over its last p[1] dims (eps p[0]), times in1
 *                plus in2; mean and 1/std of each row to the extra outputs
 *   gather       out[i] = in0 at walk.i + in1[i] * stride of the indexed dim
 *                (Gather, Embedding: in1 is an integer index tensor)
 *   select       each line of in0 along one dim: its k largest (or smallest)
 *                values sorted (Topk, MaxDim/MinDim as k = 1), or its running
 *                max (Cummax); the values to out, their indices along the dim
 *                to extra_out[0]
 *   batch norm   in0 (N, C, ...) normalised per channel (dim 1) with the
 *                batch's statistics (training, which also updates the running
 *                ones) or the running ones; per-channel affine
 *   compact      the elements of in0 that are nonzero (Nonzero: their indices)
 *                or that in1 selects (MaskedSelect: their values), row-major,
 *                into the first rows of out, sized for every element
 *   scatter      out = in0, then out at in1's positions along a dim, the
 *                dim's index taken from in1, = (or +=, *=) in2 there
 *   remap        out[i] = in0 at an index computed from i (Roll, Repeat,
 *                RepeatInterleave, ConstantPadNd, Diag), or the constant p[0]
 *                where it has none
 */
#ifndef ACLSIM_ACLNN_ENGINE_H
#define ACLSIM_ACLNN_ENGINE_H

#include "../simrt.h"
#include "desc.h"

#define SIM_OP_MAX_INPUTS 3
#define SIM_OP_MAX_PARAMS 3
/* Workspace the sim asks for where real CANN asks for one (reductions, matmul). */
#define SIM_OP_SCRATCH_WORKSPACE 1024u

enum sim_op_shape {
    SIM_ELEMENTWISE, SIM_REDUCE, SIM_MATMUL, SIM_SOFTMAX, SIM_SCAN, SIM_GATHER, SIM_LAYER_NORM, SIM_SELECT, SIM_REMAP,
    SIM_BATCH_NORM, SIM_COMPACT, SIM_SCATTER
};
/* sim_op_def.variant of SIM_SELECT and SIM_REMAP */
enum { SIM_SELECT_TOPK, SIM_SELECT_CUMMAX };
enum { SIM_COMPACT_NONZERO, SIM_COMPACT_MASKED_SELECT };
enum { SIM_REMAP_ROLL, SIM_REMAP_REPEAT, SIM_REMAP_PAD, SIM_REMAP_DIAG, SIM_REMAP_INTERLEAVE };

/* x: the inputs of one element, p: the op's parameters (alpha, threshold...). */
typedef double (*sim_elem_fn)(const double *x, const double *p);

typedef struct sim_op_def {
    simrt_op_kind kind; /* first: the executor hands finish() the sim_op, whose first field points here */
    enum sim_op_shape shape;
    sim_elem_fn fn;     /* elementwise only */
    int variant;        /* reduce: 1 = mean; softmax: 1 = log-softmax; scan: 1 = product; select, remap: above */
} sim_op_def;

enum { SIM_IN_TENSOR, SIM_IN_CONST, SIM_IN_INDEX, SIM_IN_FLAT_INDEX };

typedef struct sim_op {
    const sim_op_def *def;
    aclnnStatus error; /* first problem found while building; reported by sim_op_create */
    uint32_t nin;
    uint32_t reduce_mask;
    uint8_t in_kind[SIM_OP_MAX_INPUTS]; /* SIM_IN_TENSOR, SIM_IN_CONST, SIM_IN_INDEX or SIM_IN_FLAT_INDEX */
    double in_value[SIM_OP_MAX_INPUTS];
    double p[SIM_OP_MAX_PARAMS];
    sim_view in[SIM_OP_MAX_INPUTS];
    sim_view out;
    /* optional second outputs (layer norm's mean and rstd); ndim 0 + NULL data = absent */
    sim_view extra_out[2];
    /* gather: in0's strides along out's dims, and the indexed dim of in0 */
    int64_t gather_walk[SIM_MAX_DIMS];
    int64_t gather_stride, gather_size;
    /* batch norm: weight, bias, running mean, running var (1-D, C each); data NULL = absent */
    sim_view channel[4];
    /* remap: per dim of out, Roll's shift or ConstantPadNd's leading pad */
    int64_t remap_offset[SIM_MAX_DIMS];
} sim_op;

void sim_op_begin(sim_op *op, const sim_op_def *def);
void sim_op_input(sim_op *op, const aclTensor *t);
void sim_op_input_scalar(sim_op *op, const aclScalar *s);
/* An optional tensor input: the constant `fallback` where t is NULL. */
void sim_op_input_optional(sim_op *op, const aclTensor *t, double fallback);
/* The element's index along out's dim `dim` (negative counts from the end). */
void sim_op_input_index(sim_op *op, int64_t dim);
/* The element's row-major index in out (the random fills' counter). */
void sim_op_input_flat_index(sim_op *op);
/* Input i, a 1-D per-channel tensor, broadcasts along out's dim 1 (NCHW's C). */
void sim_op_channel_input(sim_op *op, uint32_t i);
/* Reverses in0 along the listed dims (a view with negated strides). */
void sim_op_flip(sim_op *op, const aclIntArray *dims);
void sim_op_param(sim_op *op, int i, double value);
void sim_op_param_scalar(sim_op *op, int i, const aclScalar *s);
/* As sim_op_param_scalar, `fallback` when s is NULL (an optional argument). */
void sim_op_param_optional(sim_op *op, int i, const aclScalar *s, double fallback);
void sim_op_output(sim_op *op, const aclTensor *t);
/* Reduce only: which dims of in0 are reduced (none given = all) and whether
 * out keeps them as size-1 dims. */
void sim_op_reduce_dims(sim_op *op, const aclIntArray *dims, int keepdim);
/* An optional second output (NULL: none). */
void sim_op_extra_output(sim_op *op, int i, const aclTensor *t);
/* Layer norm: normalise over the last `ndims` dims, with eps. */
void sim_op_layer_norm(sim_op *op, const aclIntArray *normalized_shape, double eps);
/* Softmax and scan: the dim (negative counts from the end). */
void sim_op_softmax_dim(sim_op *op, int64_t dim);
/* Gather only, after the inputs and output: out[i] reads in0 with index dim
 * `dim` replaced by in1's value. Embedding: in0 a [rows, cols] table and out
 * = in1's dims + [cols] (embedding = 1). */
void sim_op_gather(sim_op *op, int64_t dim, int embedding);
/* Select only, after the input and both outputs (values, then indices): lines
 * along `dim`; Topk keeps the k largest (largest) or smallest, sorted, and
 * Cummax passes k = SIM_SELECT_WHOLE_LINE. A reduction without keepdim
 * (dim_dropped) gets the dim back in its outputs as a size-1 dim. */
#define SIM_SELECT_WHOLE_LINE (-1)
void sim_op_select(sim_op *op, int64_t dim, int64_t k, int largest, int dim_dropped);
/* Remap only, after the input and output. Roll: a = shifts, b = dims (empty:
 * over the flattened tensor). Repeat: a = repeats. ConstantPadNd: a = pads
 * (last dim first, leading then trailing), fill = the value. Diag: n = the
 * diagonal. RepeatInterleave: n = repeats of each element along dim
 * (SIM_REMAP_FLAT: of the flattened tensor). */
#define SIM_REMAP_FLAT INT64_MIN
void sim_op_remap(sim_op *op, const aclIntArray *a, const aclIntArray *b, int64_t n, int64_t dim, double fill);
/* Batch norm only, after the input, output and extra outputs (save mean, save
 * 1/std): the per-channel tensors (any may be NULL; eval needs the running
 * ones). */
void sim_op_batch_norm(sim_op *op, const aclTensor *weight, const aclTensor *bias, const aclTensor *running_mean,
                       const aclTensor *running_var, int training, double momentum, double eps);
/* Compact only, after the inputs and output. */
void sim_op_compact(sim_op *op);
/* Scatter only, after self, index, src and out: along dim, reduce 0 (set), 1
 * (add) or 2 (multiply). */
void sim_op_scatter(sim_op *op, int64_t dim, int64_t reduce);
/* Validates shapes, then creates the executor (phase 1's result). */
aclnnStatus sim_op_create(sim_op *op, uint64_t *workspaceSize, aclOpExecutor **executor);

void sim_op_finish(const void *params);

/* Cat and Stack: every tensor of a list copied into its slice of out along
 * dim (Stack: each tensor is a size-1 slice of a new dim). Their own params. */
#define SIM_CAT_MAX 20
typedef struct sim_cat {
    const sim_op_def *def;
    uint32_t n, dim;
    sim_view out;
    sim_view in[SIM_CAT_MAX];
} sim_cat;
aclnnStatus sim_cat_create(const sim_op_def *def, const aclTensorList *tensors, int64_t dim, int stack,
                           const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);
void sim_cat_finish(const void *params);

#endif
