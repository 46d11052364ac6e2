/* Paged attention read straight from the K/V pool, every query row in one fixed order.
 *
 * A query at position p attends keys lo..p of its sequence (lo = 0, or p - window + 1 in a
 * sliding-window layer), read through its block table from the
 * pool [blocks][block_size][nkv][row] (bf16, fp32, or int8 rows with a scale: kvpool.h; widened to
 * fp32 as read, an int8 value as (float)q * scale). Keys are taken in
 * chunks of CH at fixed positions (chunk c holds keys [c*CH, c*CH + CH)), and for each query:
 *
 *   s[k]  = sum over d, in order, of fma(q[d] * scale, K[k][d], .)       (one chain per key)
 *   keys past p and before lo are masked; mc = max over the chunk (exact in any order)
 *   m'    = max(m, mc); alpha = e^(m - m'); p[k] = e^(s[k] - m')          (exp_le0, below)
 *   l     = l * alpha + tree sum of p                                     (fixed pairwise tree)
 *   O[d]  = O[d] * alpha, then fma(p[k], V[k][d], O[d]) for the chunk's keys lo..p in order
 *   the state restarts every SEG keys (a segment); the segments' states (m, l, O) are merged in
 *   order (merge_state), and out = O / l after the last
 *
 * Each step is one IEEE single-precision operation on values that depend only on the query, the
 * keys lo..p and the chunk and segment grids (chunks and segments holding none of them are
 * skipped, a masked key's value is never read), so a row's bits do not depend on which rows share
 * the call, how a prompt was cut into chunks, whether the row is a prefill or a decode, the
 * thread count or the vector width the compiler picked (no FMA contraction, no fast-math: the
 * build's flags). There is no gather into scratch and no padding of rows or keys, which the torch
 * path needs for its bits (attention.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attn_chunk.h" /* CH, QB, PV_VECS; one chunk's arithmetic per path (isa.h, kvpool.h) */

#define ROW_BLOCK 32 /* most query rows of one sequence in a work item */
#define PREFETCH 8   /* chunks ahead whose K/V rows are prefetched (a decode reads the pool cold) */
#define SEG 256      /* keys per segment: a row's state restarts at each, merged in order */
#define PAR_MIN 16   /* query-vector chunks in a call from which threads share the items */
#define FEW_ITEMS 2  /* items a thread below which prefill rows are split per segment too */

/* (m, l, o) <- (m, l, o) merged with a segment's (ms, ls, os): rescaled to the larger max. An
 * empty (m = -inf, l = 0, o = 0) state merged with S gives S exactly (e^0 = 1 in exp_le0). */
static void merge_state(float *m, float *l, float *o, float ms, float ls, const float *os,
                        int64_t hd) {
    const float mn = fmaxf(*m, ms), a = exp_le0(*m - mn), b = exp_le0(ms - mn);
    *l = fmaf(ls, b, *l * a);
    for (int64_t d = 0; d < hd; d++) o[d] = fmaf(os[d], b, o[d] * a);
    *m = mn;
}

/* The first key a query at position p reads: 0, or p - window + 1 in a window of window keys. */
static inline int64_t first_key(int64_t p, int64_t window) {
    return window > 0 && p >= window ? p - window + 1 : 0;
}

/* Query rows rows[0..nr) (all reading `table` for these keys) against KV head h: their g query
 * heads each, over the keys of segments seg0.. (every segment up to the rows' last key when parts
 * is NULL: the merged result, O / l, goes to out; else segment seg0 alone: row i's state (m, l,
 * O) per query head, hd + 2 floats each, goes to parts at slot[i]). A row reads its keys
 * first_key(pos, window)..pos; chunks before the rows' first key are not visited. */
