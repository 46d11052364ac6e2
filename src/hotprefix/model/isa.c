/* The level this build of the kernels compiled (isa.h), as fused.py names it. */
#include "isa.h"

const char *hp_isa_level(void) {
#if defined(HP_AMX)
    return "amx";
#elif defined(HP_AVX512)
    return "avx512";
#elif defined(HP_AVXVNNI)
    return "avxvnni";
#elif defined(HP_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}
