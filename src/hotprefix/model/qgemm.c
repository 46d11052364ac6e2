/* GEMM on GGUF block-quantized weights with 16-bit integer activations (see qlinear.py).
 *
 * y[r][n] = sum over 32-wide blocks b of  sa[r][b] * (D[n][b] * S + M[n][b] * sq[r][b])
 * where S = sum_i q[n][32b + i] * qa[r][32b + i] is an exact integer (|S| < 2^31; converted to
 * float once, with round-to-nearest on both paths), qa the row's
 * activations rounded to int16 with one scale sa per block, sq the sum of a block's qa, and the
 * weight w = D * q + M. Q6_K's scales change every 16 inputs: its blocks add
 * sa * (D_lo * S_lo + D_hi * S_hi) over the two halves (no M). Integer sums are exact in
 * any order, and each output's float operations run in one fixed sequence (two FMAs and a product
 * per block, blocks in order), so a row's bits do not depend on how many rows share the call, the
 * tiling, the thread count or the vector width: the AVX-512 VNNI path and the portable C path give
 * the same bits.
 *
 * Weight layout (qlinear.pack_weight): outputs in groups of 16 (one lane each). The buffer opens
 * with one int64 per group, (byte offset of the group << 4) | its format; a group's format:
 *   QF_Q4  Q4_0 / Q4_1: 4-bit q; per block 256 bytes of values, then 16 fp16 D and 16 fp16 M
 *          (Q4_0: M = -8 D);
 *   QF_Q8  Q8_0 / a group mixing Q4_0, Q4_1, Q5_0 and Q8_0 rows: int8 q, 512 bytes of values,
 *          16 fp16 D and 16 fp16 M;
 *   QF_Q5  Q5_0: q - 16 as the 4-bit layout's 256 bytes of low nibbles, 64 bytes of fifth bits
 *          (byte p of 32-byte plane j / 4 holds chunk j's byte p's in bits 2 (j % 4) and
 *          2 (j % 4) + 1, its low and high nibble's), then 16 fp16 D (M = 0);
 *   QF_K4  Q4_K: per super-block of 8 blocks (256 inputs), 8 times [256 bytes of 4-bit q, 16 int8
 *          sc, 16 int8 mn], then 16 fp16 d and 16 fp16 -dmin: D = d * sc, M = -dmin * mn
 *          (exact in fp32: the file's own values);
 *   QF_K5  Q5_K: the same with q (0..31) as QF_Q5's 256 bytes of low nibbles and 64 of fifth
 *          bits;
 *   QF_K6  Q6_K: q - 32 as 256 bytes of low nibbles and 128 of their top two bits (byte p of
 *          32-byte plane j / 2 holds chunk j's byte p's in bits 4 (j % 2) + 2 hi and the next),
 *          16 int8 scales of inputs 0-15 and 16 of inputs 16-31, then per super-block 16 fp16 d
 *          (and 32 unused bytes): D_lo = d * sc_lo, D_hi = d * sc_hi.
 * In the 4-bit layouts byte p of chunk j (j < 8) holds, for lane p / 2, the value of input
 * 2j + p % 2 in its low nibble and of input 2j + 16 + p % 2 in its high nibble; in the 8-bit ones
 * byte p of chunk j (j < 16) is input 2j + p % 2 of lane p / 2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "qgemm_layout.h"
#include "scratch.h"

#ifdef HP_AVX2
#define QG_ROWS 8        /* rows sharing one pass over a weight block (a row's sum: one register) */
#else
#define QG_ROWS 6        /* rows sharing one pass over a weight block */
#endif
#define QG_ROW_SPAN 192  /* rows whose activations stay in L2 while the groups stream (a multiple of QG_ROWS) */
#define QG_QMAX 32767.0f /* activations' largest magnitude: 16-bit */
#define QG_QMAX8 127.0f  /* the narrow (8-bit) activations' (a weight's table flag: qgemm_layout.h) */
#define QG_PAR_MIN (1 << 17) /* multiply-adds below which one thread runs the product */
#define QG_PREFETCH 32     /* blocks ahead to prefetch in a group's first tile */
#define QG_CHAINS 4       /* most integer accumulators a row keeps per block */
#define QG_AMX_MIN_ROWS 25 /* rows from which the AMX tile path (qgemm_amx.c) runs, where it can: at 16 a
                            * batch-16 decode step ran 0.93x the AVX-512 path (each step decodes every
                            * group into tiles for one tile of rows), and 17-24 rows (a tile and a tail
                            * of rows here) lost on Q6_K; 25-31 rows as two tiles (a warm prompt's
                            * short tail) took 0.7-0.9x the vector path's time on the 1B's matrices */
