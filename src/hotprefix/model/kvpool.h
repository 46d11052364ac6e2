/* A KV pool's element type, as the C kernels take it (their `kv` argument; kv_dtype.py):
 *   KV_FP32  rows of hd floats;
 *   KV_BF16  rows of hd bf16 values (the high half of a float);
 *   KV_INT8  rows of hd int8 values then the row's float32 scale (KV_INT8_EXTRA bytes), read back
 *            as (float)q * scale: one IEEE multiply, the same in every ISA path.
 * A pool is [blocks][block_size][nkv][kv_row(kv, hd)] elements of kv_esize(kv) bytes.
 */
#ifndef HP_KVPOOL_H
#define HP_KVPOOL_H

#include <stdint.h>
#include <string.h>

#define KV_FP32 0
#define KV_BF16 1
#define KV_INT8 2
#define KV_INT8_EXTRA 4

/* Elements of one (token, KV head) row of a pool of kind kv. */
static inline int64_t kv_row(int kv, int64_t hd) { return kv == KV_INT8 ? hd + KV_INT8_EXTRA : hd; }

/* Bytes of one element. */
static inline int kv_esize(int kv) { return kv == KV_FP32 ? 4 : kv == KV_BF16 ? 2 : 1; }

/* The scale of the int8 row starting at element `row` (1 for the other kinds: unused). */
static inline float kv_scale(const void *cache, int kv, int64_t row, int64_t hd) {
    if (kv != KV_INT8) return 1.0f;
    float s;
    memcpy(&s, (const int8_t *)cache + row + hd, sizeof s);
    return s;
}

#endif
