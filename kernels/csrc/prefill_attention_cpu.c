/*
 * Paged prefill attention for the CPU, bfloat16 query and cache, on CPUs with AVX-512 BF16: the
 * prompt tokens of one or more sequences attend causally to their context (a cached prefix, then
 * the tokens themselves), reading the KV blocks where the block tables say. PyTorch's CPU SDPA
 * ran a 2,048-token prompt's attention at 115 GFLOP/s on a Zen 4 VM whose bfloat16 GEMMs run at
 * 410: half of the prefill's time. Here both products are VDPBF16PS (32 bfloat16 pairs into 16
 * float32 lanes): the scores from the bfloat16 query and keys, exact products summed in float32;
 * the output from the softmax weights rounded to bfloat16 (as PyTorch's CPU flash attention
 * rounds them for a bfloat16 query) and the values, summed in float32; the softmax in float32.
 *
 * Two phases in one OpenMP region:
 * 1. Each (sequence, KV head)'s context is copied out of its blocks once, into the orders the
 *    products read: keys in tiles of 16 tokens as [head_dim / 2][16] pairs (a vector holds one
 *    pair of dimensions of 16 keys), values as [tokens / 2][head_dim][2] (a vector holds two
 *    tokens' values of 16 dimensions). Contexts are padded with zeros to KEY_TILE tokens.
 * 2. A work item is (sequence, KV head, QUERY_TILE query tokens); its rows (token, query head of
 *    the GQA group) go ROW_GROUP at a time over the keys KEY_TILE at a time (flash attention's
 *    online softmax: a running max and sum per row, the output rescaled when the max grows), up
 *    to the last key the group's rows may see. Items are handed out dynamically: causal items
 *    differ in cost. With `amx` set, phase 2 is prefill_attention_amx.c's, on AMX tiles.
 * Status: 0, 1 for arguments it does not take, 2 out of memory, 3 a block id outside the cache,
 * 4 compiled without AVX-512 BF16, or `amx` asked where the compiler or Linux gives no AMX tiles
 * (the caller then keeps another path).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_attention.h"
#include "vec16.h"


#if defined(__AVX512BF16__)
#include <immintrin.h>

#define ROW_GROUP 4 /* query rows computed together: 16 score accumulators */

static int64_t padded(int64_t len) { return (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE; }

/* Phase 1 for keys [first, first + 16) of sequence `seq`, KV head `kv`: `kt` and `vp` are that
 * (sequence, head)'s packed keys and values. */
static void pack_tile(const PrefillJob *job, int64_t seq, int64_t kv, int64_t first, uint32_t *kt,
                      uint16_t *vp) {
    const int64_t dim = job->head_dim, pairs = dim / 2, len = job->context_lens[seq];
    const int32_t *table = job->block_tables + seq * job->max_blocks;
    uint32_t *ktile = kt + first * pairs; /* [pairs][16] */
    for (int64_t j = 0; j < 16; j++) {
        const int64_t pos = first + j;
        uint16_t *vrow = vp + (pos / 2) * dim * 2 + (pos % 2);
        if (pos >= len) {
            for (int64_t d2 = 0; d2 < pairs; d2++) ktile[d2 * 16 + j] = 0;
            for (int64_t d = 0; d < dim; d++) vrow[2 * d] = 0;
            continue;
        }
        const int64_t at = (int64_t)table[pos / job->block_size] * job->block_stride +
                           (pos % job->block_size) * job->token_stride + kv * job->head_stride;
        const uint32_t *krow = (const uint32_t *)(job->key_cache + at);
        const uint16_t *vsrc = job->value_cache + at;
        for (int64_t d2 = 0; d2 < pairs; d2++) ktile[d2 * 16 + j] = krow[d2];
        for (int64_t d = 0; d < dim; d++) vrow[2 * d] = vsrc[d];
    }
}

/* The highest and the sum of 16 lanes. */
static inline float max_lanes(__m512 v) { return _mm512_reduce_max_ps(v); }

/* acc_out[r][c .. c + n) += the tile's weights of row r times its values, n (1-4, constant where
 * inlined) vectors of 16 dimensions at a time: ROW_GROUP x n independent sums, so that the adds
 * do not wait on each other (one sum per pair of keys waited on VDPBF16PS's latency: 3x slower). */
ALWAYS_INLINE void weigh_values(const uint16_t *vtile, int64_t dim, int64_t c,
                                const uint16_t weights[ROW_GROUP][KEY_TILE],
                                __m512 acc_out[ROW_GROUP][MAX_DIM / 16], int n) {
    __m512 acc[ROW_GROUP][4];
    for (int r = 0; r < ROW_GROUP; r++)
        for (int i = 0; i < n; i++) acc[r][i] = acc_out[r][c + i];
    for (int64_t j2 = 0; j2 < KEY_TILE / 2; j2++) {
        __m512bh v[4];
        for (int i = 0; i < n; i++)
            v[i] = (__m512bh)_mm512_load_si512(vtile + j2 * dim * 2 + (c + i) * 32);
        for (int r = 0; r < ROW_GROUP; r++) {
            uint32_t pair;
            memcpy(&pair, weights[r] + 2 * j2, sizeof pair);
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int i = 0; i < n; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w, v[i]);
        }
    }
    for (int r = 0; r < ROW_GROUP; r++)
        for (int i = 0; i < n; i++) acc_out[r][c + i] = acc[r][i];
}

