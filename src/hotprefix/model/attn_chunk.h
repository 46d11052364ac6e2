/* One chunk of keys for attn.c: K/V widened from the pool, scores, the online softmax state and
 * the value accumulation, per ISA path (AVX-512, AVX2) with the portable reference beside each,
 * every path giving the reference's bits (attn.c's header says which steps, in which order).
 * Included by attn.c alone: static functions. */
#ifndef HP_ATTN_CHUNK_H
#define HP_ATTN_CHUNK_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "isa.h"
#include "kvpool.h"

#define CH 16        /* keys per chunk */
#define QB 8         /* query vectors scored together: independent FMA chains */
#define PV_VECS 4    /* query vectors sharing each value row's loads (4 x 4 accumulators) */
/* whether chunk_update's vector path runs (it reads a decode's K and V from the pool itself) */
#if defined(HP_AVX512) || defined(HP_AVX2)
#define VECTOR_UPDATE(hd, portable) (!(portable) && (hd) % 64 == 0)
#else
#define VECTOR_UPDATE(hd, portable) 0
#endif

/* Element i of a pool of kind kv as fp32 (scale: its row's, for int8). */
static inline float widen_at(const void *cache, int kv, int64_t i, float scale) {
    if (kv == KV_INT8) return (float)((const int8_t *)cache)[i] * scale;
    if (kv == KV_BF16) {
        uint32_t b = (uint32_t)((const uint16_t *)cache)[i] << 16;
        float f;
        memcpy(&f, &b, sizeof f);
        return f;
    }
    return ((const float *)cache)[i];
}

/* Offsets in the pool of the rows of keys k0 .. k0 + nk for KV head h, through the sequence's
 * table: one division for the chunk, not one a key (a 64-bit division costs tens of cycles, and a
 * decode's chunk is only a few hundred cycles of arithmetic). */
static inline void key_bases(const int64_t *table, int64_t bs, int64_t nkv, int64_t rs, int64_t h,
                             int64_t k0, int64_t nk, int64_t *out) {
    int64_t b = k0 / bs, o = k0 % bs;
    for (int64_t k = 0; k < nk; k++) {
        out[k] = ((table[b] * bs + o) * nkv + h) * rs; /* rs: elements of a row (kv_row) */
        if (++o == bs) o = 0, b++;
    }
}

/* e^x for x <= 0 (x = -inf included), 0 below -86 (the result would be under 4.4e-38 of the
 * chunk's largest term). Cephes' expf: round x / ln 2 to n, reduce, degree-6 polynomial, scale by
 * 2^n through the exponent bits (n >= -125, so no subnormal). Within about 2 ulp of e^x. */
static inline float exp_le0(float x) {
    float xc = fmaxf(x, -86.0f);
    float n = fmaf(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n * (1 << 23);
    memcpy(&p, &bits, sizeof p);
    return x >= -86.0f ? p : 0.0f;
}

#ifdef HP_AVX512
static inline __m512 widen16(const void *cache, int64_t i) {
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* exp_le0 on 16 lanes: the same operations in the same order, so the same bits. */
static inline __m512 exp_le0_v(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-86.0f), magic = _mm512_set1_ps(12582912.0f);
    const __m512 xc = _mm512_max_ps(x, lo); /* NaN -> -86, as fmaxf */
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic), magic);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), _mm512_castsi512_ps(bits));
}

/* r[i][j] -> r[j][i] for 16 rows of 16 floats. */
static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* 16 values of a pool of kind kv from element i, as fp32 (an int8 row's scale: scale). */
static inline __m512 value16(const void *vc, int kv, int64_t i, float scale) {
    if (kv == KV_INT8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)vc + i));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(scale));
    }
    return kv == KV_BF16 ? widen16(vc, i) : _mm512_loadu_ps((const float *)vc + i);
}

/* Head dimensions db..db+15 of a chunk's keys (pool rows kb[0..nk), zeros past nk), transposed:
 * r[d] holds dimension db + d of the 16 keys. */
