/*
 * Paged decode attention for the CPU: each sequence's single query token attends to its context
 * by reading the KV blocks where they lie in the cache (no gather copy). The cache is float32 or
 * bfloat16; so are the query and the output, independently of the cache (`io_bf16`); the scores,
 * softmax and sums are float32 in every case, the output rounded once (where the values are
 * weighed with VDPBF16PS, the probabilities are rounded to bfloat16 first: weigh_values_dp). A
 * bfloat16 element is the top half of a float32, so widening 16 of them is a zero-extend and a
 * shift (two AVX-512F instructions, no AVX-512 BF16 needed), and the cache read, the bandwidth
 * that bounds decode attention, is halved.
 *
 * One work item is one (sequence, KV head) pair: its GQA group of query heads shares every key
 * and value row it reads, so the group reads each block together. With a bfloat16 query and
 * cache on a CPU with AVX-512 BF16 the scores come from VDPBF16PS on the rows as stored, and so
 * does the weighted sum of the values where the group's sums fit in registers; a group of up to
 * four heads sums the values with all its output rows in registers. Items are spread
 * over OpenMP threads. Built at first use by kernels/cpu_ops.py (cc -O3 -march=native
 * -fopenmp) and loaded after torch: the dynamic loader then binds this library's libgomp.so.1
 * to the copy torch already loaded, so the kernel runs on torch's own worker threads. (A second
 * thread pool, even plain pthreads, competes on the same cores with torch's workers, which spin
 * between ops: that made the kernel 2x slower inside the engine than alone.)
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_parts.h" /* Job */
#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* Pass 1 of a bfloat16 cache with a bfloat16 query, on CPUs with AVX-512 BF16: VDPBF16PS takes
 * 32 bfloat16 pairs of the query and a key row and adds their products to 16 float32 lanes, so a
 * 64-wide row costs two loads and two instructions per head, where widening it costs eight and
 * a store and reload besides. The products are exact and summed in float32, as the widened path
 * does, in another order. */
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define MAX_CHUNKS 16 /* head_dim up to 256 */
#define MAX_GROUP 64  /* query heads per KV head (cpu_ops.MAX_GROUP) */
#define PREFETCH_BLOCKS 2 /* blocks ahead whose rows are asked for (1 -> 2: -10% from memory) */

static inline const void *at(const void *base, int64_t index, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)base + index)
                : (const void *)((const float *)base + index);
}

/* Ask for a block's rows of this head (`count` rows of `row_bytes`, `stride_bytes` apart) ahead
 * of their use: blocks lie anywhere in the pool, so the hardware prefetcher cannot guess the next
 * one. Only this head's rows: the block's other heads are other work items' (prefetching the
 * whole block span for every head cost a sixth of the kernel's time at 64 sequences). Into L2,
 * not L1 (locality 2, PREFETCHT1): two blocks ahead are 64 lines in flight, more than L1 tracks
 * misses for, so L1 prefetches were dropped or stalled the loads; into L2 the kernel took 15-17
 * instead of 23-24 ms over a 1 GiB cache at 64 sequences of 192 tokens (Zen 4). */
static inline void prefetch_rows(const void *start, int64_t count, int64_t stride_bytes,
                                 int64_t row_bytes) {
    for (int64_t r = 0; r < count; r++)
        for (int64_t offset = 0; offset < row_bytes; offset += 64)
            __builtin_prefetch((const char *)start + r * stride_bytes + offset, 0, 2);
}

/* The first `count` (1-16) lanes of `dots` to `dst`: a whole vector when all 16 (a memcpy of a
 * runtime size compiles to `rep movs`, which cost 6% of the kernel at 64 sequences). */
ALWAYS_INLINE void store_scores(float *dst, vec16 dots, int64_t count) {
    if (count == LANES)
        store(dst, 0, dots, 0);
    else
        memcpy(dst, &dots, sizeof(float) * (size_t)count);
}

/* The largest lane and the sum of the lanes, each through a tree of four shuffles (a scalar loop
 * over 16 lanes is a chain of 16 dependent operations). */
