/*
 * Every decoder layer of a decode step, bfloat16, in one call and one OpenMP region: 1-4
 * sequences on the widening GEMV, 1-16 on its dot-product variant, up to PAIRS_MAX_ROWS where
 * every linear is in pair order (gemm_bf16_cpu.c). At one sequence a layer is nine kernel calls
 * from Python: their dispatch, thread wake-ups and the pauses in the weight stream between them
 * cost ~4 ms of a 15 ms step on a Zen 4 core pair, where the weight reads themselves take ~10 ms;
 * at 64 sequences the calls and their glue cost ~8 ms of a 70 ms step. Here the threads stay up
 * for the whole model and wait for each other only where a result is needed by all of them (a
 * barrier, ~1 us).
 *
 * Per layer: norm (rows split over threads) | qkv GEMM (all: output features split) | rotary and
 * KV write (rows split) | attention (items taken by free threads) | o GEMM | norm | gate_up GEMM |
 * SiLU-and-multiply (rows split) | down GEMM. Every piece is the function the separate kernels
 * run (decode_parts.h), each row computed alone, so the result is bit for bit theirs:
 * tests/kernels/test_decode_layers.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_parts.h"
#include "vec16.h"

#define PAIRS_MAX_ROWS 256 /* kernels.cpu_ops.PAIRS_MAX_ROWS: decode batches in pair order */
#define DOT_MAX_ROWS 16    /* the dot-product GEMV's (linear_bf16_cpu.c) */
#define WIDENED_MAX_ROWS 4 /* the float32 one's: more rows only where every linear has dots */
#define MAX_HEAD_DIM 256   /* layer_ops_cpu.c's rotary */

/* One layer's weights (bfloat16, nn.Linear's [out, in]) and KV cache. */
typedef struct {
    const uint16_t *input_norm, *post_norm; /* [hidden] */
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias; /* [qkv features] float32, or NULL */
    void *key_cache, *value_cache; /* [num_blocks, block_size, kv_heads, head_dim], strides below */
    /* Weight rows the GEMV reads together: 4 or 8 (the float32 kernel), LINEAR_DOT_TILE (the
     * 4-row tiles read by bfloat16 dot products, linear_bf16_cpu.c) or LINEAR_PAIRS_TILE (the
     * pair order of gemm_bf16_cpu.c). */
    int32_t qkv_tile, o_tile, gate_up_tile, down_tile;
} DecodeLayer;

/* The model's sizes and its caches' layout: the same for every step. */
typedef struct {
    int32_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    int64_t block_stride, token_stride, head_stride, block_size, num_blocks; /* in elements */
} DecodeShape;

/* One step: the tokens' rotary rows, KV slots and each sequence's blocks. */
typedef struct {
    int32_t rows;
    const void *cos, *sin;  /* [rows, head_dim] bfloat16 */
    const int64_t *slots;   /* [rows] */
    const int32_t *block_tables; /* [rows, max_blocks] */
    int64_t max_blocks;
    const int32_t *context_lens; /* [rows] */
    int32_t max_context_len;
} DecodeStep;

static void widen(const uint16_t *src, float *dst, int64_t count) {
    for (int64_t i = 0; i < count; i += LANES) store(dst, i, load(src, i, 1), 0);
}

static Job attention_job(const DecodeShape *shape, const DecodeStep *step,
                         const DecodeLayer *layer, const uint16_t *query, uint16_t *out) {
    return (Job){query, layer->key_cache, layer->value_cache, shape->block_stride,
                 shape->token_stride, shape->head_stride, step->block_tables, step->max_blocks,
                 step->context_lens, step->max_context_len, step->rows, shape->num_heads,
                 shape->num_kv_heads, shape->head_dim, (int32_t)shape->block_size, shape->scale,
                 out, 1};
}

/* The calling thread's share of one linear over bfloat16 `x` [rows, in]: widened into its `xf`
 * for the float32 kernel, or read as it is by the dot-product one. */
static void linear_share(const uint16_t *x, float *xf, const uint16_t *w, const float *bias,
                         uint16_t *y, int rows, int tile, int in, int out) {
    if (tile == LINEAR_PAIRS_TILE) {
        gemm_bf16_pairs_share(x, in, w, bias, y, rows, in, out);
        return;
    }
    if (tile == LINEAR_DOT_TILE) {
        linear_bf16_dot_share(x, w, bias, y, rows, in, out);
        return;
    }
    widen(x, xf, (int64_t)rows * in);
    linear_bf16_share(xf, w, bias, y, rows, tile, in, out);
}

static int valid_tile(int32_t tile) {
    return tile == 4 || tile == 8 || (tile == LINEAR_DOT_TILE && linear_bf16_dot_available()) ||
           (tile == LINEAR_PAIRS_TILE && gemm_bf16_pairs_available());
}

/* The most rows a linear of this tile takes. */
static int tile_max_rows(int32_t tile) {
    return tile == LINEAR_PAIRS_TILE ? PAIRS_MAX_ROWS
           : tile == LINEAR_DOT_TILE ? DOT_MAX_ROWS
                                     : WIDENED_MAX_ROWS;
}

/* This thread's rows of a row-wise piece: [*first, *first + return value). */
static int row_share(int rows, int *first) {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    *first = rows * thread / threads;
    return rows * (thread + 1) / threads - *first;
}

/* 1 where the kernel does not take these sizes, 3 for a slot or block outside the cache, else 0
 * (checked before anything is written). */
