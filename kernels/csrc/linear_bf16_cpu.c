/*
 * y = x W^T (+ b) for a few rows of x, reading bfloat16 weights where they lie: the decode GEMM of
 * a small batch on a CPU without bfloat16 dot products. Such a GEMM reads every weight once and
 * does a few flops with each, so it is bound by the weight read: oneDNN's packed float32 weights
 * read twice the bytes, and its emulated bfloat16 path pays for the emulation. Here each row of W
 * is widened in registers (a bfloat16 is the top half of a float32: zero-extend and shift) and
 * multiplied in float32, with float32 sums; the output is rounded to bfloat16 (to nearest even),
 * as oneDNN's bfloat16 kernels round theirs.
 *
 * Layout: x [rows, in] bfloat16 contiguous, W [out, in] bfloat16 contiguous (nn.Linear's own),
 * b [out] float32 or NULL, y [rows, out] bfloat16. Output features are spread over torch's OpenMP
 * threads (see paged_attention_cpu.c on why the same runtime); each thread takes eight weight rows
 * at a time so that every loaded x vector feeds eight, for at most MAX_ROWS rows of x.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define MAX_ROWS 4 /* rows x ROW_TILE float32 sums: at 4 rows that is every AVX-512 register */
#define ROW_TILE 8 /* weight rows per inner step: 8 streams keep more loads in flight than 2 or 4 */
#define PREFETCH 128 /* elements ahead (4 cache lines) in each weight row: +30% read rate here */
/* Each tile also prefetches the next tile, a step ahead of its own reads: the hardware prefetcher
 * does not follow eight interleaved row streams across tiles (+25% from memory, 18 -> 23 GB/s). */

/* ROW_TILE output features [n, n + ROW_TILE) for every row; `xf` is x widened, [rows, in]. */
static inline __attribute__((always_inline)) void tile(const float *xf, const uint16_t *w, const float *bias, uint16_t *y, int rows,
                 int in, int out, int n) {
    vec16 acc[MAX_ROWS][ROW_TILE];
    memset(acc, 0, sizeof acc);
    const uint16_t *wr[ROW_TILE];
    for (int t = 0; t < ROW_TILE; t++) wr[t] = w + (int64_t)(n + t) * in;
    for (int k = 0; k < in; k += LANES) {
        vec16 wv[ROW_TILE];
        /* The next tile's rows (contiguous after this tile's) at the rate this one is read. */
        const char *next = (const char *)(w + (int64_t)(n + ROW_TILE) * in + (int64_t)k * ROW_TILE);
        for (int line = 0; line < ROW_TILE * LANES * 2; line += 64) __builtin_prefetch(next + line);
        for (int t = 0; t < ROW_TILE; t++) {
            __builtin_prefetch(wr[t] + k + PREFETCH); /* past the row's end: a no-op hint */
            wv[t] = load(wr[t], k, 1);
        }
        for (int m = 0; m < rows; m++) {
            const vec16 xv = *(const vec16 *)(xf + (int64_t)m * in + k);
            for (int t = 0; t < ROW_TILE; t++) acc[m][t] += xv * wv[t];
        }
    }
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < ROW_TILE; t++) {
            const float b = bias ? bias[n + t] : 0.0f;
            y[(int64_t)m * out + n + t] = to_bf16(sum_lanes(acc[m][t]) + b);
        }
}

/* One output feature at a time: the last out % ROW_TILE. */
static void single(const float *xf, const uint16_t *w, const float *bias, uint16_t *y, int rows,
                   int in, int out, int n) {
    for (int m = 0; m < rows; m++) {
        vec16 acc = {0};
        for (int k = 0; k < in; k += LANES)
            acc += *(const vec16 *)(xf + (int64_t)m * in + k) * load(w, (int64_t)n * in + k, 1);
        y[(int64_t)m * out + n] = to_bf16(sum_lanes(acc) + (bias ? bias[n] : 0.0f));
    }
}

/* Returns 0, or 1 for arguments it does not take (rows outside [1, MAX_ROWS], in not a multiple
 * of 16), 2 when out of memory. */
int linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int rows,
                int in, int out, int num_threads) {
    if (rows < 1 || rows > MAX_ROWS || in % LANES != 0 || out < 1) return 1;
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)rows * (size_t)in);
    if (!xf) return 2;
    for (int64_t i = 0; i < (int64_t)rows * in; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, sizeof bits);
    }
    const int tiles = out / ROW_TILE;
    /* `rows` a constant in each loop: the compiler unrolls it and keeps the sums in registers */
#define TILES(R)                                                                                   \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                         \
    for (int i = 0; i < tiles; i++) tile(xf, w, bias, y, R, in, out, i * ROW_TILE)
    switch (rows) {
    case 1: TILES(1); break;
    case 2: TILES(2); break;
    case 3: TILES(3); break;
    default: TILES(4); break;
    }
#undef TILES
    for (int n = tiles * ROW_TILE; n < out; n++) single(xf, w, bias, y, rows, in, out, n);
    free(xf);
    return 0;
}