#define QG_A8_MIN_ROWS 8 /* rows from which narrow weights take qgemm_a8.c's VPDPBUSD path */
#define QG_AMX_TAIL 8      /* most rows past the last whole 16 that the vector path takes instead */

/* One 32-wide block of a row: q = rint(v * (QMAX / amax)) clamped to +-QMAX, its scale and sum.
 * amax ignores NaN (fmaxf), a NaN value clamps to -QMAX, an infinite amax gives zeros and scale inf.
 * The portable reference of quantize_block_avx. */
static void quantize_block_c(const float *v, int16_t *q, float *sa, float *sq, const float qmax) {
    float amax = 0.0f;
    for (int i = 0; i < QG_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
    int32_t sum = 0;
    if (amax > 0.0f && isfinite(amax)) {
        float inv = qmax / amax;
        for (int i = 0; i < QG_BLOCK; i++) {
            float t = rintf(v[i] * inv);
            t = fminf(fmaxf(t, -qmax), qmax);
            q[i] = (int16_t)t;
            sum += q[i];
        }
        *sa = amax / qmax;
    } else {
        memset(q, 0, QG_BLOCK * sizeof(int16_t));
        *sa = amax > 0.0f ? amax : 0.0f; /* inf/nan propagate through the scale */
    }
    *sq = (float)sum;
}

#ifdef HP_AVX512
/* quantize_block_c with AVX-512, value for value: the same IEEE products and roundings, and max
 * and min ordered so that a NaN is treated as fmaxf / fminf treat it (MAXPS returns its second
 * operand when either is NaN). */
static inline void quantize_block_avx(const float *v, int16_t *q, float *sa, float *sq,
                                      const float qmax) {
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    __m512 m = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());
    m = _mm512_max_ps(_mm512_abs_ps(v1), m);
    const float amax = _mm512_reduce_max_ps(m); /* no NaN lanes left: any order is exact */
    if (amax > 0.0f && isfinite(amax)) {
        const __m512 inv = _mm512_set1_ps(qmax / amax), lo = _mm512_set1_ps(-qmax),
                     hi = _mm512_set1_ps(qmax);
        const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m512 t0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, inv), rn);
        __m512 t1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, inv), rn);
        t0 = _mm512_min_ps(_mm512_max_ps(t0, lo), hi);
        t1 = _mm512_min_ps(_mm512_max_ps(t1, lo), hi);
        const __m512i i0 = _mm512_cvtps_epi32(t0), i1 = _mm512_cvtps_epi32(t1);
        _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(i0));
        _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(i1));
        *sq = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        *sa = amax / qmax;
    } else {
        memset(q, 0, QG_BLOCK * sizeof(int16_t));
        *sa = amax > 0.0f ? amax : 0.0f;
        *sq = 0.0f;
    }
}
#define quantize_block quantize_block_avx
#elif defined(HP_AVX2)
/* quantize_block_c with AVX2, value for value (the AVX-512 version's steps on 8 lanes). */
static inline void quantize_block_avx2(const float *v, int16_t *q, float *sa, float *sq,
                                       const float qmax) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), m); /* a NaN lane keeps m */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    if (amax > 0.0f && isfinite(amax)) {
        const __m256 inv = _mm256_set1_ps(qmax / amax), lo = _mm256_set1_ps(-qmax),
                     hi = _mm256_set1_ps(qmax);
        __m256i t[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(x[i], inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            t[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            sum = _mm256_add_epi32(sum, t[i]);
        }
        /* packs works within 128-bit halves: reorder the 64-bit quarters back */
        _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(t[0], t[1]), 0xd8));
        _mm256_storeu_si256((__m256i *)(q + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(t[2], t[3]), 0xd8));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        *sq = (float)_mm_cvtsi128_si32(s4);
        *sa = amax / qmax;
    } else {
        memset(q, 0, QG_BLOCK * sizeof(int16_t));
        *sa = amax > 0.0f ? amax : 0.0f;
        *sq = 0.0f;
    }
}
#define quantize_block quantize_block_avx2
#else
#define quantize_block quantize_block_c
#endif