/* Phase 2 for one group of ROW_GROUP rows: `q[r]` the query rows (bfloat16 pairs), `pos[r]` the
 * position of each row's token (it sees keys 0..pos), `out[r]` where its output goes. The last
 * rows may repeat a real one (a short group): they are computed and not stored. */
static void attend_rows(const PrefillJob *job, const uint32_t *kt, const uint16_t *vp,
                        const uint32_t *q[ROW_GROUP], const int64_t pos[ROW_GROUP],
                        uint16_t *out[ROW_GROUP], int rows) {
    const int64_t dim = job->head_dim, pairs = dim / 2, chunks = dim / 16;
    int64_t last = 0, first_masked = pos[0];
    for (int r = 0; r < ROW_GROUP; r++) {
        last = pos[r] > last ? pos[r] : last;
        first_masked = pos[r] < first_masked ? pos[r] : first_masked;
    }
    float top[ROW_GROUP], total[ROW_GROUP];
    __m512 acc_out[ROW_GROUP][MAX_DIM / 16];
    for (int r = 0; r < ROW_GROUP; r++) {
        top[r] = -INFINITY;
        total[r] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) acc_out[r][c] = _mm512_setzero_ps();
    }
    const float to_base2 = job->scale * LOG2_E; /* the weights are 2^(s to_base2 - max) */
    const __m512 base2 = _mm512_set1_ps(to_base2);
    __attribute__((aligned(64))) uint16_t weights[ROW_GROUP][KEY_TILE];
    for (int64_t tile = 0; tile <= last; tile += KEY_TILE) {
        /* Scores: lane j of s[r][c] is row r's dot product with key tile + 16 c + j. */
        __m512 s[ROW_GROUP][4];
        for (int r = 0; r < ROW_GROUP; r++)
            for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
        const uint32_t *ktile = kt + tile * pairs;
        for (int64_t d2 = 0; d2 < pairs; d2++) {
            __m512bh k[4];
            for (int c = 0; c < 4; c++)
                k[c] = (__m512bh)_mm512_load_si512(ktile + (c * pairs + d2) * 16);
            for (int r = 0; r < ROW_GROUP; r++) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q[r][d2]);
                for (int c = 0; c < 4; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], qv, k[c]);
            }
        }
        /* Online softmax: mask the keys past each row's token, rescale by the new max (of the
         * unscaled scores: the scale is applied in the exponent). */
        for (int r = 0; r < ROW_GROUP; r++) {
            __m512 high = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                if (tile + KEY_TILE - 1 > first_masked) {
                    const __m512i key = _mm512_add_epi32(
                        _mm512_set1_epi32((int)(tile + 16 * c)),
                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                    const __mmask16 past =
                        _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32((int)pos[r]));
                    s[r][c] = _mm512_mask_mov_ps(s[r][c], past, _mm512_set1_ps(-INFINITY));
                }
                high = _mm512_max_ps(high, s[r][c]);
            }
            const float new_top = top[r] > max_lanes(high) ? top[r] : max_lanes(high);
            /* 0 at the first tile (-inf) */
            const float shrink = exp2f((top[r] - new_top) * to_base2);
            top[r] = new_top;
            const __m512 m = _mm512_set1_ps(new_top * to_base2);
            __m512 sum = _mm512_setzero_ps(), p[4];
            for (int c = 0; c < 4; c++) {
                p[c] = exp2_weights(_mm512_fmsub_ps(s[r][c], base2, m));
                sum = _mm512_add_ps(sum, p[c]);
            }
            total[r] = total[r] * shrink + _mm512_reduce_add_ps(sum);
            if (shrink != 1.0f) /* the max grew: earlier sums shrink to its scale */
                for (int64_t c = 0; c < chunks; c++)
                    acc_out[r][c] = _mm512_mul_ps(acc_out[r][c], _mm512_set1_ps(shrink));
            _mm512_store_si512(weights[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
            _mm512_store_si512(weights[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
        }
        /* Output: lane l of acc_out[r][c] gains the sum over key pairs of weight * value. */
        const uint16_t *vtile = vp + tile * dim;
        for (int64_t c = 0; c < chunks; c += 4) {
            switch (chunks - c < 4 ? chunks - c : 4) {
            case 1: weigh_values(vtile, dim, c, weights, acc_out, 1); break;
            case 2: weigh_values(vtile, dim, c, weights, acc_out, 2); break;
            case 3: weigh_values(vtile, dim, c, weights, acc_out, 3); break;
            default: weigh_values(vtile, dim, c, weights, acc_out, 4);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const vec16 inverse = (vec16){0} + 1.0f / total[r];
        for (int64_t c = 0; c < chunks; c++) {
            vec16 o;
            memcpy(&o, &acc_out[r][c], sizeof o);
            store(out[r], c * 16, o * inverse, 1);
        }
    }
}

/* Phase 2 for one work item: query tokens [token0, token0 + QUERY_TILE) of `seq` (at most its
 * last), every query head of KV head `kv`. */
static void attend_item(const PrefillJob *job, int64_t seq, int64_t kv, int64_t token0,
                        const uint32_t *kt, const uint16_t *vp) {
    const int64_t start = job->query_start[seq], count = job->query_start[seq + 1] - start;
    const int64_t group = job->num_heads / job->num_kv_heads, dim = job->head_dim;
    const int64_t first_pos = job->context_lens[seq] - count;
    const int64_t tokens = count - token0 < QUERY_TILE ? count - token0 : QUERY_TILE;
    const int64_t rows = tokens * group;
    for (int64_t row0 = 0; row0 < rows; row0 += ROW_GROUP) {
        const uint32_t *q[ROW_GROUP];
        int64_t pos[ROW_GROUP];
        uint16_t *out[ROW_GROUP];
        const int real = rows - row0 < ROW_GROUP ? (int)(rows - row0) : ROW_GROUP;
        for (int r = 0; r < ROW_GROUP; r++) {
            const int64_t row = row0 + (r < real ? r : real - 1);
            const int64_t token = token0 + row / group, head = kv * group + row % group;
            const int64_t at = ((start + token) * job->num_heads + head) * dim;
            q[r] = (const uint32_t *)(job->query + at);
            out[r] = job->out + at;
            pos[r] = first_pos + token;
        }
        attend_rows(job, kt, vp, q, pos, out, real);
    }
}

int prefill_attention_bf16(const PrefillJob *job, int num_threads, int amx) {
    if (amx && !amx_tiles_permitted()) return 4;
    const int64_t seqs = job->num_seqs, kv_heads = job->num_kv_heads, dim = job->head_dim;
    if (seqs < 1 || kv_heads < 1 || job->num_heads % kv_heads || dim % 32 || dim > MAX_DIM ||
        job->block_size < 1)
        return 1;
    /* Where each (sequence, KV head)'s packed context starts, in elements of one of K or V. */
    int64_t *offset = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    if (!offset) return 2;
    offset[0] = 0;
    for (int64_t s = 0; s < seqs; s++) {
        const int64_t len = job->context_lens[s], count = job->query_start[s + 1] -
                                                          job->query_start[s];
        const int32_t *table = job->block_tables + s * job->max_blocks;
        const int64_t used = (len + job->block_size - 1) / job->block_size;
        int bad = len < count || count < 0 || used > job->max_blocks;
        for (int64_t b = 0; !bad && b < used; b++)
            bad = table[b] < 0 || table[b] >= job->num_blocks;
        if (bad) {
            free(offset);
            return len < count || count < 0 ? 1 : 3;
        }
        offset[s + 1] = offset[s] + padded(len) * kv_heads * dim;
    }
    uint16_t *keys = aligned_alloc(64, sizeof(uint16_t) * (size_t)offset[seqs] + 64);
    uint16_t *values = aligned_alloc(64, sizeof(uint16_t) * (size_t)offset[seqs] + 64);
    int64_t *first_tile = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    if (!keys || !values || !first_tile) {
        free(keys), free(values), free(first_tile), free(offset);
        return 2;
    }
    /* Work items of phase 1 (16-key tiles) and 2 (query tiles), numbered across sequences. */
    int64_t pack_items = 0;
    first_tile[0] = 0;
    for (int64_t s = 0; s < seqs; s++) {
        pack_items += padded(job->context_lens[s]) / 16 * kv_heads;
        const int64_t count = job->query_start[s + 1] - job->query_start[s];
        first_tile[s + 1] = first_tile[s] + (count + QUERY_TILE - 1) / QUERY_TILE * kv_heads;
    }
#pragma omp parallel num_threads(num_threads)
    {
        int64_t s = 0, base = 0;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < pack_items; item++) {
            while (item - base >= padded(job->context_lens[s]) / 16 * kv_heads)
                base += padded(job->context_lens[s++]) / 16 * kv_heads;
            const int64_t tiles = padded(job->context_lens[s]) / 16, local = item - base;
            const int64_t kv = local / tiles, size = padded(job->context_lens[s]) * dim;
            const int64_t at = offset[s] + kv * size;
            pack_tile(job, s, kv, (local % tiles) * 16, (uint32_t *)(keys + at), values + at);
        }
        /* The implicit barrier above: every context is packed. Largest items first. */
        if (amx) amx_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first_tile[seqs]; item++) {
            const int64_t reversed = first_tile[seqs] - 1 - item;
            int64_t seq = 0;
            while (reversed >= first_tile[seq + 1]) seq++;
            const int64_t local = reversed - first_tile[seq];
            const int64_t kv = local % kv_heads, tile = local / kv_heads;
            const int64_t at = offset[seq] + kv * padded(job->context_lens[seq]) * dim;
            if (amx)
                attend_item_amx(job, seq, kv, tile * QUERY_TILE, (const uint32_t *)(keys + at),
                                values + at);
            else
                attend_item(job, seq, kv, tile * QUERY_TILE, (const uint32_t *)(keys + at),
                            values + at);
        }
        if (amx) amx_end();
    }
    free(keys), free(values), free(first_tile), free(offset);
    return 0;
}

#else

int prefill_attention_bf16(const PrefillJob *job, int num_threads, int amx) {
    (void)job, (void)num_threads, (void)amx;
    return 4;
}

#endif
