/* The GGUF-block GEMM of qgemm.c for narrow weights (8-bit activations, |qa| <= 127:
 * qgemm_layout.h's group_narrow) on AVX-512 VNNI's VPDPBUSD: 64 multiply-adds an instruction
 * where the int16 kernels' VPDPWSSD does 32. It runs where the AMX tiles do not (CPUs without
 * AMX; on AMX CPUs, steps of fewer rows than those take).
 *
 * The numerics are qgemm.c's, bit for bit. VPDPBUSD multiplies unsigned bytes by signed ones, so
 * a row's activations are stored as qa + 128 (0..255) and a block's weights as their int8 values
 * q (Q4 0..15, Q5 -16..31, Q6_K -32..31, Q8 -128..127; qgemm_layout.h's block_quads_512):
 * sum (qa + 128) q - 128 sum q = sum qa q = S exactly (|S| < 2^31), the 128 sum q of each lane
 * and block (Q6_K: of each half) worked out once per group. From S on, each output's float steps
 * are group_rows_c's, in its order, so a row's bits do not depend on this path: tests compare it
 * with the portable reference.
 *
 * Work: a group of 16 outputs is decoded once per span of rows into 8 rows of 64 bytes a block
 * (row kk: each lane's inputs 4kk .. 4kk + 3) with its scales and sums; then up to QG8_ROWS rows
 * at a time run over it, a row's 4 activation bytes broadcast into each VPDPBUSD.
 */
#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "qgemm_layout.h"
#include "scratch.h"

#ifdef HP_AVX512
#include <omp.h>

#define QG8_ROWS 6          /* rows sharing one pass over a decoded group */
#define QG8_SPAN 192        /* rows whose activation bytes stay in L2 while the groups stream */
#define QG8_PAR_MIN (1 << 17) /* multiply-adds below which one thread runs the product */

/* A group's nb blocks decoded: wt [nb][8][64] int8, then per block its d, m (block_scales_512) and
 * 128 x the sum of each lane's q over inputs 0-15 and 16-31 (int32), 4 vectors of 64 bytes. */
static void decode_group8(const uint8_t *wg, const int f, int64_t nb, int8_t *wt, __m512 *dv,
                          __m512 *mv, __m512i *clo, __m512i *chi) {
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
static void group_rows8(const int8_t *wt, const __m512 *dv, const __m512 *mv, const __m512i *clo,
                        const __m512i *chi, int f, int64_t nb, const uint8_t *au, const float *sa,
                        const float *sq, int64_t k, int nr, float *y, int64_t ldy, int lanes) {
    switch (f) { /* the two Q6_K-or-not epilogues, and the row count, as constants */
    case QF_K6: QG8_ROWS_OF(QF_K6)
    default: QG8_ROWS_OF(QF_Q4)
    }
}

/* qg_gemm (qgemm.c) for a narrow weight: y [rows][n] from qa (|qa| <= 127), sa, sq. Returns 0, -1
 * when scratch memory ran out (y untouched), or 1 where this build has no AVX-512 path. */
int qg_gemm8(const uint8_t *w, int64_t n, int64_t k, const int16_t *qa, const float *sa,
             const float *sq, int64_t rows, float *y, int threads) {
    const int64_t nb = k / QG_BLOCK, groups = (n + QG_LANES - 1) / QG_LANES;
    uint8_t *au = hp_scratch(SCR_VNNI8, (size_t)(rows * k));
    if (!au) return -1;
    const int team = rows * n * k >= QG8_PAR_MIN ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(team) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i += 32) {
            const __m512i q = _mm512_add_epi16(_mm512_loadu_si512(qa + r * k + i), _mm512_set1_epi16(128));
            _mm256_storeu_si256((__m256i *)(au + r * k + i), _mm512_cvtepi16_epi8(q));
        }
    const int64_t per = nb * (512 + 4 * 64); /* a thread's decoded group */
    int8_t *decoded = hp_scratch(SCR_VNNI8_DECODED, (size_t)(team * per));
    if (!decoded) return -1;
    int64_t span;
    const int64_t spans = even_spans(rows, QG8_SPAN, QG8_ROWS, &span);
#pragma omp parallel num_threads(team)
    {
        int8_t *wt = decoded + omp_get_thread_num() * per;
        __m512 *dv = (__m512 *)(wt + nb * 512), *mv = dv + nb;
        __m512i *clo = (__m512i *)(mv + nb), *chi = clo + nb;
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < spans; s++) {
            for (int64_t g = 0; g < groups; g++) {
                const int64_t r0 = s * span, r1 = r0 + span < rows ? r0 + span : rows;
                if (r0 >= r1) continue;
                const int lanes = group_lanes(n, g);
                int f;
                const uint8_t *wg = group_at(w, g, &f);
                decode_group8(wg, f, nb, wt, dv, mv, clo, chi);
                for (int64_t r = r0; r < r1; r += QG8_ROWS) {
                    const int nr = r1 - r < QG8_ROWS ? (int)(r1 - r) : QG8_ROWS;
                    group_rows8(wt, dv, mv, clo, chi, f, nb, au + r * k, sa + r * nb, sq + r * nb,
                                k, nr, y + r * n + g * QG_LANES, n, lanes);
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
