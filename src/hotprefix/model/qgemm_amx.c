/* The GGUF-block GEMM of qgemm.c on AMX tiles (Intel Sapphire Rapids and later), for prefill.
 *
 * The numerics are qgemm.c's, bit for bit. Its int16 activations split exactly into a signed high
 * byte and an unsigned low byte, qa = 256 hi + lo (hi in -128..127, lo in 0..255), and a block's
 * weights q (Q4 0..15, Q5 -16..31, Q6_K -32..31, Q8 -128..127) are int8. Two tile products per
 * 32-input block (TDPBSSD: hi x q, TDPBUSD: lo x q) give exact int32 sums, and
 * S = 256 S_hi + S_lo is the integer sum the int16 kernels make (|S| < 2^31). From S on, each
 * output's float steps are group_rows_c's, in its order (two FMAs and a product per block, blocks
 * in order), so a row's bits do not depend on the rows beside it, the tiling, the thread count or
 * whether this path ran: tests compare it with the portable reference.
 *
 * Narrow weights (8-bit activations, |qa| <= 127: qgemm_layout.h's group_narrow) need one tile
 * product a block (TDPBSSD: qa x q), so S comes from one C tile, and a deeper pipeline over two
 * sets of A and B tiles and four C tiles keeps the products apart from their stores.
 *
 * Work: a group of 16 outputs is decoded once per span of rows into int8 B tiles (8 rows of 64
 * bytes a block: row kk holds each lane's inputs 4kk .. 4kk + 3) with its blocks' float scales;
 * then 16 rows at a time run over it, the tile products of block b + 1 in flight while the float
 * steps of block b run (two sets of C tiles). Q6_K's scales change every 16 inputs: its blocks
 * take two B tiles (inputs 0-15 with rows 4-7 zero, 16-31 with rows 0-3 zero) and four C tiles.
 *
 * The tiles need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, once per process):
 * where it is refused (an old kernel, a hypervisor without AMX state), qg_amx_ready() says no and
 * qgemm.c runs its AVX-512 path, with the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "qgemm_layout.h"
#include "scratch.h"

#ifdef HP_AMX
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16  /* rows of an activation tile */
#define AMX_SPAN 256 /* rows whose split activations stay in L2 while a group's tiles are reused */
#define AMX_TILE 512 /* bytes of one B tile (8 rows of 64) */
#define AMX_ATILE 1024 /* bytes of one block of 16 rows' activations: high bytes, then low */
#define AMX_AHEAD 2 /* blocks ahead whose activation tiles are prefetched */
#define AMX_PAR_MIN (1 << 17) /* multiply-adds below which one thread runs the product */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* the tiles (plain numbers: the intrinsics paste them into the instruction): activations' high
 * and low bytes, one or two B tiles, four C tiles */
#define T_AHI 0
#define T_ALO 1
#define T_B 2
#define T_B2 3
#define T_C0 4
#define T_C1 5
#define T_C2 6
#define T_C3 7

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

int qg_amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

static void amx_config(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[T_AHI] = c.rows[T_ALO] = AMX_ROWS;
    c.colsb[T_AHI] = c.colsb[T_ALO] = QG_BLOCK; /* 32 int8 inputs a row */
    c.rows[T_B] = c.rows[T_B2] = QG_BLOCK / 4;
    c.colsb[T_B] = c.colsb[T_B2] = 4 * QG_LANES;
    for (int t = T_C0; t <= T_C3; t++) {
        c.rows[t] = AMX_ROWS;
        c.colsb[t] = 4 * QG_LANES; /* 16 int32 sums a row */
    }
    __asm__ volatile("" ::"r"(&c) : "memory"); /* the configuration's stores happen first */
    _tile_loadconfig(&c);
}

/* A group's nb blocks as B tiles (bt: nb tiles, Q6_K 2 nb: its inputs 0-15 with rows 4-7 zero,
 * then 16-31 with rows 0-3 zero) and each block's 16 lanes' float scales as the int16 kernels
 * compute them: w = d q + m (Q6_K: d for inputs 0-15, m for 16-31). */
static void decode_group(const uint8_t *wg, const int f, int64_t nb, int8_t *bt, __m512 *dv,
                         __m512 *mv) {
    const __m512i pair = quad_pairs();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = block_at(wg, f, b);
        int8_t *t = bt + (f == QF_K6 ? 2 : 1) * b * AMX_TILE;
        __m512i rows[8];
        block_quads_512(blk, f, pair, rows);
        if (f == QF_K6) {
            const __m512i z = _mm512_setzero_si512();
            for (int kk = 0; kk < 8; kk++) {
                _mm512_storeu_si512(t + 64 * kk, kk < 4 ? rows[kk] : z);
                _mm512_storeu_si512(t + AMX_TILE + 64 * kk, kk < 4 ? z : rows[kk]);
            }
        } else {
            for (int kk = 0; kk < 8; kk++) _mm512_storeu_si512(t + 64 * kk, rows[kk]);
        }
        block_scales_512(wg, blk, f, b, &dv[b], &mv[b]);
    }
}