static inline void keys_transposed16(__m512 *r, const void *kc, int kv, const int64_t *kb,
                                     const float *ks, int64_t nk, int64_t db) {
    for (int64_t k = 0; k < CH; k++)
        r[k] = k < nk ? value16(kc, kv, kb[k] + db, ks[k]) : _mm512_setzero_ps();
    transpose16(r);
}
#elif defined(HP_AVX2) /* a chunk is two halves of 8 keys, a __m256 each */
/* 8 values of a pool of kind kv from element i, as fp32 (bf16 shifted into the high half; int8
 * times its row's scale). */
static inline __m256 value8(const void *vc, int kv, int64_t i, float scale) {
    if (kv == KV_INT8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)vc + i));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale));
    }
    if (kv == KV_FP32) return _mm256_loadu_ps((const float *)vc + i);
    const __m128i b = _mm_loadu_si128((const __m128i *)((const uint16_t *)vc + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

/* exp_le0 on 8 lanes: the same operations in the same order, so the same bits. */
static inline __m256 exp_le0_v8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-86.0f), magic = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_max_ps(x, lo); /* NaN -> -86, as fmaxf */
    const __m256 n =
        _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23); /* n is an integer: exact */
    const __m256 bits = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), bits);
}

/* r[i][j] -> r[j][i] for 8 rows of 8 floats. */
static inline void transpose8(__m256 *r) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    memcpy(r, t, sizeof t);
}

/* Head dimensions db..db+7 of a chunk's keys (pool rows kb[0..nk), zeros past nk), transposed
 * into u for key_dim8 (ks: the keys' int8 scales; int8 rows are widened as they load, as fp32
 * rows are read). bf16 rows are transposed as 16-bit words, loaded in pairs to 128-bit lanes
 * (keys i | i+4, then i+4 | i+8), so that widening them by unpacking with zeros (value8's shift)
 * leaves the keys in order; key_dim8 widens each dimension where it is used (fewer registers). */
