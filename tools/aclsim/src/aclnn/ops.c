/* The aclnn operators of the sim's libopapi.so, real signatures, real
 * arithmetic (engine.h). Each op is one table line: its arity and the element
 * function. An op not listed here is absent from the library, so a caller that
 * looks symbols up (MindTorch binds them by name) sees it is missing. */
#include <math.h>

#include "engine.h"

#define EXPORT __attribute__((visibility("default")))
#define WS_ARGS uint64_t *workspaceSize, aclOpExecutor **executor

/* Phase 2 of every op: queue the executor (engine.h runs it). */
#define PHASE2(Name)                                                                                    \
    EXPORT aclnnStatus aclnn##Name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,    \
                                   aclrtStream stream)                                                  \
    {                                                                                                   \
        return simrt_LaunchExecutor("aclnn" #Name, workspace, workspaceSize, executor, stream);         \
    }

#define DEF(Name, shape, fn, variant) \
    static const sim_op_def def_##Name = {{"aclnn" #Name, sim_op_finish}, shape, fn, variant};

#define ELEM_FN(Name, expr) \
    static double fn_##Name(const double *x, const double *p) { (void)x, (void)p; return (expr); }

/* ---- phase 1 shapes, one per argument list ---- */

/* (self, out) */
#define UNARY(Name, expr)                                                                   \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                            \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, aclTensor *out, WS_ARGS) \
    {                                                                                       \
        sim_op op;                                                                          \
        sim_op_begin(&op, &def_##Name);                                                     \
        sim_op_input(&op, self);                                                            \
        sim_op_output(&op, out);                                                            \
        return sim_op_create(&op, workspaceSize, executor);                                 \
    }                                                                                       \
    PHASE2(Name)

/* (self, other, out); Scalar: other is an aclScalar */
#define BINARY_AS(Name, OtherType, add_other, expr)                                   \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                            \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const OtherType *other, \
                                                     aclTensor *out, WS_ARGS)               \
    {                                                                                       \
        sim_op op;                                                                          \
        sim_op_begin(&op, &def_##Name);                                                     \
        sim_op_input(&op, self);                                                            \
        add_other(&op, other);                                                              \
        sim_op_output(&op, out);                                                            \
        return sim_op_create(&op, workspaceSize, executor);                                 \
    }                                                                                       \
    PHASE2(Name)
#define BINARY(Name, expr) BINARY_AS(Name, aclTensor, sim_op_input, expr)
#define BINARY_SCALAR(Name, expr) BINARY_AS(Name, aclScalar, sim_op_input_scalar, expr)
/* torch's comparison and logical ops exist as XxxTensor and XxxScalar */
#define COMPARE(Name, expr) BINARY(Name##Tensor, expr) BINARY_SCALAR(Name##Scalar, expr)

/* (self, other, alpha, out): out = self op alpha * other */
#define BINARY_ALPHA(Name, OtherType, add_other, expr)                                      \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                            \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const OtherType *other, \
                                                     const aclScalar *alpha, aclTensor *out, WS_ARGS) \
    {                                                                                       \
        sim_op op;                                                                          \
        sim_op_begin(&op, &def_##Name);                                                     \
        sim_op_input(&op, self);                                                            \
        add_other(&op, other);                                                              \
        sim_op_param_scalar(&op, 0, alpha);                                                 \
        sim_op_output(&op, out);                                                            \
        return sim_op_create(&op, workspaceSize, executor);                                 \
    }                                                                                       \
    PHASE2(Name)

/* (self, p0, out) and (self, p0, p1, out): parameters given as aclScalars */
#define UNARY_P1(Name, expr)                                                                \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                            \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclScalar *p0, \
                                                     aclTensor *out, WS_ARGS)               \
    {                                                                                       \
        sim_op op;                                                                          \
        sim_op_begin(&op, &def_##Name);                                                     \
        sim_op_input(&op, self);                                                            \
        sim_op_param_scalar(&op, 0, p0);                                                    \
        sim_op_output(&op, out);                                                            \
        return sim_op_create(&op, workspaceSize, executor);                                 \
    }                                                                                       \
    PHASE2(Name)
#define UNARY_P2(Name, expr)                                                                \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                            \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclScalar *p0, \
                                                     const aclScalar *p1, aclTensor *out, WS_ARGS) \
    {                                                                                       \
        sim_op op;                                                                          \
        sim_op_begin(&op, &def_##Name);                                                     \
        sim_op_input(&op, self);                                                            \
        sim_op_param_scalar(&op, 0, p0);                                                    \
        sim_op_param_scalar(&op, 1, p1);                                                    \
        sim_op_output(&op, out);                                                            \
        return sim_op_create(&op, workspaceSize, executor);                                 \
    }                                                                                       \
    PHASE2(Name)

static double sign(double v) { return v > 0 ? 1 : v < 0 ? -1 : v; }
static double nan_max(double a, double b) { return isnan(a) || isnan(b) ? NAN : fmax(a, b); }
static double nan_min(double a, double b) { return isnan(a) || isnan(b) ? NAN : fmin(a, b); }
static double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }
static double py_mod(double a, double b) { double r = fmod(a, b); return r != 0 && (r < 0) != (b < 0) ? r + b : r; }

/* ---- elementwise ops ---- */
UNARY(Neg, -x[0])
UNARY(Abs, fabs(x[0]))
UNARY(Sign, sign(x[0]))
UNARY(Relu, x[0] > 0 ? x[0] : isnan(x[0]) ? x[0] : 0)
UNARY(Exp, exp(x[0]))
UNARY(Exp2, exp2(x[0]))
UNARY(Expm1, expm1(x[0]))
UNARY(Log, log(x[0]))
UNARY(Log2, log2(x[0]))
UNARY(Log10, log10(x[0]))
UNARY(Log1p, log1p(x[0]))
UNARY(Sqrt, sqrt(x[0]))
UNARY(Rsqrt, 1.0 / sqrt(x[0]))
UNARY(Reciprocal, 1.0 / x[0])
UNARY(Square, x[0] * x[0])
UNARY(Sin, sin(x[0]))
UNARY(Cos, cos(x[0]))
UNARY(Tan, tan(x[0]))
UNARY(Asin, asin(x[0]))
UNARY(Acos, acos(x[0]))
UNARY(Atan, atan(x[0]))
UNARY(Sinh, sinh(x[0]))
UNARY(Cosh, cosh(x[0]))
UNARY(Tanh, tanh(x[0]))
UNARY(Erf, erf(x[0]))
UNARY(Sigmoid, sigmoid(x[0]))
UNARY(Silu, x[0] * sigmoid(x[0]))
UNARY(Gelu, 0.5 * x[0] * (1.0 + erf(x[0] / sqrt(2.0))))
UNARY(Floor, floor(x[0]))
UNARY(Ceil, ceil(x[0]))
UNARY(Round, nearbyint(x[0]))
UNARY(Trunc, trunc(x[0]))
UNARY(Asinh, asinh(x[0]))
UNARY(Acosh, acosh(x[0]))
UNARY(Atanh, atanh(x[0]))
UNARY(Erfc, erfc(x[0]))
UNARY(Frac, x[0] - trunc(x[0]))
UNARY(Sinc, x[0] == 0 ? 1.0 : sin(M_PI * x[0]) / (M_PI * x[0]))
UNARY(Mish, x[0] * tanh(log1p(exp(x[0]))))
UNARY(LogicalNot, x[0] == 0)
UNARY(Signbit, signbit(x[0]) != 0)
UNARY(IsPosInf, isinf(x[0]) && x[0] > 0)
UNARY(IsNegInf, isinf(x[0]) && x[0] < 0)
UNARY(IsFinite, isfinite(x[0]) != 0)
UNARY(IsInf, isinf(x[0]) != 0)

BINARY_ALPHA(Add, aclTensor, sim_op_input, x[0] + p[0] * x[1])
BINARY_ALPHA(Sub, aclTensor, sim_op_input, x[0] - p[0] * x[1])
BINARY_ALPHA(Adds, aclScalar, sim_op_input_scalar, x[0] + p[0] * x[1])
BINARY(Mul, x[0] * x[1])
BINARY_SCALAR(Muls, x[0] * x[1])
BINARY(Div, x[0] / x[1])
BINARY_SCALAR(Divs, x[0] / x[1])
BINARY(FloorDivide, floor(x[0] / x[1]))
BINARY(FmodTensor, fmod(x[0], x[1]))
BINARY(RemainderTensorTensor, py_mod(x[0], x[1]))
BINARY(Atan2, atan2(x[0], x[1]))
BINARY(PowTensorTensor, pow(x[0], x[1]))
BINARY_SCALAR(PowTensorScalar, pow(x[0], x[1]))
BINARY(Maximum, nan_max(x[0], x[1]))
BINARY(Minimum, nan_min(x[0], x[1]))
BINARY_SCALAR(ClampMin, nan_max(x[0], x[1]))
BINARY_SCALAR(ClampMax, nan_min(x[0], x[1]))
BINARY(ClampMinTensor, nan_max(x[0], x[1]))
BINARY(ClampMaxTensor, nan_min(x[0], x[1]))
BINARY(LogicalAnd, x[0] != 0 && x[1] != 0)
BINARY(LogicalOr, x[0] != 0 || x[1] != 0)
BINARY(LogicalXor, (x[0] != 0) != (x[1] != 0))
BINARY(LogAddExp, fmax(x[0], x[1]) + log1p(exp(-fabs(x[0] - x[1]))))
BINARY(LogAddExp2, fmax(x[0], x[1]) + log2(1.0 + exp2(-fabs(x[0] - x[1]))))
/* backward ops: (gradOutput, saved, gradInput) */
BINARY(SigmoidBackward, x[0] * x[1] * (1.0 - x[1]))
BINARY(TanhBackward, x[0] * (1.0 - x[1] * x[1]))
BINARY(SiluBackward, x[0] * sigmoid(x[1]) * (1.0 + x[1] * (1.0 - sigmoid(x[1]))))
BINARY(GeluBackward, x[0] * (0.5 * (1.0 + erf(x[1] / sqrt(2.0))) + x[1] * exp(-0.5 * x[1] * x[1]) / sqrt(2.0 * M_PI)))
COMPARE(Eq, x[0] == x[1])
COMPARE(Ne, x[0] != x[1])
COMPARE(Gt, x[0] > x[1])
COMPARE(Ge, x[0] >= x[1])
COMPARE(Lt, x[0] < x[1])
COMPARE(Le, x[0] <= x[1])

/* (self, end, weight, out): self + weight * (end - self); Lerps: weight an aclScalar */
ELEM_FN(Lerp, x[0] + x[2] * (x[1] - x[0]))
DEF(Lerp, SIM_ELEMENTWISE, fn_Lerp, 0)
DEF(Lerps, SIM_ELEMENTWISE, fn_Lerp, 0)
EXPORT aclnnStatus aclnnLerpGetWorkspaceSize(const aclTensor *self, const aclTensor *end, const aclTensor *weight,
                                             aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Lerp);
    sim_op_input(&op, self);
    sim_op_input(&op, end);
    sim_op_input(&op, weight);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Lerp)
