/*
 * Paged decode attention for the CPU: each sequence's single query token attends to its context
 * by reading the KV blocks where they lie in the cache (no gather copy). The cache is float32 or
 * bfloat16; the query, scores, softmax and output are float32 either way. A bfloat16 element is
 * the top half of a float32, so widening 16 of them is a zero-extend and a shift (two AVX-512F
 * instructions, no AVX-512 BF16 needed), and the cache read, the bandwidth that bounds decode
 * attention, is halved.
 *
 * One work item is one (sequence, KV head) pair: its GQA group of query heads shares every key
 * and value row it reads, so the group reads each block together. Items are spread over OpenMP
 * threads. Built at first use by kernels/cpu_ops.py (cc -O3 -march=native -fopenmp) and loaded
 * after torch: the dynamic loader then binds this library's libgomp.so.1 to the copy torch
 * already loaded, so the kernel runs on torch's own worker threads. (A second thread pool, even
 * plain pthreads, competes on the same cores with torch's workers, which spin between ops: that
 * made the kernel 2x slower inside the engine than alone.)
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *query;        /* [num_seqs, num_heads, head_dim], contiguous */
    const void *key_cache;     /* one layer's keys (float32 or bfloat16), strides below */
    const void *value_cache;   /* same dtype and strides as key_cache */
    int64_t block_stride, token_stride, head_stride; /* in elements; head_dim is contiguous */
    const int32_t *block_tables; /* [num_seqs, max_blocks] */
    int64_t max_blocks;
    const int32_t *context_lens; /* [num_seqs] */
    int32_t max_context_len;     /* context lengths are clamped to this */
    int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float *out; /* [num_seqs, num_heads, head_dim] */
} Job;

/* 16 floats that the compiler keeps in registers (one AVX-512 register, two AVX2 ones, or
 * four NEON ones): GCC/Clang vector extensions, portable across CPUs. */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t bf16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#define LANES 16
#define MAX_CHUNKS 16 /* head_dim up to 256 */

/* 16 cache elements from `base` + `index` elements, widened to float32 for a bfloat16 cache.
 * `bf16` is a constant in each caller (see attend_one), so each kernel has one branch-free path. */
static inline __attribute__((always_inline)) vec16 load16(const void *base, int64_t index,
                                                           int bf16) {
    if (!bf16) return *(const vec16 *)((const float *)base + index);
    const bf16x16 half = *(const bf16x16 *)((const uint16_t *)base + index);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    vec16 out;
    memcpy(&out, &bits, sizeof out); /* a register move, not a copy */
    return out;
}

static inline const void *at(const void *base, int64_t index, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)base + index)
                : (const void *)((const float *)base + index);
}

/* Ask for the next block's rows of this head (`bytes` from `start`) ahead of their use: blocks
 * lie anywhere in the pool, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_rows(const void *start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64)
        __builtin_prefetch((const char *)start + offset, 0, 3);
}

static inline float sum_lanes(vec16 x) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += x[i];
    return total;
}

/* Scores for `group` query heads over `len` tokens go to `scores[g * len + t]`. Always inlined
 * into the two kernels below with `bf16` a constant. */
