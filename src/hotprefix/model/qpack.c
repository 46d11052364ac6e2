/* GGUF weight blocks -> the GGUF-block GEMM's packed layout (described at the top of qgemm.c),
 * written straight into the final buffer: the C port of gguf_blocks.pack_weight's loops (the
 * numpy code there stays as the reference the tests compare this with, byte for byte).
 *
 * The caller (gguf_blocks.pack_weight) decides each group's format and writes the buffer's table
 * of (offset << 4 | format); qg_pack fills every group it names, one group per OpenMP iteration.
 * Each lane (output row) of a group is read from its own tensor of the stack (Q/K/V, gate/up) in
 * that tensor's GGUF block type; rows past the stack's end are zeros. No value is re-quantized:
 * the values are the file's small integers, the scales its fp16 and 6-bit numbers (Q4_0's
 * M = -8 D and the k-quants' -dmin are exact in fp16, or overflow as numpy's conversion does).
 */
#include <stdint.h>
#include <string.h>

#include "qgemm_layout.h"

/* GGUF block types, as gguf_blocks.PACK_KINDS numbers them */
enum { GK_Q4_0, GK_Q4_1, GK_Q8_0, GK_Q5_0, GK_Q4_K, GK_Q5_K, GK_Q6_K, GK_KINDS };

static const int64_t gk_bytes[GK_KINDS] = {18, 20, 34, 22, 144, 176, 210};

/* fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN kept quiet (numpy's astype). */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or NaN */
        return sign | 0x7c00 | (ax > 0x7f800000u ? (uint16_t)(0x200 | ((ax >> 13) & 0x3ff)) : 0);
    if (ax >= 0x477ff000u) return sign | 0x7c00; /* rounds past 65504 */
    if (ax < 0x38800000u) { /* subnormal or zero in fp16 */
        if (ax < 0x33000000u) return sign; /* below half the smallest subnormal */
        const uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
        const uint32_t shift = 126 - e; /* 14..24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((ax >> 13) - (112u << 10));
    const uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* One 32-input block of a Q4_0 / Q4_1 / Q8_0 / Q5_0 row: q as decode() gives it (Q4: 0..15,
 * Q5_0: -16..15, Q8_0: int8), fp16 D and M. */
static void local_block(const uint8_t *b, int kind, int q[32], uint16_t *d, uint16_t *m) {
    *d = rd16(b);
    *m = 0;
    if (kind == GK_Q8_0) {
        for (int i = 0; i < 32; i++) q[i] = (int8_t)b[2 + i];
        return;
    }
    const uint8_t *qs = b + (kind == GK_Q4_0 ? 2 : kind == GK_Q4_1 ? 4 : 6);
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0f;
        q[i + 16] = qs[i] >> 4;
    }
    if (kind == GK_Q4_1) *m = rd16(b + 2);
    if (kind == GK_Q4_0) *m = float_to_half(half_to_float(*d) * -8.0f);
    if (kind == GK_Q5_0) {
        const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        for (int i = 0; i < 32; i++) q[i] = (q[i] | (int)((qh >> i) & 1) << 4) - 16;
    }
}

/* One 256-input super-block of a k-quant row: u (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63: the stored
 * value, before Q6_K's - 32), per 32-block s1, s2 (sc and mn; Q6_K: its two scales) and fp16 d,
 * d2 (-dmin; Q6_K: 0). */