EXPORT aclnnStatus aclnnLerpsGetWorkspaceSize(const aclTensor *self, const aclTensor *end, const aclScalar *weight,
                                              aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Lerps);
    sim_op_input(&op, self);
    sim_op_input(&op, end);
    sim_op_input_scalar(&op, weight);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Lerps)

/* (self, weight, out): weight has one slope per channel (dim 1) or one for all */
ELEM_FN(Prelu, x[0] > 0 ? x[0] : x[1] * x[0])
DEF(Prelu, SIM_ELEMENTWISE, fn_Prelu, 0)
EXPORT aclnnStatus aclnnPreluGetWorkspaceSize(const aclTensor *self, const aclTensor *weight, aclTensor *out,
                                              WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Prelu);
    sim_op_input(&op, self);
    sim_op_input(&op, weight);
    sim_op_output(&op, out);
    sim_op_channel_input(&op, 1);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Prelu)

UNARY_P1(LeakyRelu, x[0] > 0 ? x[0] : x[0] * p[0])
/* (self, min, max, out); either bound may be NULL */
ELEM_FN(Clamp, nan_min(nan_max(x[0], p[0]), p[1]))
ELEM_FN(ClampTensor, nan_min(nan_max(x[0], x[1]), x[2]))
DEF(Clamp, SIM_ELEMENTWISE, fn_Clamp, 0)
EXPORT aclnnStatus aclnnClampGetWorkspaceSize(const aclTensor *self, const aclScalar *min, const aclScalar *max,
                                              aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Clamp);
    sim_op_input(&op, self);
    sim_op_param_optional(&op, 0, min, -INFINITY);
    sim_op_param_optional(&op, 1, max, INFINITY);
    sim_op_output(&op, out);
    if (min == NULL && max == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Clamp)

