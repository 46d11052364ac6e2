/* Selections over rows of logits (see fused.py): the top k of each row, whose logits are refined
 * in fp32, and the argmax that greedy sampling takes. torch's topk and argmax on a decode step's
 * [16][49,152] logits took about 1 ms of a 22 ms step; these take a few tens of microseconds.
 *
 * Both are exact comparisons, so the vector and scalar paths give the same indices, and ties have
 * one answer: among equal values the lower index ranks first, and a NaN ranks above every number
 * (torch's argmax returns the first NaN; its topk also prefers NaN).
 *
 * The vector paths (AVX-512: 16 lanes with mask compares; AVX2: 4 x 8 lanes with movemask) only
 * find the few blocks where a value could rank above the current threshold (a compare that is
 * true for NaN, _CMP_NLE_UQ) and rank just those values. On AVX2 a [49,152] row's argmax takes
 * about 3 us and its top 32 about 6 (the portable path: 50 and 68).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "isa.h"

#define SEL_PAR_MIN 4 /* rows from which threads share the rows */

/* Whether (a at ia) ranks above (b at ib). */
static inline int ranks_above(float a, int64_t ia, float b, int64_t ib) {
    const int na = isnan(a), nb = isnan(b);
    if (na || nb) return na && (!nb || ia < ib);
    return a > b || (a == b && ia < ib);
}

/* (v, i) into the ranked list val/idx of length len (< k: it grows; else the last drops off). */
static inline void insert(float *val, int64_t *idx, int64_t *len, int64_t k, float v, int64_t i) {
    int64_t j = *len < k ? (*len)++ : k - 1;
    while (j > 0 && ranks_above(v, i, val[j - 1], idx[j - 1])) {
        val[j] = val[j - 1], idx[j] = idx[j - 1];
        j--;
    }
    val[j] = v, idx[j] = i;
}

#ifdef HP_AVX2 /* (isa.h defines one of HP_AVX512 and HP_AVX2) */
/* Lanes of the nv vectors at p that are NaN or above t (t a number): a bit each, lowest first. */
static inline uint32_t above(const float *p, int nv, __m256 t) {
    uint32_t m = 0;
    for (int j = 0; j < nv; j++)
        m |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8 * j), t, _CMP_NLE_UQ))
             << (8 * j);
    return m;
}

/* (v, i) into the ranked list val/idx of length *len (< k: it grows; else the last drops off), for
 * an index i above every listed one and, in a full list, a v that ranks above the k-th: its place
 * is the count of the entries that stay above it, the NaN ones for a NaN v, else those NaN or
 * >= v (the list is in ranking order), counted 8 at a time (val's entries past the list are
 * initialized values, masked off). */
static inline void push(float *val, int64_t *idx, int64_t *len, int64_t k, float v, int64_t i) {
    const int64_t l = *len < k ? (*len)++ : k - 1; /* the entries that may stay above it */
    const __m256 vv = _mm256_set1_ps(v);
    const int v_nan = isnan(v);
    uint64_t stay = 0;
    for (int64_t j = 0; j < l; j += 8) {
        const __m256 w = _mm256_loadu_ps(val + j);
        const __m256 c = v_nan ? _mm256_cmp_ps(w, w, _CMP_UNORD_Q) : _mm256_cmp_ps(w, vv, _CMP_NLT_UQ);
        stay |= (uint64_t)_mm256_movemask_ps(c) << j;
    }
    const int64_t at = __builtin_popcountll(stay & ((1ull << l) - 1)); /* l <= 63 */
    memmove(val + at + 1, val + at, (size_t)(l - at) * sizeof *val);
    memmove(idx + at + 1, idx + at, (size_t)(l - at) * sizeof *idx);
    val[at] = v, idx[at] = i;
}

/* The lowest of the a x 8 lanes' maxima over x [0, p) (p a multiple of 8 a), a NaN lane as +inf:
 * the maxima are 8 a distinct elements, so at least 8 a elements are NaN or at least it, and no
 * value below it is among the k <= 8 a highest-ranked. */