/* x [rows][k] fp32 -> qa [rows][k] int16, sa and sq [rows][k / 32]; narrow: rounded to +-127
 * (8-bit values, held in int16: the int16 kernels' bits, the AMX path's one tile product a block),
 * else +-32767. portable: the C reference (tests: it must give the vector path's bits). */
static void quantize_rows(const float *x, int16_t *qa, float *sa, float *sq, int64_t rows,
                          int64_t k, int narrow, int threads, int portable) {
    const int64_t nb = k / QG_BLOCK;
    const float qmax = narrow ? QG_QMAX8 : QG_QMAX;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * k + b * QG_BLOCK, j = r * nb + b;
            if (portable)
                quantize_block_c(x + i, qa + i, sa + j, sq + j, qmax);
            else
                quantize_block(x + i, qa + i, sa + j, sq + j, qmax);
        }
}

void qg_quantize_rows(const float *x, int16_t *qa, float *sa, float *sq, int64_t rows, int64_t k,
                      int narrow, int threads) {
    quantize_rows(x, qa, sa, sq, rows, k, narrow, threads, 0);
}

void qg_quantize_rows_reference(const float *x, int16_t *qa, float *sa, float *sq, int64_t rows,
                                int64_t k, int narrow) {
    quantize_rows(x, qa, sa, sq, rows, k, narrow, 1, 1);
}

/* ------------------------------------------------------------------ the weight layout */
/* Bytes of one group of 16 outputs over nb blocks (qlinear checks its layout against this). */
int64_t qg_group_bytes(int f, int64_t nb) {
    if (f < 0 || f >= QF_FORMATS) return -1;
    return fmt_local(f) ? nb * (fmt_qbytes(f) + fmt_scales(f)) : nb / 8 * fmt_super(f);
}

/* ------------------------------------------------------------------ the portable reference */
/* One group of 16 outputs for rows [0, nr) of a tile. */
static void group_rows_c(const uint8_t *wg, int f, int64_t nb, const int16_t *qa,
                         const float *sa, const float *sq, int64_t k, int nr, float *y,
                         int64_t ldy, int lanes) {
    for (int r = 0; r < nr; r++) {
        float acc[QG_LANES] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = block_at(wg, f, b);
            const int16_t *a = qa + r * k + b * QG_BLOCK;
            const float q = sq[r * nb + b];
            for (int l = 0; l < QG_LANES; l++) {
                int32_t s[2] = {0, 0}; /* inputs 0-15, 16-31 */
                for (int i = 0; i < QG_BLOCK; i++) s[i / 16] += weight_q(blk, f, l, i) * a[i];
                float dlo, dhi, m, c;
                lane_scales(wg, blk, f, b, l, &dlo, &dhi, &m);
                if (f == QF_K6)
                    c = fmaf(dlo, (float)s[0], dhi * (float)s[1]);
                else
                    c = fmaf(dlo, (float)(s[0] + s[1]), m * q);
                acc[l] = fmaf(sa[r * nb + b], c, acc[l]);
            }
        }
        for (int l = 0; l < lanes; l++) y[r * ldy + l] = acc[l];
    }
}

