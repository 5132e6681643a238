/*
 * Sixteen float32 lanes, shared by the CPU kernels: GCC/Clang vector extensions, which the compiler
 * keeps in one AVX-512 register (two AVX2 ones, four NEON ones), so the kernels stay portable C.
 *
 * A bfloat16 is the top half of a float32: widening 16 of them is a zero-extend and a shift (two
 * AVX-512F instructions, no AVX-512 BF16 needed); narrowing rounds to nearest even, as PyTorch's
 * and oneDNN's bfloat16 conversions do. `bf16` arguments are 0 or 1 and constant in each caller,
 * which is always inlined, so each kernel compiles to one branch-free path per dtype.
 */
#ifndef PDSERVE_VEC16_H
#define PDSERVE_VEC16_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t bf16x16 __attribute__((vector_size(32), aligned(2)));
#define LANES 16

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vec16 as_float(u32x16 bits) {
    vec16 out;
    memcpy(&out, &bits, sizeof out); /* a register move, not a copy */
    return out;
}

ALWAYS_INLINE u32x16 as_bits(vec16 value) {
    u32x16 out;
    memcpy(&out, &value, sizeof out);
    return out;
}

/* 16 bfloat16 as float32. GCC 12 compiles the generic conversion to two 8-lane zero-extends and
 * an insert; one 16-lane zero-extend does it (the glue kernels' loads were most of their
 * instructions: SiLU-and-multiply 2.1x faster with this and exp16_fused, issue #33). */
ALWAYS_INLINE vec16 from_bf16x16(bf16x16 half) {
#if defined(__AVX512F__)
    __m256i narrow;
    memcpy(&narrow, &half, sizeof narrow);
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);
    vec16 out;
    memcpy(&out, &wide, sizeof out);
    return out;
#else
    return as_float(__builtin_convertvector(half, u32x16) << 16);
#endif
}

/* 16 elements of a float32 or bfloat16 array from `index`, as float32. */
ALWAYS_INLINE vec16 load(const void *base, int64_t index, int bf16) {
    if (!bf16) return *(const vec16 *)((const float *)base + index);
    return from_bf16x16(*(const bf16x16 *)((const uint16_t *)base + index));
}

/* Bits of float32 `value` rounded to bfloat16 (nearest even; NaN stays a quiet NaN), low half 0. */
ALWAYS_INLINE u32x16 bf16_bits(vec16 value) {
    const u32x16 bits = as_bits(value);
    const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const u32x16 is_nan = (u32x16)((bits & 0x7fffffffu) > 0x7f800000u);
    return (rounded & ~is_nan) | ((bits | 0x400000u) & 0xffff0000u & is_nan);
}

#if defined(__AVX512BF16__)
/* 16 lanes rounded to bfloat16 by VCVTNEPS2BF16: one instruction where bf16_bits takes about
 * ten, which made the rounding most of the glue kernels' time (issue #33). It rounds to nearest
 * even and quiets NaNs exactly as bf16_bits does, but reads denormal inputs as zero; a vector
 * holding one takes bf16_bits instead, so the bits never depend on the CPU. */
ALWAYS_INLINE bf16x16 to_bf16x16(vec16 value) {
    __m512 v;
    memcpy(&v, &value, sizeof v);
    const __m512i bits = _mm512_castps_si512(v);
    const __mmask16 denormal =
        _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
        _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(denormal != 0, 0))
        return __builtin_convertvector(bf16_bits(value) >> 16, bf16x16);
    const __m256bh narrow = _mm512_cvtneps_pbh(v);
    bf16x16 out;
    memcpy(&out, &narrow, sizeof out);
    return out;
}
#else
ALWAYS_INLINE bf16x16 to_bf16x16(vec16 value) {
    return __builtin_convertvector(bf16_bits(value) >> 16, bf16x16);
}
#endif

/* `value` as the dtype stores it: rounded to bfloat16's precision, or unchanged in float32. */
ALWAYS_INLINE vec16 round_to(vec16 value, int bf16) {
    if (!bf16) return value;
    return from_bf16x16(to_bf16x16(value));
}

/* Stores 16 lanes at `index`, rounded to bfloat16 for a bfloat16 array. */
ALWAYS_INLINE void store(void *base, int64_t index, vec16 value, int bf16) {
    if (!bf16) {
        *(vec16 *)((float *)base + index) = value;
        return;
    }
    *(bf16x16 *)((uint16_t *)base + index) = to_bf16x16(value);
}

