/* The GGUF-block GEMM's packed weight layout (described at the top of qgemm.c): its formats,
 * where a group's blocks and scales lie, and how one block's values decode, shared by the int16
 * kernels (qgemm.c) and the AMX tile kernel (qgemm_amx.c). Static inline: each includer gets its
 * own copy, no symbol crosses the files. */
#ifndef HP_QGEMM_LAYOUT_H
#define HP_QGEMM_LAYOUT_H

#include <stdint.h>
#include <string.h>

#include "isa.h"

#define QG_BLOCK 32
#define QG_LANES 16

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

enum { QF_Q4 = 0, QF_Q8 = 1, QF_K4 = 2, QF_K5 = 3, QF_K6 = 4, QF_Q5 = 5, QF_FORMATS };

static inline int fmt_bits(int f) {
    return f == QF_Q4 || f == QF_K4 ? 4 : f == QF_Q5 || f == QF_K5 ? 5 : f == QF_K6 ? 6 : 8;
}
static inline int64_t fmt_qbytes(int f) { return (int64_t[]){256, 512, 256, 320, 384, 320}[f]; }
/* scales of each block in the block itself (fp16 D and M; Q5_0: D only), not per super-block */
static inline int fmt_local(int f) { return f == QF_Q4 || f == QF_Q8 || f == QF_Q5; }
static inline int64_t fmt_scales(int f) { return f == QF_Q5 ? 32 : 64; }
/* bytes of one super-block of 8 blocks (K formats) */
static inline int64_t fmt_super(int f) { return 8 * (fmt_qbytes(f) + 32) + 64; }

/* Spans of at most `most` rows, of equal size (a multiple of `multiple`), covering `rows`: their
 * count; *span their size. Threads take equal counts of (span, group) pairs, so unequal spans
 * (192 rows and 64, say) would leave one thread most of the work. */
static inline int64_t even_spans(int64_t rows, int64_t most, int64_t multiple, int64_t *span) {
    const int64_t spans = (rows + most - 1) / most;
    *span = ((rows + spans - 1) / spans + multiple - 1) / multiple * multiple;
    return spans;
}

/* Outputs of group g of an n-output weight: 16, or fewer in a last partial group. */
static inline int group_lanes(int64_t n, int64_t g) {
    return n - g * QG_LANES < QG_LANES ? (int)(n - g * QG_LANES) : QG_LANES;
}

/* Block b of a group: its values, then its scale bytes (fp16 D and M, or int8 sc and mn). */
static inline const uint8_t *block_at(const uint8_t *wg, int f, int64_t b) {
    if (fmt_local(f)) return wg + b * (fmt_qbytes(f) + fmt_scales(f));
    return wg + (b / 8) * fmt_super(f) + (b % 8) * (fmt_qbytes(f) + 32);
}

/* The super-block's 16 fp16 d, then 16 fp16 -dmin (K formats). */
static inline const uint8_t *super_at(const uint8_t *wg, int f, int64_t b) {
    return wg + (b / 8) * fmt_super(f) + 8 * (fmt_qbytes(f) + 32);
}

/* Group g's bytes and format, from the buffer's table (an entry: offset << 4 | narrow << 3 |
 * format). */
static inline const uint8_t *group_at(const uint8_t *w, int64_t g, int *f) {
    int64_t h;
    memcpy(&h, w + 8 * g, sizeof h);
    *f = (int)(h & 7);
    return w + (h >> 4);
}

/* Whether the weight's products round their activations to 8 bits (+-127) rather than 16: the flag
 * of its table's first entry (qlinear.QuantWeight sets it on every entry). */
static inline int group_narrow(const uint8_t *w) {
    int64_t h;
    memcpy(&h, w, sizeof h);
    return (int)((h >> 3) & 1);
}

