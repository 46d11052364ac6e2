/* Selections over rows of logits (see fused.py): the top k of each row, whose logits are refined
 * in fp32, and the argmax that greedy sampling takes. torch's topk and argmax on a decode step's
 * [16][49,152] logits took about 1 ms of a 22 ms step; these take a few tens of microseconds.
 *
 * Both are exact comparisons, so the vector and scalar paths give the same indices, and ties have
 * one answer: among equal values the lower index ranks first, and a NaN ranks above every number
 * (torch's argmax returns the first NaN; its topk also prefers NaN).
 */
#include <math.h>
#include <stdint.h>
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

/* idx [k]: the indices of row x [n]'s k highest-ranked values, best first (k <= n, k <= 64). */
static void top_k_row(const float *x, int64_t n, int64_t k, int64_t *idx) {
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
}

/* x [rows][n] -> idx [rows][k]; -1 when k is outside [1, min(n, 64)] (nothing written). */
int select_top_k(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *idx, int threads) {
    if (k < 1 || k > n || k > 64) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= SEL_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) top_k_row(x + r * n, n, k, idx + r * k);
    return 0;
}

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
