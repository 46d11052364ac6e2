/* The block GEMM's AVX2 path (HP_AVX2: AVX2 + FMA, with AVX-VNNI's vpdpwssd where the level has it),
 * included by qgemm.c in place of its AVX-512 path: group_rows over 256-bit vectors, and the
 * decode of a group's blocks once per span. The numerics are qgemm.c's (group_rows_c's order). */
#ifndef HP_QGEMM_AVX2_H
#define HP_QGEMM_AVX2_H

/* acc += the int16 pairs' products of w and p (vpdpwssd with AVX-VNNI, else vpmaddwd + vpaddd:
 * the same exact integer sums) */
#ifdef HP_AVXVNNI
#define QG_DOT(acc, w, p) _mm256_dpwssd_avx_epi32((acc), (w), (p))
#else
#define QG_DOT(acc, w, p) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (p)))
#endif


/* A group's nb blocks decoded to the AVX2 kernel's vectors, 32 a block (4- to 6-bit: chunk j's
 * lo0, hi0, lo1, hi1 at 4j .. 4j + 3; 8-bit: chunk j's two halves at 2j, 2j + 1), so that the
 * tiles of a span read them instead of each decoding them again. */
static void decode_group16(const uint8_t *wg, const int f, int64_t nb, __m256i *dec) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        __m256i *o = dec + 32 * b;
        if (fmt_bits(f) == 8)
            for (int j = 0; j < 16; j++) {
                o[2 * j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j)));
                o[2 * j + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j + 16)));
            }
        else
            for (int j = 0; j < 8; j++) decode_chunk_256(blk, f, j, &o[4 * j], &o[4 * j + 1], &o[4 * j + 2], &o[4 * j + 3]);
    }
}

/* group_rows_vnni on 256-bit vectors: a group's 16 lanes are two halves (lanes 0-7 from bytes
 * 0-15 of each 32-byte chunk, lanes 8-15 from bytes 16-31), both in registers for up to
 * QG_ROWS_AVX2 rows (a row's two sums, its broadcast pairs shared by them). The integer sums are
 * exact, the float steps per output those of group_rows_c, in its order. */
