/* The GGUF-block GEMM of qgemm.c for narrow weights (8-bit activations, |qa| <= 127:
 * qgemm_layout.h's group_narrow) on byte products, where the AMX tiles do not run (CPUs without
 * AMX; on AMX CPUs, steps of fewer rows than those take): AVX-512 VNNI's VPDPBUSD (64
 * multiply-adds an instruction where the int16 kernels' VPDPWSSD does 32), AVX-VNNI's on 256 bits,
 * and plain AVX2's VPMADDUBSW + VPMADDWD (32 multiply-adds for three instructions with the int32
 * add, where VPMADDWD + VPADDD do 16 for two).
 *
 * The numerics are qgemm.c's, bit for bit. The byte products multiply unsigned bytes by signed
 * ones, so a row's activations are stored as qa + 128 (1..255) and a block's weights as their int8
 * values q (Q4 0..15, Q5 -16..31, Q6_K -32..31; qgemm_layout.h's block_quads_512):
 * sum (qa + 128) q - 128 sum q = sum qa q = S exactly (|S| < 2^31), the 128 sum q of each lane
 * and block (Q6_K: of each half) worked out once per group. VPMADDUBSW saturates its int16 pair
 * sums: with |q| <= 32 a pair is at most 2 x 255 x 32 = 16,320 and two pairs added 32,640, so
 * nothing saturates or wraps; 8-bit weights (Q8_0, |q| <= 128) would, so a call holding any runs
 * the int16 kernels on AVX2. From S on, each output's float steps are group_rows_c's, in its
 * order, so a row's bits do not depend on this path: tests compare it with the portable reference.
 *
 * Work: a group of 16 outputs is decoded once per span of rows into 8 rows a block (row kk: each
 * lane's inputs 4kk .. 4kk + 3, 4 bytes a lane; on AVX2 two halves of 8 lanes) with its scales and
 * sums; then up to QG8_ROWS rows at a time run over it, a row's 4 activation bytes broadcast into
 * each product.
 */
#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "qgemm_layout.h"
#include "scratch.h"

#if defined(HP_AVX512) || defined(HP_AVX2)
#include <omp.h>

#define QG8_SPAN 192        /* rows whose activation bytes stay in L2 while the groups stream */
#define QG8_PAR_MIN (1 << 17) /* multiply-adds below which one thread runs the product */
#define QG8_DECODED 768     /* bytes of a decoded block: its 8 rows of 64 bytes, then 4 x 64 of
                             * scales and sums (each path's layout) */
#endif

#ifdef HP_AVX512
#define QG8_ROWS 6          /* rows sharing one pass over a decoded group */
#define PAIR8 1             /* groups run in pairs (rows8_pair) */

/* A group's nb blocks decoded: wt [nb][8][64] int8, then per block its d, m (block_scales_512) and
 * 128 x the sum of each lane's q over inputs 0-15 and 16-31 (int32): dv, mv, clo, chi [nb]. */
static int decode_group8(const uint8_t *wg, const int f, int64_t nb, int8_t *wt) {
    __m512 *dv = (__m512 *)(wt + nb * 512), *mv = dv + nb;
    __m512i *clo = (__m512i *)(mv + nb), *chi = clo + nb;
    const __m512i pair = quad_pairs(), ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        __m512i rows[8];
        block_quads_512(blk, f, pair, rows);
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; kk++) {
            _mm512_storeu_si512(wt + (b * 8 + kk) * 64, rows[kk]);
            if (kk < 4)
                lo = _mm512_dpbusd_epi32(lo, ones, rows[kk]);
            else
                hi = _mm512_dpbusd_epi32(hi, ones, rows[kk]);
        }
        clo[b] = _mm512_slli_epi32(lo, 7);
        chi[b] = _mm512_slli_epi32(hi, 7);
        block_scales_512(wg, blk, f, b, &dv[b], &mv[b]);
    }
    return 0;
}

/* nr rows (au: their activation bytes, qa + 128, row stride k; sa / sq: their first block's,
 * stride nb) against one decoded group: y's first nr rows, its first `lanes` outputs. */
