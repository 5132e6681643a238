/*
 * y = x W^T (+ b) for a few rows of x, reading bfloat16 weights where they lie: the decode GEMM of
 * a small batch on a CPU without bfloat16 dot products. Such a GEMM reads every weight once and
 * does a few flops with each, so it is bound by the weight read: oneDNN's packed float32 weights
 * read twice the bytes, and its emulated bfloat16 path pays for the emulation. Here each row of W
 * is widened in registers (a bfloat16 is the top half of a float32: zero-extend and shift) and
 * multiplied in float32, with float32 sums; the output is rounded to bfloat16 (to nearest even),
 * as oneDNN's bfloat16 kernels round theirs.
 *
 * Layout: x [rows, in] bfloat16 contiguous, b [out] float32 or NULL, y [rows, out] bfloat16.
 * W is [out, in] bfloat16 in the row-tiled order of kernels.cpu_ops.TiledWeight: each group of
 * `row_tile` (4 or 8) output rows is stored as [in / 16][row_tile][16] (16 inputs of each of its
 * rows in turn), the last out % row_tile rows as they are. A thread reading its tiles then reads
 * one sequential stream, which the hardware prefetcher follows at the rate of a plain sum; read
 * in nn.Linear's own layout, a tile was `row_tile` interleaved streams, and the prefetcher lost
 * them (on a Zen 4 VM: 27-29 against 32-33 GB/s for a model's 121 GEMVs at one row of x). At 3-4
 * rows of x a step does more arithmetic per byte and the prefetcher falls behind: there the tile
 * prefetches PREFETCH_BYTES ahead (28 -> 31 GB/s at 4 rows; at 1-2 rows it only slowed the read).
 *
 * Output features are spread over torch's OpenMP threads (see paged_attention_cpu.c on why the
 * same runtime); each thread takes a contiguous run of tiles so that every loaded x vector feeds
 * `row_tile` weight rows, for at most MAX_ROWS rows of x. Which tile is faster depends on the CPU,
 * so the engine times both at start (services/engine/model/gemm_choice.py: paths small-batch and
 * small-batch-4); the results are the same bit for bit (each output's sum runs in one order).
 *
 * On a CPU with AVX-512 BF16 a third variant (`linear_bf16_dot`, path small-batch-dot) reads the
 * 4-row tiles with VDPBF16PS: 16 bfloat16 pairs of x and of a weight row, as stored, multiplied
 * exactly and summed into 8 float32 lanes. Nothing is widened, so a 16-input step of a tile is
 * 4 weight loads and one dot product per row of x and weight row, where widening costs two
 * instructions per weight vector and a multiply-add per 16 products: at 3-4 rows of x the
 * float32 kernel falls behind the weight read, this one less (Zen 4 VM: 1.5x at 4 rows; 1.25x
 * oneDNN's bfloat16 GEMM at 8). Past about 12 rows oneDNN is as fast (DOT_MAX_ROWS caps it).
 * It takes up to DOT_MAX_ROWS rows, in blocks of up to 6 (6 rows x 4 weight rows of sums, the
 * 4 weight vectors and x: 29 of the 32 registers), each block re-reading the tile from L1.
 * Its sums run in another order than the float32 kernel's: another path, other rounding.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_parts.h"
#include "vec16.h"

#define MAX_ROWS 4 /* rows x 8-row tile float32 sums: at 4 rows that is every AVX-512 register */
#define MAX_ROW_TILE 8 /* weight rows per inner step: 4 or 8 (the caller's row_tile) */
#define PREFETCH_BYTES 2048 /* ahead in the tiled stream, at 3-4 rows of x (see above) */

/* `row_tile` output features [n, n + row_tile) for every row, from the tile at `w + n * in`;
 * `xf` is x widened, [rows, in]. Always inlined with constant `rows` and `row_tile`: the sums
 * stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *xf, const uint16_t *w,
                                                       const float *bias, uint16_t *y, int rows,
                                                       int row_tile, int in, int out, int n) {
    vec16 acc[MAX_ROWS][MAX_ROW_TILE];
    memset(acc, 0, sizeof acc);
    const uint16_t *block = w + (int64_t)n * in; /* [in / LANES][row_tile][LANES] */
    for (int k = 0; k < in; k += LANES, block += row_tile * LANES) {
        if (rows >= 3) /* past the weight's end: a no-op hint */
            for (int line = 0; line < row_tile * LANES * 2; line += 64)
                __builtin_prefetch((const char *)block + PREFETCH_BYTES + line);
        vec16 wv[MAX_ROW_TILE];
        for (int t = 0; t < row_tile; t++) wv[t] = load(block, t * LANES, 1);
        for (int m = 0; m < rows; m++) {
            const vec16 xv = *(const vec16 *)(xf + (int64_t)m * in + k);
            for (int t = 0; t < row_tile; t++) acc[m][t] += xv * wv[t];
        }
    }
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < row_tile; t++) {
            const float b = bias ? bias[n + t] : 0.0f;
            y[(int64_t)m * out + n + t] = to_bf16(sum_lanes(acc[m][t]) + b);
        }
}