static inline __attribute__((always_inline)) void attend_one(const Job *job, int64_t seq,
                                                             int64_t kv_head, float *scores,
                                                             int bf16) {
    const int64_t group = job->num_heads / job->num_kv_heads, dim = job->head_dim;
    const int64_t chunks = dim / LANES, bs = job->block_size;
    int64_t len = job->context_lens[seq];
    if (len > job->max_context_len) len = job->max_context_len;
    const float *q = job->query + (seq * job->num_heads + kv_head * group) * dim;
    float *out = job->out + (seq * job->num_heads + kv_head * group) * dim;
    const int32_t *table = job->block_tables + seq * job->max_blocks;
    const int64_t head_offset = kv_head * job->head_stride;
    const int64_t element = bf16 ? 2 : 4;
    const int64_t row_bytes = ((bs - 1) * job->token_stride + dim) * element;
    memset(out, 0, sizeof(float) * group * dim);
    if (len <= 0) return;

    /* Pass 1: scaled dot products, block by block (a block's rows for one head lie together). */
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t block = table[start / bs] * job->block_stride + head_offset;
        const int64_t rows = len - start < bs ? len - start : bs;
        if (start + bs < len)
            prefetch_rows(at(job->key_cache,
                             table[start / bs + 1] * job->block_stride + head_offset, bf16),
                          row_bytes);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row = block + r * job->token_stride;
            vec16 k[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) k[c] = load16(job->key_cache, row + c * LANES, bf16);
            for (int64_t g = 0; g < group; g++) {
                const vec16 *qg = (const vec16 *)(q + g * dim);
                vec16 acc = qg[0] * k[0];
                for (int64_t c = 1; c < chunks; c++) acc += qg[c] * k[c];
                scores[g * len + start + r] = sum_lanes(acc) * job->scale;
            }
        }
    }

    /* Softmax weights, one query head at a time over its contiguous row of scores. */
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * len;
        float maximum = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) maximum = row[t] > maximum ? row[t] : maximum;
        for (int64_t t = 0; t < len; t++) {
            row[t] = expf(row[t] - maximum);
            sum += row[t];
        }
        const float inverse = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) row[t] *= inverse;
    }

    /* Pass 2: weighted sum of the values, one query head's output chunk held in a register
     * while every value row streams past. */
    for (int64_t g = 0; g < group; g++) {
        const float *p = scores + g * len;
        vec16 acc[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) acc[c] = (vec16){0};
        for (int64_t start = 0; start < len; start += bs) {
            const int64_t block = table[start / bs] * job->block_stride + head_offset;
            const int64_t rows = len - start < bs ? len - start : bs;
            if (g == 0 && start + bs < len)
                prefetch_rows(at(job->value_cache,
                                 table[start / bs + 1] * job->block_stride + head_offset, bf16),
                              row_bytes);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t row = block + r * job->token_stride;
                const float weight = p[start + r];
                for (int64_t c = 0; c < chunks; c++)
                    acc[c] += weight * load16(job->value_cache, row + c * LANES, bf16);
            }
        }
        vec16 *og = (vec16 *)(out + g * dim);
        for (int64_t c = 0; c < chunks; c++) og[c] = acc[c];
    }
}

static void attend_one_f32(const Job *job, int64_t seq, int64_t kv_head, float *scores) {
    attend_one(job, seq, kv_head, scores, 0);
}

static void attend_one_bf16(const Job *job, int64_t seq, int64_t kv_head, float *scores) {
    attend_one(job, seq, kv_head, scores, 1);
}

typedef void (*AttendFn)(const Job *, int64_t, int64_t, float *);

/* Returns 0 on success, 1 on a bad argument, 2 if a thread could not allocate its scores. */
static int run(const Job *job, AttendFn attend, int32_t num_threads) {
    if (job->num_kv_heads <= 0 || job->num_heads % job->num_kv_heads != 0 ||
        job->num_heads / job->num_kv_heads > 64 || job->head_dim % LANES != 0 ||
        job->head_dim / LANES > MAX_CHUNKS || job->block_size <= 0 || num_threads <= 0)
        return 1;
    const int64_t kv_heads = job->num_kv_heads, items = (int64_t)job->num_seqs * kv_heads;
    const size_t scores_size =
        sizeof(float) * (size_t)(job->max_context_len > 0 ? job->max_context_len : 1) *
        (size_t)(job->num_heads / kv_heads);
    int failed = 0;
    /* Dynamic scheduling: sequences of different lengths are different amounts of work. */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(scores_size);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            if (scores != NULL) attend(job, item / kv_heads, item % kv_heads, scores);
        free(scores);
    }
    return failed ? 2 : 0;
}

/* The exported kernels: the cache's dtype picks one; the arguments are the same. */
#define DECODE_ARGS                                                                            \
    const float *query, const void *key_cache, const void *value_cache, int64_t block_stride,  \
        int64_t token_stride, int64_t head_stride, const int32_t *block_tables,                \
        int64_t max_blocks, const int32_t *context_lens, int32_t max_context_len,              \
        int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,           \
        int32_t block_size, float scale, float *out, int32_t num_threads
#define JOB                                                                                    \
    {query, key_cache, value_cache, block_stride, token_stride, head_stride, block_tables,     \
     max_blocks, context_lens, max_context_len, num_seqs, num_heads, num_kv_heads, head_dim,   \
     block_size, scale, out}

int paged_attention_decode_f32(DECODE_ARGS) {
    const Job job = JOB;
    return run(&job, attend_one_f32, num_threads);
}

int paged_attention_decode_bf16(DECODE_ARGS) {
    const Job job = JOB;
    return run(&job, attend_one_bf16, num_threads);
}