static int check(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape,
                 const DecodeStep *step, int32_t num_threads) {
    const int64_t dim = shape->head_dim;
    if (step->rows < 1 || step->rows > PAIRS_MAX_ROWS || num_layers < 1 || num_threads < 1 ||
        shape->hidden % LANES || shape->intermediate % LANES || dim % (2 * LANES) ||
        dim > MAX_HEAD_DIM || (shape->num_heads * dim) % LANES || shape->block_size <= 0)
        return 1;
    for (int32_t l = 0; l < num_layers; l++) {
        const DecodeLayer *layer = &layers[l];
        const int32_t tiles[4] = {layer->qkv_tile, layer->o_tile, layer->gate_up_tile,
                                  layer->down_tile};
        for (int i = 0; i < 4; i++)
            if (!valid_tile(tiles[i]) || step->rows > tile_max_rows(tiles[i])) return 1;
    }
    for (int32_t t = 0; t < step->rows; t++)
        if (step->slots[t] < 0 || step->slots[t] >= shape->num_blocks * shape->block_size)
            return 3;
    const Job job = attention_job(shape, step, &layers[0], NULL, NULL);
    return attention_check(&job, shape->num_blocks);
}

/* x [rows, hidden] bfloat16: the residual stream, updated in place. delta [rows, hidden]: on
 * entry the previous layer's MLP output not yet added to x (has_delta), on return the last layer's.
 * Returns 0, 1 for sizes it does not take, 2 when out of memory, 3 for a bad slot or block. */
int decode_layers_bf16(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape,
                       const DecodeStep *step, uint16_t *x, uint16_t *delta, int32_t has_delta,
                       int32_t num_threads) {
    const int status = check(layers, num_layers, shape, step, num_threads);
    if (status) return status;
    const int rows = step->rows, hidden = shape->hidden, inter = shape->intermediate;
    const int q_size = shape->num_heads * shape->head_dim;
    const int qkv_size = q_size + 2 * shape->num_kv_heads * shape->head_dim;
    const int widest = inter > q_size ? (inter > hidden ? inter : hidden)
                                      : (q_size > hidden ? q_size : hidden);
    /* Shared: the norms' output and each GEMM's, and the SiLU rows (bfloat16); per thread: its
     * widened GEMV input (at most WIDENED_MAX_ROWS rows) and its attention scratch, each a
     * multiple of 64 bytes. */
    const Job sizing = attention_job(shape, step, &layers[0], NULL, NULL);
    const size_t shared = (size_t)rows * (2 * hidden + qkv_size + 2 * q_size + 3 * inter);
    const size_t shared_bytes = (shared * 2 + 63) / 64 * 64;
    const size_t xf_floats = rows > WIDENED_MAX_ROWS ? 0 : ((size_t)rows * widest + 15) / 16 * 16;
    const size_t private_floats = xf_floats + attention_scratch_floats(&sizing);
    uint16_t *h = aligned_alloc(64, shared_bytes + private_floats * 4 * (size_t)num_threads);
    if (h == NULL) return 2;
    uint16_t *qkv = h + (size_t)rows * hidden, *query = qkv + (size_t)rows * qkv_size;
    uint16_t *attended = query + (size_t)rows * q_size, *o = attended + (size_t)rows * q_size;
    uint16_t *gate_up = o + (size_t)rows * hidden, *act = gate_up + (size_t)rows * 2 * inter;
    float *privates = (float *)((char *)h + shared_bytes);
    const int64_t items = (int64_t)rows * shape->num_kv_heads;

#pragma omp parallel num_threads(num_threads)
    {
        float *xf = privates + (size_t)omp_get_thread_num() * private_floats;
        float *attention_scratch = xf + xf_floats;
        int first;
        const int mine = row_share(rows, &first); /* rows [first, first + mine) */
        const size_t r0 = (size_t)first;
        for (int32_t l = 0; l < num_layers; l++) {
            const DecodeLayer *layer = &layers[l];
            if (mine > 0)
                add_rms_norm_bf16_serial(x + r0 * hidden,
                                         l == 0 && !has_delta ? NULL : delta + r0 * hidden,
                                         layer->input_norm, h + r0 * hidden, mine, hidden,
                                         shape->eps);
#pragma omp barrier
            linear_share(h, xf, layer->qkv, layer->qkv_bias, qkv, rows, layer->qkv_tile, hidden,
                         qkv_size);
#pragma omp barrier
            if (mine > 0)
                rotary_write_kv_bf16_serial(
                    qkv + r0 * qkv_size, (const uint16_t *)step->cos + r0 * shape->head_dim,
                    (const uint16_t *)step->sin + r0 * shape->head_dim, step->slots + r0,
                    layer->key_cache, layer->value_cache, shape->block_stride,
                    shape->token_stride, shape->head_stride, shape->block_size,
                    query + r0 * q_size, mine, shape->num_heads, shape->num_kv_heads,
                    shape->head_dim);
#pragma omp barrier
            const Job job = attention_job(shape, step, layer, query, attended);
            /* Items differ in context length: each thread takes the next one free. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++)
                attention_item_bf16(&job, item, attention_scratch);
            /* (the loop's end is a barrier) */
            linear_share(attended, xf, layer->o, NULL, o, rows, layer->o_tile, q_size, hidden);
#pragma omp barrier
            if (mine > 0)
                add_rms_norm_bf16_serial(x + r0 * hidden, o + r0 * hidden, layer->post_norm,
                                         h + r0 * hidden, mine, hidden, shape->eps);
#pragma omp barrier
            linear_share(h, xf, layer->gate_up, NULL, gate_up, rows, layer->gate_up_tile, hidden,
                         2 * inter);
#pragma omp barrier
            if (mine > 0)
                silu_mul_bf16_serial(gate_up + r0 * 2 * inter, act + r0 * inter, mine, inter);
#pragma omp barrier
            linear_share(act, xf, layer->down, NULL, delta, rows, layer->down_tile, inter, hidden);
#pragma omp barrier
        }
    }
    free(h);
    return 0;
}