/* (self, alpha, scale, inputScale, out) */
ELEM_FN(Elu, x[0] > 0 ? p[1] * x[0] : p[1] * p[0] * expm1(x[0] * p[2]))
DEF(Elu, SIM_ELEMENTWISE, fn_Elu, 0)
EXPORT aclnnStatus aclnnEluGetWorkspaceSize(const aclTensor *self, const aclScalar *alpha, const aclScalar *scale,
                                            const aclScalar *inputScale, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Elu);
    sim_op_input(&op, self);
    sim_op_param_scalar(&op, 0, alpha);
    sim_op_param_scalar(&op, 1, scale);
    sim_op_param_scalar(&op, 2, inputScale);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Elu)

UNARY_P2(Hardtanh, nan_min(nan_max(x[0], p[0]), p[1]))
UNARY_P2(Softplus, x[0] * p[0] > p[1] ? x[0] : log1p(exp(x[0] * p[0])) / p[0])

/* (gradOutput, self, threshold, out): relu's backward is threshold 0 */
ELEM_FN(ThresholdBackward, x[1] > p[0] ? x[0] : 0)
DEF(ThresholdBackward, SIM_ELEMENTWISE, fn_ThresholdBackward, 0)
EXPORT aclnnStatus aclnnThresholdBackwardGetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *self,
                                                          const aclScalar *threshold, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_ThresholdBackward);
    sim_op_input(&op, gradOutput);
    sim_op_input(&op, self);
    sim_op_param_scalar(&op, 0, threshold);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(ThresholdBackward)

ELEM_FN(SWhere, x[0] != 0 ? x[1] : x[2])
DEF(SWhere, SIM_ELEMENTWISE, fn_SWhere, 0)
EXPORT aclnnStatus aclnnSWhereGetWorkspaceSize(const aclTensor *condition, const aclTensor *self,
                                               const aclTensor *other, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_SWhere);
    sim_op_input(&op, condition);
    sim_op_input(&op, self);
    sim_op_input(&op, other);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(SWhere)

/* Copies convert on store: Cast and InplaceCopy are the identity. */
ELEM_FN(Identity, x[0])
DEF(Cast, SIM_ELEMENTWISE, fn_Identity, 0)
EXPORT aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, aclDataType dtype, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Cast);
    sim_op_input(&op, self);
    sim_op_output(&op, out);
    if (op.error == ACLNN_SUCCESS && op.out.dtype != (int32_t)dtype)
        return ACLNN_ERR_PARAM_INVALID;
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Cast)

/* (selfRef, src): src broadcast into selfRef, converted to its dtype */
DEF(InplaceCopy, SIM_ELEMENTWISE, fn_Identity, 0)
EXPORT aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor *selfRef, const aclTensor *src, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_InplaceCopy);
    sim_op_input(&op, src);
    sim_op_output(&op, selfRef);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(InplaceCopy)

/* In-place fills: selfRef = p[0] */
ELEM_FN(Fill, p[0])
DEF(InplaceFillScalar, SIM_ELEMENTWISE, fn_Fill, 0)
DEF(InplaceZero, SIM_ELEMENTWISE, fn_Fill, 0)
DEF(InplaceOne, SIM_ELEMENTWISE, fn_Fill, 0)

static aclnnStatus fill(const sim_op_def *def, aclTensor *selfRef, const aclScalar *value, double constant,
                        WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    if (value != NULL)
        sim_op_param_scalar(&op, 0, value);
    else
        sim_op_param(&op, 0, constant);
    sim_op_output(&op, selfRef);
    return sim_op_create(&op, workspaceSize, executor);
}

