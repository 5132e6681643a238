/*
 * The per-token glue of a decoder layer, fused for the CPU: the residual add with the RMSNorm
 * after it, rotary embedding with the KV-cache write, and SiLU-and-multiply. Done with PyTorch
 * ops these are about twenty small operators per layer; at a decode batch of one sequence their
 * dispatch costs more than their arithmetic (about 0.1 ms a layer against 0.3 ms for all four
 * GEMMs). Here each is one call, one pass over its rows.
 *
 * Every function computes what kernels/reference.py's PyTorch ops compute, rounding where they
 * round: in bfloat16 each elementwise result is rounded to bfloat16 (to nearest even) before the
 * next operation reads it, as PyTorch's bfloat16 kernels do, so rotary and the KV write are
 * bit-identical to the reference in both dtypes. RMSNorm's sum of squares and SiLU's exp differ
 * from PyTorch's in the last bits of a float32 (order of the sum; the exp polynomial).
 *
 * Tensors are float32 or bfloat16 (`bf16`: 0 or 1, the same for all of a call's tensors), rows
 * contiguous, sizes multiples of 16 (the Python side checks; it falls back to the reference). Rows
 * are spread over torch's OpenMP threads (paged_attention_cpu.c says why that runtime) when there
 * are enough of them to pay for waking the threads.
 */
#pragma GCC optimize("fp-contract=off") /* a*b + c rounds twice, as PyTorch's separate ops do */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "decode_parts.h"
#include "vec16.h"

#define PARALLEL_ELEMENTS 4096 /* below this many elements one thread is faster (Zen 4) */
#define MAX_HEAD_DIM 256

/* x += delta (when delta), then out = weight * round(x * rsqrt(mean(x^2) + eps)), for one row. */
ALWAYS_INLINE void add_rms_norm_row(void *x, const void *delta, const void *weight, void *out,
                                    int64_t row, int64_t hidden, float eps, int bf16) {
    const int64_t base = row * hidden;
    vec16 squares = {0};
    for (int64_t i = 0; i < hidden; i += LANES) {
        vec16 v = load(x, base + i, bf16);
        if (delta) v = store_rounded(x, base + i, v + load(delta, base + i, bf16), bf16);
        squares += v * v;
    }
    const float inverse = 1.0f / sqrtf(sum_lanes(squares) / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i += LANES) {
        const vec16 normed = round_to(load(x, base + i, bf16) * inverse, bf16);
        store(out, base + i, load(weight, i, bf16) * normed, bf16);
    }
}

ALWAYS_INLINE void add_rms_norm_rows(void *x, const void *delta, const void *weight, void *out,
                                     int64_t rows, int64_t hidden, float eps, int num_threads,
                                     int bf16) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x, delta, weight, out, r, hidden, eps, bf16);
}

/* x, out [rows, hidden]; delta [rows, hidden] or NULL; weight [hidden]. Returns 0, or 1 for
 * sizes it does not take. */
int add_rms_norm(void *x, const void *delta, const void *weight, void *out, int64_t rows,
                 int64_t hidden, float eps, int bf16, int num_threads) {
    if (rows < 0 || hidden <= 0 || hidden % LANES || num_threads <= 0) return 1;
    if (bf16)
        add_rms_norm_rows(x, delta, weight, out, rows, hidden, eps, num_threads, 1);
    else
        add_rms_norm_rows(x, delta, weight, out, rows, hidden, eps, num_threads, 0);
    return 0;
}

/* Rotate-half RoPE of one head in place in `head` ([dim]): with cos/sin of its token,
 * x[i] cos[i] - x[i + dim/2] sin[i] for the first half, x[i] cos[i] + x[i - dim/2] sin[i] for the
 * second, each product and the sum rounded to the dtype. */
ALWAYS_INLINE void rotate_head(const void *head, int64_t at, const void *cos, const void *sin,
                               int64_t table_at, int64_t dim, void *dest, int64_t dest_at,
                               int bf16) {
    const int64_t half = dim / 2;
    vec16 first[MAX_HEAD_DIM / 2 / LANES], second[MAX_HEAD_DIM / 2 / LANES];
    for (int64_t i = 0, c = 0; i < half; i += LANES, c++) {
        const vec16 a = load(head, at + i, bf16), b = load(head, at + half + i, bf16);
        const vec16 cos_a = load(cos, table_at + i, bf16), sin_a = load(sin, table_at + i, bf16);
        const vec16 cos_b = load(cos, table_at + half + i, bf16);
        const vec16 sin_b = load(sin, table_at + half + i, bf16);
        first[c] = round_to(a * cos_a, bf16) - round_to(b * sin_a, bf16); /* stores round */
        second[c] = round_to(b * cos_b, bf16) + round_to(a * sin_b, bf16);
    }
    for (int64_t i = 0, c = 0; i < half; i += LANES, c++) {
        store(dest, dest_at + i, first[c], bf16);
        store(dest, dest_at + half + i, second[c], bf16);
    }
}

ALWAYS_INLINE void rotary_write_kv_token(const void *qkv, const void *cos, const void *sin,
                                         const int64_t *slots, void *key_cache,
                                         void *value_cache, int64_t block_stride,
                                         int64_t token_stride, int64_t head_stride,
                                         int64_t block_size, void *query, int64_t t,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                         int bf16) {
    const int64_t width = (num_heads + 2 * num_kv_heads) * dim, row = t * width;
    const int64_t slot = slots[t];
    const int64_t cache_at = slot / block_size * block_stride + slot % block_size * token_stride;
    for (int64_t h = 0; h < num_heads; h++)
        rotate_head(qkv, row + h * dim, cos, sin, t * dim, dim, query, (t * num_heads + h) * dim,
                    bf16);
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const int64_t dest = cache_at + h * head_stride;
        rotate_head(qkv, row + (num_heads + h) * dim, cos, sin, t * dim, dim, key_cache, dest,
                    bf16);
        const int64_t value_at = row + (num_heads + num_kv_heads + h) * dim;
        for (int64_t i = 0; i < dim; i += LANES)
            store(value_cache, dest + i, load(qkv, value_at + i, bf16), bf16);
    }
}

