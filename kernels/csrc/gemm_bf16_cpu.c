/*
 * y = x W^T (+ b) in bfloat16 for any number of rows of x, on CPUs with AVX-512 BF16: the GEMM of
 * decode batches (8-256 rows) and prefill chunks. VDPBF16PS multiplies 16 pairs of bfloat16 and
 * adds each pair's two products to one float32 lane. With a pair of x (x[m][2k], x[m][2k+1])
 * broadcast to every lane and lane j holding the pair (W[n+j][2k], W[n+j][2k+1]), one instruction
 * adds two terms to 16 outputs of row m: no horizontal sums anywhere, so the work is the dot
 * products alone. oneDNN's bfloat16 GEMM computes the same products (its outputs are equal, or
 * one rounding apart where it splits the sum over k), but on the narrow shapes of a small model's
 * decode step it ran at 0.6-0.9x this kernel's rate (Zen 4 VM, 2 threads, 64 rows: 576 x 576 at
 * 206 against 329 GFLOP/s, 1536 -> 576 at 248 against 370; 8-512 rows: never slower).
 *
 * Layout: x [rows, in] bfloat16, row stride `ldx` elements; b [out] float32 or NULL; y [rows, out]
 * bfloat16, contiguous. W is [out, in] in the pair order of kernels.cpu_ops.PairedWeight: each
 * group of 16 output features as [in / 2][16][2] (one 64-byte vector per pair of inputs), so a
 * group's weights are one sequential stream. `in` even, `out` a multiple of 16.
 *
 * The register block is MR rows of x by NR groups of 16 outputs: 8 x 3 = 24 float32 sums, 3
 * weight vectors and the broadcast, 28 of the 32 registers. Each weight vector serves 8 rows and
 * each broadcast 3 vectors. A thread takes a contiguous run of NR-group tiles (the output
 * features) and sweeps every row over each tile, so the tile's weights (in / 2 x 192 bytes:
 * 55 KiB at in = 576) come from memory once and from L2 for the other rows. Output rounding: to
 * nearest even (vec16.h's to_bf16x16), with the bias added in float32 first.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "decode_parts.h"
#include "vec16.h"

#define MR 8 /* rows of x per register block */
#define NR 3 /* groups of 16 output features per register block */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* Rows [0, mr) of x against groups [group, group + nr); inlined with constant `mr` and `nr`, so
 * the sums stay in registers. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t ldx,
                                                        const uint16_t *w, int64_t in,
                                                        const float *bias, uint16_t *y,
                                                        int64_t out, int64_t group, int mr,
                                                        int nr) {
    __m512 acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) acc[m][n] = _mm512_setzero_ps();
    const int64_t pairs = in / 2;
    const uint16_t *streams[NR];
    for (int n = 0; n < nr; n++) streams[n] = w + (group + n) * in * 16;
    const uint32_t *xpairs = (const uint32_t *)x; /* a pair of bfloat16 as one 32-bit lane */
    for (int64_t k = 0; k < pairs; k++) {
        __m512bh wv[NR];
        for (int n = 0; n < nr; n++) wv[n] = (__m512bh)_mm512_loadu_si512(streams[n] + k * 32);
        for (int m = 0; m < mr; m++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xpairs[m * (ldx / 2) + k]);
            for (int n = 0; n < nr; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            __m512 sums = acc[m][n];
            if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias + (group + n) * 16));
            vec16 value;
            memcpy(&value, &sums, sizeof value);
            *(bf16x16 *)(y + m * out + (group + n) * 16) = to_bf16x16(value);
        }
}

/* Every row of x against the `nr` groups from `group`, MR rows at a time. */
static void tile(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                 uint16_t *y, int64_t rows, int64_t in, int64_t out, int64_t group, int nr) {
    for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int mr = rows - m0 < MR ? (int)(rows - m0) : MR;
        const uint16_t *xm = x + m0 * ldx;
        uint16_t *ym = y + m0 * out;
        switch (mr * 10 + nr) {
#define BLOCK(R, C)                                                                                \
    case R * 10 + C: block(xm, ldx, w, in, bias, ym, out, group, R, C); break;
#define ROWS(R) BLOCK(R, 1) BLOCK(R, 2) BLOCK(R, 3)
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
#undef BLOCK
        }
    }
}

int gemm_bf16_pairs_share(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                          uint16_t *y, int64_t rows, int64_t in, int64_t out) {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t groups = out / 16, tiles = (groups + NR - 1) / NR;
    const int64_t first = tiles * thread / threads, end = tiles * (thread + 1) / threads;
    for (int64_t i = first; i < end; i++) {
        const int64_t group = i * NR;
        const int nr = groups - group < NR ? (int)(groups - group) : NR;
        tile(x, ldx, w, bias, y, rows, in, out, group, nr);
    }
    return 0;
}

int gemm_bf16_pairs_available(void) { return 1; }
#else
int gemm_bf16_pairs_share(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                          uint16_t *y, int64_t rows, int64_t in, int64_t out) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out;
    return 1;
}

int gemm_bf16_pairs_available(void) { return 0; }
#endif

/* Returns 0, or 1 for what it does not take: no rows, `in` odd or `ldx` < `in` or odd, `out` not
 * a positive multiple of 16, or a CPU (or compiler) without AVX-512 BF16. */
int gemm_bf16_pairs(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                    uint16_t *y, int64_t rows, int64_t in, int64_t out, int num_threads) {
    if (!gemm_bf16_pairs_available() || rows < 1 || in < 2 || in % 2 || ldx < in || ldx % 2 ||
        out < 16 || out % 16 || num_threads < 1)
        return 1;
#pragma omp parallel num_threads(num_threads)
    gemm_bf16_pairs_share(x, ldx, w, bias, y, rows, in, out);
    return 0;
}