#ifdef HP_AVX512
/* A group's nb blocks decoded to the int16 kernel's vectors, 16 a block (4- to 6-bit: chunk j's
 * lo, hi at 2j, 2j + 1; 8-bit: chunk j at j), so that the tiles of a span read them instead of
 * each decoding them again. */
static void decode_group16(const uint8_t *wg, const int f, int64_t nb, __m512i *dec) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        __m512i *o = dec + 16 * b;
        if (fmt_bits(f) == 8)
            for (int j = 0; j < 16; j++)
                o[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * j)));
        else
            for (int j = 0; j < 8; j++) decode_chunk_512(blk, f, j, &o[2 * j], &o[2 * j + 1]);
    }
}

/* dec: the group as decode_group16 left it, or NULL: each block decoded here */
static inline __attribute__((always_inline)) void group_rows_vnni(
    const uint8_t *wg, const int f, int64_t nb, const int16_t *qa, const float *sa,
    const float *sq, int64_t k, const int nr, float *y, int64_t ldy, int lanes, int fetch,
    const __m512i *dec) {
    const int bits = fmt_bits(f);
    const int64_t qbytes = fmt_qbytes(f);
    const int64_t ahead = QG_PREFETCH * (fmt_local(f) ? qbytes + fmt_scales(f) : qbytes + 40);
    /* one row alone waits on its accumulators' latency: give it four chains; many rows have
     * enough chains between them (and registers for no more) */
    const int chains = f == QF_K6 ? 2 : nr == 1 ? 4 : nr == 2 ? 2 : 1; /* Q6_K: inputs 0-15, 16-31 */
    __m512 acc[QG_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        if (fetch) /* a group's first tile: its weights stream from memory, fetch them ahead (a
                    * prefetch past the last block is a hint, never a fault) */
            for (int64_t off = 0; off < qbytes + fmt_scales(f); off += 64)
                _mm_prefetch((const char *)(blk + ahead + off), _MM_HINT_T0);
        /* several independent integer chains per row (a VNNI op waits for the previous one on
         * its accumulator); integer sums are exact, so how they are split changes no bits */
        __m512i s[QG_ROWS][QG_CHAINS], lo[QG_ROWS];
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < chains; c++) s[r][c] = _mm512_setzero_si512();
        if (bits != 8) {
            for (int j = 0; j < 8; j++) {
                __m512i wl, wh;
                if (dec) {
                    wl = dec[16 * b + 2 * j];
                    wh = dec[16 * b + 2 * j + 1];
                } else {
                    decode_chunk_512(blk, f, j, &wl, &wh);
                }
                const int c = chains == 4 ? (j & 1) * 2 : 0, c1 = chains == 1 ? 0 : c + 1;
                for (int r = 0; r < nr; r++) {
                    const int16_t *a = qa + r * k + b * QG_BLOCK + 2 * j;
                    int32_t p0, p1;
                    memcpy(&p0, a, 4);
                    memcpy(&p1, a + 16, 4);
                    s[r][c] = _mm512_dpwssd_epi32(s[r][c], wl, _mm512_set1_epi32(p0));
                    s[r][c1] = _mm512_dpwssd_epi32(s[r][c1], wh, _mm512_set1_epi32(p1));
                }
            }
        } else {
            for (int j = 0; j < 16; j++) {
                __m512i w = dec ? dec[16 * b + j]
                                : _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * j)));
                const int c = j % chains;
                for (int r = 0; r < nr; r++) {
                    int32_t p;
                    memcpy(&p, qa + r * k + b * QG_BLOCK + 2 * j, 4);
                    s[r][c] = _mm512_dpwssd_epi32(s[r][c], w, _mm512_set1_epi32(p));
                }
            }
        }
        __m512i t[QG_ROWS];
        for (int r = 0; r < nr; r++) {
            if (f == QF_K6) { /* the two halves' sums, apart */
                lo[r] = s[r][0];
                t[r] = s[r][1];
                continue;
            }
            t[r] = s[r][0];
            for (int c = 1; c < chains; c++) t[r] = _mm512_add_epi32(t[r], s[r][c]);
        }
        __m512 d, m;
        block_scales_512(wg, blk, f, b, &d, &m);
        for (int r = 0; r < nr; r++) {
            __m512 c = f == QF_K6
                ? _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(m, _mm512_cvtepi32_ps(t[r])))
                : _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(m, _mm512_set1_ps(sq[r * nb + b])));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sa[r * nb + b]), c, acc[r]);
        }
    }
    __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