static inline __attribute__((always_inline)) void rows8(
    const int8_t *wt, const __m512 *dv, const __m512 *mv, const __m512i *clo, const __m512i *chi,
    const int f, int64_t nb, const uint8_t *au, const float *sa, const float *sq, int64_t k,
    const int nr, float *y, int64_t ldy, int lanes) {
    __m512 acc[QG8_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = wt + b * 512;
        /* two chains a row (inputs 0-15 and 16-31): Q6_K's halves, apart; summed for the rest */
        __m512i s0[QG8_ROWS], s1[QG8_ROWS];
        for (int r = 0; r < nr; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        for (int kk = 0; kk < 4; kk++) {
            const __m512i w0 = _mm512_loadu_si512(wb + 64 * kk), w1 = _mm512_loadu_si512(wb + 64 * (kk + 4));
            for (int r = 0; r < nr; r++) {
                const uint8_t *a = au + r * k + b * QG_BLOCK + 4 * kk;
                int32_t p0, p1;
                memcpy(&p0, a, 4);
                memcpy(&p1, a + 16, 4);
                s0[r] = _mm512_dpbusd_epi32(s0[r], _mm512_set1_epi32(p0), w0);
                s1[r] = _mm512_dpbusd_epi32(s1[r], _mm512_set1_epi32(p1), w1);
            }
        }
        const __m512 d = dv[b], m = mv[b];
        for (int r = 0; r < nr; r++) {
            const __m512i lo = _mm512_sub_epi32(s0[r], clo[b]), hi = _mm512_sub_epi32(s1[r], chi[b]);
            const __m512 c = f == QF_K6
                ? _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), _mm512_mul_ps(m, _mm512_cvtepi32_ps(hi)))
                : _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                                  _mm512_mul_ps(m, _mm512_set1_ps(sq[r * nb + b])));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sa[r * nb + b]), c, acc[r]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    for (int r = 0; r < nr; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

#define QG8_CASE(F, R) \
    case R: rows8(wt, dv, mv, clo, chi, F, nb, au, sa, sq, k, R, y, ldy, lanes); break;
#define QG8_ROWS_OF(F) \
    switch (nr) { QG8_CASE(F, 1) QG8_CASE(F, 2) QG8_CASE(F, 3) QG8_CASE(F, 4) QG8_CASE(F, 5) QG8_CASE(F, 6) } \
    break;
static void group_rows8(const int8_t *wt, int f, int64_t nb, const uint8_t *au, const float *sa,
                        const float *sq, int64_t k, int nr, float *y, int64_t ldy, int lanes) {
    const __m512 *dv = (const __m512 *)(wt + nb * 512), *mv = dv + nb;
    const __m512i *clo = (const __m512i *)(mv + nb), *chi = clo + nb;
    switch (f) { /* the two Q6_K-or-not epilogues, and the row count, as constants */
    case QF_K6: QG8_ROWS_OF(QF_K6)
    default: QG8_ROWS_OF(QF_Q4)
    }
}


/* rows8 for two decoded groups of one format other than Q6_K (wt0, wt1): each broadcast of a
 * row's 4 activation bytes feeds both groups' products, half rows8's broadcast loads a product
 * (which bound its loop, as in qgemm.c's group_rows_pair). A row's two chains are one here (rows8
 * adds them before the float steps; integer sums are exact in any order): the same bits. */
static inline __attribute__((always_inline)) void rows8_pair(
    const int8_t *wt0, const int8_t *wt1, int64_t nb, const uint8_t *au, const float *sa,
    const float *sq, int64_t k, const int nr, float *y, int64_t ldy, int lanes0, int lanes1) {
    const int8_t *wt[2] = {wt0, wt1};
    const __m512 *dv[2], *mv[2];
    const __m512i *clo[2], *chi[2];
    for (int g = 0; g < 2; g++) {
        dv[g] = (const __m512 *)(wt[g] + nb * 512), mv[g] = dv[g] + nb;
        clo[g] = (const __m512i *)(mv[g] + nb), chi[g] = clo[g] + nb;
    }
    __m512 acc[QG8_ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb0 = wt0 + b * 512, *wb1 = wt1 + b * 512;
        __m512i s[QG8_ROWS][2];
        for (int r = 0; r < nr; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; kk++) { /* row kk of the block: inputs 4kk..4kk+3 of 0-15, then 16-31 */
            const __m512i w0 = _mm512_loadu_si512(wb0 + 64 * kk), w1 = _mm512_loadu_si512(wb1 + 64 * kk);
            for (int r = 0; r < nr; r++) {
                int32_t p;
                memcpy(&p, au + r * k + b * QG_BLOCK + (kk < 4 ? 4 * kk : 16 + 4 * (kk - 4)), 4);
                const __m512i a = _mm512_set1_epi32(p);
                s[r][0] = _mm512_dpbusd_epi32(s[r][0], a, w0);
                s[r][1] = _mm512_dpbusd_epi32(s[r][1], a, w1);
            }
        }
        for (int g = 0; g < 2; g++) {
            const __m512 d = dv[g][b], m = mv[g][b];
            const __m512i c = _mm512_add_epi32(clo[g][b], chi[g][b]);
            for (int r = 0; r < nr; r++) { /* rows8's float steps */
                const __m512 t = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][g], c)),
                                                 _mm512_mul_ps(m, _mm512_set1_ps(sq[r * nb + b])));
                acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(sa[r * nb + b]), t, acc[r][g]);
            }
        }
    }
    const __mmask16 k0 = (__mmask16)((1u << lanes0) - 1), k1 = (__mmask16)((1u << lanes1) - 1);
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, acc[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + QG_LANES, k1, acc[r][1]);
    }
}