static inline __attribute__((always_inline)) void keys_transposed8(__m256i *u, const void *kc,
                                                                   int kv, const int64_t *kb,
                                                                   const float *ks, int64_t nk,
                                                                   int64_t db) {
    if (kv != KV_BF16) { /* u[2d + h]: dimension db + d of keys 8h..8h+7 (fp32, int8 widened) */
        for (int h = 0; h < 2; h++) {
            __m256 x[8];
            for (int k = 0; k < 8; k++)
                x[k] = 8 * h + k < nk ? value8(kc, kv, kb[8 * h + k] + db, ks[8 * h + k])
                                      : _mm256_setzero_ps();
            transpose8(x);
            for (int d = 0; d < 8; d++) u[2 * d + h] = _mm256_castps_si256(x[d]);
        }
        return;
    }
    const uint16_t *c = kc;
    const __m128i zero = _mm_setzero_si128();
    __m256i a[8], t[8];
    for (int i = 0; i < 8; i++) {
        const int k0 = i < 4 ? i : i + 4, k1 = k0 + 4;
        const __m128i lo = k0 < nk ? _mm_loadu_si128((const __m128i *)(c + kb[k0] + db)) : zero;
        const __m128i hi = k1 < nk ? _mm_loadu_si128((const __m128i *)(c + kb[k1] + db)) : zero;
        a[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    for (int i = 0; i < 8; i += 2) { /* rows i, i+1: dimensions 0..3, 4..7 */
        t[i] = _mm256_unpacklo_epi16(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi16(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* u[i + e]: rows i..i+3 (keys 0..7 or 8..15), dims 2e, 2e+1 */
        u[i] = _mm256_unpacklo_epi32(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi32(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi32(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi32(t[i + 1], t[i + 3]);
    }
}

/* Dimension db + d of keys 8h..8h+7, from keys_transposed8's u. */
static inline __attribute__((always_inline)) __m256 key_dim8(const __m256i *u, int kv, int d,
                                                             int h) {
    if (kv != KV_BF16) return _mm256_castsi256_ps(u[2 * d + h]);
    const __m256i w = u[4 * h + d / 2], z = _mm256_setzero_si256();
    return _mm256_castsi256_ps(d & 1 ? _mm256_unpackhi_epi16(z, w) : _mm256_unpacklo_epi16(z, w));
}
#endif

/* The chunk's K transposed to kt[hd][CH] and V as vch[CH][hd], fp32 (ks, vs: the keys' int8
 * scales); keys nk..CH zeroed (past
 * every row's keys: masked, zeros keep the score chains finite). attn.c calls it where the vector
 * path has many vectors (a prefill, a warm tail: they all read vch) or does not run; a decode's
 * few vectors read K and V from the pool themselves. */
static void load_chunk(float *kt, float *vch, const void *kc, const void *vc, int kv, int64_t hd,
                       const int64_t *kb, const float *ks, const float *vs, int64_t nk,
                       int portable) {
#ifdef HP_AVX512
    if (!portable && hd % CH == 0) {
        for (int64_t db = 0; db < hd; db += CH) {
            for (int64_t k = 0; k < CH; k++)
                _mm512_storeu_ps(vch + k * hd + db,
                                 k < nk ? value16(vc, kv, kb[k] + db, vs[k]) : _mm512_setzero_ps());
            __m512 r[CH];
            keys_transposed16(r, kc, kv, kb, ks, nk, db);
            for (int64_t d = 0; d < CH; d++) _mm512_storeu_ps(kt + (db + d) * CH, r[d]);
        }
        return;
    }
#elif defined(HP_AVX2) /* V too: the vector path reads it here when it has many vectors */
    if (!portable && hd % 8 == 0) {
        for (int64_t db = 0; db < hd; db += 8) {
            for (int64_t k = 0; k < CH; k++)
                _mm256_storeu_ps(vch + k * hd + db,
                                 k < nk ? value8(vc, kv, kb[k] + db, vs[k]) : _mm256_setzero_ps());
            __m256i u[16];
            keys_transposed8(u, kc, kv, kb, ks, nk, db);
            for (int d = 0; d < 8; d++)
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_ps(kt + (db + d) * CH + 8 * h, key_dim8(u, kv, d, h));
        }
        return;
    }
#endif
    for (int64_t k = 0; k < CH; k++) {
        if (k >= nk) {
            for (int64_t d = 0; d < hd; d++) kt[d * CH + k] = 0.0f, vch[k * hd + d] = 0.0f;
            continue;
        }
        const int64_t base = kb[k];
        for (int64_t d = 0; d < hd; d++) {
            kt[d * CH + k] = widen_at(kc, kv, base + d, ks[k]);
            vch[k * hd + d] = widen_at(vc, kv, base + d, vs[k]);
        }
    }
}

#ifdef HP_AVX512
/* s[b][k] for nb (a constant where inlined) query vectors: one FMA chain over d per key. */
static inline __attribute__((always_inline)) void scores_avx(const float *qs, const float *kt,
                                                             int64_t hd, __m512 *s, const int nb) {
    for (int b = 0; b < nb; b++) s[b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const __m512 kd = _mm512_loadu_ps(kt + d * CH);
        for (int b = 0; b < nb; b++) s[b] = _mm512_fmadd_ps(_mm512_set1_ps(qs[b * hd + d]), kd, s[b]);
    }
}

/* O = O * alpha, then O += p[k] V[k] for the chunk's keys in order, V read from the pool (rows
 * kb[k]), for nvec (a constant where inlined) vectors at once, each taking keys nf..nv: the value
 * rows' loads are shared by the vectors for kf <= k < kmin (kf: the latest first key of any of
 * them, kmin: the fewest keys); each vector's keys before kf first, in order. */
static inline __attribute__((always_inline)) void pv_avx(const void *vc, int kv,
                                                         const int64_t *kb, const float *vs,
                                                         int64_t hd,
                                                         const float (*p)[CH], const float *alpha,
                                                         const int *nf, const int *nv, int kf,
                                                         int kmin, float **o, const int nvec) {
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        __m512 a[PV_VECS][4];
        for (int v = 0; v < nvec; v++) {
            const __m512 av = _mm512_set1_ps(alpha[v]);
            for (int c = 0; c < 4; c++) a[v][c] = _mm512_mul_ps(_mm512_loadu_ps(o[v] + d0 + 16 * c), av);
            for (int k = nf[v]; k < kf && k < nv[v]; k++) { /* a window's first keys */
                const __m512 pk = _mm512_set1_ps(p[v][k]);
                for (int c = 0; c < 4; c++)
                    a[v][c] = _mm512_fmadd_ps(pk, value16(vc, kv, kb[k] + d0 + 16 * c, vs[k]),
                                              a[v][c]);
            }
        }
        for (int k = kf; k < kmin; k++) {
            const int64_t vr = kb[k] + d0;
            const float sk = vs[k];
            const __m512 v0 = value16(vc, kv, vr, sk), v1 = value16(vc, kv, vr + 16, sk),
                         v2 = value16(vc, kv, vr + 32, sk), v3 = value16(vc, kv, vr + 48, sk);
            for (int v = 0; v < nvec; v++) {
                const __m512 pk = _mm512_set1_ps(p[v][k]);
                a[v][0] = _mm512_fmadd_ps(pk, v0, a[v][0]);
                a[v][1] = _mm512_fmadd_ps(pk, v1, a[v][1]);
                a[v][2] = _mm512_fmadd_ps(pk, v2, a[v][2]);
                a[v][3] = _mm512_fmadd_ps(pk, v3, a[v][3]);
            }
        }
        for (int v = 0; v < nvec; v++) { /* the rest of each vector's keys, in order */
            for (int k = kmin > kf ? kmin : kf; k < nv[v]; k++) {
                const __m512 pk = _mm512_set1_ps(p[v][k]);
                for (int c = 0; c < 4; c++)
                    a[v][c] = _mm512_fmadd_ps(pk, value16(vc, kv, kb[k] + d0 + 16 * c, vs[k]),
                                              a[v][c]);
            }
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[v] + d0 + 16 * c, a[v][c]);
        }
    }
}

/* scores_avx for a decode's few vectors, the keys read from the pool (rows kb[0..nk), zeros
 * past nk) and transposed in registers, 16 head dimensions at a time: the same chains, with no
 * store and reload of the transposed chunk, which only these few vectors would read. */
static inline __attribute__((always_inline)) void scores_pool_avx(
    const float *qs, const void *kc, int kv, const int64_t *kb, const float *ks, int64_t nk,
    int64_t hd, __m512 *s, const int nb) {
    for (int b = 0; b < nb; b++) s[b] = _mm512_setzero_ps();
    for (int64_t db = 0; db < hd; db += CH) {
        __m512 r[CH];
        keys_transposed16(r, kc, kv, kb, ks, nk, db);
        for (int d = 0; d < CH; d++)
            for (int b = 0; b < nb; b++)
                s[b] = _mm512_fmadd_ps(_mm512_set1_ps(qs[b * hd + db + d]), r[d], s[b]);
    }
}
#elif defined(HP_AVX2)
/* s[b][h] (keys 8h..8h+7) for nb query vectors (nb, pool constants where inlined): one FMA chain
 * over d per key, the keys read from kt, or (pool) from the pool and transposed in registers, as
 * scores_pool_avx does for a decode's few vectors. */
static inline __attribute__((always_inline)) void scores_avx2(
    const float *qs, const float *kt, const void *kc, int kv, const int64_t *kb, const float *ks,
    int64_t nk, int64_t hd, __m256 (*s)[2], const int nb, const int pool) {
    for (int b = 0; b < nb; b++) s[b][0] = s[b][1] = _mm256_setzero_ps();
    for (int64_t db = 0; db < hd; db += 8) {
        __m256i u[16];
        if (pool) keys_transposed8(u, kc, kv, kb, ks, nk, db);
        for (int d = 0; d < 8; d++) {
            __m256 r0, r1;
            if (pool) {
                r0 = key_dim8(u, kv, d, 0), r1 = key_dim8(u, kv, d, 1);
            } else { /* kept in registers: folded into each FMA (gcc), the loads bound the loop */
                const float *kd = kt + (db + d) * CH;
                r0 = _mm256_loadu_ps(kd), r1 = _mm256_loadu_ps(kd + 8);
                __asm__("" : "+x"(r0), "+x"(r1));
            }
            for (int b = 0; b < nb; b++) {
                const __m256 qd = _mm256_set1_ps(qs[b * hd + db + d]);
                s[b][0] = _mm256_fmadd_ps(qd, r0, s[b][0]);
                s[b][1] = _mm256_fmadd_ps(qd, r1, s[b][1]);
            }
        }
    }
}

/* pv_avx on 8-lane registers, 16 head dimensions a pass (nvec x 2 accumulators, the value rows
 * and a broadcast within the 16 registers), the value rows at vc + vr[k] (the pool or vch; vs:
 * their int8 scales). */
static inline __attribute__((always_inline)) void pv_avx2(const void *vc, int kv,
                                                          const int64_t *vr, const float *vs,
                                                          int64_t hd,
                                                          const float (*p)[CH], const float *alpha,
                                                          const int *nf, const int *nv, int kf,
                                                          int kmin, float **o, const int nvec) {
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        __m256 a[PV_VECS][2];
        for (int v = 0; v < nvec; v++) {
            const __m256 av = _mm256_set1_ps(alpha[v]);
            for (int c = 0; c < 2; c++)
                a[v][c] = _mm256_mul_ps(_mm256_loadu_ps(o[v] + d0 + 8 * c), av);
            for (int k = nf[v]; k < kf && k < nv[v]; k++) { /* a window's first keys */
                const __m256 pk = _mm256_set1_ps(p[v][k]);
                for (int c = 0; c < 2; c++)
                    a[v][c] = _mm256_fmadd_ps(pk, value8(vc, kv, vr[k] + d0 + 8 * c, vs[k]),
                                              a[v][c]);
            }
        }
        for (int k = kf; k < kmin; k++) {
            const __m256 v0 = value8(vc, kv, vr[k] + d0, vs[k]),
                         v1 = value8(vc, kv, vr[k] + d0 + 8, vs[k]);
            for (int v = 0; v < nvec; v++) {
                const __m256 pk = _mm256_set1_ps(p[v][k]);
                a[v][0] = _mm256_fmadd_ps(pk, v0, a[v][0]);
                a[v][1] = _mm256_fmadd_ps(pk, v1, a[v][1]);
            }
        }
        for (int v = 0; v < nvec; v++) { /* the rest of each vector's keys, in order */
            for (int k = kmin > kf ? kmin : kf; k < nv[v]; k++) {
                const __m256 pk = _mm256_set1_ps(p[v][k]);
                for (int c = 0; c < 2; c++)
                    a[v][c] = _mm256_fmadd_ps(pk, value8(vc, kv, vr[k] + d0 + 8 * c, vs[k]),
                                              a[v][c]);
            }
            for (int c = 0; c < 2; c++) _mm256_storeu_ps(o[v] + d0 + 8 * c, a[v][c]);
        }
    }
}
#endif

/* The vector paths' vectors j0 + live[i] (i < the count returned) that have keys in the chunk at
 * k0: keys nf[i] .. nv[i] - 1 of it (the others masked), as the portable path picks them. */
static inline int live_vectors(int64_t j0, int64_t nq, int64_t g, const int64_t *rpos,
                               const int64_t *rlo, int64_t k0, int *live, int *nf, int *nv) {
    int nlive = 0;
    for (int b = 0; b < QB && j0 + b < nq; b++) {
        const int64_t valid = rpos[(j0 + b) / g] - k0 + 1, first = rlo[(j0 + b) / g] - k0;
        if (valid <= 0 || first >= CH) continue; /* no key of this row in the chunk */
        live[nlive] = b;
        nf[nlive] = first > 0 ? (int)first : 0;
        nv[nlive++] = valid < CH ? (int)valid : CH;
    }
    return nlive;
}

/* For nvec live vectors sharing a PV pass: their accumulators (o[v] = acc0 + live[v] * hd, acc0
 * the accumulators of vector j0), the latest first key kf and the fewest keys kmin of any. */
static inline void pv_group(const int *live, const int *nf, const int *nv, int nvec, float *acc0,
                            int64_t hd, float **o, int *kf, int *kmin) {
    *kmin = CH, *kf = 0;
    for (int v = 0; v < nvec; v++) {
        *kmin = nv[v] < *kmin ? nv[v] : *kmin;
        *kf = nf[v] > *kf ? nf[v] : *kf;
        o[v] = acc0 + live[v] * hd;
    }
}

/* Where the weighted sums read V: vch, fp32 rows k * hd (in vrow), where load_chunk widened it
 * once for the chunk (nq > QB / 2: every group of PV_VECS vectors reads it); else (a decode's few
 * vectors) the pool's rows kb in its kind kv. Returns the rows; *src and *kind the source. */
static inline const int64_t *value_rows(int64_t nq, int64_t hd, const float *vch, const void *vc,
                                        int kv, const int64_t *kb, int64_t *vrow,
                                        const void **src, int *kind) {
    if (nq <= QB / 2) {
        *src = vc, *kind = kv;
        return kb;
    }
    for (int k = 0; k < CH; k++) vrow[k] = k * hd;
    *src = vch, *kind = KV_FP32;
    return vrow;
}

/* One chunk for query vectors j0..j0+QB (scaled, qs[j][hd]) whose rows read keys rlo..rpos of
 * their row (j / g): scores, online softmax state (m, l) and accumulators acc[j][hd] updated;
 * vectors >= nq, and those with no key in the chunk, untouched. */
static void chunk_update(const float *qs, const float *kt, const float *vch, const void *kc,
                         const void *vc, int kv, const int64_t *kb, const float *ks,
                         const float *vs, int64_t nk, int64_t hd,
                         int64_t j0, int64_t nq, int64_t g, const int64_t *rpos,
                         const int64_t *rlo, int64_t k0, float *m, float *l, float *acc,
                         int portable) {
#ifdef HP_AVX512
    if (VECTOR_UPDATE(hd, portable)) {
        __m512 s[QB];
        if (nq <= QB / 2) { /* a decode's few vectors: a chain each, kt unused */
            switch (nq) {
            case 1: scores_pool_avx(qs, kc, kv, kb, ks, nk, hd, s, 1); break;
            case 2: scores_pool_avx(qs, kc, kv, kb, ks, nk, hd, s, 2); break;
            case 3: scores_pool_avx(qs, kc, kv, kb, ks, nk, hd, s, 3); break;
            default: scores_pool_avx(qs, kc, kv, kb, ks, nk, hd, s, QB / 2); break;
            }
        } else if (nq - j0 <= QB / 2)
            scores_avx(qs + j0 * hd, kt, hd, s, QB / 2);
        else
            scores_avx(qs + j0 * hd, kt, hd, s, QB);
        /* Each vector's steps are those of the portable path below, in its order; they run in
         * phases across the vectors (each phase's vectors independent of each other), so that
         * the long dependency chains of the max, the exponentials and the sums overlap, and the
         * value rows are loaded once for up to PV_VECS vectors. */
        int live[QB], nv[QB], nf[QB];
        const int nlive = live_vectors(j0, nq, g, rpos, rlo, k0, live, nf, nv);
        float mn[16] = {0}, alpha[16], mo[16] = {0}, p[QB][CH];
        __m512 sb[QB];
        for (int i = 0; i < nlive; i++) {
            const int b = live[i];
            const __mmask16 keep = (__mmask16)(((1u << nv[i]) - 1u) & ~((1u << nf[i]) - 1u));
            sb[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, s[b]);
            mo[i] = m[j0 + b];
            mn[i] = fmaxf(mo[i], _mm512_reduce_max_ps(sb[i]));
        }
        /* every vector's alpha at once, a lane each (exp_le0_v: exp_le0's steps, lane by lane) */
        _mm512_storeu_ps(alpha, exp_le0_v(_mm512_sub_ps(_mm512_loadu_ps(mo), _mm512_loadu_ps(mn))));
        for (int i = 0; i < nlive; i++)
            _mm512_storeu_ps(p[i], exp_le0_v(_mm512_sub_ps(sb[i], _mm512_set1_ps(mn[i]))));
        for (int i = 0; i < nlive; i++) {
            const int64_t j = j0 + live[i];
            const __m512 pv = _mm512_loadu_ps(p[i]);
            const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(pv),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pv), 1)));
            const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
            const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
            l[j] = l[j] * alpha[i] + (_mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1)));
            m[j] = mn[i];
        }
        int64_t vrow[CH];
        int vkv;
        const void *vsrc;
        const int64_t *vr = value_rows(nq, hd, vch, vc, kv, kb, vrow, &vsrc, &vkv);
        for (int i0 = 0; i0 < nlive; i0 += PV_VECS) {
            const int nvec = nlive - i0 < PV_VECS ? nlive - i0 : PV_VECS;
            int kmin, kf;
            float *o[PV_VECS];
            pv_group(live + i0, nf + i0, nv + i0, nvec, acc + j0 * hd, hd, o, &kf, &kmin);
            const int *f = nf + i0, *e = nv + i0;
            switch (nvec) { /* a constant count each: the accumulators stay in registers */
            case 1: pv_avx(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 1); break;
            case 2: pv_avx(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 2); break;
            case 3: pv_avx(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 3); break;
            default: pv_avx(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 4); break;
            }
        }
        return;
    }