#define QG_CASE(F, R) \
    case R: group_rows_vnni(wg, F, nb, qa, sa, sq, k, R, y, ldy, lanes, fetch, dec); break;
#define QG_ROWS_OF(F) \
    switch (nr) { QG_CASE(F, 1) QG_CASE(F, 2) QG_CASE(F, 3) QG_CASE(F, 4) QG_CASE(F, 5) QG_CASE(F, 6) } \
    break;
static void group_rows(const uint8_t *wg, int f, int64_t nb, const int16_t *qa,
                       const float *sa, const float *sq, int64_t k, int nr, float *y, int64_t ldy,
                       int lanes, int fetch, const __m512i *dec) {
    switch (f) {
    case QF_Q4: QG_ROWS_OF(QF_Q4)
    case QF_Q8: QG_ROWS_OF(QF_Q8)
    case QF_K4: QG_ROWS_OF(QF_K4)
    case QF_K5: QG_ROWS_OF(QF_K5)
    case QF_Q5: QG_ROWS_OF(QF_Q5)
    default: QG_ROWS_OF(QF_K6)
    }
}

/* Two groups (wg0, wg1: the same format, not Q6_K) for the same rows: each broadcast pair of a
 * row's activations feeds both groups' products, half the broadcast loads a multiply-add of
 * group_rows_vnni's (whose loop those loads bound: 51.9 -> 44.2 ms on a 512 x 2,048 x 8,192 Q4_K
 * product). Each output's integer sum and float steps are group_rows_vnni's: the same bits. One
 * chain a row and group: for tiles of several rows (a lone row waits on its chains' latency).
 * dec0, dec1: 5-bit groups as decode_group16 left them, or NULL: each block decoded (8-bit: read)
 * here. */