/* S for 16 rows of stored C tiles: 256 hi + lo (16-bit activations, two tiles), or the one tile's
 * sums (narrow: 8-bit activations) */
static inline __m512i tile_sum(const int32_t *c, int r, const int narrow) {
    if (narrow) return _mm512_loadu_si512(c + 16 * r);
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c + 16 * r), 8),
                            _mm512_loadu_si512(c + 256 + 16 * r));
}

/* block B's two tile products (16-bit activations: high bytes x q, low bytes x q) into C tiles CH
 * and CL */
#define ISSUE(B, CH, CL)                                                       \
    do {                                                                       \
        _tile_loadd(T_AHI, at + (B) * AMX_ATILE, QG_BLOCK);                    \
        _tile_loadd(T_ALO, at + (B) * AMX_ATILE + AMX_ATILE / 2, QG_BLOCK);    \
        _tile_loadd(T_B, bt + (B) * AMX_TILE, 4 * QG_LANES);                   \
        _tile_zero(CH);                                                        \
        _tile_zero(CL);                                                        \
        _tile_dpbssd(CH, T_AHI, T_B);                                          \
        _tile_dpbusd(CL, T_ALO, T_B);                                          \
    } while (0)
#define STORE(CH, CL, BUF)                                                     \
    do {                                                                       \
        _tile_stored(CH, (BUF), 4 * QG_LANES);                                 \
        if (!narrow) _tile_stored(CL, (BUF) + 256, 4 * QG_LANES);              \
    } while (0)

/* The float steps of block b for 16 rows from its stored sums (c: S_hi, then S_lo, or the narrow
 * sums; Q6_K: c2 the inputs 16-31's), group_rows_c's: c = d S + m sq (Q6_K: d S_0-15 + m S_16-31),
 * acc += sa c. */
#define EPILOGUE(B, C, C2, K6)                                                                    \
    do {                                                                                          \
        const __m512 d = dv[B], m = mv[B];                                                        \
        _Pragma("GCC unroll 16") /* the 16 rows' sums stay in registers */                        \
        for (int r = 0; r < AMX_ROWS; r++) {                                                      \
            const __m512 s = _mm512_cvtepi32_ps(tile_sum(C, r, narrow));                          \
            const __m512 t = (K6)                                                                 \
                ? _mm512_fmadd_ps(d, s, _mm512_mul_ps(m, _mm512_cvtepi32_ps(tile_sum(C2, r, narrow)))) \
                : _mm512_fmadd_ps(d, s, _mm512_mul_ps(m, _mm512_set1_ps(sq[(B) * AMX_ROWS + r]))); \
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sa[(B) * AMX_ROWS + r]), t, acc[r]);          \
        }                                                                                         \
    } while (0)

/* Step I of the narrow pipeline: block I's tiles into A and B, its product into C; block I - 2's
 * sums (in CS) stored; block I - 3's float steps. */
#define STEP8(I, A, B, C, CS)                                                                     \
    do {                                                                                          \
        const int64_t i_ = (I); /* no prefetch: 9% faster without it here */                     \
        if (i_ < nb) {                                                                            \
            _tile_loadd(A, at + i_ * (AMX_ATILE / 2), QG_BLOCK);                                  \
            _tile_loadd(B, bt + i_ * AMX_TILE, 4 * QG_LANES);                                     \
            _tile_zero(C);                                                                        \
            _tile_dpbssd(C, A, B);                                                                \
        }                                                                                         \
        if (i_ >= 2 && i_ - 2 < nb) _tile_stored(CS, cb[(i_ - 2) % 3], 4 * QG_LANES);             \
        if (i_ >= 3 && i_ - 3 < nb) EPILOGUE(i_ - 3, cb[(i_ - 3) % 3], cb[0], 0);                 \
    } while (0)

/* 16 rows (at: their activation tiles, split_rows' layout; sa / sq: their first block's, stride nb)
 * against one decoded group: y's first nr rows, its first `lanes` outputs. The tile products of a
 * block are stored one step after they are issued and their float steps run one step after that,
 * so neither waits on the tiles' latency. narrow: the activations are 8-bit (one tile a block);
 * a constant at each call, so each kind gets its own copy of the loop. */
