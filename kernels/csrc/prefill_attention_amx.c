/*
 * Prefill attention's phase 2 on AMX tiles (Sapphire Rapids and later Xeons): the same attention
 * as prefill_attention_cpu.c's VDPBF16PS path, over the same packed context, with both products
 * on the tile unit. On an Emerald Rapids core VDPBF16PS issues at half the rate of a float32 FMA:
 * that path ran a 2,048-token prompt at 107 GFLOP/s and PyTorch's SDPA (on tiles) at 300; this
 * one at 550 (benchmarks/cpu_kernels.py). The products cost little here: the softmax's vector
 * work is most of the time.
 *
 * A work item is (sequence, KV head, QUERY_TILE = 16 query tokens); each query head of the GQA
 * group in turn, its 16 rows are one tile's rows. Per span of up to SPAN = 256 keys:
 *   scores  S [16 x span] = Q [16 x head_dim] K^T, KEY_TILE = 64 keys (four C tiles) at a time,
 *           head_dim / 32 steps of TDPBF16PS each;
 *   softmax online in float32 (a running max and sum per row, the output rescaled when the max
 *           grows), the weights rounded to bfloat16 (as the other path and PyTorch's CPU flash
 *           attention round them) into P [16 x span];
 *   output  O [16 x head_dim] += P V: O lives in memory in float32 and goes through C tiles 64
 *           dimensions at a time, loaded and stored once a span.
 * Spans of 256 rather than 64 keys: a tile that loads what the vector unit has just stored (P,
 * and O after a rescale) waits for those stores, and the per-row bookkeeping (maxima, sums,
 * rescales) is paid once a span. Scores are exact bfloat16 products summed in
 * float32, in the tile unit's order. Query rows past a sequence's last token are zeros in a
 * private copy and are not stored.
 *
 * Tiles need Linux's permission (arch_prctl ARCH_REQ_XCOMP_PERM): amx_tiles_permitted asks for
 * it; where it is refused or the compiler lacks AMX, the caller keeps the other paths.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "prefill_attention.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 16  /* a tile's rows: query tokens of one head */
#define SPAN 256 /* keys per online-softmax step: scores of up to four KEY_TILEs */

int amx_tiles_permitted(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Palette 1, all eight tiles 16 rows of 64 bytes: 16 x 32 bfloat16 (A, B) or 16 x 16 float32. */
void amx_begin(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = ROWS;
    /* GCC 12 does not see LDTILECFG read the struct and drops the stores above without this. */
    __asm__ volatile("" : : "m"(config) : "memory");
    _tile_loadconfig(&config);
}

void amx_end(void) { _tile_release(); }

/* S = Q K^T for keys [tile, tile + 64) into `scores` (16 rows at a stride of SPAN): tiles 0-3
 * its four 16-key columns, 4 the query's 32 dimensions of each step, 5 and 6 the keys'. */
static void scores_tile(const uint16_t *q, int64_t dim, const uint32_t *keys, int64_t tile,
                        float *scores) {
    const int64_t pairs = dim / 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t h = 0; h < dim / 32; h++) {
        const uint32_t *k = keys + tile * pairs + h * 16 * 16; /* [16 pairs][16 keys] at 64 B */
        _tile_loadd(4, q + h * 32, dim * 2);
        _tile_loadd(5, k, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, k + 16 * pairs, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, k + 32 * pairs, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, k + 48 * pairs, 64);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, scores, SPAN * 4);
    _tile_stored(1, scores + 16, SPAN * 4);
    _tile_stored(2, scores + 32, SPAN * 4);
    _tile_stored(3, scores + 48, SPAN * 4);
}

/* A span's keys from `tile`: up to SPAN, to the KEY_TILE that holds key `last`. */
static int64_t span_keys(int64_t tile, int64_t last) {
    const int64_t rest = (last - tile) / KEY_TILE * KEY_TILE + KEY_TILE;
    return rest < SPAN ? rest : SPAN;
}

/* O [16][dim] float32 += P [16][keys] V for `keys` (a multiple of 64) from `tile`: 64 output
 * dimensions (four C tiles) at a time, or 32 for a last odd group; tile 4 holds 32 keys'
 * weights, 5 and 6 values. */
static void weigh_values(const uint16_t *weights, const uint16_t *values, int64_t dim,
                         int64_t tile, int64_t keys, float *o) {
    const uint16_t *v0 = values + tile * dim; /* key pair tile / 2, row stride 2 dim elements */
    for (int64_t c = 0; c < dim; c += 64) {
        const int four = dim - c >= 64;
        _tile_loadd(0, o + c, dim * 4);
        _tile_loadd(1, o + c + 16, dim * 4);
        if (four) {
            _tile_loadd(2, o + c + 32, dim * 4);
            _tile_loadd(3, o + c + 48, dim * 4);
        }
        for (int64_t u = 0; u < keys / 32; u++) { /* keys tile + 32 u .. + 32 */
            const uint16_t *v = v0 + u * 16 * dim * 2 + c * 2;
            _tile_loadd(4, weights + u * 32, SPAN * 2);
            _tile_loadd(5, v, dim * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, v + 32, dim * 4);
            _tile_dpbf16ps(1, 4, 6);
            if (four) {
                _tile_loadd(5, v + 64, dim * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, v + 96, dim * 4);
                _tile_dpbf16ps(3, 4, 6);
            }
        }
        _tile_stored(0, o + c, dim * 4);
        _tile_stored(1, o + c + 16, dim * 4);
        if (four) {
            _tile_stored(2, o + c + 32, dim * 4);
            _tile_stored(3, o + c + 48, dim * 4);
        }
    }
}