static int attend_item(const float *q, float *out, float *parts, const int64_t *slot, int64_t nh,
                       int64_t g, int64_t hd, int64_t h, const void *kc, const void *vc, int kv,
                       int64_t bs, int64_t nkv, const int64_t *table, const int64_t *pos,
                       const int64_t *rows, int64_t nr, int64_t seg0, int64_t window, float scale,
                       int portable) {
    const int64_t nq = nr * g, nqp = (nq + QB - 1) / QB * QB;
    float *scr = malloc((size_t)(2 * hd * CH + (nqp + 2 * nq) * hd + 4 * nq) * sizeof(float));
    int64_t *rpos = malloc((size_t)(2 * nr) * sizeof(int64_t)), *rlo = rpos + nr;
    if (!scr || !rpos) {
        free(scr);
        free(rpos);
        return -1;
    }
    float *kt = scr, *vch = kt + hd * CH, *qs = vch + CH * hd, *acc = qs + nqp * hd;
    float *tacc = acc + nq * hd, *m = tacc + nq * hd, *l = m + nq, *tm = l + nq, *tl = tm + nq;
    int64_t maxpos = 0, minlo = INT64_MAX;
    for (int64_t i = 0; i < nr; i++) {
        rpos[i] = pos[rows[i]];
        rlo[i] = first_key(rpos[i], window);
        maxpos = rpos[i] > maxpos ? rpos[i] : maxpos;
        minlo = rlo[i] < minlo ? rlo[i] : minlo;
    }
    /* keys from the chunk of the rows' first key (or the segment's first): no chunk before it */
    const int64_t seg_lo = seg0 * SEG, rs = kv_row(kv, hd), esize = kv_esize(kv);
    const int64_t k_lo = minlo / CH * CH > seg_lo ? minlo / CH * CH : seg_lo;
    const int64_t k_hi = parts ? (seg_lo + SEG - 1 < maxpos ? seg_lo + SEG - 1 : maxpos) : maxpos;
    for (int64_t j = 0; j < nqp; j++) { /* vectors past nq repeat the last: scored, unused */
        int64_t jj = j < nq ? j : nq - 1, head = h * g + jj % g;
        const float *src = q + (rows[jj / g] * nh + head) * hd;
        for (int64_t d = 0; d < hd; d++) qs[j * hd + d] = src[d] * scale;
    }
    memset(acc, 0, (size_t)(2 * nq * hd) * sizeof(float)); /* acc and tacc */
    for (int64_t j = 0; j < nq; j++) m[j] = tm[j] = -INFINITY, l[j] = tl[j] = 0.0f;
    for (int64_t k0 = k_lo; k0 <= k_hi + CH; k0 += CH) {
        if (k0 > k_lo && (k0 % SEG == 0 || k0 > k_hi)) {
            /* a segment ends: merged into the total by every row with keys in it, then reset */
            if (parts) break;
            const int64_t seg_start = (k0 - 1) / SEG * SEG;
            for (int64_t j = 0; j < nq; j++) {
                if (rpos[j / g] < seg_start || rlo[j / g] >= k0) continue; /* none of its keys */
                merge_state(&tm[j], &tl[j], tacc + j * hd, m[j], l[j], acc + j * hd, hd);
                m[j] = -INFINITY, l[j] = 0.0f;
                memset(acc + j * hd, 0, (size_t)hd * sizeof(float));
            }
        }
        if (k0 > k_hi) break;
        const int64_t nk = k_hi - k0 + 1 < CH ? k_hi - k0 + 1 : CH;
        int64_t kb[CH];
        float ks[CH], vs[CH]; /* the keys' int8 scales (K, V) */
        /* later chunks' rows on their way to L2 meanwhile (into L1, the prefetches of a cold pool
         * stalled more than they hid: 16 decodes at 160 keys, 213 against 152 us a layer): at the
         * first chunk the next PREFETCH, then one a chunk */
        for (int64_t ahead = k0 == k_lo ? k0 : k0 + PREFETCH * CH; ahead <= k0 + PREFETCH * CH;
             ahead += CH) {
            const int64_t na = ahead > k_hi || ahead < minlo ? 0 /* the first chunk, past a window's start */
                               : k_hi - ahead + 1 < CH ? k_hi - ahead + 1 : CH;
            key_bases(table, bs, nkv, rs, h, ahead, na, kb);
            for (int64_t t = 0; t < na; t++) {
                const char *kr = (const char *)kc + kb[t] * esize;
                const char *vr = (const char *)vc + kb[t] * esize;
                for (int64_t b = 0; b < rs * esize; b += 64) {
                    __builtin_prefetch(kr + b, 0, 2);
                    __builtin_prefetch(vr + b, 0, 2);
                }
            }
        }
        /* keys before the rows' first (masked for every row; their blocks may be gone): the first
         * key's row, so that every row read is in the pool */
        const int64_t skip = minlo > k0 ? minlo - k0 : 0;
        key_bases(table, bs, nkv, rs, h, k0 + skip, nk - skip, kb + skip);
        for (int64_t k = 0; k < skip; k++) kb[k] = kb[skip];
        for (int64_t k = 0; k < CH; k++) {
            ks[k] = k < nk ? kv_scale(kc, kv, kb[k], hd) : 1.0f;
            vs[k] = k < nk ? kv_scale(vc, kv, kb[k], hd) : 1.0f;
        }
        if (!VECTOR_UPDATE(hd, portable) || nq > QB / 2) /* else chunk_update reads the pool */
            load_chunk(kt, vch, kc, vc, kv, hd, kb, ks, vs, nk, portable);
        for (int64_t j0 = 0; j0 < nqp; j0 += QB)
            chunk_update(qs, kt, vch, kc, vc, kv, kb, ks, vs, nk, hd, j0, nq, g, rpos, rlo, k0, m, l,
                         acc, portable);
    }
    for (int64_t j = 0; j < nq; j++) {
        if (parts) {
            float *dst = parts + (slot[j / g] * g + j % g) * (hd + 2);
            dst[0] = m[j], dst[1] = l[j];
            memcpy(dst + 2, acc + j * hd, (size_t)hd * sizeof(float));
            continue;
        }
        float *dst = out + (rows[j / g] * nh + h * g + j % g) * hd;
        for (int64_t d = 0; d < hd; d++) dst[d] = tacc[j * hd + d] / tl[j];
    }
    free(scr);
    free(rpos);
    return 0;
}