static inline __attribute__((always_inline)) void group_rows_pair(
    const uint8_t *wg0, const uint8_t *wg1, const int f, int64_t nb, const int16_t *qa,
    const float *sa, const float *sq, int64_t k, const int nr, float *y, int64_t ldy, int lanes0,
    int lanes1, int fetch, const __m512i *dec0, const __m512i *dec1) {
    const int64_t qbytes = fmt_qbytes(f);
    const int64_t ahead = QG_PREFETCH * (fmt_local(f) ? qbytes + fmt_scales(f) : qbytes + 40);
    __m512 acc[QG_ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk0 = block_at(wg0, f, b), *blk1 = block_at(wg1, f, b);
        if (fetch) /* the groups' first tile: their weights stream from memory */
            for (int64_t off = 0; off < qbytes + fmt_scales(f); off += 64) {
                _mm_prefetch((const char *)(blk0 + ahead + off), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk1 + ahead + off), _MM_HINT_T0);
            }
        __m512i s[QG_ROWS][2];
        for (int r = 0; r < nr; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        for (int j = 0; fmt_bits(f) == 8 && j < 16; j++) { /* 8-bit: chunk j, inputs 2j, 2j + 1 */
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk0 + 32 * j)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk1 + 32 * j)));
            for (int r = 0; r < nr; r++) {
                int32_t p;
                memcpy(&p, qa + r * k + b * QG_BLOCK + 2 * j, 4);
                const __m512i a = _mm512_set1_epi32(p);
                s[r][0] = _mm512_dpwssd_epi32(s[r][0], w0, a);
                s[r][1] = _mm512_dpwssd_epi32(s[r][1], w1, a);
            }
        }
        for (int j = 0; fmt_bits(f) != 8 && j < 8; j++) {
            __m512i wl0, wh0, wl1, wh1;
            if (dec0) {
                wl0 = dec0[16 * b + 2 * j], wh0 = dec0[16 * b + 2 * j + 1];
                wl1 = dec1[16 * b + 2 * j], wh1 = dec1[16 * b + 2 * j + 1];
            } else {
                decode_chunk_512(blk0, f, j, &wl0, &wh0);
                decode_chunk_512(blk1, f, j, &wl1, &wh1);
            }
            for (int r = 0; r < nr; r++) {
                const int16_t *a = qa + r * k + b * QG_BLOCK + 2 * j;
                int32_t p0, p1;
                memcpy(&p0, a, 4);
                memcpy(&p1, a + 16, 4);
                const __m512i b0 = _mm512_set1_epi32(p0), b1 = _mm512_set1_epi32(p1);
                s[r][0] = _mm512_dpwssd_epi32(s[r][0], wl0, b0);
                s[r][1] = _mm512_dpwssd_epi32(s[r][1], wl1, b0);
                s[r][0] = _mm512_dpwssd_epi32(s[r][0], wh0, b1);
                s[r][1] = _mm512_dpwssd_epi32(s[r][1], wh1, b1);
            }
        }
        __m512 d0, m0, d1, m1;
        block_scales_512(wg0, blk0, f, b, &d0, &m0);
        block_scales_512(wg1, blk1, f, b, &d1, &m1);
        for (int r = 0; r < nr; r++) { /* group_rows_vnni's float steps, per group */
            const __m512 q = _mm512_set1_ps(sq[r * nb + b]), a = _mm512_set1_ps(sa[r * nb + b]);
            const __m512 c0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(m0, q));
            const __m512 c1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(m1, q));
            acc[r][0] = _mm512_fmadd_ps(a, c0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, c1, acc[r][1]);
        }
    }
    const __mmask16 k0 = (__mmask16)((1u << lanes0) - 1), k1 = (__mmask16)((1u << lanes1) - 1);
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, acc[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + QG_LANES, k1, acc[r][1]);
    }
}

#define QG_PAIR_CASE(F, R) \
    case R: group_rows_pair(wg0, wg1, F, nb, qa, sa, sq, k, R, y, ldy, lanes0, lanes1, fetch, dec0, dec1); break;
#define QG_PAIR_ROWS_OF(F) \
    switch (nr) { QG_PAIR_CASE(F, 1) QG_PAIR_CASE(F, 2) QG_PAIR_CASE(F, 3) QG_PAIR_CASE(F, 4) \
                  QG_PAIR_CASE(F, 5) QG_PAIR_CASE(F, 6) } \
    break;
/* Whether groups of format f go in pairs (group_rows_pair): all but Q6_K (two sums a row and
 * group: two groups do not fit the registers; tried as 4-row pairs, no faster). */
#define PAIRED(f) ((f) != QF_K6)
static void group_rows2(const uint8_t *wg0, const uint8_t *wg1, int f, int64_t nb,
                        const int16_t *qa, const float *sa, const float *sq, int64_t k, int nr,
                        float *y, int64_t ldy, int lanes0, int lanes1, int fetch,
                        const __m512i *dec0, const __m512i *dec1) {
    switch (f) {
    case QF_Q4: QG_PAIR_ROWS_OF(QF_Q4)
    case QF_Q8: QG_PAIR_ROWS_OF(QF_Q8)
    case QF_K5: QG_PAIR_ROWS_OF(QF_K5)
    case QF_Q5: QG_PAIR_ROWS_OF(QF_Q5)
    default: QG_PAIR_ROWS_OF(QF_K4)
    }
}
#elif defined(HP_AVX2)
#include "qgemm_avx2.h"
#else
#define group_rows(wg, f, nb, qa, sa, sq, k, nr, y, ldy, lanes, fetch, dec) \
    group_rows_c(wg, f, nb, qa, sa, sq, k, nr, y, ldy, lanes)
#endif

