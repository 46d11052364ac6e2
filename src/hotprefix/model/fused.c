/* Fused row-wise kernels of the decoder's elementwise work (see fused.py).
 *
 * Every row is computed by the same sequence of IEEE operations whatever the number of rows, the
 * thread count or the vector width the compiler picks: sums run in LANES fixed lanes (lane j takes
 * the elements j, j + LANES, ...) combined by a fixed tree, and the build turns off FMA
 * contraction, so the bits are those of the C source on every x86 or ARM CPU. Rows are split
 * over threads only when there are many of them; a row's arithmetic is the same either way.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kvpool.h"

#define LANES 16
#define PAR_MIN_ROWS 32 /* fewer rows run on the calling thread */

static float sum_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[k + j] * x[k + j];
    for (int j = 0; k < n; k++, j++) acc[j] += x[k] * x[k];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* h[r] += d[r] (when d is not NULL), then out[r] = h[r] / sqrt(mean(h[r]^2) + eps) * w. */
void add_rms_norm(float *h, const float *d, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PAR_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * dim;
        if (d) {
            const float *y = d + r * dim;
            for (int64_t i = 0; i < dim; i++) x[i] = x[i] + y[i];
        }
        float inv = 1.0f / sqrtf(sum_squares(x, dim) / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = (x[i] * inv) * w[i];
    }
}

/* Each of `heads` heads of hd values at column lo of every row (rows of `width` floats) <- its
 * RMSNorm times w, in place: add_rms_norm's arithmetic on each head (QK-norm). */
void head_rms_norm(float *x, int64_t rows, int64_t width, int64_t lo, int64_t heads, int64_t hd,
                   const float *w, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PAR_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * width + lo + h * hd;
            float inv = 1.0f / sqrtf(sum_squares(v, hd) / (float)hd + eps);
            for (int64_t i = 0; i < hd; i++) v[i] = (v[i] * inv) * w[i];
        }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                    /* round to nearest even, as torch */
    return (uint16_t)(u >> 16);
}

/* out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[half:], x[:half]] (Hugging Face). */
static inline void rope(const float *x, const float *c, const float *s, float *out, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int64_t i = half; i < hd; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* One row of hd values -> int8 at dst: scale = absmax / 127, q = clamp(rint(x / scale), +-127),
 * the scale's bytes after the values (kv_dtype.quantize_int8: the same bits). Zeros (or a scale
 * that underflows to 0) store zeros and scale 0; a NaN or infinity stores zeros and a NaN scale. */
static inline void quantize_row_int8(const float *x, int8_t *dst, int64_t hd) {
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < hd; i++) {
        finite &= isfinite(x[i]) != 0;
        amax = fmaxf(amax, fabsf(x[i]));
    }
    float scale = amax / 127.0f;
    if (finite && scale > 0.0f) {
        for (int64_t i = 0; i < hd; i++) {
            float q = rintf(x[i] / scale);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            dst[i] = (int8_t)q;
        }
    } else {
        memset(dst, 0, (size_t)hd);
        if (!finite) scale = NAN;
    }
    memcpy(dst + hd, &scale, sizeof scale);
}

/* Row `row` (of kv_row elements) of a pool <- hd values, rounded to the pool's kind. */
static inline void store(void *cache, int kv, int64_t row, const float *x, int64_t hd) {
    if (kv == KV_BF16) {
        uint16_t *c = (uint16_t *)cache + row * hd;
        for (int64_t i = 0; i < hd; i++) c[i] = to_bf16(x[i]);
    } else if (kv == KV_INT8) {
        quantize_row_int8(x, (int8_t *)cache + row * (hd + KV_INT8_EXTRA), hd);
    } else {
        memcpy((float *)cache + row * hd, x, hd * sizeof(float));
    }
}

/* qkv [rows, (nh + 2 nkv) hd] fp32 -> q_out [rows, nh, hd] fp32 with RoPE; K (RoPE) and V of the
 * rows below n_slots with slot >= 0 written to the pool at slot (pool rows of nkv heads, of kind
 * kv). cos/sin are [n_pos, hd] tables. Returns the number of rows whose position is outside
 * them: those rows are skipped (nothing read or written), and the caller raises. */
int64_t rope_write_kv(const float *qkv, int64_t rows, int64_t nh, int64_t nkv, int64_t hd,
                      const float *cos_t, const float *sin_t, int64_t n_pos, const int64_t *pos,
                      float *q_out, void *k_cache, void *v_cache, int kv, const int64_t *slots,
                      int64_t n_slots, int threads) {
    int64_t width = (nh + 2 * nkv) * hd, bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PAR_MIN_ROWS) reduction(+ : bad)
    for (int64_t r = 0; r < rows; r++) {
        if (pos[r] < 0 || pos[r] >= n_pos) {
            bad++;
            continue;
        }
        const float *x = qkv + r * width;
        const float *c = cos_t + pos[r] * hd, *s = sin_t + pos[r] * hd;
        for (int64_t h = 0; h < nh; h++) rope(x + h * hd, c, s, q_out + (r * nh + h) * hd, hd);
        int64_t slot = r < n_slots ? slots[r] : -1;
        if (slot < 0) continue;
        float k[512];
        for (int64_t h = 0; h < nkv; h++) {
            rope(x + (nh + h) * hd, c, s, k, hd);
            store(k_cache, kv, slot * nkv + h, k, hd);
            store(v_cache, kv, slot * nkv + h, x + (nh + nkv + h) * hd, hd);
        }
    }
    return bad;
}

/* exp(x) by Cody-Waite range reduction and a degree-5 polynomial (Cephes expf): about 1 ulp,
 * plain IEEE operations only, so it vectorizes and gives the same bits everywhere. x is clamped
 * to [lo, hi] (EXP_LO, EXP_HI: see act_mul). */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504019f