/* Input i of lane l in a block's values. */
static inline int weight_q(const uint8_t *blk, int f, int l, int i) {
    const int bits = fmt_bits(f);
    const int pair = i / 2, e = i % 2;
    if (bits == 8) return (int8_t)blk[32 * pair + 2 * l + e];
    const int j = pair % 8, hi = pair / 8;
    const uint8_t byte = blk[32 * j + 2 * l + e];
    const int q = hi ? byte >> 4 : byte & 0x0f;
    if (bits == 4) return q;
    if (bits == 6) return q + 16 * ((blk[256 + 32 * (j / 2) + 2 * l + e] >> (4 * (j % 2) + 2 * hi)) & 3) - 32;
    return q + 16 * ((blk[256 + 32 * (j / 4) + 2 * l + e] >> (2 * (j % 4) + hi)) & 1) - (f == QF_Q5 ? 16 : 0);
}

/* Lane l's scales of block b: w = D * q + M, D = dlo for inputs 0-15 and dhi for 16-31 (equal but
 * in Q6_K, whose M is 0). The K formats' products d * sc are exact in fp32. */
static inline void lane_scales(const uint8_t *wg, const uint8_t *blk, int f, int64_t b, int l,
                               float *dlo, float *dhi, float *m) {
    const int64_t qb = fmt_qbytes(f);
    if (fmt_local(f)) {
        const uint16_t *h = (const uint16_t *)(blk + qb);
        *dlo = *dhi = half_to_float(h[l]);
        *m = f == QF_Q5 ? 0.0f : half_to_float(h[QG_LANES + l]);
        return;
    }
    const uint16_t *sup = (const uint16_t *)super_at(wg, f, b);
    const int8_t *sc = (const int8_t *)(blk + qb);
    const float d = half_to_float(sup[l]);
    *dlo = d * (float)sc[l];
    if (f == QF_K6) {
        *dhi = d * (float)sc[QG_LANES + l];
        *m = 0.0f;
    } else {
        *dhi = *dlo;
        *m = half_to_float(sup[QG_LANES + l]) * (float)sc[QG_LANES + l];
    }
}

#ifdef HP_AVX512
/* Chunk j (< 8) of a 4-, 5- or 6-bit block's values as int16 (the value q of w = D q + M):
 * *lo holds lane l's inputs 2j, 2j + 1 in words 2l, 2l + 1, *hi its inputs 2j + 16, 2j + 17. */
static inline __attribute__((always_inline)) void decode_chunk_512(const uint8_t *blk, const int f,
                                                                   int j, __m512i *lo, __m512i *hi) {
    const int bits = fmt_bits(f);
    const __m512i low4 = _mm512_set1_epi16(0x0f);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * j)));
    __m512i wl = _mm512_and_si512(w, low4), wh = _mm512_srli_epi16(w, 4);
    if (bits == 5) { /* Q5_0: q - 16, 16 subtracted where the fifth bit is clear (Q5_K: q) */
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * (j / 4))));
        const __m512i s16 = _mm512_set1_epi16(16);
        wl = _mm512_mask_sub_epi16(wl, _mm512_testn_epi16_mask(h, _mm512_set1_epi16(1 << (2 * (j % 4)))), wl, s16);
        wh = _mm512_mask_sub_epi16(wh, _mm512_testn_epi16_mask(h, _mm512_set1_epi16(2 << (2 * (j % 4)))), wh, s16);
        if (f == QF_K5) {
            wl = _mm512_add_epi16(wl, s16);
            wh = _mm512_add_epi16(wh, s16);
        }
    }
    if (bits == 6) { /* Q6_K: q - 32 = nibble + 16 x its two top bits - 32 */
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * (j / 2))));
        const __m512i three = _mm512_set1_epi16(3), n32 = _mm512_set1_epi16(32);
        const __m512i tl = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(4 * (j % 2))), three);
        const __m512i th = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(4 * (j % 2) + 2)), three);
        wl = _mm512_sub_epi16(_mm512_add_epi16(wl, _mm512_slli_epi16(tl, 4)), n32);
        wh = _mm512_sub_epi16(_mm512_add_epi16(wh, _mm512_slli_epi16(th, 4)), n32);
    }
    *lo = wl;
    *hi = wh;
}