/* Whether a group of format f is decoded once for a span of `span` rows, into the thread's
 * scratch, and its tiles read it back: 5- and 6-bit blocks over several tiles (their decode cost
 * ~40% of a tile's work; 4- and 8-bit blocks decode faster than they load back). */
static inline int decoded_once(int f, int64_t span) {
    return span > QG_ROWS && (fmt_bits(f) == 5 || fmt_bits(f) == 6);
}

/* Whether groups g and g + 1 (formats f, f2; of `groups`) run as a pair on a span of `span` rows
 * (group_rows_pair): groups of one format (PAIRED), on tiles of several rows, on AVX-512. */
static inline int pair_at(int64_t groups, int64_t g, int f, int f2, int64_t span) {
#ifdef HP_AVX512
    return g % 2 == 0 && g + 1 < groups && f == f2 && PAIRED(f) && span >= QG_ROWS;
#else
    (void)groups, (void)g, (void)f, (void)f2, (void)span;
    return 0;
#endif
}

/* y [rows][n] = the block-quantized product described above. */
void qg_gemm(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
             const float *sq, int64_t rows, float *y, int threads) {
    const int64_t nb = k / QG_BLOCK, groups = (n + QG_LANES - 1) / QG_LANES;
    int64_t span; /* equal spans of at most QG_ROW_SPAN rows, a whole number of tiles */
    const int64_t spans = even_spans(rows, QG_ROW_SPAN, QG_ROWS, &span);
    /* a span of rows (its activations held in L2) and two groups of 16 outputs (their weights in
     * L1) per iteration, as a pair where pair_at says, else one after the other; threads take
     * contiguous ranges of these: the groups of a short batch are split between them, a long
     * prefill's spans too */
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (rows * n * k >= QG_PAR_MIN)
    for (int64_t s = 0; s < spans; s++) {
        for (int64_t g2 = 0; g2 < (groups + 1) / 2; g2++) {
            const int64_t r0 = s * span, r1 = r0 + span < rows ? r0 + span : rows;
            for (int64_t g = 2 * g2; g < 2 * g2 + 2 && g < groups; g++) {
                const int lanes = group_lanes(n, g);
                int f, f2 = -1;
                const uint8_t *wg = group_at(w, g, &f);
                const uint8_t *wg2 = g + 1 < groups ? group_at(w, g + 1, &f2) : NULL;
                if (pair_at(groups, g, f, f2, r1 - r0)) {
#ifdef HP_AVX512
                    __m512i *d0 = NULL, *d1 = NULL;
                    if (decoded_once(f, r1 - r0) &&
                        (d0 = hp_scratch(SCR_GEMM_DECODED, (size_t)(2 * nb * 1024)))) {
                        d1 = d0 + 16 * nb;
                        decode_group16(wg, f, nb, d0);
                        decode_group16(wg2, f, nb, d1);
                    }
                    for (int64_t r = r0; r < r1; r += QG_ROWS) {
                        const int nr = r1 - r < QG_ROWS ? (int)(r1 - r) : QG_ROWS;
                        group_rows2(wg, wg2, f, nb, qa + r * k, sa + r * nb, sq + r * nb, k, nr,
                                    y + r * n + g * QG_LANES, n, lanes, group_lanes(n, g + 1),
                                    r == r0 && !d0, d0, d1);
                    }
#endif
                    break; /* both groups done */
                }
                (void)wg2;
                void *dec = NULL;
#if defined(HP_AVX512) || defined(HP_AVX2)
                if (decoded_once(f, r1 - r0) &&
                    (dec = hp_scratch(SCR_GEMM_DECODED, (size_t)(nb * 1024))))
                    decode_group16(wg, f, nb, dec);
#endif
                for (int64_t r = r0; r < r1; r += QG_ROWS) {
                    int nr = r1 - r < QG_ROWS ? (int)(r1 - r) : QG_ROWS;
                    group_rows(wg, f, nb, qa + r * k, sa + r * nb, sq + r * nb, k, nr,
                               y + r * n + g * QG_LANES, n, lanes, r == r0 && !dec, dec);
                }
            }
        }
    }
}