/* One output feature at a time: the last out % row_tile, stored as plain rows. */
static void single(const float *xf, const uint16_t *w, const float *bias, uint16_t *y, int rows,
                   int in, int out, int n) {
    for (int m = 0; m < rows; m++) {
        vec16 acc = {0};
        for (int k = 0; k < in; k += LANES)
            acc += *(const vec16 *)(xf + (int64_t)m * in + k) * load(w, (int64_t)n * in + k, 1);
        y[(int64_t)m * out + n] = to_bf16(sum_lanes(acc) + (bias ? bias[n] : 0.0f));
    }
}

/* This thread's share of y (decode_parts.h): a contiguous run of tiles, with `rows` and
 * `row_tile` made constants; the features past the last whole tile on the last thread. */
void linear_bf16_share(const float *xf, const uint16_t *w, const float *bias, uint16_t *y,
                       int rows, int row_tile, int in, int out) {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int tiles = out / row_tile;
    const int first = tiles * thread / threads, end = tiles * (thread + 1) / threads;
#define RANGE(R, T)                                                                                \
    for (int i = first; i < end; i++) tile(xf, w, bias, y, R, T, in, out, i * T)
    switch (rows * 10 + row_tile) {
    case 14: RANGE(1, 4); break;
    case 24: RANGE(2, 4); break;
    case 34: RANGE(3, 4); break;
    case 44: RANGE(4, 4); break;
    case 18: RANGE(1, 8); break;
    case 28: RANGE(2, 8); break;
    case 38: RANGE(3, 8); break;
    default: RANGE(4, 8); break;
    }
#undef RANGE
    if (thread == threads - 1)
        for (int n = tiles * row_tile; n < out; n++) single(xf, w, bias, y, rows, in, out, n);
}

#define DOT_MAX_ROWS 16 /* kernels.cpu_ops.LINEAR_DOT_MAX_ROWS: past it oneDNN is as fast */
#define DOT_BLOCK 6      /* rows of x per pass over a tile (see the top) */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* The sums of four 8-lane vectors. */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Output features [n, n + 4) of rows [m0, m0 + block) from the 4-row tile at `tile`; inlined
 * with a constant `block` so that the sums stay in registers. The first block of a tile asks for
 * the stream PREFETCH_BYTES ahead where it has 3 rows or more (as the float32 kernel: at fewer
 * the hardware prefetcher keeps up, and the hints cost a single stream 4-5%); the later blocks
 * read the tile again from L1. */