static inline __attribute__((always_inline)) void
tile_rows(const int8_t *bt, const __m512 *dv, const __m512 *mv, const int f, int64_t nb,
          const uint8_t *at, const float *sa, const float *sq, int nr, float *y, int64_t ldy,
          int lanes, const int narrow) {
    int32_t cb[3][1024] __attribute__((aligned(64))); /* stored C tiles of three blocks in flight */
    const int64_t atile = narrow ? AMX_ATILE / 2 : AMX_ATILE;
    __m512 acc[AMX_ROWS];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    if (f == QF_K6) { /* four C tiles a block (narrow: two): one set, stored before the next
                       * block's products */
        for (int64_t i = 0; i < nb + 2; i++) {
            if (i >= 1 && i - 1 < nb) {
                int32_t *c = cb[(i - 1) & 1];
                STORE(T_C0, T_C1, c);
                STORE(T_C2, T_C3, c + 512);
            }
            if (i < nb) {
                _tile_loadd(T_AHI, at + i * atile, QG_BLOCK);
                if (!narrow) _tile_loadd(T_ALO, at + i * atile + AMX_ATILE / 2, QG_BLOCK);
                _tile_loadd(T_B, bt + 2 * i * AMX_TILE, 4 * QG_LANES);
                _tile_loadd(T_B2, bt + (2 * i + 1) * AMX_TILE, 4 * QG_LANES);
                _tile_zero(T_C0);
                _tile_zero(T_C2);
                _tile_dpbssd(T_C0, T_AHI, T_B);
                _tile_dpbssd(T_C2, T_AHI, T_B2);
                if (!narrow) {
                    _tile_zero(T_C1);
                    _tile_zero(T_C3);
                    _tile_dpbusd(T_C1, T_ALO, T_B);
                    _tile_dpbusd(T_C3, T_ALO, T_B2);
                }
            }
            if (i >= 2) EPILOGUE(i - 2, cb[i & 1], cb[i & 1] + 512, 1);
        }
    } else if (narrow) { /* one tile product a block, a deeper pipeline: block i's tiles load into
                          * pair i % 2 and its product runs into C tile i % 4, its sums are stored
                          * two steps later and its float steps run one step after that */
        for (int64_t i = 0; i < nb + 3; i += 4) {
            STEP8(i, T_AHI, T_B, T_C0, T_C2);
            STEP8(i + 1, T_ALO, T_B2, T_C1, T_C3);
            STEP8(i + 2, T_AHI, T_B, T_C2, T_C0);
            STEP8(i + 3, T_ALO, T_B2, T_C3, T_C1);
        }
    } else { /* two sets of C tiles, three stored blocks: block i's products are issued, block
              * i - 2's float steps run, then block i - 1's sums are stored (its products had a
              * whole step to finish) */
        for (int64_t i = 0; i < nb + 2; i++) {
            if (i + AMX_AHEAD < nb) /* the activation tiles stream from L2: fetch them ahead */
                for (int c = 0; c < atile; c += 64) _mm_prefetch((const char *)(at + (i + AMX_AHEAD) * atile + c), _MM_HINT_T0);
            if (i < nb) {
                if (i & 1)
                    ISSUE(i, T_C2, T_C3);
                else
                    ISSUE(i, T_C0, T_C1);
            }
            if (i >= 2) EPILOGUE(i - 2, cb[(i - 2) % 3], cb[0], 0);
            if (i >= 1 && i - 1 < nb) {
                if ((i - 1) & 1)
                    STORE(T_C2, T_C3, cb[(i - 1) % 3]);
                else
                    STORE(T_C0, T_C1, cb[(i - 1) % 3]);
            }
        }
    }
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    /* constant indices (unrolled, nr tested inside): acc stays in registers, not on the stack */
    _Pragma("GCC unroll 16")
    for (int r = 0; r < AMX_ROWS; r++)
        if (r < nr) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

/* qa [rows][k] -> the activation tiles: for each 16 rows and block b, AMX_ATILE bytes, the rows'
 * high bytes (int8, 16 x 32) then their low bytes (uint8, 16 x 32), qa = 256 hi + lo exactly: a
 * tile load reads 512 contiguous bytes. narrow (|qa| <= 127): AMX_ATILE / 2 bytes, the values
 * as int8. */
static void split_rows(const int16_t *qa, uint8_t *at, int64_t rows, int64_t k, int narrow,
                       int threads) {
    const int64_t nb = k / QG_BLOCK, atile = narrow ? AMX_ATILE / 2 : AMX_ATILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const __m512i q = _mm512_loadu_si512(qa + r * k + b * QG_BLOCK);
            uint8_t *t = at + ((r / AMX_ROWS) * nb + b) * atile + (r % AMX_ROWS) * QG_BLOCK;
            if (narrow) {
                _mm256_storeu_si256((__m256i *)t, _mm512_cvtepi16_epi8(q));
                continue;
            }
            _mm256_storeu_si256((__m256i *)t, _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
            _mm256_storeu_si256((__m256i *)(t + AMX_ATILE / 2), _mm512_cvtepi16_epi8(q));
        }
}

void qg_quantize_rows(const float *x, int16_t *qa, float *sa, float *sq, int64_t rows, int64_t k,
                      int narrow, int threads);

/* qg_linear (qgemm.c) on tiles: x [rows][k] fp32 -> y [rows][n]. Returns -1 when scratch memory
 * ran out (y untouched), else 0. The caller checks qg_amx_ready() first. */
int qg_linear_amx(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                  int threads) {
    const int64_t nb = k / QG_BLOCK, groups = (n + QG_LANES - 1) / QG_LANES;
    const int64_t padded = (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    /* qa [rows][k], the activation tiles of padded rows (zero past rows), sa and sq [padded][nb]
     * (zero past rows) */
    const size_t bytes = (size_t)(rows * k) * 2 + 2 * (size_t)(padded * k) + 4 * (size_t)(padded * nb) * 4;
    uint8_t *scratch = hp_scratch(SCR_AMX, bytes);
    if (!scratch) return -1;
    int16_t *qa = (int16_t *)scratch;
    uint8_t *at = scratch + (size_t)(rows * k) * 2;
    float *sa = (float *)(at + 2 * padded * k), *sq = sa + padded * nb;
    const int narrow = group_narrow(w);
    const int64_t atile = narrow ? AMX_ATILE / 2 : AMX_ATILE;
    if (padded > rows) /* the last tile's rows past `rows`: zero activations and scales */
        memset(at + (rows / AMX_ROWS) * nb * atile, 0, (size_t)(nb * atile));
    memset(sa + rows * nb, 0, (size_t)((padded - rows) * nb) * 4);
    memset(sq + rows * nb, 0, (size_t)((padded - rows) * nb) * 4);
    qg_quantize_rows(x, qa, sa, sq, rows, k, narrow, threads);
    split_rows(qa, at, rows, k, narrow, threads);
    /* the scales per tile of 16 rows, block-major: [tile][block][16 rows], the float steps' broadcasts
     * then read one line a block */
    float *st = sq + padded * nb, *qt = st + padded * nb;
    for (int64_t r = 0; r < padded; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = ((r / AMX_ROWS) * nb + b) * AMX_ROWS + r % AMX_ROWS;
            st[i] = sa[r * nb + b];
            qt[i] = sq[r * nb + b];
        }
    int64_t span;
    const int64_t spans = even_spans(padded, AMX_SPAN, AMX_ROWS, &span);
    /* each thread: one group's decoded tiles (Q6_K: two a block) and its blocks' scales */
    const int64_t per = 2 * nb * AMX_TILE + 2 * nb * 64;
    const int team = rows * n * k >= AMX_PAR_MIN ? threads : 1;
    int8_t *decoded = hp_scratch(SCR_AMX_DECODED, (size_t)(team * per));
    if (!decoded) return -1;
#pragma omp parallel num_threads(team)
    {
        int8_t *bt = decoded + omp_get_thread_num() * per;
        __m512 *dv = (__m512 *)(bt + 2 * nb * AMX_TILE), *mv = dv + nb;
        amx_config();
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < spans; s++) {
            for (int64_t g = 0; g < groups; g++) {
                const int64_t r0 = s * span, r1 = r0 + span < padded ? r0 + span : padded;
                const int lanes = group_lanes(n, g);
                int f;
                const uint8_t *wg = group_at(w, g, &f);
                decode_group(wg, f, nb, bt, dv, mv);
                for (int64_t r = r0; r < r1 && r < rows; r += AMX_ROWS) {
                    const int nr = rows - r < AMX_ROWS ? (int)(rows - r) : AMX_ROWS;
                    const uint8_t *a = at + (r / AMX_ROWS) * nb * atile;
                    if (narrow)
                        tile_rows(bt, dv, mv, f, nb, a, st + r * nb, qt + r * nb, nr,
                                  y + r * n + g * QG_LANES, n, lanes, 1);
                    else
                        tile_rows(bt, dv, mv, f, nb, a, st + r * nb, qt + r * nb, nr,
                                  y + r * n + g * QG_LANES, n, lanes, 0);
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int qg_amx_ready(void) { return 0; }
int qg_linear_amx(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                  int threads) {
    (void)w, (void)n, (void)k, (void)x, (void)rows, (void)y, (void)threads;
    return -1;
}
#endif
