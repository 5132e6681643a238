/*
 * The two passes around an int8 GEMM (W8A8, `--quantization int8`): each activation row to int8
 * with its own scale before the GEMM, and the int32 products back to float after it, with both
 * scales and the bias applied in the same pass. The GEMM between them is oneDNN's (VNNI dot
 * products of int8 into int32, through torch._int_mm). Done with PyTorch ops each pass is four or
 * five operators over the whole tensor; at a decode batch of one their dispatch costs as much as
 * the GEMM itself.
 *
 * Both compute exactly what kernels/reference.py's quantize_rows_int8 and dequantize_int32
 * compute, in the same float32 operations in the same order (no fused multiply-adds), so the
 * results are bit-identical. Rows are contiguous; the row length (quantize) or column count
 * (dequantize) is a multiple of 16 (the Python side checks and falls back to the reference).
 */
#pragma GCC optimize("fp-contract=off") /* x * inv + magic must round twice, as in PyTorch */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vec16.h"

#define PARALLEL_ELEMENTS 16384 /* below this many elements one thread is faster */
#define INT8_MAX_LEVEL 127.0f   /* symmetric: -127 .. 127, never -128 */
#define ROUNDING_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 to nearest even */

/* Unaligned: rows of any length are read and written at any multiple of 16 elements. */
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16_unaligned __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE vec16 clamp16(vec16 v, float bound) {
    v = blend(v, (vec16){0} + bound, v > bound);
    return blend(v, (vec16){0} - bound, v < -bound);
}

ALWAYS_INLINE void quantize_row(const void *x, int8_t *q, float *scales, int64_t row,
                                int64_t size, int bf16) {
    const int64_t base = row * size;
    vec16 peak = {0};
    for (int64_t i = 0; i < size; i += LANES) {
        const vec16 v = load(x, base + i, bf16);
        const vec16 magnitude = blend(v, -v, v < 0);
        peak = blend(peak, magnitude, magnitude > peak);
    }
    float amax = 0.0f;
    for (int i = 0; i < LANES; i++) amax = peak[i] > amax ? peak[i] : amax;
    /* A row of zeros: scale 0 and every q 0, which dequantizes to the zeros it was. */
    const float inverse = amax > 0.0f ? INT8_MAX_LEVEL / amax : 0.0f;
    scales[row] = amax / INT8_MAX_LEVEL;
    for (int64_t i = 0; i < size; i += LANES) {
        const vec16 scaled = clamp16(load(x, base + i, bf16) * inverse, INT8_MAX_LEVEL);
        const vec16 rounded = (scaled + ROUNDING_MAGIC) - ROUNDING_MAGIC;
        *(i8x16 *)(q + base + i) =
            __builtin_convertvector(__builtin_convertvector(rounded, i32x16), i8x16);
    }
}

ALWAYS_INLINE void quantize_rows(const void *x, int8_t *q, float *scales, int64_t rows,
                                 int64_t size, int num_threads, int bf16) {
#pragma omp parallel for num_threads(num_threads) if (rows * size >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) quantize_row(x, q, scales, r, size, bf16);
}

/* q [rows, size] int8 and scales [rows] float32 of x [rows, size]: scale = max |x| / 127 and
 * q = round(clamp(x * (127 / max |x|), -127, 127)), to nearest even. Returns 0, or 1 for sizes it
 * does not take. */
int quantize_rows_int8(const void *x, int8_t *q, float *scales, int64_t rows, int64_t size,
                       int bf16, int num_threads) {
    if (rows < 0 || size <= 0 || size % LANES || num_threads <= 0) return 1;
    if (bf16)
        quantize_rows(x, q, scales, rows, size, num_threads, 1);
    else
        quantize_rows(x, q, scales, rows, size, num_threads, 0);
    return 0;
}

ALWAYS_INLINE void dequantize_rows(const int32_t *acc, const float *row_scales,
                                   const float *col_scales, const float *bias, void *out,
                                   int64_t rows, int64_t cols, int num_threads, int bf16) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float row_scale = row_scales[r];
        for (int64_t c = 0; c < cols; c += LANES) {
            const i32x16 products = *(const i32x16_unaligned *)(acc + r * cols + c);
            vec16 v = __builtin_convertvector(products, vec16) * row_scale;
            v = v * *(const vec16 *)(col_scales + c);
            if (bias) v = v + *(const vec16 *)(bias + c);
            store(out, r * cols + c, v, bf16);
        }
    }
}

/* out [rows, cols] = (float(acc) * row_scales[:, None]) * col_scales[None, :] (+ bias), rounded
 * to bfloat16 when bf16, from the int32 products acc [rows, cols]. bias may be NULL. Returns 0,
 * or 1 for sizes it does not take. */
int dequantize_int32(const int32_t *acc, const float *row_scales, const float *col_scales,
                     const float *bias, void *out, int64_t rows, int64_t cols, int bf16,
                     int num_threads) {
    if (rows < 0 || cols <= 0 || cols % LANES || num_threads <= 0) return 1;
    if (bf16)
        dequantize_rows(acc, row_scales, col_scales, bias, out, rows, cols, num_threads, 1);
    else
        dequantize_rows(acc, row_scales, col_scales, bias, out, rows, cols, num_threads, 0);
    return 0;
}