ALWAYS_INLINE float max_lanes(vec16 x) {
    vec16 y = SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = blend(x, y, y > x);
    y = SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = blend(x, y, y > x);
    y = SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = blend(x, y, y > x);
    y = SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    x = blend(x, y, y > x);
    return x[0];
}

ALWAYS_INLINE float tree_sum(vec16 x) {
    x += SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

/* Softmax of a row of scores, but for the division: `row` holds `span` floats (a multiple of
 * 16: the context's scores, then -inf up to `span`, so every pass runs whole vectors and the
 * padding comes out as 0); each becomes exp(score - max). Returns 1 / their sum, which pass 2
 * applies once to each output row instead of to every score. */
static inline float softmax_numerators(float *row, int64_t span) {
    vec16 top = load(row, 0, 0);
    for (int64_t t = LANES; t < span; t += LANES) {
        const vec16 v = load(row, t, 0);
        top = blend(top, v, v > top);
    }
    const float maximum = max_lanes(top);
    vec16 sums = {0};
    for (int64_t t = 0; t < span; t += LANES) {
        const vec16 e = exp16(load(row, t, 0) - maximum);
        store(row, t, e, 0);
        sums += e;
    }
    return 1.0f / tree_sum(sums);
}

/* `count` rows of `chunks` x 16 elements from `index`, `token_stride` apart, as float32: the
 * cache's own rows for float32, else widened into `scratch` (so that every head of a GQA group
 * reads them without widening them again). `*stride` gets the returned rows' stride. */
ALWAYS_INLINE const float *rows16(const void *cache, int64_t index, int64_t token_stride,
                                  int64_t count, int64_t chunks, float *scratch, int64_t *stride,
                                  int bf16) {
    if (!bf16) {
        *stride = token_stride;
        return (const float *)cache + index;
    }
    *stride = chunks * LANES;
    for (int64_t r = 0; r < count; r++)
        for (int64_t c = 0; c < chunks; c++)
            store(scratch, r * chunks * LANES + c * LANES,
                  load(cache, index + r * token_stride + c * LANES, 1), 0);
    return scratch;
}

/* Where this head's rows of the block holding tokens [start, start + block_size) begin (in
 * elements), and through `rows` how many of them the context has; this head's rows of the block
 * PREFETCH_BLOCKS ahead are prefetched (and at the first block, those before it). Past the last
 * block the prefetch goes on into `then`, the cache the next pass reads (NULL: none), so that
 * pass starts with its first blocks on the way. */
ALWAYS_INLINE int64_t block_rows(const Job *job, const void *cache, const void *then,
                                 const int32_t *table, int64_t head_offset, int64_t start,
                                 int64_t len, int bf16, int64_t *rows) {
    const int64_t bs = job->block_size, element = bf16 ? 2 : 4;
    const int64_t stride_bytes = job->token_stride * element, row_bytes = job->head_dim * element;
    *rows = len - start < bs ? len - start : bs;
    const int64_t block = start / bs, used = (len + bs - 1) / bs;
    for (int64_t ahead = block == 0 ? 1 : PREFETCH_BLOCKS; ahead <= PREFETCH_BLOCKS; ahead++)
        if (block + ahead < used)
            prefetch_rows(at(cache, table[block + ahead] * job->block_stride + head_offset, bf16),
                          bs, stride_bytes, row_bytes);
        else if (then != NULL && block + ahead - used < used)
            prefetch_rows(
                at(then, table[block + ahead - used] * job->block_stride + head_offset, bf16), bs,
                stride_bytes, row_bytes);
    return table[block] * job->block_stride + head_offset;
}

#if HAVE_DPBF16
/* Pass 1 with VDPBF16PS (above): `qbf16` holds the group's query rows in bfloat16, as the
 * caller got them; `chunks` is even (rows of 32 bfloat16 pairs). Scores go where pass 1 puts
 * them. */
ALWAYS_INLINE void dot_blocks_bf16(const Job *job, const int32_t *table, int64_t head_offset,
                                   int64_t len, int64_t span, const uint16_t *qbf16,
                                   int64_t group, int64_t chunks, float *scores) {
    const int64_t bs = job->block_size, dim = chunks * LANES, pairs = chunks / 2;
    const uint16_t *cache = (const uint16_t *)job->key_cache;
    for (int64_t start = 0; start < len; start += bs) {
        int64_t rows;
        const uint16_t *block =
            cache + block_rows(job, cache, job->value_cache, table, head_offset, start, len, 1,
                                 &rows);
        for (int64_t first = 0; first < rows; first += LANES) {
            const int64_t count = rows - first < LANES ? rows - first : LANES;
            const uint16_t *keys = block + first * job->token_stride;
            for (int64_t g = 0; g < group; g++) {
                __m512bh qv[MAX_CHUNKS / 2];
                for (int64_t c = 0; c < pairs; c++)
                    qv[c] = (__m512bh)_mm512_loadu_si512(qbf16 + g * dim + c * 2 * LANES);
                vec16 acc[LANES];
                for (int64_t r = 0; r < LANES; r++) {
                    __m512 sum = _mm512_setzero_ps();
                    if (r < count)
                        for (int64_t c = 0; c < pairs; c++)
                            sum = _mm512_dpbf16_ps(
                                sum, qv[c],
                                (__m512bh)_mm512_loadu_si512(keys + r * job->token_stride +
                                                             c * 2 * LANES));
                    memcpy(&acc[r], &sum, sizeof sum);
                }
                const vec16 dots = sum_lanes16(acc) * job->scale;
                store_scores(scores + g * span + start + first, dots, count);
            }
        }
    }
}
#endif

#if HAVE_DPBF16
/* Pass 2 with VDPBF16PS, for a bfloat16 cache and query on CPUs with AVX-512 BF16, a group of
 * `group` heads (constants, `group` x `chunks` at most 16 sums in registers) and an even block
 * size. Two value rows t, t+1 are interleaved (VPUNPCK{L,H}WD) into pairs (v[t][d], v[t+1][d]),
 * and one instruction adds p[t] v[t][d] + p[t+1] v[t+1][d] to 16 outputs of a head: half the
 * instructions of widening each row and a multiply-add per row. The price: each head's
 * probabilities are rounded to bfloat16 first (as flash attention rounds P on GPUs), and their
 * rounded sum normalises them, so the weights still sum to one; the sums are float32. An output
 * then differs from the widening pass's by a rounding of the probabilities (a relative 2^-9 per
 * term), the order of the lanes comes back at the end. Scores are rounded in place: row g's
 * bfloat16 values take the first half of its floats. */
ALWAYS_INLINE void weigh_values_dp(const Job *job, const int32_t *table, int64_t head_offset,
                                   int64_t len, int64_t span, float *scores, float *out,
                                   int64_t chunks, int64_t group) {
    const int64_t bs = job->block_size, dim = chunks * LANES;
    float inverse[4];
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * span;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < span; t += LANES) { /* span: a multiple of 16 (see pass 1) */
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(row + t));
            bf16x16 narrow; /* widened back by a shift: GCC before 12 lacks _mm512_cvtpbh_ps */
            memcpy(&narrow, &rounded, sizeof narrow);
            const vec16 wide = from_bf16x16(narrow);
            __m512 widened;
            memcpy(&widened, &wide, sizeof widened);
            sum = _mm512_add_ps(sum, widened);
            _mm256_storeu_si256((__m256i *)((uint16_t *)row + t), (__m256i)rounded);
        }
        inverse[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 acc[4][MAX_CHUNKS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    const uint16_t *cache = (const uint16_t *)job->value_cache;
    for (int64_t start = 0; start < len; start += bs) {
        int64_t rows;
        const uint16_t *block =
            cache + block_rows(job, cache, NULL, table, head_offset, start, len, 1, &rows);
        for (int64_t r = 0; r < rows; r += 2) {
            const uint16_t *a = block + r * job->token_stride, *b = a + job->token_stride;
            const int two = r + 1 < rows; /* the context's last token may lack its pair */
            __m512bh p[4];
            for (int64_t g = 0; g < group; g++) /* (p[t], p[t+1]), both rounded: one 32-bit lane */
                p[g] = (__m512bh)_mm512_set1_epi32(
                    ((const int32_t *)(scores + g * span))[(start + r) / 2]);
            for (int64_t c = 0; c < chunks; c += 2) {
                const __m512i va = _mm512_loadu_si512(a + c * LANES);
                const __m512i vb = two ? _mm512_loadu_si512(b + c * LANES) : _mm512_setzero_si512();
                const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(va, vb);
                const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(va, vb);
                for (int64_t g = 0; g < group; g++) {
                    acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p[g], low);
                    acc[g][c + 1] = _mm512_dpbf16_ps(acc[g][c + 1], p[g], high);
                }
            }
        }
    }
    /* Lane i of acc[c] holds element 8(i / 4) + i % 4 of the 32 at c * 16, acc[c + 1] the four
     * after each of those: back in order, 16 at a time. */
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c += 2) {
            vec16 low, high;
            memcpy(&low, &acc[g][c], sizeof low);
            memcpy(&high, &acc[g][c + 1], sizeof high);
            const vec16 first =
                SHUFFLE(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const vec16 second =
                SHUFFLE(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            store(out, g * dim + c * LANES, first * inverse[g], 0);
            store(out, g * dim + (c + 1) * LANES, second * inverse[g], 0);
        }
}
#endif
/* Pass 2 for a group of `group` (a constant, at most 4) heads: out[g] = sum over the context of
 * p[g][t] * value[t], every output row in registers from the first value row to the last, and
 * each value row widened once, in registers, for all the group's heads. The additions per
 * output element come in the order of the tokens, as in the sixteen-row path. */
ALWAYS_INLINE void weigh_values(const Job *job, const int32_t *table, int64_t head_offset,
                                int64_t len, int64_t span, const float *scores,
                                const float *inverse, float *out, int bf16, int64_t chunks,
                                int64_t group) {
    const int64_t bs = job->block_size;
    /* A bfloat16 row read as pairs widens 32 elements in two operations (a shift, a mask) where
     * one at a time takes two for 16; each accumulator then holds every other element, which
     * the end puts back in order. */
    const int64_t split = bf16 && chunks % 2 == 0;
    vec16 acc[4][MAX_CHUNKS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = (vec16){0};
    for (int64_t start = 0; start < len; start += bs) {
        int64_t rows;
        const int64_t block =
            block_rows(job, job->value_cache, NULL, table, head_offset, start, len, bf16,
                           &rows);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row = block + r * job->token_stride;
            if (split) /* 32 bfloat16 as 16 pairs: the even ones, then the odd ones */
                for (int64_t c = 0; c < chunks; c += 2) {
                    u32x16 pairs;
                    memcpy(&pairs, (const uint16_t *)job->value_cache + row + c * LANES,
                           sizeof pairs); /* an unaligned load */
                    const vec16 even = as_float(pairs << 16), odd = as_float(pairs & 0xffff0000u);
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * span + start + r];
                        acc[g][c] += p * even;
                        acc[g][c + 1] += p * odd;
                    }
                }
            else
                for (int64_t c = 0; c < chunks; c++) {
                    const vec16 v = load(job->value_cache, row + c * LANES, bf16);
                    for (int64_t g = 0; g < group; g++)
                        acc[g][c] += scores[g * span + start + r] * v;
                }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c += 1 + split) {
            vec16 low = acc[g][c], high = acc[g][c + split];
            if (split) { /* back in order: even and odd lanes interleaved */
                low = SHUFFLE(acc[g][c], acc[g][c + 1], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                              6, 22, 7, 23);
                high = SHUFFLE(acc[g][c], acc[g][c + 1], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28,
                               13, 29, 14, 30, 15, 31);
                store(out, g * chunks * LANES + (c + 1) * LANES, high * inverse[g], 0);
            }
            store(out, g * chunks * LANES + c * LANES, low * inverse[g], 0);
        }
}

