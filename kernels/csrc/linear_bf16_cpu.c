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
