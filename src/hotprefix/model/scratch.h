/* Scratch memory the kernels keep from one call to the next (scratch.c): a buffer per call site
 * (slot) and calling thread, grown when a call needs more and kept until the thread ends, so a
 * prefill's activations land in pages already mapped instead of fresh ones from the kernel every
 * call (page faults took ~10% of a 1B prefill's CPU time). Slots never alias: a call that holds
 * one may call another slot's user. */
#ifndef HP_SCRATCH_H
#define HP_SCRATCH_H
#include <stddef.h>

enum {
    SCR_LINEAR,      /* qg_linear: the int16 activations and their block scales */
    SCR_GEMM_DECODED, /* qg_gemm: each thread's decoded group (a span of several tiles) */
    SCR_AMX,         /* qg_linear_amx: the same, and the activation tiles */
    SCR_AMX_DECODED, /* qg_linear_amx: each thread's decoded B tiles */
    SCR_A8,       /* qg_gemm8: the activations as unsigned bytes */
    SCR_A8_DECODED, /* qg_gemm8: each thread's decoded group */
    SCR_LAYER_PRE,   /* qg_layer_pre: the normed rows and Q/K/V */
    SCR_LAYER_POST,  /* qg_layer_post: attention's projection, normed rows, gate/up, the MLP input */
    SCR_LAYERS,      /* qg_layers: queries, attention output, the pending MLP output */
    SCR_SLOTS
};

/* At least `bytes` bytes, 64-byte aligned, of the calling thread's buffer for `slot` (its
 * contents are whatever the last call left), or NULL when memory ran out. */
void *hp_scratch(int slot, size_t bytes);

#endif