/* Scores for `group` query heads over `len` tokens go to `scores[g * span + t]` (`span`: `len`
 * rounded up to 16, the rest -inf); `q` and `out` are
 * float32 buffers of the group's query and output rows. Always inlined, with `bf16` and `chunks`
 * (head_dim / 16) constants: with a constant trip count the accumulators stay in registers (a
 * runtime count kept them in memory, every add waiting on the store before it: 3x slower). */
static inline __attribute__((always_inline)) void attend_one(const Job *job, int64_t seq,
                                                             int64_t kv_head, float *scores,
                                                             const float *q,
                                                             const uint16_t *qbf16, float *out,
                                                             int bf16, int64_t chunks) {
    const int64_t group = job->num_heads / job->num_kv_heads, dim = chunks * LANES;
    const int64_t bs = job->block_size;
    int64_t len = job->context_lens[seq];
    if (len > job->max_context_len) len = job->max_context_len;
    const int32_t *table = job->block_tables + seq * job->max_blocks;
    const int64_t head_offset = kv_head * job->head_stride;
    memset(out, 0, sizeof(float) * group * dim);
    if (len <= 0) return;
    const int64_t span = (len + LANES - 1) / LANES * LANES;

    float widened[LANES * MAX_CHUNKS * LANES]; /* 16 rows of a bfloat16 cache, widened once */
    /* Pass 1: scaled dot products, block by block (a block's rows for one head lie together),
     * sixteen keys at a time so that their sixteen horizontal sums share one shuffle tree. */
#if HAVE_DPBF16
    if (bf16 && qbf16 != NULL && chunks % 2 == 0) {
        dot_blocks_bf16(job, table, head_offset, len, span, qbf16, group, chunks, scores);
    } else
#endif
    {
        for (int64_t start = 0; start < len; start += bs) {
            int64_t rows;
            const int64_t block =
                block_rows(job, job->key_cache, job->value_cache, table, head_offset, start,
                           len, bf16, &rows);
            for (int64_t first = 0; first < rows; first += LANES) {
                const int64_t count = rows - first < LANES ? rows - first : LANES;
                int64_t stride;
                const float *keys = rows16(job->key_cache, block + first * job->token_stride,
                                           job->token_stride, count, chunks, widened, &stride,
                                           bf16);
                for (int64_t g = 0; g < group; g++) {
                    const vec16 *qg = (const vec16 *)(q + g * dim);
                    vec16 acc[LANES];
                    for (int64_t r = 0; r < LANES; r++) {
                        acc[r] = (vec16){0};
                        if (r >= count) continue;
                        for (int64_t c = 0; c < chunks; c++)
                            acc[r] += qg[c] * load(keys, r * stride + c * LANES, 0);
                    }
                    const vec16 dots = sum_lanes16(acc) * job->scale;
                    store_scores(scores + g * span + start + first, dots, count);
                }
            }
        }
    }

    float inverse[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t t = len; t < span; t++) scores[g * span + t] = -INFINITY;
        inverse[g] = softmax_numerators(scores + g * span, span);
    }