/* The word permutation quad_rows uses: word 2l of a row from the first chunk, 2l + 1 from the
 * second. */
static inline __m512i quad_pairs(void) {
    uint16_t ix[32];
    for (int l = 0; l < 16; l++) {
        ix[2 * l] = (uint16_t)l;
        ix[2 * l + 1] = (uint16_t)(16 + l);
    }
    return _mm512_loadu_si512(ix);
}

/* A block's values (q of w = D q + M) as int8 in 8 rows of 64 bytes: row kk holds each lane's
 * inputs 4kk .. 4kk + 3 (4 bytes a lane), the layout of an AMX B tile and of VPDPBUSD's signed
 * operand. pair: quad_pairs(). */
static inline __attribute__((always_inline)) void block_quads_512(const uint8_t *blk, const int f,
                                                                  const __m512i pair, __m512i rows[8]) {
    if (fmt_bits(f) == 8) {
        for (int kk = 0; kk < 8; kk++)
            rows[kk] = _mm512_permutexvar_epi16(pair, _mm512_loadu_si512(blk + 64 * kk));
        return;
    }
    __m256i lo[8], hi[8];
    for (int j = 0; j < 8; j++) {
        __m512i wl, wh;
        decode_chunk_512(blk, f, j, &wl, &wh);
        lo[j] = _mm512_cvtepi16_epi8(wl);
        hi[j] = _mm512_cvtepi16_epi8(wh);
    }
    for (int kk = 0; kk < 4; kk++) {
        rows[kk] = _mm512_permutexvar_epi16(
            pair, _mm512_inserti64x4(_mm512_castsi256_si512(lo[2 * kk]), lo[2 * kk + 1], 1));
        rows[4 + kk] = _mm512_permutexvar_epi16(
            pair, _mm512_inserti64x4(_mm512_castsi256_si512(hi[2 * kk]), hi[2 * kk + 1], 1));
    }
}

/* Block b's 16 lanes' float scales: w = d q + m (Q6_K: d for inputs 0-15, m = D_hi for 16-31), the
 * K formats' products d * sc exact in fp32. */
static inline __attribute__((always_inline)) void block_scales_512(const uint8_t *wg,
                                                                   const uint8_t *blk, const int f,
                                                                   int64_t b, __m512 *d, __m512 *m) {
    const int64_t qbytes = fmt_qbytes(f);
    if (fmt_local(f)) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + qbytes)));
        *m = f == QF_Q5 ? _mm512_setzero_ps()
                        : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + qbytes + 32)));
        return;
    }
    const uint8_t *sup = super_at(wg, f, b);
    const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + qbytes))));
    const __m512 s2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + qbytes + 16))));
    *d = _mm512_mul_ps(dd, sc);
    *m = f == QF_K6 ? _mm512_mul_ps(dd, s2)
                    : _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + 32))), s2);
}

#elif defined(HP_AVX2)
/* 8 int8 at p -> 8 floats */
static inline __m256 i8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Chunk j (< 8) of a 4-, 5- or 6-bit block's values as int16 (the value q of w = D q + M), lanes
 * 0-7 in lo0 / hi0 (inputs 2j, 2j + 1 / 2j + 16, 2j + 17) and lanes 8-15 in lo1 / hi1. */
