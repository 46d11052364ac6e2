/* A decoder layer's work around attention in two calls, and a forward pass's layers in one, for
 * the gguf weight mode (qlinear.py): the same kernels, in the same order and on the same values,
 * as the layer loop that calls them one by one (arch.ops.FusedOps under a family's layer), so the
 * same bits; what goes is the per-call cost between them (a dozen Python-side calls and tensor
 * allocations a layer). The layer is the base one (arch/base.py) with what the families add:
 * Q/K/V bias, QK-norm (qwen3, gemma3), norms on the attention's and the MLP's outputs, a GELU-tanh
 * MLP and per-layer RoPE tables and sliding windows (gemma3); a NULL norm is one the layer lacks.
 */
#include <stdint.h>
#include <stdlib.h>

#include "scratch.h"

void add_rms_norm(float *h, const float *d, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps, int threads);
void head_rms_norm(float *x, int64_t rows, int64_t width, int64_t lo, int64_t heads, int64_t hd,
                   const float *w, float eps, int threads);
int64_t rope_write_kv(const float *qkv, int64_t rows, int64_t nh, int64_t nkv, int64_t hd,
                      const float *cos_t, const float *sin_t, int64_t n_pos, const int64_t *pos,
                      float *q_out, void *k_cache, void *v_cache, int kv, const int64_t *slots,
                      int64_t n_slots, int threads);
void act_mul(const float *gu, float *out, int64_t rows, int64_t inter, int act, int threads);
int qg_linear(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
              int threads);

/* h += pending (when not NULL); x = RMSNorm(h) * norm; qkv = x W^T (+ bias); QK-norm (each
 * head of q and k, when q_norm is not NULL); RoPE on q and k, k and v written to the pools at
 * slots, q to q_out [rows][nh][hd]. Returns rope_write_kv's count of positions outside the
 * tables, or -1 when scratch memory ran out (nothing written then). */
int64_t qg_layer_pre(float *h, const float *pending, const float *norm, float eps, int64_t rows,
                     int64_t dim, const uint8_t *w_qkv, const float *bias, const float *q_norm,
                     const float *k_norm, int64_t nh, int64_t nkv, int64_t hd, const float *cos_t,
                     const float *sin_t, int64_t n_pos, const int64_t *pos, float *q_out,
                     void *k_cache, void *v_cache, int kv, const int64_t *slots, int64_t n_slots,
                     int threads) {
    const int64_t width = (nh + 2 * nkv) * hd;
    float *x = hp_scratch(SCR_LAYER_PRE, (size_t)(rows * (dim + width)) * sizeof(float));
    if (!x) return -1;
    float *qkv = x + rows * dim;
    add_rms_norm(h, pending, norm, x, rows, dim, eps, threads);
    int64_t bad = -1;
    if (qg_linear(w_qkv, width, dim, x, rows, qkv, threads) == 0) {
        if (bias)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < width; j++) qkv[r * width + j] = qkv[r * width + j] + bias[j];
        if (q_norm) {
            head_rms_norm(qkv, rows, width, 0, nh, hd, q_norm, eps, threads);
            head_rms_norm(qkv, rows, width, nh * hd, nkv, hd, k_norm, eps, threads);
        }
        bad = rope_write_kv(qkv, rows, nh, nkv, hd, cos_t, sin_t, n_pos, pos, q_out, k_cache,
                            v_cache, kv, slots, n_slots, threads);
    }
    return bad;
}

#define MLP_ROWS 512 /* rows whose gate/up and MLP input the scratch holds at once (row-local work) */

/* attn = o W_o^T (then RMSNorm(attn) * attn_out_norm, when not NULL); h += attn;
 * x = RMSNorm(h) * norm; mlp_out = (act(x W_g^T) * x W_u^T) W_d^T (then RMSNorm(mlp_out) *
 * mlp_out_norm, when not NULL), the residual add of mlp_out left to the next layer's norm. The MLP
 * runs on MLP_ROWS rows at a time (every kernel is row-local: the same bits), so a long prefill's
 * scratch holds the gate/up of those rows only. Returns -1 when scratch memory ran out, else 0. */
int qg_layer_post(const float *o, int64_t o_dim, float *h, const float *norm,
                  const float *attn_out_norm, const float *mlp_out_norm, int act, float eps,
                  int64_t rows, int64_t dim, const uint8_t *w_o, const uint8_t *w_gu, int64_t inter,
                  const uint8_t *w_down, float *mlp_out, int threads) {
    const int64_t part = rows < MLP_ROWS ? rows : MLP_ROWS;
    float *attn = hp_scratch(SCR_LAYER_POST, (size_t)(2 * rows * dim + 3 * part * inter) * sizeof(float));
    if (!attn) return -1;
    float *x = attn + rows * dim, *gu = x + rows * dim, *up = gu + part * 2 * inter;
    int err = qg_linear(w_o, dim, o_dim, o, rows, attn, threads);
    if (!err) {
        if (attn_out_norm) add_rms_norm(attn, NULL, attn_out_norm, attn, rows, dim, eps, threads);
        add_rms_norm(h, attn, norm, x, rows, dim, eps, threads);
    }
    for (int64_t r = 0; r < rows && !err; r += part) {
        const int64_t nr = rows - r < part ? rows - r : part;
        err = qg_linear(w_gu, 2 * inter, dim, x + r * dim, nr, gu, threads);
        if (!err) {
            act_mul(gu, up, nr, inter, act, threads); /* act: 0 SiLU, 1 GELU-tanh */
            err = qg_linear(w_down, dim, inter, up, nr, mlp_out + r * dim, threads);
        }
    }
    if (!err && mlp_out_norm)
        add_rms_norm(mlp_out, NULL, mlp_out_norm, mlp_out, rows, dim, eps, threads);
    return err;
}