#if HAVE_DPBF16
    if (bf16 && qbf16 != NULL && chunks % 2 == 0 && bs % 2 == 0 && group * chunks <= 16) {
        switch (group) {
#define WEIGH_DP(G) weigh_values_dp(job, table, head_offset, len, span, scores, out, chunks, G)
        case 1: WEIGH_DP(1); return;
        case 2: WEIGH_DP(2); return;
        case 3: WEIGH_DP(3); return;
        case 4: WEIGH_DP(4); return;
#undef WEIGH_DP
        }
    }
#endif

    /* Pass 2: weighted sum of the values. A group of up to four heads keeps all its output
     * rows in registers over the whole context and widens each value row once, in registers;
     * a larger group goes sixteen rows at a time (widened once into `widened` for all its
     * heads), one head's output row in registers at a time. */
    switch (group) {
#define WEIGH(G)                                                                               \
    weigh_values(job, table, head_offset, len, span, scores, inverse, out, bf16, chunks, G)
    case 1: WEIGH(1); return;
    case 2: WEIGH(2); return;
    case 3: WEIGH(3); return;
    case 4: WEIGH(4); return;
#undef WEIGH
    }
    for (int64_t start = 0; start < len; start += bs) {
        int64_t rows;
        const int64_t block =
            block_rows(job, job->value_cache, NULL, table, head_offset, start, len, bf16,
                           &rows);
        for (int64_t first = 0; first < rows; first += LANES) {
            const int64_t count = rows - first < LANES ? rows - first : LANES;
            int64_t stride;
            const float *values = rows16(job->value_cache, block + first * job->token_stride,
                                         job->token_stride, count, chunks, widened, &stride, bf16);
            for (int64_t g = 0; g < group; g++) {
                const float *p = scores + g * span + start + first;
                vec16 acc[MAX_CHUNKS];
                for (int64_t c = 0; c < chunks; c++) acc[c] = load(out, g * dim + c * LANES, 0);
                for (int64_t r = 0; r < count; r++)
                    for (int64_t c = 0; c < chunks; c++)
                        acc[c] += p[r] * load(values, r * stride + c * LANES, 0);
                for (int64_t c = 0; c < chunks; c++) store(out, g * dim + c * LANES, acc[c], 0);
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            store(out, g * dim + c * LANES, load(out, g * dim + c * LANES, 0) * inverse[g], 0);
}

/* head_dim 32, 64, 96 and 128 get a copy each; other multiples of 16 share a generic one. */
#define BY_HEAD_DIM(BF16)                                                                      \
    switch (job->head_dim / LANES) {                                                           \
    case 2: attend_one(job, seq, kv_head, scores, q, qbf16, out, BF16, 2); break;              \
    case 4: attend_one(job, seq, kv_head, scores, q, qbf16, out, BF16, 4); break;              \
    case 6: attend_one(job, seq, kv_head, scores, q, qbf16, out, BF16, 6); break;              \
    case 8: attend_one(job, seq, kv_head, scores, q, qbf16, out, BF16, 8); break;              \
    default: attend_one(job, seq, kv_head, scores, q, qbf16, out, BF16, job->head_dim / LANES);   \
    }

static void attend_one_f32(const Job *job, int64_t seq, int64_t kv_head, float *scores,
                           const float *q, const uint16_t *qbf16, float *out) {
    BY_HEAD_DIM(0)
}

static void attend_one_bf16(const Job *job, int64_t seq, int64_t kv_head, float *scores,
                            const float *q, const uint16_t *qbf16, float *out) {
    BY_HEAD_DIM(1)
}

typedef void (*AttendFn)(const Job *, int64_t, int64_t, float *, const float *, const uint16_t *,
                         float *);

/* One work item: the group's query rows widened to float32, attended, the output stored in the
 * query's dtype. `buffer` holds the scores, then the float32 query and output rows. */
static void attend_item(const Job *job, AttendFn attend, int64_t item, float *buffer,
                        size_t scores_floats) {
    const int64_t kv_heads = job->num_kv_heads, group = job->num_heads / kv_heads;
    const int64_t seq = item / kv_heads, kv_head = item % kv_heads;
    const int64_t first = (seq * job->num_heads + kv_head * group) * job->head_dim;
    const int64_t size = group * job->head_dim;
    float *q = buffer + scores_floats, *out = q + size;
    /* head_dim is a multiple of 16: whole vectors in and out (bfloat16 rounded to nearest even) */
    for (int64_t i = 0; i < size; i += LANES)
        store(q, i, load(job->query, first + i, job->io_bf16), 0);
    const uint16_t *qbf16 = job->io_bf16 ? (const uint16_t *)job->query + first : NULL;
    attend(job, seq, kv_head, buffer, q, qbf16, out);
    for (int64_t i = 0; i < size; i += LANES)
        store(job->out, first + i, load(out, i, 0), job->io_bf16);
}

/* Whether every block the context lengths reach is in the table and in [0, num_blocks): the
 * kernel reads where the table says, so it checks (once per call, about a compare per block). */
static int tables_valid(const Job *job, int64_t num_blocks) {
    for (int64_t seq = 0; seq < job->num_seqs; seq++) {
        int64_t len = job->context_lens[seq];
        if (len > job->max_context_len) len = job->max_context_len;
        const int64_t used = (len + job->block_size - 1) / job->block_size;
        if (used > job->max_blocks) return 0;
        const int32_t *table = job->block_tables + seq * job->max_blocks;
        for (int64_t b = 0; b < used; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 0;
    }
    return 1;
}

/* 1 where the kernel does not take `job`'s shapes, else 0. */
static int job_invalid(const Job *job) {
    return job->num_kv_heads <= 0 || job->num_heads % job->num_kv_heads != 0 ||
           job->num_heads / job->num_kv_heads > MAX_GROUP || job->head_dim % LANES != 0 ||
           job->head_dim / LANES > MAX_CHUNKS || job->block_size <= 0;
}

int attention_check(const Job *job, int64_t num_blocks) {
    if (job_invalid(job)) return 1;
    return tables_valid(job, num_blocks) ? 0 : 3;
}

/* The scores of one item (a multiple of 16 floats), then its float32 query and output rows;
 * 64-byte multiples keep the rows aligned. */
static size_t scores_floats(const Job *job) {
    const size_t group = (size_t)(job->num_heads / job->num_kv_heads);
    const size_t len = (size_t)(job->max_context_len > 0 ? job->max_context_len : 1);
    return (len + 15) / 16 * 16 * group; /* each head's row padded to whole vectors */
}

size_t attention_scratch_floats(const Job *job) {
    const size_t group = (size_t)(job->num_heads / job->num_kv_heads);
    return (scores_floats(job) + 2 * group * (size_t)job->head_dim + 15) / 16 * 16;
}

void attention_item_bf16(const Job *job, int64_t item, float *scratch) {
    attend_item(job, attend_one_bf16, item, scratch, scores_floats(job));
}

/* Returns 0 on success, 1 on a bad argument, 2 if a thread could not allocate its scores, 3 for
 * a block table that does not cover the context lengths or names a block outside the cache. */
static int run(const Job *job, AttendFn attend, int64_t num_blocks, int32_t num_threads) {
    if (job_invalid(job) || num_threads <= 0) return 1;
    if (!tables_valid(job, num_blocks)) return 3;
    const int64_t items = (int64_t)job->num_seqs * job->num_kv_heads;
    const size_t floats = attention_scratch_floats(job), padded = scores_floats(job);
    int failed = 0;
    /* Dynamic scheduling: sequences of different lengths are different amounts of work. */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buffer = aligned_alloc(64, sizeof(float) * floats);
        if (buffer == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (buffer != NULL) attend_item(job, attend, item, buffer, padded);
        free(buffer);
    }
    return failed ? 2 : 0;
}

/* The exported kernels: the cache's dtype picks one; the arguments are the same. */
#define DECODE_ARGS                                                                            \
    const void *query, const void *key_cache, const void *value_cache, int64_t block_stride,  \
        int64_t token_stride, int64_t head_stride, const int32_t *block_tables,                \
        int64_t max_blocks, const int32_t *context_lens, int32_t max_context_len,              \
        int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,           \
        int32_t block_size, float scale, void *out, int32_t io_bf16, int64_t num_blocks,       \
        int32_t num_threads
#define JOB                                                                                    \
    {query, key_cache, value_cache, block_stride, token_stride, head_stride, block_tables,     \
     max_blocks, context_lens, max_context_len, num_seqs, num_heads, num_kv_heads, head_dim,   \
     block_size, scale, out, io_bf16}

int paged_attention_decode_f32(DECODE_ARGS) {
    const Job job = JOB;
    return run(&job, attend_one_f32, num_blocks, num_threads);
}

int paged_attention_decode_bf16(DECODE_ARGS) {
    const Job job = JOB;
    return run(&job, attend_one_bf16, num_blocks, num_threads);
}