static inline float exp_poly(float x, float hi, float lo) {
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick: plain adds, so the loop vectorizes */
    float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    x = x - fx * 0.693359375f;
    x = x - fx * -2.12194440e-4f;
    float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    int32_t e = (int32_t)fx + 127;
    uint32_t bits = (uint32_t)e << 23;
    float p;
    memcpy(&p, &bits, 4);
    return y * p;
}

/* GELU-tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) with tanh(y) = 1 - 2 / (e^2y + 1)
 * and exp_poly: plain IEEE operations, so the same bits on every CPU and level (torch's GELU, on
 * SLEEF's tanh, rounds otherwise: the numerics tag says which ran). */
static inline float gelu_tanh(float x, float hi, float lo) {
    float y = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    float t = 1.0f - 2.0f / (exp_poly(2.0f * y, hi, lo) + 1.0f);
    return (0.5f * x) * (1.0f + t);
}

/* gu [rows, 2 inter] (gate then up) -> out [rows, inter] = act(gate) * up, act 0: SiLU
 * (g / (1 + e^-g)), 1: GELU-tanh (Gemma's GeGLU) (qlinear.ACTIVATIONS' order).
 * exp's clamps are read through a volatile: with them as constants the compiler splits the loop
 * body into the two clamped paths (folded to constants) and the polynomial's, and, as FP
 * operations may trap (-ftrapping-math, the default), no longer vectorizes it: 7 ns a value on
 * one thread, against 1 vectorized for AVX2 and 2 for x86-64-v2, with the same bits (every gate's
 * bit pattern checked against the unvectorized build). One loop per activation: each vectorizes. */
void act_mul(const float *gu, float *out, int64_t rows, int64_t inter, int act, int threads) {
    volatile float clamp_hi = EXP_HI, clamp_lo = EXP_LO;
    const float hi = clamp_hi, lo = clamp_lo;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PAR_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        if (act == 1)
            for (int64_t i = 0; i < inter; i++) o[i] = gelu_tanh(g[i], hi, lo) * u[i];
        else
            for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i], hi, lo)) * u[i];
    }
}

/* gather_widen_kv: blocks of the K and V pools -> fp32. A large gather is split over threads by KV head in contiguous ranges, as
 * torch's attention splits its work, so each core writes the heads it then reads; a small one
 * (a decode step's: 1,024 keys took 70 us on one thread, 96 on two) runs on the calling thread,
 * block by block (a cold 192-key gather: 27-29 us against 36 head by head). */
#define GATHER_PAR_MIN (1 << 20) /* elements of K below which one thread gathers */

/* len elements at element offset src of a pool (bf16 or fp32) -> fp32 out; an int8 pool's rows
 * of hd values (src, len: whole rows of kv_row elements) -> float(q) * scale each. */
static inline void widen_run(const void *cache, int kv, int64_t hd, int64_t src, float *out,
                             int64_t len) {
    if (kv == KV_BF16) {
        const uint16_t *c = (const uint16_t *)cache + src;
        for (int64_t j = 0; j < len; j++) {
            uint32_t u = (uint32_t)c[j] << 16;
            memcpy(out + j, &u, 4);
        }
    } else if (kv == KV_INT8) {
        const int64_t rs = hd + KV_INT8_EXTRA;
        for (int64_t r = 0; r < len / rs; r++) {
            const int8_t *c = (const int8_t *)cache + src + r * rs;
            float scale;
            memcpy(&scale, c + hd, sizeof scale);
            for (int64_t j = 0; j < hd; j++) out[r * hd + j] = (float)c[j] * scale;
        }
    } else {
        memcpy(out, (const float *)cache + src, len * sizeof(float));
    }
}

/* Blocks table[0..n) of the K and V pools [blocks, bs, nkv, row] (kind kv) -> k_out, v_out
 * [n, bs, nkv, hd] fp32 (the threads: above). */
void gather_widen_kv(const void *k_cache, const void *v_cache, int kv, const int64_t *table,
                     int64_t n, int64_t bs, int64_t nkv, int64_t hd, float *k_out, float *v_out,
                     int threads) {
    const int64_t rs = kv_row(kv, hd), per = bs * nkv * hd, pin = bs * nkv * rs;
    if (n * per < GATHER_PAR_MIN) {
        /* whole blocks in turn: long contiguous runs (a decode's blocks are rarely in cache) */
        for (int64_t b = 0; b < n; b++) {
            if (table[b] < 0) continue; /* padding past the sequence: masked, left as is */
            widen_run(k_cache, kv, hd, table[b] * pin, k_out + b * per, pin);
            widen_run(v_cache, kv, hd, table[b] * pin, v_out + b * per, pin);
        }
        return;
    }
    int t = threads < nkv ? threads : (int)nkv;
    int64_t chunk = (nkv + t - 1) / t;
#pragma omp parallel for schedule(static, 1) num_threads(t) if (t > 1)
    for (int64_t part = 0; part < t; part++) {
        int64_t h0 = part * chunk, h1 = h0 + chunk < nkv ? h0 + chunk : nkv;
        if (h0 >= nkv) continue; /* more threads than head ranges (nkv = 5 on 4 threads) */
        for (int k = 0; k < 2; k++) {
            const void *cache = k ? v_cache : k_cache;
            float *out = k ? v_out : k_out;
            for (int64_t b = 0; b < n; b++) {
                if (table[b] < 0) continue; /* padding past the sequence: masked, left as is */
                for (int64_t s = 0; s < bs; s++) {
                    widen_run(cache, kv, hd, table[b] * pin + (s * nkv + h0) * rs,
                              out + b * per + (s * nkv + h0) * hd, (h1 - h0) * rs);
                }
            }
        }
    }
}