static void k_super(const uint8_t *b, int kind, uint8_t u[256], int8_t s1[8], int8_t s2[8],
                    uint16_t *d, uint16_t *d2) {
    if (kind == GK_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 32; i++) {
                    const uint8_t lo = ql[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1)) & 0x0f;
                    u[128 * h + 32 * t + i] = lo | (uint8_t)(((qh[32 * h + i] >> (2 * t)) & 3) << 4);
                }
        for (int j = 0; j < 8; j++) {
            s1[j] = (int8_t)b[192 + 2 * j];
            s2[j] = (int8_t)b[193 + 2 * j];
        }
        *d = rd16(b + 208);
        *d2 = 0;
        return;
    }
    *d = rd16(b);
    *d2 = rd16(b + 2) ^ 0x8000; /* -dmin, exact */
    const uint8_t *s = b + 4;
    for (int j = 0; j < 4; j++) {
        s1[j] = (int8_t)(s[j] & 0x3f);
        s2[j] = (int8_t)(s[j + 4] & 0x3f);
        s1[j + 4] = (int8_t)((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
        s2[j + 4] = (int8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
    const uint8_t *qs = b + (kind == GK_Q5_K ? 48 : 16), *qh = b + 16;
    for (int i = 0; i < 4; i++)
        for (int x = 0; x < 32; x++) {
            u[64 * i + x] = qs[32 * i + x] & 0x0f;
            u[64 * i + 32 + x] = qs[32 * i + x] >> 4;
        }
    if (kind == GK_Q5_K)
        for (int sb = 0; sb < 8; sb++)
            for (int x = 0; x < 32; x++) u[32 * sb + x] |= (uint8_t)(((qh[x] >> sb) & 1) << 4);
}

/* Lane l's 32 values u (low nibbles used) into a 4-bit block's 256 bytes. */
static inline void put_nibbles(uint8_t *blk, int l, const uint8_t *u) {
    for (int j = 0; j < 8; j++)
        for (int e = 0; e < 2; e++)
            blk[32 * j + 2 * l + e] = (uint8_t)((u[2 * j + e] & 0x0f) | (u[2 * j + 16 + e] << 4));
}

/* Bit 4 of lane l's u into the two 32-byte planes of fifth bits at p. */
static inline void put_fifth(uint8_t *p, int l, const uint8_t *u) {
    for (int plane = 0; plane < 2; plane++)
        for (int e = 0; e < 2; e++) {
            uint8_t byte = 0;
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * plane + jj;
                byte |= (uint8_t)(((u[2 * j + e] >> 4) & 1) << (2 * jj));
                byte |= (uint8_t)(((u[2 * j + 16 + e] >> 4) & 1) << (2 * jj + 1));
            }
            p[32 * plane + 2 * l + e] = byte;
        }
}

/* Bits 4-5 of lane l's u into the four 32-byte planes of top bits at p. */
static inline void put_top_two(uint8_t *p, int l, const uint8_t *u) {
    for (int plane = 0; plane < 4; plane++)
        for (int e = 0; e < 2; e++) {
            uint8_t byte = 0;
            for (int jj = 0; jj < 2; jj++) {
                const int j = 2 * plane + jj;
                byte |= (uint8_t)(((u[2 * j + e] >> 4) & 3) << (4 * jj));
                byte |= (uint8_t)(((u[2 * j + 16 + e] >> 4) & 3) << (4 * jj + 2));
            }
            p[32 * plane + 2 * l + e] = byte;
        }
}

/* One group of a local format (QF_Q4, QF_Q8, QF_Q5): rows[l] is lane l's GGUF row (NULL: a
 * padding lane, zeros), kinds[l] its type. */
static void pack_local(uint8_t *wg, int f, const uint8_t *const rows[QG_LANES],
                       const int kinds[QG_LANES], int64_t nb) {
    const int64_t qb = fmt_qbytes(f), step = qb + fmt_scales(f);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = wg + b * step;
        for (int l = 0; l < QG_LANES; l++) {
            int q[32] = {0};
            uint16_t d = 0, m = 0;
            if (rows[l]) local_block(rows[l] + b * gk_bytes[kinds[l]], kinds[l], q, &d, &m);
            if (f == QF_Q8) {
                for (int i = 0; i < 32; i++) blk[32 * (i / 2) + 2 * l + i % 2] = (uint8_t)(int8_t)q[i];
            } else {
                uint8_t u[32];
                for (int i = 0; i < 32; i++) u[i] = (uint8_t)(f == QF_Q5 && rows[l] ? q[i] + 16 : q[i]);
                put_nibbles(blk, l, u);
                if (f == QF_Q5) put_fifth(blk + 256, l, u);
            }
            wr16(blk + qb + 2 * l, d);
            if (f != QF_Q5) wr16(blk + qb + 32 + 2 * l, m);
        }
    }
}

/* One group of a k-quant format (QF_K4, QF_K5, QF_K6), every lane of one type. */
static void pack_k(uint8_t *wg, int f, const uint8_t *const rows[QG_LANES],
                   const int kinds[QG_LANES], int64_t nb) {
    const int64_t qb = fmt_qbytes(f);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        uint8_t *sup = wg + sb * fmt_super(f);
        for (int l = 0; l < QG_LANES; l++) {
            uint8_t u[256] = {0};
            int8_t s1[8] = {0}, s2[8] = {0};
            uint16_t d = 0, d2 = 0;
            if (rows[l]) k_super(rows[l] + sb * gk_bytes[kinds[l]], kinds[l], u, s1, s2, &d, &d2);
            for (int j = 0; j < 8; j++) {
                uint8_t *blk = sup + j * (qb + 32);
                const uint8_t *uj = u + 32 * j;
                put_nibbles(blk, l, uj);
                if (f == QF_K5) put_fifth(blk + 256, l, uj);
                if (f == QF_K6) put_top_two(blk + 256, l, uj);
                blk[qb + l] = (uint8_t)s1[j];
                blk[qb + 16 + l] = (uint8_t)s2[j];
            }
            uint8_t *tail = sup + 8 * (qb + 32);
            wr16(tail + 2 * l, d);
            wr16(tail + 32 + 2 * l, d2);
        }
    }
}

