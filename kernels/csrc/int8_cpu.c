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

/*
 * y = x W^T (+ b) for a few rows of x with int8 weights read where they lie (VNNI): the decode GEMM
 * of a small batch under `--quantization int8`, bound by the weight read, in one call instead of
 * three (quantize, torch._int_mm, dequantize), each of which costs more in dispatch than a
 * one-row GEMM of int8 weights takes to read them. The rows of x are quantized here, as
 * quantize_rows_int8 does; the int32 sums are exact, and the dequantization is
 * dequantize_int32's, so y is bit-identical to the three-call path.
 *
 * VPDPBUSD multiplies unsigned bytes by signed ones: x's int8 values go in offset by 128 (u = q +
 * 128, 1..255), and 128 x (the sum of each weight row) comes off each sum (`weight_sums`, int32,
 * computed once at load). Layout: x [rows, in] float32 or bfloat16, W [out, in] int8 contiguous
 * (in a multiple of 64), scales float32, y [rows, out] in x's dtype. Output features are spread
 * over the OpenMP threads, INT8_ROW_TILE weight rows at a time so each loaded x vector feeds them.
 */
#define INT8_MAX_ROWS 4
#define INT8_ROW_TILE 8
#define INT8_PREFETCH 512 /* bytes ahead in each weight row (8 cache lines) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdlib.h>

/* int32 sums of rows x `tile` weight rows from n; `tile` and `rows` constant per call site. */
ALWAYS_INLINE void int8_sums(const uint8_t *xu, const int8_t *w, int32_t *sums, int rows,
                             int64_t in, int64_t n, int tile) {
    __m512i acc[INT8_MAX_ROWS][INT8_ROW_TILE];
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < tile; t++) acc[m][t] = _mm512_setzero_si512();
    for (int64_t k = 0; k < in; k += 64) {
        __m512i wv[INT8_ROW_TILE];
        /* The next tile's rows (contiguous after this tile's) at the rate this one is read: the
         * hardware prefetcher does not follow eight interleaved streams across tiles. */
        const char *next = (const char *)(w + (n + tile) * in + k * tile);
        for (int line = 0; line < tile * 64; line += 64) __builtin_prefetch(next + line);
        for (int t = 0; t < tile; t++) {
            const int8_t *row = w + (n + t) * in + k;
            __builtin_prefetch(row + INT8_PREFETCH); /* past the row's end: a no-op hint */
            wv[t] = _mm512_loadu_si512(row);
        }
        for (int m = 0; m < rows; m++) {
            const __m512i xv = _mm512_loadu_si512(xu + m * in + k);
            for (int t = 0; t < tile; t++) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], xv, wv[t]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < tile; t++) sums[m * INT8_ROW_TILE + t] = _mm512_reduce_add_epi32(acc[m][t]);
}

ALWAYS_INLINE void int8_store(const int32_t *sums, const int32_t *weight_sums,
                              const float *row_scales, const float *col_scales, const float *bias,
                              void *y, int rows, int64_t out, int64_t n, int tile, int bf16) {
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < tile; t++) {
            const int32_t exact = sums[m * INT8_ROW_TILE + t] - 128 * weight_sums[n + t];
            float v = (float)exact * row_scales[m];
            v = v * col_scales[n + t];
            if (bias) v = v + bias[n + t];
            if (bf16)
                ((uint16_t *)y)[m * out + n + t] = to_bf16(v);
            else
                ((float *)y)[m * out + n + t] = v;
        }
}

ALWAYS_INLINE void int8_rows(const uint8_t *xu, const int8_t *w, const int32_t *weight_sums,
                             const float *row_scales, const float *col_scales, const float *bias,
                             void *y, int rows, int64_t in, int64_t out, int num_threads,
                             int bf16) {
    const int64_t tiles = out / INT8_ROW_TILE;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
        int32_t sums[INT8_MAX_ROWS * INT8_ROW_TILE];
        int8_sums(xu, w, sums, rows, in, i * INT8_ROW_TILE, INT8_ROW_TILE);
        int8_store(sums, weight_sums, row_scales, col_scales, bias, y, rows, out,
                   i * INT8_ROW_TILE, INT8_ROW_TILE, bf16);
    }
    for (int64_t n = tiles * INT8_ROW_TILE; n < out; n++) {
        int32_t sums[INT8_MAX_ROWS * INT8_ROW_TILE];
        int8_sums(xu, w, sums, rows, in, n, 1);
        int8_store(sums, weight_sums, row_scales, col_scales, bias, y, rows, out, n, 1, bf16);
    }
}

/* Returns 0; 1 for arguments it does not take (rows outside [1, INT8_MAX_ROWS], in not a multiple
 * of 64); 2 when out of memory; 3 where it was built without AVX512-VNNI (below). */
int linear_int8(const void *x, const int8_t *w, const int32_t *weight_sums,
                const float *col_scales, const float *bias, void *y, int rows, int64_t in,
                int64_t out, int bf16, int num_threads) {
    if (rows < 1 || rows > INT8_MAX_ROWS || in % 64 || out < 1 || num_threads <= 0) return 1;
    int8_t *q = malloc((size_t)rows * (size_t)in);
    if (!q) return 2;
    float row_scales[INT8_MAX_ROWS];
    for (int m = 0; m < rows; m++) quantize_row(x, q, row_scales, m, in, bf16);
    uint8_t *xu = (uint8_t *)q; /* in place: q + 128 as an unsigned byte is q ^ 0x80 */
    for (int64_t i = 0; i < (int64_t)rows * in; i++) xu[i] ^= 0x80;
    /* `rows` and `bf16` constant in each branch: the compiler unrolls and keeps sums in registers */
#define ROWS(R)                                                                                   \
    (bf16 ? int8_rows(xu, w, weight_sums, row_scales, col_scales, bias, y, R, in, out,           \
                      num_threads, 1)                                                              \
          : int8_rows(xu, w, weight_sums, row_scales, col_scales, bias, y, R, in, out,           \
                      num_threads, 0))
    switch (rows) {
    case 1: ROWS(1); break;
    case 2: ROWS(2); break;
    case 3: ROWS(3); break;
    default: ROWS(4); break;
    }
#undef ROWS
    free(q);
    return 0;
}
#else
int linear_int8(const void *x, const int8_t *w, const int32_t *weight_sums,
                const float *col_scales, const float *bias, void *y, int rows, int64_t in,
                int64_t out, int bf16, int num_threads) {
    (void)x, (void)w, (void)weight_sums, (void)col_scales, (void)bias, (void)y, (void)rows;
    (void)in, (void)out, (void)bf16, (void)num_threads;
    return 3;
}
#endif