#elif defined(HP_AVX2)
    if (VECTOR_UPDATE(hd, portable)) { /* the AVX-512 path's steps and phases, on two halves */
        __m256 s[QB][2];
        const float *qj = qs + j0 * hd;
        switch (nq <= QB / 2 ? nq : 0) { /* a decode's few vectors: kt unused */
        case 1: scores_avx2(qs, kt, kc, kv, kb, ks, nk, hd, s, 1, 1); break;
        case 2: scores_avx2(qs, kt, kc, kv, kb, ks, nk, hd, s, 2, 1); break;
        case 3: scores_avx2(qs, kt, kc, kv, kb, ks, nk, hd, s, 3, 1); break;
        case 4: scores_avx2(qs, kt, kc, kv, kb, ks, nk, hd, s, 4, 1); break;
        default: /* 4 vectors a pass: 8 chains, in the registers with the keys */
            scores_avx2(qj, kt, kc, kv, kb, ks, nk, hd, s, QB / 2, 0);
            if (nq - j0 > QB / 2)
                scores_avx2(qj + QB / 2 * hd, kt, kc, kv, kb, ks, nk, hd, s + QB / 2, QB / 2, 0);
        }
        int live[QB], nv[QB], nf[QB];
        const int nlive = live_vectors(j0, nq, g, rpos, rlo, k0, live, nf, nv);
        float mo[QB] = {0}, mc[QB] = {0}, mn[QB], alpha[QB], p[QB][CH];
        /* masked keys and NaN scores -inf (fmaxf skips a NaN; its p is 0 either way) */
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256 sb[QB][2];
        for (int i = 0; i < nlive; i++) {
            for (int h = 0; h < 2; h++) {
                const __m256 sh = s[live[i]][h], in = _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(nv[i] - 8 * h), iota),
                    _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(nf[i] - 8 * h - 1))));
                const __m256 keep = _mm256_and_ps(in, _mm256_cmp_ps(sh, sh, _CMP_ORD_Q));
                sb[i][h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sh, keep);
            }
            const __m256 m8 = _mm256_max_ps(sb[i][0], sb[i][1]);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            mc[i] = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            mo[i] = m[j0 + live[i]];
        }
        /* every vector's m' and alpha at once, a lane each (no max is NaN: max_ps is fmaxf) */
        const __m256 mov = _mm256_loadu_ps(mo), mnv = _mm256_max_ps(_mm256_loadu_ps(mc), mov);
        _mm256_storeu_ps(mn, mnv);
        _mm256_storeu_ps(alpha, exp_le0_v8(_mm256_sub_ps(mov, mnv)));
        for (int i = 0; i < nlive; i++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(p[i] + 8 * h,
                                 exp_le0_v8(_mm256_sub_ps(sb[i][h], _mm256_set1_ps(mn[i]))));
        for (int i = 0; i < nlive; i++) {
            const int64_t j = j0 + live[i];
            const __m256 t8 = _mm256_add_ps(_mm256_loadu_ps(p[i]), _mm256_loadu_ps(p[i] + 8));
            const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
            const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
            l[j] = l[j] * alpha[i] + (_mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1)));
            m[j] = mn[i];
        }
        int64_t vrow[CH];
        int vkv;
        const void *vsrc;
        const int64_t *vr = value_rows(nq, hd, vch, vc, kv, kb, vrow, &vsrc, &vkv);
        for (int i0 = 0; i0 < nlive; i0 += PV_VECS) {
            const int nvec = nlive - i0 < PV_VECS ? nlive - i0 : PV_VECS;
            int kmin, kf;
            float *o[PV_VECS];
            pv_group(live + i0, nf + i0, nv + i0, nvec, acc + j0 * hd, hd, o, &kf, &kmin);
            const int *f = nf + i0, *e = nv + i0;
            switch (nvec) {
            case 1: pv_avx2(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 1); break;
            case 2: pv_avx2(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 2); break;
            case 3: pv_avx2(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 3); break;
            default: pv_avx2(vsrc, vkv, vr, vs, hd, p + i0, alpha + i0, f, e, kf, kmin, o, 4); break;
            }
        }
        return;
    }