/* One row's online-softmax step over its `scores` of `keys` (a multiple of 64, at most SPAN)
 * from `tile`, keys past `pos` masked: its weights into `weights` as bfloat16, its running max
 * (of the unscaled scores) and sum updated, its output row rescaled where the max grew. Four
 * independent maxima and two sums: one chain each left a row's latency exposed. */
static void softmax_row(const float *scores, int64_t keys, int64_t tile, int64_t pos,
                        float to_base2, float *top, float *total, uint16_t *weights, float *o,
                        int64_t dim) {
    __m512 s[SPAN / 16], high[4];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t vectors = keys / 16;
    for (int i = 0; i < 4; i++) high[i] = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < vectors; c += 4)
        for (int i = 0; i < 4; i++) {
            const int64_t first = tile + 16 * (c + i);
            __m512 x = _mm512_load_ps(scores + 16 * (c + i));
            if (first + 15 > pos) {
                const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)first), lane);
                const __mmask16 past = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32((int)pos));
                x = _mm512_mask_mov_ps(x, past, _mm512_set1_ps(-INFINITY));
            }
            s[c + i] = x;
            high[i] = _mm512_max_ps(high[i], x);
        }
    const float span_top = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_max_ps(high[0], high[1]), _mm512_max_ps(high[2], high[3])));
    const float new_top = *top > span_top ? *top : span_top;
    const float shrink = exp2f((*top - new_top) * to_base2); /* 0 at the first span (-inf) */
    *top = new_top;
    const __m512 base2 = _mm512_set1_ps(to_base2), m = _mm512_set1_ps(new_top * to_base2);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < vectors; c += 2) {
        const __m512 low = exp2_weights(_mm512_fmsub_ps(s[c], base2, m));
        const __m512 up = exp2_weights(_mm512_fmsub_ps(s[c + 1], base2, m));
        sum[c / 2 % 2] = _mm512_add_ps(sum[c / 2 % 2], _mm512_add_ps(low, up));
        _mm512_store_si512(weights + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(up, low));
    }
    *total = *total * shrink + _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    if (shrink != 1.0f)
        for (int64_t c = 0; c < dim; c += 16)
            _mm512_store_ps(o + c, _mm512_mul_ps(_mm512_load_ps(o + c), _mm512_set1_ps(shrink)));
}

/* Query head `head`'s rows for `tokens` (1-16) query tokens from `token0` of `seq`. */
static void attend_head(const PrefillJob *job, int64_t seq, int64_t head, int64_t token0,
                        int64_t tokens, const uint32_t *keys, const uint16_t *values) {
    const int64_t dim = job->head_dim, start = job->query_start[seq];
    const int64_t first_pos = job->context_lens[seq] - (job->query_start[seq + 1] - start);
    __attribute__((aligned(64))) uint16_t q[ROWS * MAX_DIM];
    __attribute__((aligned(64))) float o[ROWS * MAX_DIM];
    __attribute__((aligned(64))) float scores[ROWS * SPAN];
    __attribute__((aligned(64))) uint16_t weights[ROWS * SPAN];
    float top[ROWS], total[ROWS];
    int64_t pos[ROWS];
    for (int64_t r = 0; r < ROWS; r++) {
        const int64_t real = r < tokens;
        if (real)
            memcpy(q + r * dim, job->query + ((start + token0 + r) * job->num_heads + head) * dim,
                   (size_t)dim * 2);
        else
            memset(q + r * dim, 0, (size_t)dim * 2);
        memset(o + r * dim, 0, (size_t)dim * 4);
        top[r] = -INFINITY, total[r] = 0.0f;
        pos[r] = first_pos + token0 + (real ? r : tokens - 1); /* padding rows: the last real */
    }
    const int64_t last = pos[ROWS - 1];
    for (int64_t tile = 0; tile <= last; tile += SPAN) {
        const int64_t keys_here = span_keys(tile, last);
        for (int64_t k = 0; k < keys_here; k += KEY_TILE)
            scores_tile(q, dim, keys, tile + k, scores + k);
        for (int64_t r = 0; r < ROWS; r++)
            softmax_row(scores + r * SPAN, keys_here, tile, pos[r], job->scale * LOG2_E,
                        top + r, total + r, weights + r * SPAN, o + r * dim, dim);
        weigh_values(weights, values, dim, tile, keys_here, o);
    }
    for (int64_t r = 0; r < tokens; r++) {
        uint16_t *out = job->out + ((start + token0 + r) * job->num_heads + head) * dim;
        const __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        for (int64_t c = 0; c < dim; c += 32) {
            const __m512 low = _mm512_mul_ps(_mm512_load_ps(o + r * dim + c), inverse);
            const __m512 high = _mm512_mul_ps(_mm512_load_ps(o + r * dim + c + 16), inverse);
            _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
    }
}

void attend_item_amx(const PrefillJob *job, int64_t seq, int64_t kv, int64_t token0,
                     const uint32_t *keys, const uint16_t *values) {
    const int64_t count = job->query_start[seq + 1] - job->query_start[seq];
    const int64_t tokens = count - token0 < QUERY_TILE ? count - token0 : QUERY_TILE;
    const int64_t group = job->num_heads / job->num_kv_heads;
    for (int64_t h = kv * group; h < (kv + 1) * group; h++)
        attend_head(job, seq, h, token0, tokens, keys, values);
}

#else

int amx_tiles_permitted(void) { return 0; }
void amx_begin(void) {}
void amx_end(void) {}
void attend_item_amx(const PrefillJob *job, int64_t seq, int64_t kv, int64_t token0,
                     const uint32_t *keys, const uint16_t *values) {
    (void)job, (void)seq, (void)kv, (void)token0, (void)keys, (void)values;
}

#endif
