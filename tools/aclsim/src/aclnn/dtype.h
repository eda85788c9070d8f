/* Element access for the sim's aclnn data types: every op computes in double
 * and converts on load and store, so one kernel serves every dtype. (int64
 * values beyond 2^53 lose precision; the ops the sim runs never need them.) */
#ifndef ACLSIM_ACLNN_DTYPE_H
#define ACLSIM_ACLNN_DTYPE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "aclnn/aclnn_base.h"

/* Bytes per element, 0 for a type the sim does not support. */
static inline size_t sim_dtype_size(int32_t dtype)
{
    switch (dtype) {
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: return 1;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: return 8;
    default: return 0;
    }
}

static inline int sim_dtype_is_float(int32_t dtype)
{
    return dtype == ACL_FLOAT || dtype == ACL_FLOAT16 || dtype == ACL_BF16 || dtype == ACL_DOUBLE;
}

static inline double sim_bf16_load(uint16_t bits)
{
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t sim_bf16_store(double v)
{
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline double sim_load(int32_t dtype, const void *p)
{
    switch (dtype) {
    case ACL_FLOAT: { float v; memcpy(&v, p, 4); return v; }
    case ACL_FLOAT16: { _Float16 v; memcpy(&v, p, 2); return (double)v; }
    case ACL_BF16: { uint16_t v; memcpy(&v, p, 2); return sim_bf16_load(v); }
    case ACL_DOUBLE: { double v; memcpy(&v, p, 8); return v; }
    case ACL_INT8: return *(const int8_t *)p;
    case ACL_UINT8: return *(const uint8_t *)p;
    case ACL_BOOL: return *(const uint8_t *)p != 0;
    case ACL_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
    case ACL_UINT16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case ACL_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case ACL_UINT32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case ACL_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case ACL_UINT64: { uint64_t v; memcpy(&v, p, 8); return (double)v; }
    default: return 0;
    }
}

/* Integer stores truncate toward zero and saturate (NaN stores 0). */
static inline double sim_clamp_int(double v, double lo, double hi)
{
    if (isnan(v))
        return 0;
    v = trunc(v);
    return v < lo ? lo : v > hi ? hi : v;
}

static inline void sim_store(int32_t dtype, void *p, double v)
{
    switch (dtype) {
    case ACL_FLOAT: { float f = (float)v; memcpy(p, &f, 4); break; }
    case ACL_FLOAT16: { _Float16 h = (_Float16)v; memcpy(p, &h, 2); break; }
    case ACL_BF16: { uint16_t b = sim_bf16_store(v); memcpy(p, &b, 2); break; }
    case ACL_DOUBLE: memcpy(p, &v, 8); break;
    case ACL_BOOL: *(uint8_t *)p = v != 0; break;
    case ACL_INT8: *(int8_t *)p = (int8_t)sim_clamp_int(v, INT8_MIN, INT8_MAX); break;
    case ACL_UINT8: *(uint8_t *)p = (uint8_t)sim_clamp_int(v, 0, UINT8_MAX); break;
    case ACL_INT16: { int16_t x = (int16_t)sim_clamp_int(v, INT16_MIN, INT16_MAX); memcpy(p, &x, 2); break; }
    case ACL_UINT16: { uint16_t x = (uint16_t)sim_clamp_int(v, 0, UINT16_MAX); memcpy(p, &x, 2); break; }
    case ACL_INT32: { int32_t x = (int32_t)sim_clamp_int(v, INT32_MIN, INT32_MAX); memcpy(p, &x, 4); break; }
    case ACL_UINT32: { uint32_t x = (uint32_t)sim_clamp_int(v, 0, UINT32_MAX); memcpy(p, &x, 4); break; }
    case ACL_INT64: { int64_t x = (int64_t)sim_clamp_int(v, -9.2233720368547758e18, 9.2233720368547748e18); memcpy(p, &x, 8); break; }
    case ACL_UINT64: { uint64_t x = (uint64_t)sim_clamp_int(v, 0, 1.8446744073709550e19); memcpy(p, &x, 8); break; }
    default: break;
    }
}

#endif