#define QG_ROWS_AVX2 4
static inline __attribute__((always_inline)) void group_rows_avx2(
    const uint8_t *wg, const int f, int64_t nb, const int16_t *qa, const float *sa,
    const float *sq, int64_t k, const int nr, float *y, int64_t ldy, int lanes, int fetch,
    const __m256i *dec) {
    const int bits = fmt_bits(f);
    const int64_t qbytes = fmt_qbytes(f);
    const int64_t ahead = QG_PREFETCH * (fmt_local(f) ? qbytes + fmt_scales(f) : qbytes + 40);
    __m256 acc[QG_ROWS_AVX2][2], lo[QG_ROWS_AVX2][2];
    __m256i u0[QG_ROWS_AVX2], u1[QG_ROWS_AVX2]; /* Q6_K: the sums of inputs 16-31, apart */
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        const int16_t *ab = qa + b * QG_BLOCK;
        if (fetch)
            for (int64_t off = 0; off < qbytes + fmt_scales(f); off += 64)
                _mm_prefetch((const char *)(blk + ahead + off), _MM_HINT_T0);
        __m256i s0[QG_ROWS_AVX2], s1[QG_ROWS_AVX2];
        for (int r = 0; r < nr; r++) s0[r] = s1[r] = u0[r] = u1[r] = _mm256_setzero_si256();
        if (bits != 8) {
            for (int j = 0; j < 8; j++) {
                __m256i lo0, hi0, lo1, hi1;
                if (dec) {
                    lo0 = dec[32 * b + 4 * j];
                    hi0 = dec[32 * b + 4 * j + 1];
                    lo1 = dec[32 * b + 4 * j + 2];
                    hi1 = dec[32 * b + 4 * j + 3];
                } else {
                    decode_chunk_256(blk, f, j, &lo0, &hi0, &lo1, &hi1);
                }
                for (int r = 0; r < nr; r++) {
                    int32_t p0, p1;
                    memcpy(&p0, ab + r * k + 2 * j, 4);
                    memcpy(&p1, ab + r * k + 2 * j + 16, 4);
                    const __m256i a0 = _mm256_set1_epi32(p0), a1 = _mm256_set1_epi32(p1);
                    if (f == QF_K6) {
                        s0[r] = QG_DOT(s0[r], lo0, a0);
                        u0[r] = QG_DOT(u0[r], hi0, a1);
                        s1[r] = QG_DOT(s1[r], lo1, a0);
                        u1[r] = QG_DOT(u1[r], hi1, a1);
                    } else {
                        s0[r] = QG_DOT(QG_DOT(s0[r], lo0, a0), hi0, a1);
                        s1[r] = QG_DOT(QG_DOT(s1[r], lo1, a0), hi1, a1);
                    }
                }
            }
            if (f == QF_K6)
                for (int r = 0; r < nr; r++) {
                    lo[r][0] = _mm256_cvtepi32_ps(s0[r]);
                    lo[r][1] = _mm256_cvtepi32_ps(s1[r]);
                    s0[r] = u0[r];
                    s1[r] = u1[r];
                }
        } else {
            for (int j = 0; j < 16; j++) {
                const __m256i w0 = dec ? dec[32 * b + 2 * j]
                                       : _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j)));
                const __m256i w1 = dec ? dec[32 * b + 2 * j + 1]
                                       : _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * j + 16)));
                for (int r = 0; r < nr; r++) {
                    int32_t p;
                    memcpy(&p, ab + r * k + 2 * j, 4);
                    const __m256i a = _mm256_set1_epi32(p);
                    s0[r] = QG_DOT(s0[r], w0, a);
                    s1[r] = QG_DOT(s1[r], w1, a);
                }
            }
        }
        __m256 d0, d1, m0, m1;
        block_scales_256(wg, blk, f, b, &d0, &d1, &m0, &m1);
        for (int r = 0; r < nr; r++) {
            const __m256 a = _mm256_set1_ps(sa[r * nb + b]);
            __m256 c0, c1;
            if (f == QF_K6) {
                c0 = _mm256_fmadd_ps(d0, lo[r][0], _mm256_mul_ps(m0, _mm256_cvtepi32_ps(s0[r])));
                c1 = _mm256_fmadd_ps(d1, lo[r][1], _mm256_mul_ps(m1, _mm256_cvtepi32_ps(s1[r])));
            } else {
                const __m256 q = _mm256_set1_ps(sq[r * nb + b]);
                c0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(s0[r]), _mm256_mul_ps(m0, q));
                c1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(s1[r]), _mm256_mul_ps(m1, q));
            }
            acc[r][0] = _mm256_fmadd_ps(a, c0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, c1, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        if (lanes == QG_LANES) {
            _mm256_storeu_ps(y + r * ldy, acc[r][0]);
            _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
        } else {
            float t[QG_LANES];
            _mm256_storeu_ps(t, acc[r][0]);
            _mm256_storeu_ps(t + 8, acc[r][1]);
            memcpy(y + r * ldy, t, (size_t)lanes * sizeof(float));
        }
    }
}

#define QG_CASE(F)                                                                        \
    switch (n) {                                                                          \
    case 1: group_rows_avx2(wg, F, nb, q, a, s, k, 1, out, ldy, lanes, fetch, dec); break; \
    case 2: group_rows_avx2(wg, F, nb, q, a, s, k, 2, out, ldy, lanes, fetch, dec); break; \
    case 3: group_rows_avx2(wg, F, nb, q, a, s, k, 3, out, ldy, lanes, fetch, dec); break; \
    default: group_rows_avx2(wg, F, nb, q, a, s, k, 4, out, ldy, lanes, fetch, dec); break; \
    }                                                                                     \
    break;
static void group_rows(const uint8_t *wg, int f, int64_t nb, const int16_t *qa,
                       const float *sa, const float *sq, int64_t k, int nr, float *y, int64_t ldy,
                       int lanes, int fetch, const __m256i *dec) {
    const int pass = f == QF_K6 ? 2 : QG_ROWS_AVX2; /* Q6_K keeps twice the sums a row */
    for (int r0 = 0; r0 < nr; r0 += pass) { /* the tile in passes of up to 4 rows */
        const int n = nr - r0 < pass ? nr - r0 : pass;
        const int16_t *q = qa + r0 * k;
        const float *a = sa + r0 * nb, *s = sq + r0 * nb;
        float *out = y + r0 * ldy;
        switch (f) {
        case QF_Q4: QG_CASE(QF_Q4)
        case QF_Q8: QG_CASE(QF_Q8)
        case QF_K4: QG_CASE(QF_K4)
        case QF_K5: QG_CASE(QF_K5)
        case QF_Q5: QG_CASE(QF_Q5)
        default: QG_CASE(QF_K6)
        }
        fetch = 0; /* the first pass brought the group's weights in */
    }
}

#endif