/* store(), returning the value as stored (rounded for bfloat16): one rounding, not two, where a
 * kernel goes on with what it wrote. */
ALWAYS_INLINE vec16 store_rounded(void *base, int64_t index, vec16 value, int bf16) {
    if (!bf16) {
        *(vec16 *)((float *)base + index) = value;
        return value;
    }
    const bf16x16 narrow = to_bf16x16(value);
    *(bf16x16 *)((uint16_t *)base + index) = narrow;
    return from_bf16x16(narrow);
}

/* One float32 -> bfloat16, rounding to nearest even (NaN stays NaN). */
ALWAYS_INLINE uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

ALWAYS_INLINE float sum_lanes(vec16 x) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += x[i];
    return total;
}

/* Two-vector shuffles: clang and GCC 12+ spell them __builtin_shufflevector, older GCC only has
 * __builtin_shuffle (a mask vector). Same lanes either way. */
#if defined(__clang__) || (__GNUC__ >= 12 && !defined(PDSERVE_GCC_SHUFFLE))
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i32x16){__VA_ARGS__})
#endif

/* Lane i of the result is the sum of the lanes of v[i]: sixteen horizontal sums in 15 shuffle-add
 * pairs (a transposing tree) instead of 16 x 15 dependent scalar adds. */
ALWAYS_INLINE vec16 sum_lanes16(const vec16 v[LANES]) {
    vec16 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* [v(2i) lanes 0-7 + 8-15 | v(2i+1) the same] */
        halves[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                            17, 18, 19, 20, 21, 22, 23) +
                    SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                            24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* four partial sums each of v(4i) .. v(4i+3) */
        quarters[i] = SHUFFLE(halves[2 * i], halves[2 * i + 1], 0, 1, 2, 3, 8, 9,
                                              10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      SHUFFLE(halves[2 * i], halves[2 * i + 1], 4, 5, 6, 7, 12,
                                              13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* two partial sums each of v(8i) .. v(8i+7) */
        eighths[i] = SHUFFLE(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8,
                                             9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                     SHUFFLE(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10,
                                             11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20,
                                   22, 24, 26, 28, 30) +
           SHUFFLE(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                                   23, 25, 27, 29, 31);
}

/* Lanes of `low` where `mask` is 0, of `high` where it is all ones. */
ALWAYS_INLINE vec16 blend(vec16 low, vec16 high, i32x16 mask) {
    const u32x16 m = (u32x16)mask;
    return as_float((as_bits(low) & ~m) | (as_bits(high) & m));
}

/* e^x in float32 to about 1 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor polynomial of
 * degree 7 (error below 1e-8 there), times 2^n built in the exponent bits. Below about -87.34
 * (where e^x is no normal float) it gives 0, as a flush to zero; between 88.38 and ln(FLT_MAX),
 * about 2.4e38 (within 1.5x); above, inf; NaN stays NaN. */
ALWAYS_INLINE vec16 exp16(vec16 x) {
    const vec16 high = (vec16){0} + 88.3762626647949f, low = (vec16){0} - 87.3365447504f;
    const i32x16 under = x < low, over = x > 88.72283935546875f;
    x = blend(x, high, x > high);
    x = blend(x, low, under);
    const vec16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x/ln2) */
    const vec16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln2 in two parts */
    vec16 p = r * (1.0f / 5040) + (1.0f / 720);
    p = p * r + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
    vec16 scale;
    memcpy(&scale, &exponent, sizeof scale);
    const vec16 e = blend(p * scale, (vec16){0} + INFINITY, over);
    return blend(e, (vec16){0}, under);
}

/* exp16 with fused multiply-adds where the CPU has them: the same reduction, polynomial and edges
 * (NaN stays NaN, 0 below -87.34, inf above 88.72), about half the dependent operations, within
 * a float32 ulp of exp16. For kernels whose file keeps a*b + c rounding twice elsewhere. */
ALWAYS_INLINE vec16 exp16_fused(vec16 value) {
#if defined(__AVX512F__)
    __m512 x;
    memcpy(&x, &value, sizeof x);
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447504f), _CMP_LT_OQ);
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x); /* NaN: the second operand, kept */
    x = _mm512_max_ps(_mm512_set1_ps(-87.3365447504f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 5040), _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 e = _mm512_scalef_ps(p, n);
    e = _mm512_mask_mov_ps(e, over, _mm512_set1_ps(INFINITY));
    e = _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
    vec16 out;
    memcpy(&out, &e, sizeof out);
    return out;
#else
    return exp16(value);
#endif
}

#endif