#endif
    float s[QB][CH];
    memset(s, 0, sizeof s);
    for (int64_t d = 0; d < hd; d++)
        for (int b = 0; b < QB; b++) {
            const float qd = qs[(j0 + b) * hd + d];
            for (int k = 0; k < CH; k++) s[b][k] = fmaf(qd, kt[d * CH + k], s[b][k]);
        }
    for (int b = 0; b < QB && j0 + b < nq; b++) {
        const int64_t j = j0 + b, valid = rpos[j / g] - k0 + 1, first = rlo[j / g] - k0;
        if (valid <= 0 || first >= CH) continue; /* no key of this row in the chunk */
        const int nv = valid < CH ? (int)valid : CH, nf = first > 0 ? (int)first : 0;
        float p[CH], mc = -INFINITY;
        for (int k = 0; k < CH; k++) {
            if (k >= nv || k < nf) s[b][k] = -INFINITY;
            mc = fmaxf(mc, s[b][k]);
        }
        const float mn = fmaxf(m[j], mc), alpha = exp_le0(m[j] - mn);
        for (int k = 0; k < CH; k++) p[k] = exp_le0(s[b][k] - mn);
        float t8[8], t4[4];
        for (int k = 0; k < 8; k++) t8[k] = p[k] + p[k + 8];
        for (int k = 0; k < 4; k++) t4[k] = t8[k] + t8[k + 4];
        l[j] = l[j] * alpha + ((t4[0] + t4[2]) + (t4[1] + t4[3]));
        m[j] = mn;
        float *o = acc + j * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = o[d] * alpha;
        for (int k = nf; k < nv; k++) {
            const float pk = p[k], *v = vch + k * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = fmaf(pk, v[d], o[d]);
        }
    }
}

#endif /* HP_ATTN_CHUNK_H */