/* qkv [tokens, (num_heads + 2 num_kv_heads) * dim] (one GEMM's output: queries, keys, values);
 * cos, sin [tokens, dim]: each token's row of the rotary tables; slots [tokens] int64; caches
 * [num_blocks, block_size, kv_heads, dim] with the given element strides. Writes the rotated
 * queries to query [tokens, num_heads, dim], the rotated keys and the values to their slots.
 * Returns 0, 1 for sizes it does not take, 3 for a slot outside [0, num_blocks * block_size)
 * (checked before anything is written). */
int rotary_write_kv(const void *qkv, const void *cos, const void *sin, const int64_t *slots,
                    void *key_cache, void *value_cache, int64_t block_stride,
                    int64_t token_stride, int64_t head_stride, int64_t block_size,
                    int64_t num_blocks, void *query, int64_t tokens, int64_t num_heads,
                    int64_t num_kv_heads, int64_t dim, int bf16, int num_threads) {
    if (tokens < 0 || dim <= 0 || dim % (2 * LANES) || dim > MAX_HEAD_DIM || block_size <= 0 ||
        num_threads <= 0)
        return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return 3;
    const int parallel = tokens * (num_heads + 2 * num_kv_heads) * dim >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < tokens; t++) {
        if (bf16)
            rotary_write_kv_token(qkv, cos, sin, slots, key_cache, value_cache, block_stride,
                                  token_stride, head_stride, block_size, query, t, num_heads,
                                  num_kv_heads, dim, 1);
        else
            rotary_write_kv_token(qkv, cos, sin, slots, key_cache, value_cache, block_stride,
                                  token_stride, head_stride, block_size, query, t, num_heads,
                                  num_kv_heads, dim, 0);
    }
    return 0;
}

/* One vector of silu(gate) * up at `i` of row r. */
ALWAYS_INLINE void silu_mul_vector(const void *gate_up, void *out, int64_t r, int64_t size,
                                   int64_t i, vec16 gate, vec16 e, int bf16) {
    const vec16 silu = round_to(gate / (1.0f + e), bf16);
    store(out, r * size + i, silu * load(gate_up, r * 2 * size + size + i, bf16), bf16);
}

#define SILU_GROUP 8 /* vectors in flight: one exp is a chain of ~15 dependent operations */

ALWAYS_INLINE void silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t size,
                                int bf16) {
    int64_t i = 0;
    for (; i + SILU_GROUP * LANES <= size; i += SILU_GROUP * LANES) {
        vec16 gate[SILU_GROUP], e[SILU_GROUP];
        for (int k = 0; k < SILU_GROUP; k++)
            gate[k] = load(gate_up, r * 2 * size + i + k * LANES, bf16);
        for (int k = 0; k < SILU_GROUP; k++) e[k] = exp16_fused(-gate[k]);
        for (int k = 0; k < SILU_GROUP; k++)
            silu_mul_vector(gate_up, out, r, size, i + k * LANES, gate[k], e[k], bf16);
    }
    for (; i < size; i += LANES) {
        const vec16 gate = load(gate_up, r * 2 * size + i, bf16);
        silu_mul_vector(gate_up, out, r, size, i, gate, exp16_fused(-gate), bf16);
    }
}

ALWAYS_INLINE void silu_mul_rows(const void *gate_up, void *out, int64_t rows, int64_t size,
                                 int num_threads, int bf16) {
#pragma omp parallel for num_threads(num_threads) if (rows * size >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, out, r, size, bf16);
}

/* out [rows, size] = silu(gate) * up, gate_up [rows, 2 size] holding gate then up in each row.
 * Returns 0, or 1 for sizes it does not take. */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t size, int bf16,
             int num_threads) {
    if (rows < 0 || size <= 0 || size % LANES || num_threads <= 0) return 1;
    if (bf16)
        silu_mul_rows(gate_up, out, rows, size, num_threads, 1);
    else
        silu_mul_rows(gate_up, out, rows, size, num_threads, 0);
    return 0;
}

/* The three above on bfloat16 rows, on the calling thread, unchecked (decode_parts.h). */
void add_rms_norm_bf16_serial(void *x, const void *delta, const void *weight, void *out,
                              int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) add_rms_norm_row(x, delta, weight, out, r, hidden, eps, 1);
}

void rotary_write_kv_bf16_serial(const void *qkv, const void *cos, const void *sin,
                                 const int64_t *slots, void *key_cache, void *value_cache,
                                 int64_t block_stride, int64_t token_stride, int64_t head_stride,
                                 int64_t block_size, void *query, int64_t tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t dim) {
    for (int64_t t = 0; t < tokens; t++)
        rotary_write_kv_token(qkv, cos, sin, slots, key_cache, value_cache, block_stride,
                              token_stride, head_stride, block_size, query, t, num_heads,
                              num_kv_heads, dim, 1);
}

void silu_mul_bf16_serial(const void *gate_up, void *out, int64_t rows, int64_t size) {
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, out, r, size, 1);
}