EXPORT aclnnStatus aclnnInplaceFillScalarGetWorkspaceSize(aclTensor *selfRef, const aclScalar *value, WS_ARGS)
{
    if (value == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    return fill(&def_InplaceFillScalar, selfRef, value, 0, workspaceSize, executor);
}
PHASE2(InplaceFillScalar)
EXPORT aclnnStatus aclnnInplaceZeroGetWorkspaceSize(aclTensor *selfRef, WS_ARGS)
{
    return fill(&def_InplaceZero, selfRef, NULL, 0, workspaceSize, executor);
}
PHASE2(InplaceZero)
EXPORT aclnnStatus aclnnInplaceOneGetWorkspaceSize(aclTensor *selfRef, WS_ARGS)
{
    return fill(&def_InplaceOne, selfRef, NULL, 1, workspaceSize, executor);
}
PHASE2(InplaceOne)

/* In-place arithmetic: selfRef = selfRef op other */
#define INPLACE_OF(Name, Base, OtherType, add_other)                                                 \
    DEF(Name, SIM_ELEMENTWISE, fn_##Base, 0)                                                         \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(aclTensor *selfRef, const OtherType *other,     \
                                                     const aclScalar *alpha, WS_ARGS)                \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, selfRef);                                                                  \
        add_other(&op, other);                                                                       \
        sim_op_param_scalar(&op, 0, alpha);                                                          \
        sim_op_output(&op, selfRef);                                                                 \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
INPLACE_OF(InplaceAdd, Add, aclTensor, sim_op_input)
INPLACE_OF(InplaceSub, Sub, aclTensor, sim_op_input)
INPLACE_OF(InplaceAdds, Adds, aclScalar, sim_op_input_scalar)

/* ---- reductions: (self, dims, keepDim, dtype, out) ---- */
#define REDUCE(Name, mean)                                                                           \
    DEF(Name, SIM_REDUCE, NULL, mean)                                                                \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclIntArray *dims, \
                                                     bool keepDim, aclDataType dtype, aclTensor *out, \
                                                     WS_ARGS)                                        \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, self);                                                                     \
        sim_op_reduce_dims(&op, dims, keepDim);                                                      \
        sim_op_output(&op, out);                                                                     \
        if (op.error == ACLNN_SUCCESS && op.out.dtype != (int32_t)dtype)                             \
            return ACLNN_ERR_PARAM_INVALID;                                                          \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
REDUCE(ReduceSum, 0)
REDUCE(Mean, 1)

/* ---- matrix products: (self, mat2, out, cubeMathType) ---- */
#define MATMUL(Name)                                                                                 \
    DEF(Name, SIM_MATMUL, NULL, 0)                                                                   \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *mat2,   \
                                                     aclTensor *out, int8_t cubeMathType, WS_ARGS)   \
    {                                                                                                \
        (void)cubeMathType;                                                                          \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, self);                                                                     \
        sim_op_input(&op, mat2);                                                                     \
        sim_op_param(&op, 0, 1.0);                                                                   \
        sim_op_output(&op, out);                                                                     \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
MATMUL(Matmul)
MATMUL(Mm)
MATMUL(BatchMatMul)

/* (self, mat1, mat2, beta, alpha, out, cubeMathType): out = beta * self + alpha * mat1 @ mat2 */
DEF(Addmm, SIM_MATMUL, NULL, 0)
EXPORT aclnnStatus aclnnAddmmGetWorkspaceSize(const aclTensor *self, const aclTensor *mat1, const aclTensor *mat2,
                                              const aclScalar *beta, const aclScalar *alpha, aclTensor *out,
                                              int8_t cubeMathType, WS_ARGS)
{
    (void)cubeMathType;
    sim_op op;
    sim_op_begin(&op, &def_Addmm);
    sim_op_input(&op, mat1);
    sim_op_input(&op, mat2);
    sim_op_input(&op, self);
    sim_op_param_scalar(&op, 0, alpha);
    sim_op_param_scalar(&op, 1, beta);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Addmm)

/* ---- ops over the element's index ---- */
/* (start, end, step, out): out[i] = start + i * step; Range is Arange with an inclusive end,
 * the same formula over the out the caller sized */
ELEM_FN(Arange, p[0] + x[0] * p[2])
#define ARANGE(Name)                                                                                 \
    DEF(Name, SIM_ELEMENTWISE, fn_Arange, 0)                                                         \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclScalar *start, const aclScalar *end,  \
                                                     const aclScalar *step, aclTensor *out, WS_ARGS) \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_param_scalar(&op, 0, start);                                                          \
        sim_op_param_scalar(&op, 1, end);                                                            \
        sim_op_param_scalar(&op, 2, step);                                                           \
        sim_op_output(&op, out);                                                                     \
        sim_op_input_index(&op, 0);                                                                  \
        if (op.error == ACLNN_SUCCESS && (op.out.ndim != 1 || op.p[2] == 0))                         \
            return ACLNN_ERR_PARAM_INVALID;                                                          \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
ARANGE(Arange)
ARANGE(Range)