#define QG8_PAIR_CASE(R) \
    case R: rows8_pair(wt0, wt1, nb, au, sa, sq, k, R, y, ldy, lanes0, lanes1); break;
static void group_rows8_pair(const int8_t *wt0, const int8_t *wt1, int64_t nb, const uint8_t *au,
                             const float *sa, const float *sq, int64_t k, int nr, float *y,
                             int64_t ldy, int lanes0, int lanes1) {
    switch (nr) { QG8_PAIR_CASE(1) QG8_PAIR_CASE(2) QG8_PAIR_CASE(3) QG8_PAIR_CASE(4) QG8_PAIR_CASE(5) QG8_PAIR_CASE(6) }
}
#elif defined(HP_AVX2)
#define QG8_ROWS 2 /* rows sharing one pass over a decoded group (16 registers) */
#define PAIR8 0

/* acc += the 4-byte products of unsigned a and signed w, lane by lane: AVX-VNNI's VPDPBUSD, else
 * VPMADDUBSW + VPMADDWD; two at once (a0 x w0 + a1 x w1: their int16 pair sums added before
 * widening, at most 32,640, see above) */
#ifdef HP_AVXVNNI
#define QG8_DOT2(acc, a0, w0, a1, w1) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32((acc), (a0), (w0)), (a1), (w1))
#else
#define QG8_DOT2(acc, a0, w0, a1, w1)                                                           \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((a0), (w0)), \
                                                               _mm256_maddubs_epi16((a1), (w1))), \
                                              _mm256_set1_epi16(1)))
#endif

/* A group's nb blocks decoded: wt [nb][8][2][32] int8 (row kk's lanes 0-7, then 8-15: each lane's
 * inputs 4kk .. 4kk + 3), then per block d0, d1, m0, m1 (block_scales_256), then 128 x the sum of
 * each lane's q over inputs 0-15 (clo: lanes 0-7, 8-15) and 16-31 (chi): 8 vectors of 32 bytes.
 * Returns 1 (nothing written) for 8-bit weights, whose pair sums VPMADDUBSW would saturate. */
