/* Which vector path a build of the kernels compiles: the one ISA layer of the C sources.
 *
 * A build targets one level (fused.py picks it from the CPU's flags and passes -march for it):
 *   HP_AVX512  AVX-512 F/BW with VNNI (vpdpwssd): the widest paths; HP_AMX where the build also
 *              has AMX-TILE and AMX-INT8 (the prefill GEMM on tiles: qgemm_amx.c);
 *   HP_AVX2    AVX2 with FMA and F16C (x86-64-v3), and HP_AVXVNNI where the build also has
 *              AVX-VNNI (vpdpwssd on 256 bits);
 *   neither    the portable C path (x86-64-v2, or any other CPU; NEON would go here).
 * Every kernel keeps its portable C reference beside its vector paths, and every vector path gives
 * the reference's bits (integer sums are exact, float steps run in one fixed order, no FMA
 * contraction): tests build each level the machine can run and compare them.
 */
#ifndef HP_ISA_H
#define HP_ISA_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HP_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HP_AMX 1 /* AMX tiles (TDPBSSD / TDPBUSD) too: qgemm_amx.c, when the kernel grants them */
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HP_AVX2 1
#if defined(__AVXVNNI__)
#define HP_AVXVNNI 1
#endif
#endif

#if defined(HP_AVX512) || defined(HP_AVX2)
#include <immintrin.h>
#endif

#endif