static inline __attribute__((always_inline)) void decode_chunk_256(const uint8_t *blk, const int f,
                                                                   int j, __m256i *plo0, __m256i *phi0,
                                                                   __m256i *plo1, __m256i *phi1) {
    const int bits = fmt_bits(f);
    const __m256i low4 = _mm256_set1_epi16(0x0f);
    const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j)));
    const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j + 16)));
    __m256i lo0 = _mm256_and_si256(w0, low4), hi0 = _mm256_srli_epi16(w0, 4);
    __m256i lo1 = _mm256_and_si256(w1, low4), hi1 = _mm256_srli_epi16(w1, 4);
    if (bits == 5) { /* Q5_0: q - 16, -16 added where the fifth bit is clear (Q5_K: q) */
        const uint8_t *pl = blk + 256 + 32 * (j / 4);
        const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)pl));
        const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(pl + 16)));
        const __m256i ml = _mm256_set1_epi16((short)(1 << (2 * (j % 4))));
        const __m256i mh = _mm256_set1_epi16((short)(2 << (2 * (j % 4))));
        const __m256i z = _mm256_setzero_si256(), n16 = _mm256_set1_epi16(-16);
#define QG_Q5(v, h, msk) v = _mm256_add_epi16(v, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, msk), z), n16))
        QG_Q5(lo0, h0, ml);
        QG_Q5(hi0, h0, mh);
        QG_Q5(lo1, h1, ml);
        QG_Q5(hi1, h1, mh);
#undef QG_Q5
        if (f == QF_K5) {
            const __m256i p16 = _mm256_set1_epi16(16);
            lo0 = _mm256_add_epi16(lo0, p16);
            hi0 = _mm256_add_epi16(hi0, p16);
            lo1 = _mm256_add_epi16(lo1, p16);
            hi1 = _mm256_add_epi16(hi1, p16);
        }
    }
    if (bits == 6) { /* Q6_K: q - 32 = nibble + 16 x its two top bits - 32 */
        const uint8_t *pl = blk + 256 + 32 * (j / 2);
        const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)pl));
        const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(pl + 16)));
        const __m128i cl = _mm_cvtsi32_si128(4 * (j % 2)), ch = _mm_cvtsi32_si128(4 * (j % 2) + 2);
        const __m256i three = _mm256_set1_epi16(3), n32 = _mm256_set1_epi16(32);
#define QG_Q6(v, h, c) v = _mm256_sub_epi16(_mm256_add_epi16(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, c), three), 4)), n32)
        QG_Q6(lo0, h0, cl);
        QG_Q6(hi0, h0, ch);
        QG_Q6(lo1, h1, cl);
        QG_Q6(hi1, h1, ch);
#undef QG_Q6
    }
    *plo0 = lo0;
    *phi0 = hi0;
    *plo1 = lo1;
    *phi1 = hi1;
}

/* Block b's 16 lanes' float scales as two halves (lanes 0-7, 8-15): w = d q + m (Q6_K: d for
 * inputs 0-15, m = D_hi for 16-31), the K formats' products d * sc exact in fp32. */
static inline __attribute__((always_inline)) void block_scales_256(const uint8_t *wg,
                                                                   const uint8_t *blk, const int f,
                                                                   int64_t b, __m256 *pd0, __m256 *pd1,
                                                                   __m256 *pm0, __m256 *pm1) {
    const int64_t qbytes = fmt_qbytes(f);
    if (fmt_local(f)) {
        *pd0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes)));
        *pd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes + 16)));
        if (f == QF_Q5) {
            *pm0 = *pm1 = _mm256_setzero_ps();
        } else {
            *pm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes + 32)));
            *pm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes + 48)));
        }
    } else {
        const uint8_t *sup = super_at(wg, f, b), *sc = blk + qbytes;
        const __m256 dd0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sup));
        const __m256 dd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 16)));
        *pd0 = _mm256_mul_ps(dd0, i8_ps(sc));
        *pd1 = _mm256_mul_ps(dd1, i8_ps(sc + 8));
        if (f == QF_K6) { /* m: D_hi */
            *pm0 = _mm256_mul_ps(dd0, i8_ps(sc + 16));
            *pm1 = _mm256_mul_ps(dd1, i8_ps(sc + 24));
        } else {
            *pm0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 32))), i8_ps(sc + 16));
            *pm1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 48))), i8_ps(sc + 24));
        }
    }
}
#endif

#endif
