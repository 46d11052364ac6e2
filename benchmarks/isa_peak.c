/* The integer multiply-add peak of the instruction each kernel level builds its GEMM on: a loop
 * of independent instructions (12 accumulators, no memory traffic) on every thread, timed.
 * Built and called by isa_peak.py (cc -O2 -fopenmp -shared); each kind is compiled for its own
 * ISA with a target attribute and must only be called where the CPU has it.
 *
 *   kind 0  vpmaddwd ymm (AVX2: 16 int16 multiply-adds an instruction; the avx2 level adds a
 *           vpaddd per vpmaddwd, not counted here)
 *   kind 1  vpdpwssd ymm (AVX-VNNI: 16)
 *   kind 2  vpdpwssd zmm (AVX-512 VNNI: 32)
 *   kind 3  tdpbssd, 16 x 16 x 64 int8 (AMX: 16,384 int8 multiply-adds; the amx level's int16
 *           product takes two of them, so its int16 peak is half)
 *   kind 4  vfmadd231ps ymm (FMA: 8 fp32 multiply-adds; the C attention's dot products and
 *           weighted sums at the avx2 level)
 *   kind 5  vfmadd231ps zmm (AVX-512: 16 fp32; the attention at the avx512 and amx levels)
 * Returns multiply-adds per second over all threads (int8 ones for kind 3, fp32 for 4 and 5), or
 * -1 for an unknown kind or where the AMX tiles are refused.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define LOOP(T, INIT, OP, SINK)                                         \
    T a[12];                                                            \
    for (int i = 0; i < 12; i++) a[i] = INIT;                           \
    for (long n = 0; n < iters; n++) {                                  \
        _Pragma("GCC unroll 12") /* the accumulators in registers */    \
        for (int i = 0; i < 12; i++) a[i] = OP;                         \
        __asm__ volatile("" : "+v"(w), "+v"(p));                        \
    }                                                                   \
    for (int i = 1; i < 12; i++) a[0] = SINK;                           \
    __asm__ volatile("" ::"v"(a[0]));

__attribute__((target("avx2"))) static void k_madd(long iters) {
    __m256i w = _mm256_set1_epi16(3), p = _mm256_set1_epi16(5);
    LOOP(__m256i, _mm256_setzero_si256(), _mm256_add_epi32(a[i], _mm256_madd_epi16(w, p)),
         _mm256_add_epi32(a[0], a[i]))
}

__attribute__((target("avx2,avxvnni"))) static void k_vnni256(long iters) {
    __m256i w = _mm256_set1_epi16(3), p = _mm256_set1_epi16(5);
    LOOP(__m256i, _mm256_setzero_si256(), _mm256_dpwssd_avx_epi32(a[i], w, p),
         _mm256_add_epi32(a[0], a[i]))
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void k_vnni512(long iters) {
    __m512i w = _mm512_set1_epi16(3), p = _mm512_set1_epi16(5);
    LOOP(__m512i, _mm512_setzero_si512(), _mm512_dpwssd_epi32(a[i], w, p),
         _mm512_add_epi32(a[0], a[i]))
}

__attribute__((target("avx2,fma"))) static void k_fma256(long iters) {
    __m256 w = _mm256_set1_ps(0.999f), p = _mm256_set1_ps(1e-3f);
    LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(w, a[i], p), _mm256_add_ps(a[0], a[i]))
}

__attribute__((target("avx512f"))) static void k_fma512(long iters) {
    __m512 w = _mm512_set1_ps(0.999f), p = _mm512_set1_ps(1e-3f);
    LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(w, a[i], p), _mm512_add_ps(a[0], a[i]))
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

__attribute__((target("amx-tile,amx-int8"))) static void k_amx(long iters) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("" ::"r"(&c) : "memory"); /* the configuration's stores happen first */
    _tile_loadconfig(&c);
    static const int8_t src[1024] __attribute__((aligned(64)));
    _tile_loadd(0, src, 64);
    _tile_loadd(1, src, 64);
    _tile_zero(2); /* tile numbers are pasted into the instruction: literals only */
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (long n = 0; n < iters / 6; n++) { /* six independent accumulators */
        _tile_dpbssd(2, 0, 1);
        _tile_dpbssd(3, 0, 1);
        _tile_dpbssd(4, 0, 1);
        _tile_dpbssd(5, 0, 1);
        _tile_dpbssd(6, 0, 1);
        _tile_dpbssd(7, 0, 1);
    }
    _tile_release();
}

double isa_peak(int kind, int threads, double seconds) {
    static const double per_instr[] = {16, 16, 32, 16 * 16 * 64, 8, 16};
    if (kind < 0 || kind > 5) return -1;
    if (kind == 3 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0) return -1;
    /* a first short run sizes the timed one */
    long iters = kind == 3 ? 60000 : 2000000;
    double best = 0;
    for (int round = 0; round < 2; round++) {
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            switch (kind) {
            case 0: k_madd(iters); break;
            case 1: k_vnni256(iters); break;
            case 2: k_vnni512(iters); break;
            case 4: k_fma256(iters); break;
            case 5: k_fma512(iters); break;
            default: k_amx(iters); break;
            }
        }
        const double dt = now() - t0;
        const double instr = (double)threads * (kind == 3 ? iters / 6 * 6 : iters * 12);
        best = instr * per_instr[kind] / dt;
        if (round == 0) iters = (long)(iters * (seconds / dt)) + 1;
    }
    return best;
}
