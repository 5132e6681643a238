/*
 * What the two prefill attention paths share (prefill_attention_cpu.c: VDPBF16PS, and
 * prefill_attention_amx.c: AMX tiles): the job, the packed context's layout and the softmax's
 * exponential. The packing (prefill_attention_cpu.c, phase 1) serves both: a 16-key tile of keys
 * as [head_dim / 2][16] pairs is an AMX B tile of Q K^T as it is, and values as
 * [tokens / 2][head_dim][2] are B tiles of P V at a row stride of 2 head_dim elements.
 */
#ifndef PDSERVE_PREFILL_ATTENTION_H
#define PDSERVE_PREFILL_ATTENTION_H

#include <stdint.h>

typedef struct {
    const uint16_t *query;       /* [tokens, num_heads, head_dim], contiguous */
    const uint16_t *key_cache;   /* [blocks, block_size, kv_heads, head_dim] at the strides below */
    const uint16_t *value_cache; /* same strides */
    int64_t block_stride, token_stride, head_stride; /* elements; head_dim is contiguous */
    const int32_t *block_tables; /* [num_seqs, max_blocks] */
    int64_t max_blocks, num_blocks;
    const int64_t *query_start;  /* [num_seqs + 1]: sequence s's tokens in `query` */
    const int64_t *context_lens; /* [num_seqs]: its context, the query tokens last */
    int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    uint16_t *out; /* [tokens, num_heads, head_dim] */
} PrefillJob;

#define KEY_TILE 64   /* keys per online-softmax step; contexts are packed padded to it */
#define QUERY_TILE 16 /* query tokens per work item */
#define MAX_DIM 256

#if defined(__AVX512F__)
#include <immintrin.h>

#define LOG2_E 1.44269504f

/* 2^t for t <= 0 (-inf included), to about 3e-6 relative: enough for softmax weights rounded to
 * bfloat16 (8 significant bits) next. The caller folds the softmax's scale and the change of base
 * into one multiply-add, t = s (scale log2 e) - max (scale log2 e). t = n + f with |f| <= 1/2,
 * 2^f by its degree-5 Taylor polynomial, times 2^n by VSCALEFPS. Below -126 (no normal float32)
 * it gives 0: a denormal result there costs a microcode assist on Intel cores, and the masked
 * keys on a causal diagonal all land there (the diagonal's softmax ran several times slower). */
static inline __m512 exp2_weights(__m512 t) {
    const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    t = _mm512_max_ps(t, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.3333558e-3f), _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, n);
}
#endif

/* prefill_attention_amx.c: whether this process may use AMX tiles (it asks Linux once per call:
 * the permission is the process's); per thread, before and after its work items; one item. */
int amx_tiles_permitted(void);
void amx_begin(void);
void amx_end(void);
void attend_item_amx(const PrefillJob *job, int64_t seq, int64_t kv, int64_t token0,
                     const uint32_t *keys, const uint16_t *values);

#endif