static inline __attribute__((always_inline)) void dot_block(const uint16_t *x,
                                                            const uint16_t *tile,
                                                            const float *bias, uint16_t *y,
                                                            int m0, int block, int in, int out,
                                                            int n, int prefetch) {
    __m256 acc[DOT_BLOCK][4];
    for (int m = 0; m < block; m++)
        for (int t = 0; t < 4; t++) acc[m][t] = _mm256_setzero_ps();
    const uint16_t *step = tile; /* [in / 16][4][16] */
    for (int k = 0; k < in; k += LANES, step += 4 * LANES) {
        if (prefetch && block >= 3)
            for (int line = 0; line < 4 * LANES * 2; line += 64)
                __builtin_prefetch((const char *)step + PREFETCH_BYTES + line);
        __m256bh w[4];
        for (int t = 0; t < 4; t++) w[t] = (__m256bh)_mm256_loadu_si256((const void *)(step + t * LANES));
        for (int m = 0; m < block; m++) {
            const __m256bh xv =
                (__m256bh)_mm256_loadu_si256((const void *)(x + (int64_t)(m0 + m) * in + k));
            for (int t = 0; t < 4; t++) acc[m][t] = _mm256_dpbf16_ps(acc[m][t], xv, w[t]);
        }
    }
    float b[4] = {0};
    if (bias) memcpy(b, bias + n, sizeof b);
    for (int m = 0; m < block; m++) {
        float sums[4];
        _mm_storeu_ps(sums, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        for (int t = 0; t < 4; t++) /* rounded as the float32 kernel rounds (denormals too) */
            y[(int64_t)(m0 + m) * out + n + t] = to_bf16(sums[t] + b[t]);
    }
}

/* Every row of x against the 4-row tile of output features [n, n + 4), in blocks as even as
 * they can be (8 rows: 4 + 4, not 6 + 2, whose second pass reads the tile for two rows). */
static void dot_tile(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                     int rows, int in, int out, int n) {
    const uint16_t *tile = w + (int64_t)n * in;
    const int passes = (rows + DOT_BLOCK - 1) / DOT_BLOCK, even = (rows + passes - 1) / passes;
    for (int m0 = 0; m0 < rows; m0 += even) {
        const int block = rows - m0 < even ? rows - m0 : even, first = m0 == 0;
        switch (block) {
        case 1: dot_block(x, tile, bias, y, m0, 1, in, out, n, first); break;
        case 2: dot_block(x, tile, bias, y, m0, 2, in, out, n, first); break;
        case 3: dot_block(x, tile, bias, y, m0, 3, in, out, n, first); break;
        case 4: dot_block(x, tile, bias, y, m0, 4, in, out, n, first); break;
        case 5: dot_block(x, tile, bias, y, m0, 5, in, out, n, first); break;
        default: dot_block(x, tile, bias, y, m0, DOT_BLOCK, in, out, n, first); break;
        }
    }
}

/* One output feature stored as a plain row (the last out % 4). */
static void dot_single(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                       int rows, int in, int out, int n) {
    for (int m = 0; m < rows; m++) {
        __m256 acc = _mm256_setzero_ps();
        for (int k = 0; k < in; k += LANES)
            acc = _mm256_dpbf16_ps(
                acc, (__m256bh)_mm256_loadu_si256((const void *)(x + (int64_t)m * in + k)),
                (__m256bh)_mm256_loadu_si256((const void *)(w + (int64_t)n * in + k)));
        float sums[4];
        _mm_storeu_ps(sums, sum4(acc, _mm256_setzero_ps(), _mm256_setzero_ps(),
                                 _mm256_setzero_ps()));
        y[(int64_t)m * out + n] = to_bf16(sums[0] + (bias ? bias[n] : 0.0f));
    }
}

int linear_bf16_dot_share(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                          int rows, int in, int out) {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int tiles = out / 4;
    const int first = tiles * thread / threads, end = tiles * (thread + 1) / threads;
    for (int i = first; i < end; i++) dot_tile(x, w, bias, y, rows, in, out, i * 4);
    if (thread == threads - 1)
        for (int n = tiles * 4; n < out; n++) dot_single(x, w, bias, y, rows, in, out, n);
    return 0;
}

int linear_bf16_dot_available(void) { return 1; }
#else
int linear_bf16_dot_share(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                          int rows, int in, int out) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out;
    return 1;
}

int linear_bf16_dot_available(void) { return 0; }
#endif

/* y = x W^T (+ b) by the dot-product variant (see the top) over the 4-row tiles of W. Returns 0,
 * or 1 for what it does not take: rows outside [1, DOT_MAX_ROWS], in not a multiple of 16, or a
 * CPU (or compiler) without AVX-512 BF16. */
int linear_bf16_dot(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                    int rows, int in, int out, int num_threads) {
    if (!linear_bf16_dot_available() || rows < 1 || rows > DOT_MAX_ROWS || in % LANES != 0 ||
        out < 1)
        return 1;
#pragma omp parallel num_threads(num_threads)
    linear_bf16_dot_share(x, w, bias, y, rows, in, out);
    return 0;
}

/* Returns 0, or 1 for arguments it does not take (rows outside [1, MAX_ROWS], in not a multiple
 * of 16, row_tile not 4 or 8), 2 when out of memory. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int rows,
                int in, int out, int num_threads, int row_tile) {
    if (rows < 1 || rows > MAX_ROWS || in % LANES != 0 || out < 1) return 1;
    if (row_tile != 4 && row_tile != 8) return 1;
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)rows * (size_t)in);
    if (!xf) return 2;
    for (int64_t i = 0; i < (int64_t)rows * in; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, sizeof bits);
    }
#pragma omp parallel num_threads(num_threads)
    linear_bf16_share(xf, w, bias, y, rows, row_tile, in, out);
    free(xf);
    return 0;
}