/* (start, end, steps, out): steps values from start to end inclusive */
ELEM_FN(Linspace, p[2] <= 1 ? p[0] : p[0] + x[0] * (p[1] - p[0]) / (p[2] - 1))
DEF(Linspace, SIM_ELEMENTWISE, fn_Linspace, 0)
EXPORT aclnnStatus aclnnLinspaceGetWorkspaceSize(const aclScalar *start, const aclScalar *end, int64_t steps,
                                                 aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Linspace);
    sim_op_param_scalar(&op, 0, start);
    sim_op_param_scalar(&op, 1, end);
    sim_op_param(&op, 2, (double)steps);
    sim_op_output(&op, out);
    sim_op_input_index(&op, 0);
    if (op.error == ACLNN_SUCCESS && (op.out.ndim != 1 || op.out.dims[0] != steps))
        return ACLNN_ERR_PARAM_INVALID;
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Linspace)

/* (n, m, out): the identity */
ELEM_FN(Eye, x[0] == x[1])
DEF(Eye, SIM_ELEMENTWISE, fn_Eye, 0)
EXPORT aclnnStatus aclnnEyeGetWorkspaceSize(int64_t n, int64_t m, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Eye);
    sim_op_output(&op, out);
    sim_op_input_index(&op, 0);
    sim_op_input_index(&op, 1);
    if (op.error == ACLNN_SUCCESS && (op.out.ndim != 2 || op.out.dims[0] != n || op.out.dims[1] != m))
        return ACLNN_ERR_PARAM_INVALID;
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Eye)

/* (self, diagonal, out): keep the elements on and below (Tril) or above (Triu) the diagonal */
ELEM_FN(Tril, x[2] - x[1] <= p[0] ? x[0] : 0)
ELEM_FN(Triu, x[2] - x[1] >= p[0] ? x[0] : 0)
#define TRIANGLE(Name)                                                                               \
    DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                                                         \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, int64_t diagonal,        \
                                                     aclTensor *out, WS_ARGS)                        \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, self);                                                                     \
        sim_op_input_index(&op, -2);                                                                 \
        sim_op_input_index(&op, -1);                                                                 \
        sim_op_param(&op, 0, (double)diagonal);                                                      \
        sim_op_output(&op, out);                                                                     \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
TRIANGLE(Tril)
TRIANGLE(Triu)

/* (self, dims, out) */
DEF(Flip, SIM_ELEMENTWISE, fn_Identity, 0)
EXPORT aclnnStatus aclnnFlipGetWorkspaceSize(const aclTensor *self, const aclIntArray *dims, aclTensor *out,
                                             WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Flip);
    sim_op_input(&op, self);
    sim_op_flip(&op, dims);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Flip)

/* (self, min, max, out): tensor bounds, either may be NULL */
DEF(ClampTensor, SIM_ELEMENTWISE, fn_ClampTensor, 0)
EXPORT aclnnStatus aclnnClampTensorGetWorkspaceSize(const aclTensor *self, const aclTensor *min,
                                                    const aclTensor *max, aclTensor *out, WS_ARGS)
{
    if (min == NULL && max == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    sim_op op;
    sim_op_begin(&op, &def_ClampTensor);
    sim_op_input(&op, self);
    sim_op_input_optional(&op, min, -INFINITY);
    sim_op_input_optional(&op, max, INFINITY);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(ClampTensor)

/* (self, tensor1, tensor2, value, out): self + value * tensor1 (* or /) tensor2 */
#define ADDC(Name, expr)                                                                             \
    ELEM_FN(Name, expr) DEF(Name, SIM_ELEMENTWISE, fn_##Name, 0)                                     \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *tensor1, \
                                                     const aclTensor *tensor2, const aclScalar *value, \
                                                     aclTensor *out, WS_ARGS)                        \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, self);                                                                     \
        sim_op_input(&op, tensor1);                                                                  \
        sim_op_input(&op, tensor2);                                                                  \
        sim_op_param_scalar(&op, 0, value);                                                          \
        sim_op_output(&op, out);                                                                     \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
ADDC(Addcmul, x[0] + p[0] * x[1] * x[2])
ADDC(Addcdiv, x[0] + p[0] * x[1] / x[2])

/* ---- (log-)softmax: (self, dim, out) ---- */
#define SOFTMAX(Name, log)                                                                           \
    DEF(Name, SIM_SOFTMAX, NULL, log)                                                                \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out, \
                                                     WS_ARGS)                                        \
    {                                                                                                \
        sim_op op;                                                                                   \
        sim_op_begin(&op, &def_##Name);                                                              \
        sim_op_input(&op, self);                                                                     \
        sim_op_softmax_dim(&op, dim);                                                                \
        sim_op_output(&op, out);                                                                     \
        return sim_op_create(&op, workspaceSize, executor);                                          \
    }                                                                                                \
    PHASE2(Name)
SOFTMAX(Softmax, 0)
SOFTMAX(LogSoftmax, 1)

/* ---- cumulative: (self, dim, dtype, out); Cumprod's dim is an aclScalar ---- */
DEF(Cumsum, SIM_SCAN, NULL, 0)
DEF(Cumprod, SIM_SCAN, NULL, 1)

static aclnnStatus scan(const sim_op_def *def, const aclTensor *self, int64_t dim, aclDataType dtype,
                        aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    sim_op_input(&op, self);
    sim_op_softmax_dim(&op, dim);
    sim_op_output(&op, out);
    if (op.error == ACLNN_SUCCESS && op.out.dtype != (int32_t)dtype)
        return ACLNN_ERR_PARAM_INVALID;
    return sim_op_create(&op, workspaceSize, executor);
}

EXPORT aclnnStatus aclnnCumsumGetWorkspaceSize(const aclTensor *self, int64_t dim, aclDataType dtype, aclTensor *out,
                                               WS_ARGS)
{
    return scan(&def_Cumsum, self, dim, dtype, out, workspaceSize, executor);
}
PHASE2(Cumsum)

EXPORT aclnnStatus aclnnCumprodGetWorkspaceSize(const aclTensor *self, const aclScalar *dim, aclDataType dtype,
                                                aclTensor *out, WS_ARGS)
{
    sim_op probe;
    sim_op_begin(&probe, &def_Cumprod);
    sim_op_param_scalar(&probe, 0, dim);
    if (probe.error != ACLNN_SUCCESS)
        return probe.error;
    return scan(&def_Cumprod, self, (int64_t)probe.p[0], dtype, out, workspaceSize, executor);
}
PHASE2(Cumprod)

/* (input, normalizedShape, weight, bias, eps, out, meanOut, rstdOut); weight,
 * bias, meanOut and rstdOut may be NULL */
DEF(LayerNorm, SIM_LAYER_NORM, NULL, 0)
EXPORT aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor *input, const aclIntArray *normalizedShape,
                                                  const aclTensor *weight, const aclTensor *bias, double eps,
                                                  aclTensor *out, aclTensor *meanOut, aclTensor *rstdOut,
                                                  WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_LayerNorm);
    sim_op_input(&op, input);
    sim_op_input_optional(&op, weight, 1.0);
    sim_op_input_optional(&op, bias, 0.0);
    sim_op_output(&op, out);
    sim_op_extra_output(&op, 0, meanOut);
    sim_op_extra_output(&op, 1, rstdOut);
    sim_op_layer_norm(&op, normalizedShape, eps);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(LayerNorm)