/* A split row's full segment, keyed by the blocks holding it: rows whose keys there sit in the
 * same blocks (a shared prefix) are attended together, reading each chunk once. */
typedef struct {
    int64_t seg, row;
    const int64_t *blocks;
    int64_t nblocks;
} seg_key;

static int cmp_seg_key(const void *pa, const void *pb) {
    const seg_key *a = pa, *b = pb;
    if (a->seg != b->seg) return a->seg < b->seg ? -1 : 1;
    if (a->nblocks != b->nblocks) return a->nblocks < b->nblocks ? -1 : 1;
    int c = memcmp(a->blocks, b->blocks, (size_t)a->nblocks * sizeof(int64_t));
    if (c) return c;
    return a->row < b->row ? -1 : a->row > b->row;
}

typedef struct {
    int64_t first, nr, seg; /* rows order[first .. first + nr); seg -1: every segment, merged */
} work_item;

/* Whether row r is split into an item per segment: a lone row of its sequence (a decode) with
 * keys in more than one segment, when threads share the call. */
static int split_row(const int64_t *seq, const int64_t *pos, int64_t n, int64_t r, int64_t window,
                     int threads) {
    return threads > 1 && pos[r] / SEG > first_key(pos[r], window) / SEG &&
           (r == 0 || seq[r - 1] != seq[r]) && (r + 1 == n || seq[r + 1] != seq[r]);
}

/* End of the group of rows from r (consecutive rows of one sequence, at most ROW_BLOCK; a
 * padding row alone). */
static int64_t group_end(const int64_t *seq, int64_t n, int64_t r) {
    int64_t e = r + 1;
    while (seq[r] >= 0 && e < n && e - r < ROW_BLOCK && seq[e] == seq[r]) e++;
    return e;
}

/* The first and last segments holding keys of rows [r, e). */
static void group_segments(const int64_t *pos, int64_t r, int64_t e, int64_t window, int64_t *lo,
                           int64_t *hi) {
    *lo = INT64_MAX, *hi = 0;
    for (int64_t i = r; i < e; i++) {
        *hi = pos[i] / SEG > *hi ? pos[i] / SEG : *hi;
        *lo = first_key(pos[i], window) / SEG < *lo ? first_key(pos[i], window) / SEG : *lo;
    }
}

/* Whether the group of several rows [r, e) is split into an item per segment (each row's state
 * per segment, merged after as a decode's are): when the call has too few items to keep its
 * threads busy (a warm prompt's short tail over a long cached context: one group a KV head, and
 * a model with one or a few KV heads) and the rows' keys lie in more than one segment. */
static int split_group(const int64_t *pos, int64_t r, int64_t e, int64_t window, int few) {
    if (!few || e - r < 2) return 0;
    int64_t lo, hi;
    group_segments(pos, r, e, window, &lo, &hi);
    return hi > lo;
}

/* 0 when every block the rows read (those of keys first_key(pos, window)..pos) is in their
 * tables and the pool, else -2. */
