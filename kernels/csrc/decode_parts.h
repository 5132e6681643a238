/*
 * The pieces of a decoder layer that kernels/csrc/decode_layers_cpu.c strings together, each
 * exported by the file that owns it, on one thread and a slice of the work given by the caller:
 * the caller runs inside its own OpenMP region and synchronises between them. Each file keeps its
 * own compile options (layer_ops_cpu.c rounds every product, as PyTorch's separate ops do; the
 * GEMV fuses multiply-adds), so a fused layer computes bit for bit what the separate calls do.
 */
#ifndef PDSERVE_DECODE_PARTS_H
#define PDSERVE_DECODE_PARTS_H

#include <stddef.h>
#include <stdint.h>

/* One call of paged decode attention (paged_attention_cpu.c): shapes, cache strides, tables. */
typedef struct {
    const void *query;         /* [num_seqs, num_heads, head_dim], contiguous */
    const void *key_cache;     /* one layer's keys (float32 or bfloat16), strides below */
    const void *value_cache;   /* same dtype and strides as key_cache */
    int64_t block_stride, token_stride, head_stride; /* in elements; head_dim is contiguous */
    const int32_t *block_tables; /* [num_seqs, max_blocks] */
    int64_t max_blocks;
    const int32_t *context_lens; /* [num_seqs] */
    int32_t max_context_len;     /* context lengths are clamped to this */
    int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    void *out; /* [num_seqs, num_heads, head_dim], the query's dtype */
    int32_t io_bf16; /* query and out are bfloat16 (else float32) */
} Job;

/* paged_attention_cpu.c. 0 when `job` is one the kernel takes and its tables cover its context
 * lengths with blocks in [0, num_blocks); else the status the exported kernel returns. */
int attention_check(const Job *job, int64_t num_blocks);
/* Floats of scratch one thread needs for `job`'s items (64-byte multiple). */
size_t attention_scratch_floats(const Job *job);
/* Work item `item` (sequence item / kv_heads, KV head item % kv_heads) of a bfloat16 cache. */
void attention_item_bf16(const Job *job, int64_t item, float *scratch);

/* linear_bf16_cpu.c: the calling thread's share of y = x W^T + b (its OpenMP team splits the
 * output features). `xf`: x widened to float32, [rows, in]; rows 1-4; row_tile 4 or 8. */
void linear_bf16_share(const float *xf, const uint16_t *w, const float *bias, uint16_t *y,
                       int rows, int row_tile, int in, int out);

/* linear_bf16_cpu.c, the dot-product variant: the calling thread's share over x as stored
 * ([rows, in] bfloat16, rows 1-16) and W in 4-row tiles; 1 (nothing done) on a CPU without
 * AVX-512 BF16, which linear_bf16_dot_available() tells. A fused layer names it by this tile. */
#define LINEAR_DOT_TILE (-4)
int linear_bf16_dot_share(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                          int rows, int in, int out);
int linear_bf16_dot_available(void);

/* gemm_bf16_cpu.c: the calling thread's share of y = x W^T + b (its OpenMP team splits the output
 * features) over x as stored ([rows, ldx] bfloat16, any rows) and W in pair order
 * (kernels.cpu_ops.PairedWeight); 1 (nothing done) on a CPU without AVX-512 BF16. */
int gemm_bf16_pairs_share(const uint16_t *x, int64_t ldx, const uint16_t *w, const float *bias,
                          uint16_t *y, int64_t rows, int64_t in, int64_t out);
int gemm_bf16_pairs_available(void);
/* A fused layer names the pair order by this tile (kernels.cpu_ops.LINEAR_PAIRS_TILE). */
#define LINEAR_PAIRS_TILE (-16)

/* layer_ops_cpu.c, bfloat16 rows on the calling thread (the contracts of add_rms_norm,
 * rotary_write_kv and silu_mul, without their checks). */
void add_rms_norm_bf16_serial(void *x, const void *delta, const void *weight, void *out,
                              int64_t rows, int64_t hidden, float eps);
void rotary_write_kv_bf16_serial(const void *qkv, const void *cos, const void *sin,
                                 const int64_t *slots, void *key_cache, void *value_cache,
                                 int64_t block_stride, int64_t token_stride, int64_t head_stride,
                                 int64_t block_size, void *query, int64_t tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t dim);
void silu_mul_bf16_serial(const void *gate_up, void *out, int64_t rows, int64_t size);

#endif