/* ---- indexing ---- */
DEF(Gather, SIM_GATHER, NULL, 0)
EXPORT aclnnStatus aclnnGatherGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                               aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Gather);
    sim_op_input(&op, self);
    sim_op_input(&op, index);
    sim_op_output(&op, out);
    sim_op_gather(&op, dim, 0);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Gather)

/* (weight, indices, out): out[i..., :] = weight[indices[i...], :] */
DEF(Embedding, SIM_GATHER, NULL, 0)
EXPORT aclnnStatus aclnnEmbeddingGetWorkspaceSize(const aclTensor *weight, const aclTensor *indices, aclTensor *out,
                                                  WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Embedding);
    sim_op_input(&op, weight);
    sim_op_input(&op, indices);
    sim_op_output(&op, out);
    sim_op_gather(&op, 0, 1);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Embedding)

/* ---- (tensors, dim, out) ---- */
#define CAT(Name, stack)                                                                             \
    static const sim_op_def def_##Name = {{"aclnn" #Name, sim_cat_finish}, SIM_ELEMENTWISE, NULL, 0}; \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensorList *tensors, int64_t dim,     \
                                                     aclTensor *out, WS_ARGS)                        \
    {                                                                                                \
        return sim_cat_create(&def_##Name, tensors, dim, stack, out, workspaceSize, executor);      \
    }                                                                                                \
    PHASE2(Name)
CAT(Cat, 0)
CAT(Stack, 1)

/* (self, other, rtol, atol, equalNan, out): |self - other| <= atol + rtol * |other|,
 * equal infinities close, NaN close to NaN only with equalNan */
ELEM_FN(IsClose, isnan(x[0]) || isnan(x[1]) ? p[2] != 0 && isnan(x[0]) && isnan(x[1])
                 : x[0] == x[1] ? 1 : isinf(x[0]) || isinf(x[1]) ? 0 : fabs(x[0] - x[1]) <= p[1] + p[0] * fabs(x[1]))
DEF(IsClose, SIM_ELEMENTWISE, fn_IsClose, 0)
EXPORT aclnnStatus aclnnIsCloseGetWorkspaceSize(const aclTensor *self, const aclTensor *other, double rtol,
                                                double atol, bool equalNan, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_IsClose);
    sim_op_input(&op, self);
    sim_op_input(&op, other);
    sim_op_param(&op, 0, rtol);
    sim_op_param(&op, 1, atol);
    sim_op_param(&op, 2, equalNan);
    sim_op_output(&op, out);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(IsClose)

/* ---- per line along a dim: values and their indices ---- */
static aclnnStatus select_op(const sim_op_def *def, const aclTensor *self, int64_t dim, int64_t k, int largest,
                             int dim_dropped, aclTensor *values, aclTensor *indices, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    sim_op_input(&op, self);
    sim_op_output(&op, values);
    sim_op_extra_output(&op, 0, indices);
    sim_op_select(&op, dim, k, largest, dim_dropped);
    return sim_op_create(&op, workspaceSize, executor);
}

/* (self, k, dim, largest, sorted, valuesOut, indicesOut); always sorted */
DEF(Topk, SIM_SELECT, NULL, SIM_SELECT_TOPK)
EXPORT aclnnStatus aclnnTopkGetWorkspaceSize(const aclTensor *self, int64_t k, int64_t dim, bool largest,
                                             bool sorted, aclTensor *valuesOut, aclTensor *indicesOut, WS_ARGS)
{
    (void)sorted;
    if (k < 0)
        return ACLNN_ERR_PARAM_INVALID;
    return select_op(&def_Topk, self, dim, k, largest, 0, valuesOut, indicesOut, workspaceSize, executor);
}
PHASE2(Topk)

/* (self, dim, keepdim, out, indices): the first largest (smallest) value of each line */
#define MAX_DIM(Name, largest)                                                                       \
    DEF(Name, SIM_SELECT, NULL, SIM_SELECT_TOPK)                                                     \
    EXPORT aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, \
                                                     aclTensor *out, aclTensor *indices, WS_ARGS)    \
    {                                                                                                \
        return select_op(&def_##Name, self, dim, 1, largest, !keepdim, out, indices, workspaceSize, executor); \
    }                                                                                                \
    PHASE2(Name)
MAX_DIM(MaxDim, 1)
MAX_DIM(MinDim, 0)

/* (self, dim, valuesOut, indicesOut): running max along dim */
DEF(Cummax, SIM_SELECT, NULL, SIM_SELECT_CUMMAX)
EXPORT aclnnStatus aclnnCummaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *valuesOut,
                                               aclTensor *indicesOut, WS_ARGS)
{
    return select_op(&def_Cummax, self, dim, SIM_SELECT_WHOLE_LINE, 1, 0, valuesOut, indicesOut, workspaceSize, executor);
}
PHASE2(Cummax)