/* Fill the groups of a packed buffer whose table (one int64 offset << 4 | format per group) the
 * caller wrote. Row r (< n) of the stack is row_ptr[r] (an address: row_kind[r]'s GGUF blocks of
 * k inputs); rows from n to groups * 16 are padding (zeros). One group per OpenMP iteration.
 * Returns 0, or -1 for a group whose format cannot hold its rows' types (its bytes then are
 * unspecified) or a k-quant row with k not a multiple of 256. */
int64_t qg_pack(uint8_t *out, int64_t groups, int64_t k, int64_t n, const int64_t *row_ptr,
                const int64_t *row_kind, int threads) {
    const int64_t nb = k / QG_BLOCK;
    int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1) reduction(+ : bad)
    for (int64_t g = 0; g < groups; g++) {
        int f;
        uint8_t *wg = out + (group_at(out, g, &f) - out);
        const uint8_t *rows[QG_LANES];
        int kinds[QG_LANES];
        int ok = f >= 0 && f < QF_FORMATS;
        for (int l = 0; l < QG_LANES; l++) {
            const int64_t r = g * QG_LANES + l;
            rows[l] = r < n ? (const uint8_t *)(intptr_t)row_ptr[r] : NULL;
            kinds[l] = r < n ? (int)row_kind[r] : -1;
            if (!rows[l]) continue;
            const int kd = kinds[l];
            if (kd < 0 || kd >= GK_KINDS) ok = 0;
            else if (f == QF_Q4) ok &= kd == GK_Q4_0 || kd == GK_Q4_1;
            else if (f == QF_Q5) ok &= kd == GK_Q5_0;
            else if (f == QF_Q8) ok &= kd < GK_Q4_K;
            else ok &= kd == GK_Q4_K + (f - QF_K4) && k % 256 == 0;
        }
        if (!ok) {
            bad++;
            continue;
        }
        if (fmt_local(f))
            pack_local(wg, f, rows, kinds, nb);
        else
            pack_k(wg, f, rows, kinds, nb);
    }
    return bad ? -1 : 0;
}