static int decode_group8(const uint8_t *wg, const int f, int64_t nb, int8_t *wt) {
    if (fmt_bits(f) == 8) return 1;
    __m256 *sc = (__m256 *)(wt + nb * 512);
    __m256i *sums = (__m256i *)(sc + 4 * nb);
    /* in each 128-bit half: the packed pairs of lanes 0-3 of chunk 2kk, then of chunk 2kk + 1, to
     * each lane's pair from 2kk, then its pair from 2kk + 1 */
    const __m256i quad = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                          0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        __m256i v[8][4]; /* chunk j: lo0, hi0, lo1, hi1 */
        for (int j = 0; j < 8; j++) decode_chunk_256(blk, f, j, &v[j][0], &v[j][1], &v[j][2], &v[j][3]);
        __m256i s[2][2]; /* [inputs 0-15 / 16-31][lanes 0-7 / 8-15] */
        for (int i = 0; i < 4; i++) s[i / 2][i % 2] = _mm256_setzero_si256();
        for (int kk = 0; kk < 8; kk++) {
            const int hi = kk / 4, j = 2 * (kk % 4); /* rows 4-7: the chunks' inputs 16-31 */
            for (int h = 0; h < 2; h++) {
                const int x = 2 * h + hi; /* lo0, hi0, lo1, hi1 */
                const __m256i q = _mm256_shuffle_epi8(_mm256_packs_epi16(v[j][x], v[j + 1][x]), quad);
                _mm256_storeu_si256((__m256i *)(wt + ((b * 8 + kk) * 2 + h) * 32), q);
                s[hi][h] = _mm256_add_epi32(s[hi][h], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16));
            }
        }
        block_scales_256(wg, blk, f, b, &sc[4 * b], &sc[4 * b + 1], &sc[4 * b + 2], &sc[4 * b + 3]);
        for (int i = 0; i < 4; i++) sums[4 * b + i] = _mm256_slli_epi32(s[i / 2][i % 2], 7);
    }
    return 0;
}

/* nr rows (au: their activation bytes, qa + 128, row stride k; sa / sq: their first block's,
 * stride nb) against one decoded group: y's first nr rows, its first `lanes` outputs. */
static inline __attribute__((always_inline)) void rows8(
    const int8_t *wt, const int f, int64_t nb, const uint8_t *au, const float *sa, const float *sq,
    int64_t k, const int nr, float *y, int64_t ldy, int lanes) {
    const __m256 *sc = (const __m256 *)(wt + nb * 512);
    const __m256i *sums = (const __m256i *)(sc + 4 * nb);
    __m256 acc[QG8_ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *wb = wt + b * 512;
        __m256i s[QG8_ROWS][2][2]; /* a row's sums: [inputs 0-15 / 16-31][lanes 0-7 / 8-15] */
        for (int r = 0; r < nr; r++) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm256_setzero_si256();
        for (int kk = 0; kk < 4; kk += 2)
            for (int hi = 0; hi < 2; hi++)
                for (int h = 0; h < 2; h++) {
                    const int row = 4 * hi + kk;
                    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + (row * 2 + h) * 32));
                    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + ((row + 1) * 2 + h) * 32));
                    for (int r = 0; r < nr; r++) {
                        const uint8_t *a = au + r * k + b * QG_BLOCK + 4 * row;
                        int32_t p0, p1;
                        memcpy(&p0, a, 4);
                        memcpy(&p1, a + 4, 4);
                        s[r][hi][h] = QG8_DOT2(s[r][hi][h], _mm256_set1_epi32(p0), w0, _mm256_set1_epi32(p1), w1);
                    }
                }
        for (int h = 0; h < 2; h++) {
            const __m256 d = sc[4 * b + h], m = sc[4 * b + 2 + h];
            for (int r = 0; r < nr; r++) {
                const __m256i lo = _mm256_sub_epi32(s[r][0][h], sums[4 * b + h]);
                const __m256i hi = _mm256_sub_epi32(s[r][1][h], sums[4 * b + 2 + h]);
                const __m256 c = f == QF_K6
                    ? _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), _mm256_mul_ps(m, _mm256_cvtepi32_ps(hi)))
                    : _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)),
                                      _mm256_mul_ps(m, _mm256_set1_ps(sq[r * nb + b])));
                acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(sa[r * nb + b]), c, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        float t[QG_LANES];
        _mm256_storeu_ps(t, acc[r][0]);
        _mm256_storeu_ps(t + 8, acc[r][1]);
        memcpy(y + r * ldy, t, (size_t)lanes * sizeof(float));
    }
}

static void group_rows8(const int8_t *wt, int f, int64_t nb, const uint8_t *au, const float *sa,
                        const float *sq, int64_t k, int nr, float *y, int64_t ldy, int lanes) {
    if (f == QF_K6) { /* the two epilogues, and the row count, as constants */
        if (nr == 1) rows8(wt, QF_K6, nb, au, sa, sq, k, 1, y, ldy, lanes);
        else rows8(wt, QF_K6, nb, au, sa, sq, k, 2, y, ldy, lanes);
    } else {
        if (nr == 1) rows8(wt, QF_Q4, nb, au, sa, sq, k, 1, y, ldy, lanes);
        else rows8(wt, QF_Q4, nb, au, sa, sq, k, 2, y, ldy, lanes);
    }
}
#endif

