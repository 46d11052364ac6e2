/* A decoder layer's work around attention in two calls, for the gguf weight mode (qlinear.py):
 * the same kernels, in the same order and on the same values, as the layer loop that calls them
 * one by one (llama.LlamaModel._layers_fused), so the same bits; what goes is the per-call cost
 * between them (a dozen Python-side calls and tensor allocations a layer).
 */
#include <stdint.h>
#include <stdlib.h>

void add_rms_norm(float *h, const float *d, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps, int threads);
int64_t rope_write_kv(const float *qkv, int64_t rows, int64_t nh, int64_t nkv, int64_t hd,
                      const float *cos_t, const float *sin_t, int64_t n_pos, const int64_t *pos,
                      float *q_out, void *k_cache, void *v_cache, int kv, const int64_t *slots,
                      int64_t n_slots, int threads);
void silu_mul(const float *gu, float *out, int64_t rows, int64_t inter, int threads);
int qg_linear(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
              int threads);

/* h += pending (when not NULL); x = RMSNorm(h) * norm; qkv = x W^T (+ bias); RoPE on q and k,
 * k and v written to the pools at slots, q to q_out [rows][nh][hd]. Returns rope_write_kv's count
 * of positions outside the tables, or -1 when scratch memory ran out (nothing written then). */
int64_t qg_layer_pre(float *h, const float *pending, const float *norm, float eps, int64_t rows,
                     int64_t dim, const uint8_t *w_qkv, const float *bias, int64_t nh,
                     int64_t nkv, int64_t hd, const float *cos_t, const float *sin_t, int64_t n_pos,
                     const int64_t *pos, float *q_out, void *k_cache, void *v_cache, int kv,
                     const int64_t *slots, int64_t n_slots, int threads) {
    const int64_t width = (nh + 2 * nkv) * hd;
    float *x = malloc((size_t)(rows * (dim + width)) * sizeof(float));
    if (!x) return -1;
    float *qkv = x + rows * dim;
    add_rms_norm(h, pending, norm, x, rows, dim, eps, threads);
    int64_t bad = -1;
    if (qg_linear(w_qkv, width, dim, x, rows, qkv, threads) == 0) {
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < width; j++) qkv[r * width + j] = qkv[r * width + j] + bias[j];
        bad = rope_write_kv(qkv, rows, nh, nkv, hd, cos_t, sin_t, n_pos, pos, q_out, k_cache,
                            v_cache, kv, slots, n_slots, threads);
    }
    free(x);
    return bad;
}

/* attn = o W_o^T; h += attn; x = RMSNorm(h) * norm; mlp_out = (SiLU(x W_g^T) * x W_u^T) W_d^T,
 * the residual add of mlp_out left to the next layer's norm. Returns -1 when scratch memory ran
 * out, else 0. */
int qg_layer_post(const float *o, int64_t o_dim, float *h, const float *norm, float eps,
                  int64_t rows, int64_t dim, const uint8_t *w_o, const uint8_t *w_gu, int64_t inter,
                  const uint8_t *w_down, float *mlp_out, int threads) {
    float *attn = malloc((size_t)(rows * (2 * dim + 3 * inter)) * sizeof(float));
    if (!attn) return -1;
    float *x = attn + rows * dim, *gu = x + rows * dim, *act = gu + rows * 2 * inter;
    int err = qg_linear(w_o, dim, o_dim, o, rows, attn, threads);
    if (!err) {
        add_rms_norm(h, attn, norm, x, rows, dim, eps, threads);
        err = qg_linear(w_gu, 2 * inter, dim, x, rows, gu, threads);
    }
    if (!err) {
        silu_mul(gu, act, rows, inter, threads);
        err = qg_linear(w_down, dim, inter, act, rows, mlp_out, threads);
    }
    free(attn);
    return err;
}

int attn_check_tables(int64_t n, int64_t bs, int64_t pool_blocks, const int64_t *tables,
                      int64_t tstride, const int64_t *seq, const int64_t *pos, int64_t window);
int attn_rows(const float *q, int64_t n, int64_t nh, int64_t nkv, int64_t hd, const void *k_cache,
              const void *v_cache, int kv, int64_t bs, const int64_t *tables, int64_t tstride,
              const int64_t *seq, const int64_t *pos, int64_t window, float scale, float *out,
              int threads, int portable);

/* Fields of a layer's row in qg_layers' table: pointers (as integers). */
enum { QL_IN_NORM, QL_POST_NORM, QL_QKV, QL_QKV_BIAS, QL_O, QL_GU, QL_DOWN, QL_K_CACHE, QL_V_CACHE,
       QL_FIELDS };

int64_t qg_layer_fields(void) { return QL_FIELDS; }

/* Every layer of a forward pass in one call: per layer qg_layer_pre, attn_rows and
 * qg_layer_post, then h += the last MLP output: the calls the Python layer loop makes, in its
 * order on the same values, so the same bits. rope_pos: each row's position for RoPE; seq and
 * attn_pos: the attention's rows. Returns 0, -1 when scratch memory ran out, -2 when a block
 * table does not cover its row (checked once, before any layer: nothing is written then), or the
 * count of positions outside the RoPE tables (h is then partly updated and the step must be
 * dropped). */
int64_t qg_layers(float *h, int64_t rows, int64_t dim, int64_t layers, const int64_t *table,
                  float eps, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, const float *cos_t,
                  const float *sin_t, int64_t n_pos, const int64_t *rope_pos, const int64_t *slots,
                  int64_t n_slots, int kv, int64_t bs, int64_t pool_blocks, const int64_t *tables,
                  int64_t tstride, const int64_t *seq, const int64_t *attn_pos, float scale,
                  int threads) {
    if (attn_check_tables(rows, bs, pool_blocks, tables, tstride, seq, attn_pos, 0))
        return -2; /* once for every layer: they read the same tables */
    float *q = malloc((size_t)(rows * (2 * nh * hd + dim)) * sizeof(float));
    if (!q) return -1;
    float *o = q + rows * nh * hd, *pending = o + rows * nh * hd;
    int64_t bad = 0;
    for (int64_t l = 0; l < layers && !bad; l++) {
        const int64_t *f = table + l * QL_FIELDS;
        void *kc = (void *)f[QL_K_CACHE], *vc = (void *)f[QL_V_CACHE];
        bad = qg_layer_pre(h, l ? pending : NULL, (const float *)f[QL_IN_NORM], eps, rows, dim,
                           (const uint8_t *)f[QL_QKV], (const float *)f[QL_QKV_BIAS], nh, nkv, hd, cos_t, sin_t, n_pos,
                           rope_pos, q, kc, vc, kv, slots, n_slots, threads);
        if (!bad)
            bad = attn_rows(q, rows, nh, nkv, hd, kc, vc, kv, bs, tables, tstride, seq, attn_pos,
                            0, scale, o, threads, 0); /* the plain Llama layer: no window */
        if (!bad && qg_layer_post(o, nh * hd, h, (const float *)f[QL_POST_NORM], eps, rows, dim,
                                  (const uint8_t *)f[QL_O], (const uint8_t *)f[QL_GU], inter,
                                  (const uint8_t *)f[QL_DOWN], pending, threads))
            bad = -1;
    }
    if (!bad && layers > 0)
        for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + pending[i];
    free(q);
    return bad;
}