int attn_check_tables(int64_t n, int64_t bs, int64_t pool_blocks, const int64_t *tables,
                      int64_t tstride, const int64_t *seq, const int64_t *pos, int64_t window) {
    if (window < 0) return -2;
    for (int64_t r = 0; r < n; r++) {
        if (seq[r] < 0) continue;
        if (pos[r] < 0 || pos[r] / bs >= tstride) return -2;
        for (int64_t b = first_key(pos[r], window) / bs; b <= pos[r] / bs; b++)
            if (tables[seq[r] * tstride + b] < 0 || tables[seq[r] * tstride + b] >= pool_blocks)
                return -2;
    }
    return 0;
}

/* q, out: [n][nh][hd] fp32. Row i attends keys first_key(pos[i], window)..pos[i] (window 0: from
 * key 0) of sequence seq[i], whose block table
 * is tables[seq[i] * tstride ...]; a row with seq[i] < 0 is padding and gets zeros. K/V pools:
 * [blocks][bs][nkv][kv_row(kv, hd)] of kind kv (kvpool.h).
 *
 * Consecutive rows of one sequence (a prefill chunk) share a work item per KV head, up to
 * ROW_BLOCK rows. A lone row (a decode) with keys in several segments, when threads share the
 * call, gets an item per segment instead, and decodes whose segment lies in the same blocks (a
 * shared prefix) share that segment's item: each chunk is read and transposed once for all of
 * them (cascade attention, with each row's arithmetic unchanged). Split rows' segment states are
 * merged after, in segment order: what an item merging them inline gives, to the bit. The tables
 * must cover the rows (attn_check_tables). Returns 0, or -1 when memory ran out. */