static inline __attribute__((always_inline)) float lanes_bound(const float *x, int64_t p, int a) {
    __m256 acc[8];
    for (int j = 0; j < a; j++) acc[j] = _mm256_loadu_ps(x + 8 * j);
    for (int64_t i = 8 * a; i < p; i += 8 * a)
        for (int j = 0; j < a; j++) acc[j] = _mm256_max_ps(acc[j], _mm256_loadu_ps(x + i + 8 * j));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 lo = inf;
    for (int j = 0; j < a; j++)
        lo = _mm256_min_ps(lo, _mm256_blendv_ps(acc[j], inf, _mm256_cmp_ps(acc[j], acc[j], _CMP_UNORD_Q)));
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

#ifndef TK_PREFIX
#define TK_PREFIX 8192 /* values over which the lanes' maxima bound the start */
#endif

/* top_k_row on AVX2. The list starts as the top k of a prefix, ranked from only its values NaN or
 * at least lanes_bound's value (on normal logits about 4 k of 8,192); then 32 values a compare
 * round against the k-th, and only those above it are ranked (each insert raises it: the round's
 * rest is compared again). A 49,152-value row of normal logits ranks about 6 k values so, where
 * the first k values as the start ranked about 7 k while the threshold was still low: 5.8 against
 * 7.9 us a row. */
static void top_k_row_avx2(const float *x, int64_t n, int64_t k, int64_t *idx) {
    float val[64] = {0};
    int64_t len = 0, i = 0;
    const int a = k <= 32 ? 4 : 8;
    const int64_t p = (n < TK_PREFIX ? n : TK_PREFIX) / (8 * a) * (8 * a);
    if (p >= 16 * a) { /* the 8 a lanes' maxima lie in [0, p): the list is full by p */
        const __m256 b = _mm256_set1_ps(a == 4 ? lanes_bound(x, p, 4) : lanes_bound(x, p, 8));
        for (; len < k; i += 8)
            for (uint32_t m = (uint32_t)_mm256_movemask_ps(
                     _mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_NLT_UQ));
                 m; m &= m - 1) {
                const int64_t j = i + __builtin_ctz(m);
                if (len < k || ranks_above(x[j], j, val[k - 1], idx[k - 1]))
                    push(val, idx, &len, k, x[j], j);
            }
    } else {
        for (; i < k; i++) insert(val, idx, &len, k, x[i], i);
    }
    if (isnan(val[k - 1])) return; /* k NaN already: every later value ranks below them */
    __m256 t = _mm256_set1_ps(val[k - 1]);
    for (; i + 32 <= n; i += 32) {
        const float *q = x + i;
        const __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(q), t, _CMP_NLE_UQ);
        const __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(q + 8), t, _CMP_NLE_UQ);
        const __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(q + 16), t, _CMP_NLE_UQ);
        const __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(q + 24), t, _CMP_NLE_UQ);
        if (!_mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3))))
            continue;
        uint32_t m = (uint32_t)_mm256_movemask_ps(c0) | (uint32_t)_mm256_movemask_ps(c1) << 8 |
                     (uint32_t)_mm256_movemask_ps(c2) << 16 | (uint32_t)_mm256_movemask_ps(c3) << 24;
        while (m) { /* m: the round's values above the k-th as it is now */
            const int b = __builtin_ctz(m);
            push(val, idx, &len, k, q[b], i + b);
            if (isnan(val[k - 1])) return;
            t = _mm256_set1_ps(val[k - 1]);
            if ((m &= m - 1)) m &= above(q, 4, t);
        }
    }
    for (; i + 8 <= n; i += 8)
        for (uint32_t m = above(x + i, 1, t); m;) {
            const int b = __builtin_ctz(m);
            push(val, idx, &len, k, x[i + b], i + b);
            if (isnan(val[k - 1])) return;
            t = _mm256_set1_ps(val[k - 1]);
            if ((m &= m - 1)) m &= above(x + i, 1, t);
        }
    for (; i < n; i++)
        if (ranks_above(x[i], i, val[k - 1], idx[k - 1])) insert(val, idx, &len, k, x[i], i);
}
#endif

/* idx [k]: the indices of row x [n]'s k highest-ranked values, best first (k <= n, k <= 64). */
static void top_k_row(const float *x, int64_t n, int64_t k, int64_t *idx) {
#ifdef HP_AVX2
    top_k_row_avx2(x, n, k, idx);
#else
    float val[64];
    int64_t len = 0, i = 0;
    for (; i < k; i++) insert(val, idx, &len, k, x[i], i);
    /* later values enter only above the k-th: strictly greater (an equal one has a higher index),
     * or a NaN while the k-th is a number */
#ifdef HP_AVX512
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const float t = val[k - 1];
        __mmask16 m = isnan(t) ? 0 : _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_NLE_UQ);
        while (m) {
            const int b = __builtin_ctz(m);
            m &= m - 1;
            if (ranks_above(x[i + b], i + b, val[k - 1], idx[k - 1]))
                insert(val, idx, &len, k, x[i + b], i + b);
        }
    }
#endif
    for (; i < n; i++)
        if (ranks_above(x[i], i, val[k - 1], idx[k - 1])) insert(val, idx, &len, k, x[i], i);
