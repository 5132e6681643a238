/*
 * Sampling's last step over a batch of logit rows, for the CPU, in the model's dtype: greedy
 * rows take the argmax, the others the exponential race (race_rows, below).
 *
 * At a decode batch of 64 the LM head's logits are 64 x the vocabulary (3.1 M values for a 49k
 * vocabulary): widening them to float32 and reducing them with PyTorch's max took about 1.6 ms
 * of a ~75 ms bfloat16 step on a Zen 4 core pair; this reads the bfloat16 rows as they are, 16
 * lanes at a time, in about 0.4 ms. A bfloat16 widens to float32 exactly, so the index is the
 * one the float32 logits give.
 *
 * The answer is torch.max(dim=-1)'s: the first maximum of each row, where a NaN counts as above
 * every number (the first NaN wins). Rows are spread over torch's OpenMP threads
 * (paged_attention_cpu.c says why that runtime) when there are enough values to pay for it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define PARALLEL_VALUES 65536 /* below this many values one thread is faster */

static inline float scalar_at(const void *x, int64_t index, int bf16) {
    if (!bf16) return ((const float *)x)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[index] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Whether (value, index) goes before the best so far, (best, at): a NaN before any number, then
 * the larger, then the smaller index. */
static inline int goes_first(float value, int64_t index, float best, int64_t at) {
    if (best != best) return value != value && index < at;
    if (value != value) return 1;
    return value > best || (value == best && index < at);
}

/* Each lane keeps the first best of the columns it sees (a lane sees its columns in order, so a
 * later equal value never replaces it); the lanes are then merged by `goes_first`. */
ALWAYS_INLINE int64_t row_argmax(const void *x, int64_t row, int64_t n, int bf16) {
    const int64_t base = row * n;
    vec16 best = (vec16){0} + NAN;
    i32x16 where = {0}, column = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t i = 0;
    if (n >= LANES) {
        best = load(x, base, bf16);
        where = column;
        for (i = LANES, column += LANES; i + LANES <= n; i += LANES, column += LANES) {
            const vec16 v = load(x, base + i, bf16);
            const i32x16 take = (v > best) | ((v != v) & (best == best));
            best = blend(best, v, take);
            where = (where & ~take) | (column & take);
        }
    }
    float top = scalar_at(x, base, bf16);
    int64_t index = 0;
    if (n >= LANES)
        for (int lane = 0; lane < LANES; lane++)
            if (goes_first(best[lane], where[lane], top, index)) {
                top = best[lane];
                index = where[lane];
            }
    for (; i < n; i++) {
        const float value = scalar_at(x, base + i, bf16);
        if (goes_first(value, i, top, index)) {
            top = value;
            index = i;
        }
    }
    return index;
}

/* out [rows] (int64) = the index of each row's first maximum in x [rows, n], float32 or
 * bfloat16 (`bf16`), contiguous. Returns 0, or 1 for sizes it does not take. */
int argmax_rows(const void *x, int64_t *out, int64_t rows, int64_t n, int bf16,
                int num_threads) {
    if (rows < 0 || n <= 0 || num_threads <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++)
        out[r] = bf16 ? row_argmax(x, r, n, 1) : row_argmax(x, r, n, 0);
    return 0;
}

/* ---- The exponential race ------------------------------------------------------------------
 *
 * A draw from softmax(x * scale) is the argmax over the vocabulary of p_i / E_i with E_i ~ Exp(1)
 * independent, that is of x_i * scale - log(E_i) (the row's normalizer is the same for every
 * i). E_i = -log(U_i), and U_i comes from a counter-based hash of (the row's 64-bit key, i), so
 * a row's draw depends on its key and logits only, never on the batch around it, and needs no
 * random generator state. The winner changes only where the top two scores nearly tie, so
 * logits that differ in the last bits (another batch shape's GEMM) give the same token.
 * kernels/reference.py's race_rows computes the same noise bits with PyTorch; its logarithm may
 * differ from log16's in the last bit, which moves a token only at such a near-tie.
 */

/* lowbias32, a 32-bit integer mix with good avalanche (constants from Chris Wellons's hash
 * prospector); a bijection, so the vocabulary's indices get distinct bits within a row. */
ALWAYS_INLINE u32x16 mix32(u32x16 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* U in (0, 1), exactly ((bits >> 9) + 0.5) / 2^23: never 0 or 1, so -log U is finite and
 * positive and its log finite too. */
ALWAYS_INLINE vec16 uniform16(u32x16 column, uint32_t key_low, uint32_t key_high) {
    const u32x16 bits = mix32(mix32(column ^ key_low) ^ key_high);
    return (__builtin_convertvector(bits >> 9, vec16) + 0.5f) * (1.0f / 8388608.0f);
}

/* 1 / x for x in [1.7, 2.5): VRCP14PS (relative error below 2^-14) and a Newton step (below
 * 2^-27), in place of a division, which issues on one port at a fraction of the rate; a
 * division where AVX-512 is absent. */
ALWAYS_INLINE vec16 reciprocal16(vec16 x) {
#if defined(__AVX512F__)
    __m512 v;
    memcpy(&v, &x, sizeof v);
    const __m512 r = _mm512_rcp14_ps(v);
    vec16 guess;
    memcpy(&guess, &r, sizeof guess);
    return guess * (2.0f - x * guess);
#else
    return 1.0f / x;
#endif
}

/* The natural log of positive normal floats, relatively accurate near 1 too (where -log U for U
 * close to 1 is tiny): x = 2^e m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s) with
 * s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^11 (truncation below 5e-9). */
ALWAYS_INLINE vec16 log16(vec16 x) {
    const u32x16 bits = as_bits(x);
    i32x16 exponent = (i32x16)(bits >> 23) - 127;
    vec16 m = as_float((bits & 0x7fffffu) | 0x3f800000u); /* [1, 2) */
    const i32x16 high = m > 1.41421356f;
    m = blend(m, m * 0.5f, high);
    exponent -= high; /* a true compare is all ones: -1 */
    const vec16 s = (m - 1.0f) * reciprocal16(m + 1.0f), s2 = s * s;
    vec16 series = s2 * (1.0f / 11) + (1.0f / 9);
    series = series * s2 + (1.0f / 7);
    series = series * s2 + (1.0f / 5);
    series = series * s2 + (1.0f / 3);
    series = series * s2 + 1.0f;
    return __builtin_convertvector(exponent, vec16) * 0.693147180559945f + 2.0f * s * series;
}

/* Whether some lane of v is >= at_least (a NaN is not). */
ALWAYS_INLINE int any_at_least(vec16 v, float at_least) {
#if defined(__AVX512F__)
    __m512 packed;
    memcpy(&packed, &v, sizeof packed);
    return _mm512_cmp_ps_mask(packed, _mm512_set1_ps(at_least), _CMP_GE_OQ) != 0;
#else
    for (int l = 0; l < LANES; l++)
        if (v[l] >= at_least) return 1;
    return 0;
#endif
}

/* Row `row`'s winner: the first maximum of x * scale - log(-log U) over the x >= at_least; a NaN
 * score never wins, an all -inf row gives 0. The last partial vector is padded with -inf, so every column takes the
 * same vector arithmetic. */
ALWAYS_INLINE int64_t row_race(const void *x, int64_t row, int64_t n, float scale, float at_least,
                               uint64_t key, int bf16) {
    const int64_t base = row * n;
    const uint32_t key_low = (uint32_t)key, key_high = (uint32_t)(key >> 32);
    const u32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vec16 best = (vec16){0} - INFINITY;
    i32x16 where = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        vec16 v;
        if (i + LANES <= n) {
            v = load(x, base + i, bf16);
        } else {
            v = (vec16){0} - INFINITY;
            for (int64_t j = i; j < n; j++) v[j - i] = scalar_at(x, base + j, bf16);
        }
        /* What the filters dropped cannot win: a vector of it needs no noise (most of a row,
         * under top-p or top-k). */
        if (!any_at_least(v, at_least)) continue;
        v = blend(v, (vec16){0} - INFINITY, v < at_least);
        const u32x16 column = lane + (uint32_t)i;
        const vec16 score = v * scale - log16(-log16(uniform16(column, key_low, key_high)));
        const i32x16 take = score > best;
        best = blend(best, score, take);
        where = (where & ~take) | ((i32x16)column & take);
    }
    float top = -INFINITY;
    int64_t index = 0;
    for (int l = 0; l < LANES; l++)
        if (best[l] > top || (best[l] == top && where[l] < index && best[l] > -INFINITY)) {
            top = best[l];
            index = where[l];
        }
    return index;
}

/* out [rows] (int64): for a row with scale > 0 the exponential race over x * scale with noise
 * keyed by keys[row] (a uint64), among the x >= floors[row] (floors NULL: all; filter_floors
 * gives it), for a row with scale <= 0 its argmax (argmax_rows'); x [rows, n] float32 or
 * bfloat16 (`bf16`), contiguous. Returns 0, or 1 for sizes it does not take. */
int race_rows(const void *x, const float *scale, const uint64_t *keys, const float *floors,
              int64_t *out, int64_t rows, int64_t n, int bf16, int num_threads) {
    if (rows < 0 || n <= 0 || n > UINT32_MAX || num_threads <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        if (scale[r] <= 0)
            out[r] = bf16 ? row_argmax(x, r, n, 1) : row_argmax(x, r, n, 0);
        else {
            const float at_least = floors == NULL ? -INFINITY : floors[r];
            out[r] = bf16 ? row_race(x, r, n, scale[r], at_least, keys[r], 1)
                          : row_race(x, r, n, scale[r], at_least, keys[r], 0);
        }
    }
    return 0;
}

/* ---- Top-k, top-p and min-p as one floor per row ----------------------------------------------
 *
 * Each filter keeps the tokens whose logit reaches some value, so together they keep the tokens
 * at or above one floor per row: the smallest logit all three keep. The filters are judged on
 * y = x * scale (logits / temperature) with w = exp(y - max y), a token's probability over the
 * most likely one's:
 *   top-k  keeps the k largest logits, and every logit equal to the k-th;
 *   top-p  keeps a token while the mass of the larger logits (within top-k's set) is below
 *          top_p times that set's mass, so the most likely token always stays and equal logits
 *          stay or go together;
 *   min-p  keeps w >= min_p.
 * No sort: top-k's and top-p's floors are found by bisection over an order-preserving 32-bit key
 * of the logit, each step one vectorized pass over the row's keys (and weights), which stay in
 * the core's cache. kernels/reference.py's filter_floors computes the same by a sort; the sums'
 * order differs, which moves a floor only where a mass ties top_p to float32 rounding.
 */

/* The float's bits mapped so that unsigned order is the float's order (-inf lowest of the
 * numbers); a NaN maps to 0, below everything. */
ALWAYS_INLINE u32x16 order_key16(vec16 x) {
    const u32x16 bits = as_bits(x);
    const u32x16 negative = (u32x16)((i32x16)bits < 0);
    const u32x16 key = (~bits & negative) | ((bits | 0x80000000u) & ~negative);
    return key & ~(u32x16)(x != x);
}

static float key_value(uint32_t key) {
    const uint32_t bits = (key & 0x80000000u) ? key & 0x7fffffffu : ~key;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The largest of row `base`'s n values, NaN ignored (-inf where there are none). */
static float row_max(const void *x, int64_t base, int64_t n, int bf16) {
    vec16 best = (vec16){0} - INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vec16 v = load(x, base + i, bf16);
        best = blend(best, v, v > best);
    }
    float top = -INFINITY;
    for (int l = 0; l < LANES; l++)
        if (best[l] > top) top = best[l];
    for (; i < n; i++) {
        const float v = scalar_at(x, base + i, bf16);
        if (v > top) top = v;
    }
    return top;
}

/* How many keys are >= `at`. */
static int64_t count_from(const uint32_t *key, int64_t padded, uint32_t at) {
    i32x16 count = {0};
    for (int64_t i = 0; i < padded; i += LANES) count -= (i32x16)(*(const u32x16 *)(key + i) >= at);
    int64_t total = 0;
    for (int l = 0; l < LANES; l++) total += count[l];
    return total;
}

/* The sum of the weights whose key is > `above` and >= `from`. */
static float mass_above(const uint32_t *key, const float *w, int64_t padded, uint32_t above,
                        uint32_t from) {
    vec16 sum = {0};
    for (int64_t i = 0; i < padded; i += LANES) {
        const u32x16 k = *(const u32x16 *)(key + i);
        sum += blend((vec16){0}, *(const vec16 *)(w + i), (i32x16)((k > above) & (k >= from)));
    }
    return sum_lanes(sum);
}

/* One row's floor key (0: nothing dropped). `key` and `w` hold `padded` entries, the padding
 * key 0 and weight 0. */
static uint32_t row_floor_key(const uint32_t *key, const float *w, int64_t n, int64_t padded,
                              int64_t top_k, float top_p, float min_p) {
    uint32_t floor_key = 0;
    if (top_k > 0 && top_k < n) { /* the largest key with at least top_k keys at or above it */
        uint32_t low = 0, high = UINT32_MAX;
        while (low < high) {
            const uint32_t mid = low + (uint32_t)(((uint64_t)high - low + 1) / 2);
            if (count_from(key, padded, mid) >= top_k) low = mid;
            else high = mid - 1;
        }
        floor_key = low;
    }
    if (top_p < 1.0f) { /* the smallest key whose larger keys' mass is below the target */
        /* Key 0 (a NaN, the padding) weighs nothing, so "above 0" is the whole set. */
        const float target = top_p * mass_above(key, w, padded, 0, floor_key);
        uint32_t low = floor_key, high = UINT32_MAX;
        while (low < high) {
            const uint32_t mid = low + (high - low) / 2;
            if (mass_above(key, w, padded, mid, floor_key) < target) high = mid;
            else low = mid + 1;
        }
        floor_key = low;
    }
    if (min_p > 0.0f) { /* the smallest key whose weight reaches min_p */
        u32x16 smallest = (u32x16){0} + UINT32_MAX;
        for (int64_t i = 0; i < padded; i += LANES) {
            const u32x16 k = *(const u32x16 *)(key + i);
            const u32x16 take = (u32x16)(*(const vec16 *)(w + i) >= min_p) & (k < smallest);
            smallest = (smallest & ~take) | (k & take);
        }
        uint32_t lowest = UINT32_MAX; /* the max token's w is 1: some key reaches min_p */
        for (int l = 0; l < LANES; l++)
            if (smallest[l] < lowest) lowest = smallest[l];
        if (lowest > floor_key) floor_key = lowest;
    }
    return floor_key;
}

/* floor [rows] (float32): each row's smallest kept logit under its top_k (0: off), top_p (1:
 * off) and min_p (0: off) over x * scale, -inf where nothing is dropped; x [rows, n] float32 or
 * bfloat16 (`bf16`), contiguous, scale > 0. Returns 0, 1 for sizes it does not take, 2 where
 * memory ran out. */
int filter_floors(const void *x, const float *scale, const int64_t *top_k, const float *top_p,
                  const float *min_p, float *floor_out, int64_t rows, int64_t n, int bf16,
                  int num_threads) {
    if (rows < 0 || n <= 0 || num_threads <= 0) return 1;
    const int64_t padded = (n + LANES - 1) / LANES * LANES;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows * n >= PARALLEL_VALUES)
    {
        uint32_t *key = aligned_alloc(64, (size_t)padded * sizeof *key);
        float *w = aligned_alloc(64, (size_t)padded * sizeof *w);
        if (key == NULL || w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t r = 0; r < rows; r++) {
            floor_out[r] = -INFINITY;
            const int filtering = (top_k[r] > 0 && top_k[r] < n) || top_p[r] < 1.0f || min_p[r] > 0;
            if (key == NULL || w == NULL || !filtering) continue;
            const int64_t base = r * n;
            const float top = row_max(x, base, n, bf16);
            if (top == -INFINITY) continue; /* nothing to keep or drop */
            const float s = scale[r], max_y = top * s;
            for (int64_t i = 0; i < padded; i += LANES) {
                vec16 v;
                if (i + LANES <= n) {
                    v = load(x, base + i, bf16);
                } else {
                    v = (vec16){0} + NAN;
                    for (int64_t j = i; j < n; j++) v[j - i] = scalar_at(x, base + j, bf16);
                }
                const i32x16 nan = v != v;
                *(u32x16 *)(key + i) = order_key16(v);
                *(vec16 *)(w + i) = blend(exp16(v * s - max_y), (vec16){0}, nan);
            }
            const uint32_t floor_key =
                row_floor_key(key, w, n, padded, top_k[r], top_p[r], min_p[r]);
            if (floor_key != 0) floor_out[r] = key_value(floor_key);
        }
        free(key);
        free(w);
    }
    return failed ? 2 : 0;
}