int attn_check_tables(int64_t n, int64_t bs, int64_t pool_blocks, const int64_t *tables,
                      int64_t tstride, const int64_t *seq, const int64_t *pos, int64_t window);
int attn_rows(const float *q, int64_t n, int64_t nh, int64_t nkv, int64_t hd, const void *k_cache,
              const void *v_cache, int kv, int64_t bs, const int64_t *tables, int64_t tstride,
              const int64_t *seq, const int64_t *pos, int64_t window, float scale, float *out,
              int threads, int portable);

/* Fields of a layer's row in qg_layers' table (pointers as integers; 0: a norm the layer lacks,
 * no bias). The weights and norms; the layer's RoPE tables [n_pos][hd]; its window (0: full);
 * its KV group's pools, slot mapping and attention rows (tables [seqs][tstride], seq, attn_pos:
 * attention.RowPlan), which layers of one group share. */
enum { QL_IN_NORM, QL_POST_NORM, QL_QKV, QL_QKV_BIAS, QL_O, QL_GU, QL_DOWN, QL_Q_NORM, QL_K_NORM,
       QL_ATTN_OUT_NORM, QL_MLP_OUT_NORM, QL_COS, QL_SIN, QL_N_POS, QL_WINDOW, QL_K_CACHE,
       QL_V_CACHE, QL_POOL_BLOCKS, QL_SLOTS, QL_N_SLOTS, QL_TABLES, QL_TSTRIDE, QL_SEQ,
       QL_ATTN_POS, QL_FIELDS };

int64_t qg_layer_fields(void) { return QL_FIELDS; }

#define F(f, type) ((type)row[f])

/* Every layer of a forward pass in one call: per layer qg_layer_pre, attn_rows and
 * qg_layer_post, then h += the last MLP output: the calls the Python layer loop makes, in its
 * order on the same values, so the same bits. rope_pos: each row's position for RoPE. Returns 0,
 * -1 when scratch memory ran out, -2 when a block table does not cover its row (checked for every
 * layer before any runs: nothing is written then), or the count of positions outside the RoPE
 * tables (h is then partly updated and the step must be dropped). */
int64_t qg_layers(float *h, int64_t rows, int64_t dim, int64_t layers, const int64_t *table,
                  float eps, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, int act,
                  const int64_t *rope_pos, int kv, int64_t bs, float scale, int threads) {
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *row = table + l * QL_FIELDS;
        if (attn_check_tables(rows, bs, row[QL_POOL_BLOCKS], F(QL_TABLES, const int64_t *),
                              row[QL_TSTRIDE], F(QL_SEQ, const int64_t *),
                              F(QL_ATTN_POS, const int64_t *), row[QL_WINDOW]))
            return -2;
    }
    float *q = hp_scratch(SCR_LAYERS, (size_t)(rows * (2 * nh * hd + dim)) * sizeof(float));
    if (!q) return -1;
    float *o = q + rows * nh * hd, *pending = o + rows * nh * hd;
    int64_t bad = 0;
    for (int64_t l = 0; l < layers && !bad; l++) {
        const int64_t *row = table + l * QL_FIELDS;
        void *kc = F(QL_K_CACHE, void *), *vc = F(QL_V_CACHE, void *);
        bad = qg_layer_pre(h, l ? pending : NULL, F(QL_IN_NORM, const float *), eps, rows, dim,
                           F(QL_QKV, const uint8_t *), F(QL_QKV_BIAS, const float *),
                           F(QL_Q_NORM, const float *), F(QL_K_NORM, const float *), nh, nkv, hd,
                           F(QL_COS, const float *), F(QL_SIN, const float *), row[QL_N_POS],
                           rope_pos, q, kc, vc, kv, F(QL_SLOTS, const int64_t *), row[QL_N_SLOTS],
                           threads);
        if (!bad)
            bad = attn_rows(q, rows, nh, nkv, hd, kc, vc, kv, bs, F(QL_TABLES, const int64_t *),
                            row[QL_TSTRIDE], F(QL_SEQ, const int64_t *),
                            F(QL_ATTN_POS, const int64_t *), row[QL_WINDOW], scale, o, threads, 0);
        if (!bad && qg_layer_post(o, nh * hd, h, F(QL_POST_NORM, const float *),
                                  F(QL_ATTN_OUT_NORM, const float *),
                                  F(QL_MLP_OUT_NORM, const float *), act, eps, rows, dim,
                                  F(QL_O, const uint8_t *), F(QL_GU, const uint8_t *), inter,
                                  F(QL_DOWN, const uint8_t *), pending, threads))
            bad = -1;
    }
    if (!bad && layers > 0)
        for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + pending[i];
    return bad;
}