#endif
}

/* x [rows][n] -> idx [rows][k]; -1 when k is outside [1, min(n, 64)] (nothing written). */
int select_top_k(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *idx, int threads) {
    if (k < 1 || k > n || k > 64) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= SEL_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) top_k_row(x + r * n, n, k, idx + r * k);
    return 0;
}

#ifdef HP_AVX2 /* (isa.h defines one of HP_AVX512 and HP_AVX2) */
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* The nv vectors at x + at, some lane of which is a NaN or above *m (no NaN before them): the
 * index of their first NaN, or -1 once *m and *best are their largest value and its first index
 * (-0 and +0 compare equal: the first of either). */
static inline int64_t argmax_block(const float *x, int64_t at, int nv, float *m, int64_t *best) {
    __m256 mx = _mm256_loadu_ps(x + at);
    uint32_t nan = 0;
    for (int j = 0; j < nv; j++) {
        const __m256 v = _mm256_loadu_ps(x + at + 8 * j);
        nan |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) << (8 * j);
        mx = _mm256_max_ps(mx, v);
    }
    if (nan) return at + __builtin_ctz(nan);
    const float c = hmax8(mx);
    if (c > *m) {
        const __m256 cv = _mm256_set1_ps(c);
        uint32_t eq = 0;
        for (int j = 0; j < nv; j++)
            eq |= (uint32_t)_mm256_movemask_ps(
                      _mm256_cmp_ps(_mm256_loadu_ps(x + at + 8 * j), cv, _CMP_EQ_OQ)) << (8 * j);
        *m = c, *best = at + __builtin_ctz(eq);
    }
    return -1;
}

/* argmax_row for n >= 8 in one pass: the running maximum m as a threshold, 32 values a compare
 * round; only a block holding a NaN or a value above m is looked at again. The last partial vector
 * is the row's last 8 values: those already seen are at most m and not NaN, so they never hit. */
static int64_t argmax_row_avx2(const float *x, int64_t n) {
    float m = x[0];
    int64_t best = 0, i = 0, r;
    if (isnan(m)) return 0;
    __m256 t = _mm256_set1_ps(m);
    for (; i + 32 <= n; i += 32) {
        const float *p = x + i;
        const __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(p), t, _CMP_NLE_UQ);
        const __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(p + 8), t, _CMP_NLE_UQ);
        const __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(p + 16), t, _CMP_NLE_UQ);
        const __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(p + 24), t, _CMP_NLE_UQ);
        if (_mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3)))) {
            if ((r = argmax_block(x, i, 4, &m, &best)) >= 0) return r;
            t = _mm256_set1_ps(m);
        }
    }
    for (; i < n; i += 8) {
        if (i + 8 > n) i = n - 8;
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_NLE_UQ))) {
            if ((r = argmax_block(x, i, 1, &m, &best)) >= 0) return r;
            t = _mm256_set1_ps(m);
        }
    }
    return best;
}
#endif

/* The index of row x [n]'s highest-ranked value (n >= 1). */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0, i = 1;
#ifdef HP_AVX512
    /* the largest number and whether a NaN is present, 16 lanes at a time; then its first index */
    if (n >= 16) {
        __m512 mx = _mm512_loadu_ps(x);
        __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
        int64_t j = 16;
        for (; j + 16 <= n && !nan; j += 16) {
            const __m512 v = _mm512_loadu_ps(x + j);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        if (!nan) {
            float m = _mm512_reduce_max_ps(mx);
            for (; j < n; j++) {
                if (isnan(x[j])) break;
                m = x[j] > m ? x[j] : m;
            }
            if (j == n) { /* no NaN: the first index holding m (-0 and +0 compare equal) */
                const __m512 mv = _mm512_set1_ps(m);
                for (i = 0; i + 16 <= n; i += 16) {
                    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
                    if (eq) return i + __builtin_ctz(eq);
                }
                for (; i < n; i++)
                    if (x[i] == m) return i;
            }
        }
        i = 1; /* a NaN: the scalar scan below finds the first */
    }
#elif defined(HP_AVX2)
    if (n >= 8) return argmax_row_avx2(x, n);
#endif
    for (; i < n; i++)
        if (ranks_above(x[i], i, x[best], best)) best = i;
    return best;
}

/* x [rows][n] -> idx [rows]: each row's argmax (see the top of the file for ties and NaN). */
void select_argmax(const float *x, int64_t rows, int64_t n, int64_t *idx, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= SEL_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) idx[r] = n > 0 ? argmax_row(x + r * n, n) : -1;
}