/* ---- out[i] = self at an index computed from i ---- */
static aclnnStatus remap_op(const sim_op_def *def, const aclTensor *self, const aclIntArray *a,
                            const aclIntArray *b, int64_t n, int64_t dim, const aclScalar *fill, aclTensor *out,
                            WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    sim_op_input(&op, self);
    sim_op_output(&op, out);
    if (fill != NULL)
        sim_op_param_scalar(&op, 1, fill); /* read (and checked) here, handed to remap as its fill */
    sim_op_remap(&op, a, b, n, dim, fill != NULL ? op.p[1] : 0);
    return sim_op_create(&op, workspaceSize, executor);
}

/* (self, shifts, dims, out); empty dims: over the flattened tensor */
DEF(Roll, SIM_REMAP, NULL, SIM_REMAP_ROLL)
EXPORT aclnnStatus aclnnRollGetWorkspaceSize(const aclTensor *self, const aclIntArray *shifts,
                                             const aclIntArray *dims, aclTensor *out, WS_ARGS)
{
    return remap_op(&def_Roll, self, shifts, dims, 0, 0, NULL, out, workspaceSize, executor);
}
PHASE2(Roll)

/* (self, repeats, out): torch's Tensor.repeat */
DEF(Repeat, SIM_REMAP, NULL, SIM_REMAP_REPEAT)
EXPORT aclnnStatus aclnnRepeatGetWorkspaceSize(const aclTensor *self, const aclIntArray *repeats, aclTensor *out,
                                               WS_ARGS)
{
    return remap_op(&def_Repeat, self, repeats, NULL, 0, 0, NULL, out, workspaceSize, executor);
}
PHASE2(Repeat)

/* (self, pad, value, out) */
DEF(ConstantPadNd, SIM_REMAP, NULL, SIM_REMAP_PAD)
EXPORT aclnnStatus aclnnConstantPadNdGetWorkspaceSize(const aclTensor *self, const aclIntArray *pad,
                                                      const aclScalar *value, aclTensor *out, WS_ARGS)
{
    if (value == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    return remap_op(&def_ConstantPadNd, self, pad, NULL, 0, 0, value, out, workspaceSize, executor);
}
PHASE2(ConstantPadNd)

/* (self, diagonal, out): a 1-D self onto a diagonal of a square matrix, or a 2-D self's diagonal */
DEF(Diag, SIM_REMAP, NULL, SIM_REMAP_DIAG)
EXPORT aclnnStatus aclnnDiagGetWorkspaceSize(const aclTensor *self, int64_t diagonal, aclTensor *out, WS_ARGS)
{
    return remap_op(&def_Diag, self, NULL, NULL, diagonal, 0, NULL, out, workspaceSize, executor);
}
PHASE2(Diag)

/* (self, repeats, outputSize, out): each element of the flattened self
 * repeated; WithDim: (self, repeats, dim, outputSize, out) along dim */
static aclnnStatus repeat_interleave(const sim_op_def *def, const aclTensor *self, int64_t repeats, int64_t dim,
                                     int64_t outputSize, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    sim_op_input(&op, self);
    sim_op_output(&op, out);
    sim_op_remap(&op, NULL, NULL, repeats, dim, 0);
    if (op.error == ACLNN_SUCCESS && op.out.dims[op.p[2] < 0 ? 0 : (int)op.p[2]] != outputSize)
        return ACLNN_ERR_PARAM_INVALID;
    return sim_op_create(&op, workspaceSize, executor);
}

DEF(RepeatInterleaveInt, SIM_REMAP, NULL, SIM_REMAP_INTERLEAVE)
EXPORT aclnnStatus aclnnRepeatInterleaveIntGetWorkspaceSize(const aclTensor *self, int64_t repeats,
                                                            int64_t outputSize, aclTensor *out, WS_ARGS)
{
    return repeat_interleave(&def_RepeatInterleaveInt, self, repeats, SIM_REMAP_FLAT, outputSize, out,
                             workspaceSize, executor);
}
PHASE2(RepeatInterleaveInt)

DEF(RepeatInterleaveIntWithDim, SIM_REMAP, NULL, SIM_REMAP_INTERLEAVE)
EXPORT aclnnStatus aclnnRepeatInterleaveIntWithDimGetWorkspaceSize(const aclTensor *self, int64_t repeats, int64_t dim,
                                                                   int64_t outputSize, aclTensor *out, WS_ARGS)
{
    return repeat_interleave(&def_RepeatInterleaveIntWithDim, self, repeats, dim, outputSize, out, workspaceSize,
                             executor);
}
PHASE2(RepeatInterleaveIntWithDim)

/* ---- random fills: (selfRef, a, b, seed, offset) ----
 * Each element's value is a function of (seed, offset, its row-major index):
 * the same call fills the same values, a new offset new ones. The generator is
 * a counter hash (splitmix64), not CANN's Philox: the values differ from a
 * real NPU's, their distribution does not. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in (0, 1) from the key p[2] (the seed and offset hashed) and a counter */
static double unit(double key, double counter, uint64_t stream)
{
    uint64_t bits = mix64((uint64_t)key ^ mix64((uint64_t)counter * 2 + stream));
    return ((double)(bits >> 11) + 0.5) * 0x1.0p-53;
}

/* uniform [p0, p1); normal: Box-Muller, mean p0, std p1 */
ELEM_FN(InplaceUniform, p[0] + (p[1] - p[0]) * unit(p[2], x[0], 0))
ELEM_FN(InplaceNormal, p[0] + p[1] * sqrt(-2.0 * log(unit(p[2], x[0], 0))) * cos(2.0 * M_PI * unit(p[2], x[0], 1)))

static aclnnStatus random_fill(const sim_op_def *def, aclTensor *selfRef, double a, double b, int64_t seed,
                               int64_t offset, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, def);
    sim_op_input_flat_index(&op);
    sim_op_param(&op, 0, a);
    sim_op_param(&op, 1, b);
    /* 53 bits, so the key survives the double it is kept in */
    sim_op_param(&op, 2, (double)(mix64((uint64_t)seed ^ mix64((uint64_t)offset)) >> 11));
    sim_op_output(&op, selfRef);
    return sim_op_create(&op, workspaceSize, executor);
}