int qg_amx_ready(void);
int qg_gemm8(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
             const float *sq, int64_t rows, float *y, int threads);
int qg_linear_amx(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                  int threads);

/* x [rows][k] fp32 -> y [rows][n]: the activations quantized (in kept scratch: scratch.h), then the
 * product. Returns -1 when the scratch cannot be allocated (y untouched), else 0. */
int qg_linear(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
              int threads) {
    const int64_t nb = k / QG_BLOCK;
    if (rows <= 0) return 0;
    if (rows >= QG_AMX_MIN_ROWS && qg_amx_ready()) { /* the same bits on AMX tiles */
        /* a last partial tile of a few rows: those rows here, not as a padded tile */
        const int64_t tiled = rows % 16 && rows % 16 <= QG_AMX_TAIL ? rows / 16 * 16 : rows;
        if (qg_linear_amx(w, n, k, x, tiled, y, threads)) return -1;
        if (tiled == rows) return 0;
        x += tiled * k;
        y += tiled * n;
        rows -= tiled;
    }
    int16_t *qa = hp_scratch(SCR_LINEAR, (size_t)(rows * k) * sizeof(int16_t) + 2 * (size_t)(rows * nb) * sizeof(float));
    if (!qa) return -1;
    float *sa = (float *)(qa + rows * k), *sq = sa + rows * nb;
    const int narrow = group_narrow(w);
    qg_quantize_rows(x, qa, sa, sq, rows, k, narrow, threads);
    if (narrow && rows >= QG_A8_MIN_ROWS) { /* 8-bit activations: VPDPBUSD where it builds */
        const int err = qg_gemm8(w, n, k, qa, sa, sq, rows, y, threads);
        if (err <= 0) return err;
    }
    qg_gemm(w, n, k, qa, sa, sq, rows, y, threads);
    return 0;
}

/* Rows idx[0..count) of a packed [n][k] weight as fp32 (out [count][k]): D * q + M, GGUF's own
 * dequantization value for value (D * q is exact in fp32; the legacy formats add M only where it
 * is not zero, as Q4_0 / Q8_0 / Q5_0 have none; Q6_K has none). Rows outside [0, n) are left
 * unwritten and counted in the return value. */
int64_t qg_dequant_rows(const uint8_t *w, int64_t n, int64_t k, const int64_t *idx, int64_t count,
                        float *out) {
    const int64_t nb = k / QG_BLOCK;
    int64_t bad = 0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = idx[i];
        if (row < 0 || row >= n) {
            bad++;
            continue;
        }
        const int l = (int)(row % QG_LANES);
        int f;
        const uint8_t *wg = group_at(w, row / QG_LANES, &f);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = block_at(wg, f, b);
            float dlo, dhi, m;
            lane_scales(wg, blk, f, b, l, &dlo, &dhi, &m);
            float *o = out + i * k + b * QG_BLOCK;
            for (int j = 0; j < QG_BLOCK; j++) {
                const float d = j < 16 ? dlo : dhi, p = d * (float)weight_q(blk, f, l, j);
                o[j] = f == QF_K4 || f == QF_K5 || m != 0.0f ? p + m : p;
            }
        }
    }
    return bad;
}

/* The portable path on the same data, for tests: it must give the vector path's bits. */
void qg_gemm_reference(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
                       const float *sq, int64_t rows, float *y) {
    const int64_t nb = k / QG_BLOCK, groups = (n + QG_LANES - 1) / QG_LANES;
    for (int64_t g = 0; g < groups; g++) {
        const int lanes = group_lanes(n, g);
        int f;
        const uint8_t *wg = group_at(w, g, &f);
        for (int64_t r = 0; r < rows; r++)
            group_rows_c(wg, f, nb, qa + r * k, sa + r * nb, sq + r * nb, k, 1,
                         y + r * n + g * QG_LANES, n, lanes);
    }
}