int attn_rows(const float *q, int64_t n, int64_t nh, int64_t nkv, int64_t hd, const void *k_cache,
              const void *v_cache, int kv, int64_t bs, const int64_t *tables, int64_t tstride,
              const int64_t *seq, const int64_t *pos, int64_t window, float scale, float *out,
              int threads, int portable) {
    const int64_t g = nh / nkv, per = g * (hd + 2); /* a row's partial state for one KV head */
    int64_t nkeys = 0, work = 0, groups = 0; /* nkeys: split rows' segments (each a partial state slot) */
    for (int64_t r = 0; r < n; r++) {
        if (seq[r] < 0) continue;
        work += g * ((pos[r] - first_key(pos[r], window)) / CH + 1);
        if (split_row(seq, pos, n, r, window, threads)) nkeys += pos[r] / SEG + 1;
    }
    for (int64_t r = 0; r < n; r = group_end(seq, n, r)) groups += seq[r] >= 0;
    const int few = threads > 1 && groups * nkv < (int64_t)FEW_ITEMS * threads;
    for (int64_t r = 0, e; r < n; r = e) {
        e = group_end(seq, n, r);
        if (seq[r] >= 0 && split_group(pos, r, e, window, few))
            for (int64_t i = r; i < e; i++) nkeys += pos[i] / SEG + 1;
    }
    /* rows in item order, each row's first partial slot (-1: not split), the items */
    int64_t *order = malloc((size_t)(n + nkeys + 1) * sizeof(int64_t));
    int64_t *base = malloc((size_t)(n + 1) * sizeof(int64_t));
    seg_key *keys = malloc((size_t)(nkeys + 1) * sizeof(seg_key));
    work_item *items = malloc((size_t)(n + nkeys + 1) * sizeof(work_item));
    float *parts = nkeys ? malloc((size_t)(nkeys * nkv * per) * sizeof(float)) : NULL;
    if (!order || !base || !keys || !items || (nkeys && !parts)) {
        free(order), free(base), free(keys), free(items), free(parts);
        return -1;
    }
    int64_t no = 0, ni = 0, nk = 0, next_slot = 0;
    for (int64_t r = 0, e; r < n; r = e) {
        e = group_end(seq, n, r);
        for (int64_t i = r; i < e; i++) base[i] = -1;
        if (seq[r] < 0) {
            memset(out + r * nh * hd, 0, (size_t)(nh * hd) * sizeof(float));
            continue;
        }
        if (split_group(pos, r, e, window, few)) { /* an item per segment, of the rows with keys in it */
            int64_t lo, hi;
            group_segments(pos, r, e, window, &lo, &hi);
            for (int64_t i = r; i < e; i++) {
                base[i] = next_slot;
                next_slot += pos[i] / SEG + 1;
            }
            for (int64_t s = lo; s <= hi; s++) {
                const int64_t first = no;
                for (int64_t i = r; i < e; i++)
                    if (first_key(pos[i], window) / SEG <= s && s <= pos[i] / SEG) order[no++] = i;
                if (no > first) items[ni++] = (work_item){first, no - first, s};
            }
            continue;
        }
        if (!split_row(seq, pos, n, r, window, threads)) { /* one item: every segment, merged */
            items[ni++] = (work_item){no, e - r, -1};
            for (int64_t i = r; i < e; i++) order[no++] = i;
            continue;
        }
        base[r] = next_slot;
        const int64_t segs = pos[r] / SEG + 1;
        next_slot += segs;
        for (int64_t s = first_key(pos[r], window) / SEG; s < segs; s++) { /* those with its keys */
            if (pos[r] < (s + 1) * SEG - 1 || first_key(pos[r], window) > s * SEG) {
                /* the last segment, partly filled, or a window's first, partly read: alone */
                items[ni++] = (work_item){no, 1, s};
                order[no++] = r;
                continue;
            }
            const int64_t b0 = s * SEG / bs, b1 = ((s + 1) * SEG - 1) / bs;
            keys[nk++] = (seg_key){s, r, tables + seq[r] * tstride + b0, b1 - b0 + 1};
        }
    }
    qsort(keys, (size_t)nk, sizeof(seg_key), cmp_seg_key);
    for (int64_t i = 0, e; i < nk; i = e) { /* groups of rows sharing a segment's blocks */
        e = i + 1;
        while (e < nk && e - i < ROW_BLOCK && keys[e].seg == keys[i].seg &&
               keys[e].nblocks == keys[i].nblocks &&
               !memcmp(keys[e].blocks, keys[i].blocks, (size_t)keys[i].nblocks * sizeof(int64_t)))
            e++;
        items[ni++] = (work_item){no, e - i, keys[i].seg};
        for (int64_t k = i; k < e; k++) order[no++] = keys[k].row;
    }
    int err = 0;
    const int par = threads > 1 && work * nkv >= PAR_MIN;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (par) reduction(| : err)
    for (int64_t it = 0; it < ni * nkv; it++) {
        const work_item w = items[it / nkv];
        const int64_t h = it % nkv, *rows = order + w.first;
        int64_t slot_buf[ROW_BLOCK];
        for (int64_t i = 0; w.seg >= 0 && i < w.nr; i++)
            slot_buf[i] = (base[rows[i]] + w.seg) * nkv + h;
        const int64_t r0 = rows[0];
        const int64_t *table = tables + seq[r0] * tstride;
        err |= attend_item(q, out, w.seg < 0 ? NULL : parts, slot_buf, nh, g, hd, h, k_cache,
                           v_cache, kv, bs, nkv, table, pos, rows, w.nr,
                           w.seg < 0 ? 0 : w.seg, window, scale, portable);
    }
    /* split rows: their segments' states merged in order, as attend_item merges them inline */
    for (int64_t r = 0; r < n && !err; r++) {
        if (seq[r] < 0 || base[r] < 0) continue;
        for (int64_t h = 0; h < nkv; h++)
            for (int64_t j = 0; j < g; j++) {
                float tm = -INFINITY, tl = 0.0f, *o = out + (r * nh + h * g + j) * hd;
                memset(o, 0, (size_t)hd * sizeof(float));
                for (int64_t s = first_key(pos[r], window) / SEG; s <= pos[r] / SEG; s++) {
                    const float *st = parts + ((base[r] + s) * nkv + h) * per + j * (hd + 2);
                    merge_state(&tm, &tl, o, st[0], st[1], st + 2, hd);
                }
                for (int64_t d = 0; d < hd; d++) o[d] = o[d] / tl;
            }
    }
    free(order), free(base), free(keys), free(items), free(parts);
    return err ? -1 : 0;
}

/* attn_rows on tables checked first: -2 (nothing computed) when a row's keys reach past its
 * block table or a block id is outside the pool's pool_blocks. */
int attn_paged(const float *q, int64_t n, int64_t nh, int64_t nkv, int64_t hd, const void *k_cache,
               const void *v_cache, int kv, int64_t bs, int64_t pool_blocks,
               const int64_t *tables, int64_t tstride, const int64_t *seq, const int64_t *pos,
               int64_t window, float scale, float *out, int threads, int portable) {
    if (attn_check_tables(n, bs, pool_blocks, tables, tstride, seq, pos, window)) return -2;
    return attn_rows(q, n, nh, nkv, hd, k_cache, v_cache, kv, bs, tables, tstride, seq, pos,
                     window, scale, out, threads, portable);
}