#if defined(HP_AVX512) || defined(HP_AVX2)
/* qg_gemm (qgemm.c) for a narrow weight: y [rows][n] from qa (|qa| <= 127), sa, sq. Returns 0, -1
 * when scratch memory ran out (y untouched), or 1 (y untouched) where this build has no byte
 * product path or (AVX2) the weight holds an 8-bit group. */
int qg_gemm8(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
             const float *sq, int64_t rows, float *y, int threads) {
    const int64_t nb = k / QG_BLOCK, groups = (n + QG_LANES - 1) / QG_LANES;
#ifndef HP_AVX512
    for (int64_t g = 0; g < groups; g++) { /* VPMADDUBSW would saturate on 8-bit weights */
        int f;
        group_at(w, g, &f);
        if (fmt_bits(f) == 8) return 1;
    }
#endif
    uint8_t *au = hp_scratch(SCR_A8, (size_t)(rows * k));
    if (!au) return -1;
    const int team = rows * n * k >= QG8_PAR_MIN ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(team) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) au[r * k + i] = (uint8_t)(qa[r * k + i] + 128);
    const int64_t per = nb * QG8_DECODED; /* a thread's decoded group (two on AVX-512: a pair) */
    const int64_t slots = PAIR8 ? 2 : 1;
    int8_t *decoded = hp_scratch(SCR_A8_DECODED, (size_t)(team * slots * per));
    if (!decoded) return -1;
    int64_t span;
    const int64_t spans = even_spans(rows, QG8_SPAN, QG8_ROWS, &span);
#pragma omp parallel num_threads(team)
    {
        int8_t *wt = decoded + omp_get_thread_num() * slots * per;
        /* a span and two groups per iteration: on AVX-512 two groups of one format other than
         * Q6_K run as a pair over a span of a full pass of rows or more, else one at a time */
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < spans; s++) {
            for (int64_t g2 = 0; g2 < (groups + 1) / 2; g2++) {
                const int64_t r0 = s * span, r1 = r0 + span < rows ? r0 + span : rows;
                for (int64_t g = 2 * g2; r0 < r1 && g < 2 * g2 + 2 && g < groups; g++) {
                    const int lanes = group_lanes(n, g);
                    int f, f2 = -1;
                    const uint8_t *wg = group_at(w, g, &f);
                    const uint8_t *wg2 = g + 1 < groups ? group_at(w, g + 1, &f2) : NULL;
                    decode_group8(wg, f, nb, wt); /* 8-bit groups were refused above (AVX2) */
#if PAIR8
                    if (g % 2 == 0 && f2 == f && f != QF_K6 && r1 - r0 >= QG8_ROWS) {
                        decode_group8(wg2, f, nb, wt + per);
                        for (int64_t r = r0; r < r1; r += QG8_ROWS) {
                            const int nr = r1 - r < QG8_ROWS ? (int)(r1 - r) : QG8_ROWS;
                            group_rows8_pair(wt, wt + per, nb, au + r * k, sa + r * nb, sq + r * nb,
                                             k, nr, y + r * n + g * QG_LANES, n, lanes,
                                             group_lanes(n, g + 1));
                        }
                        break; /* both groups done */
                    }
#endif
                    (void)wg2;
                    for (int64_t r = r0; r < r1; r += QG8_ROWS) {
                        const int nr = r1 - r < QG8_ROWS ? (int)(r1 - r) : QG8_ROWS;
                        group_rows8(wt, f, nb, au + r * k, sa + r * nb, sq + r * nb, k, nr,
                                    y + r * n + g * QG_LANES, n, lanes);
                    }
                }
            }
        }
    }
    return 0;
}
#else
int qg_gemm8(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
             const float *sq, int64_t rows, float *y, int threads) {
    (void)w, (void)n, (void)k, (void)qa, (void)sa, (void)sq, (void)rows, (void)y, (void)threads;
    return 1;
}
#endif