DEF(InplaceUniform, SIM_ELEMENTWISE, fn_InplaceUniform, 0)
EXPORT aclnnStatus aclnnInplaceUniformGetWorkspaceSize(aclTensor *selfRef, double from, double to, int64_t seed,
                                                       int64_t offset, WS_ARGS)
{
    if (!(from <= to))
        return ACLNN_ERR_PARAM_INVALID;
    return random_fill(&def_InplaceUniform, selfRef, from, to, seed, offset, workspaceSize, executor);
}
PHASE2(InplaceUniform)

DEF(InplaceNormal, SIM_ELEMENTWISE, fn_InplaceNormal, 0)
EXPORT aclnnStatus aclnnInplaceNormalGetWorkspaceSize(aclTensor *selfRef, float mean, float std, int64_t seed,
                                                      int64_t offset, WS_ARGS)
{
    if (!(std >= 0))
        return ACLNN_ERR_PARAM_INVALID;
    return random_fill(&def_InplaceNormal, selfRef, mean, std, seed, offset, workspaceSize, executor);
}
PHASE2(InplaceNormal)

/* (input, weight, bias, runningMean, runningVar, training, momentum, eps, output, saveMean, saveInvstd);
 * weight, bias, and in training the running stats and save outputs, may be NULL */
DEF(BatchNorm, SIM_BATCH_NORM, NULL, 0)
EXPORT aclnnStatus aclnnBatchNormGetWorkspaceSize(const aclTensor *input, const aclTensor *weight, const aclTensor *bias,
                                                  aclTensor *runningMean, aclTensor *runningVar, bool training,
                                                  double momentum, double eps, aclTensor *output, aclTensor *saveMean,
                                                  aclTensor *saveInvstd, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_BatchNorm);
    sim_op_input(&op, input);
    sim_op_output(&op, output);
    sim_op_extra_output(&op, 0, saveMean);
    sim_op_extra_output(&op, 1, saveInvstd);
    sim_op_batch_norm(&op, weight, bias, runningMean, runningVar, training, momentum, eps);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(BatchNorm)

/* ---- data-dependent sizes: out sized for every element, the first rows filled ---- */
/* (self, out): out (rows, self's rank), the indices of self's nonzero elements, row-major */
DEF(Nonzero, SIM_COMPACT, NULL, SIM_COMPACT_NONZERO)
EXPORT aclnnStatus aclnnNonzeroGetWorkspaceSize(const aclTensor *self, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Nonzero);
    sim_op_input(&op, self);
    sim_op_output(&op, out);
    sim_op_compact(&op);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Nonzero)

/* (self, mask, out): self's elements where mask (broadcast to self) is nonzero */
DEF(MaskedSelect, SIM_COMPACT, NULL, SIM_COMPACT_MASKED_SELECT)
EXPORT aclnnStatus aclnnMaskedSelectGetWorkspaceSize(const aclTensor *self, const aclTensor *mask, aclTensor *out,
                                                     WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_MaskedSelect);
    sim_op_input(&op, self);
    sim_op_input(&op, mask);
    sim_op_output(&op, out);
    sim_op_compact(&op);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(MaskedSelect)

/* (self, dim, index, src, reduce, out): reduce 0 none, 1 add, 2 multiply */
DEF(Scatter, SIM_SCATTER, NULL, 0)
EXPORT aclnnStatus aclnnScatterGetWorkspaceSize(const aclTensor *self, int64_t dim, const aclTensor *index,
                                                const aclTensor *src, int64_t reduce, aclTensor *out, WS_ARGS)
{
    sim_op op;
    sim_op_begin(&op, &def_Scatter);
    sim_op_input(&op, self);
    sim_op_input(&op, index);
    sim_op_input(&op, src);
    sim_op_output(&op, out);
    sim_op_scatter(&op, dim, reduce);
    return sim_op_create(&op, workspaceSize, executor);
}
PHASE2(Scatter)
