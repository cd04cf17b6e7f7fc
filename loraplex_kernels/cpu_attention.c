/* Paged decode attention on CPU (fp32, or bf16 q, cache and out with fp32 arithmetic): one query token per
 * sequence over its KV pages, read in place. Loaded through ctypes by torch_ops.py, built together with the other
 * cpu_*.c loops. */
#include <math.h>

#include "cpu_common.h"

struct attention_args {
    const void *q, *k_cache, *v_cache; /* fp32, or bf16 when bf16 is set (out too) */
    void *out;
    float *scratch;
    int64_t bf16;
    const int32_t *block_tables, *context_lens;
    int64_t page_stride, token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim, block_size;
    int64_t scratch_per_thread, parts, window; /* window 0: full attention */
    float scale, softcap; /* softcap 0: no logit soft-capping */
    int64_t *next_item; /* shared counter: contexts differ in length, so threads claim items as they free up */
};

/* Two-vector lane shuffle with constant indices: clang and GCC >= 12 spell it __builtin_shufflevector, older
 * GCC __builtin_shuffle with a mask vector. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i8x8 __attribute__((vector_size(32)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i8x8){__VA_ARGS__})
#endif

/* Lane i of the result is the sum of v[i]'s lanes: eight horizontal sums for the price of about one. */
static inline f8 reduce8(const f8 v[8]) {
    f8 p[4], r[2];
    for (int i = 0; i < 4; ++i)
        p[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        r[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(r[0], r[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(r[0], r[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline __attribute__((always_inline)) f8 load8_as(const void *p, int64_t i, int bf16) {
    return bf16 ? load8_bf16((const bf16_t *)p + i) : load8((const float *)p + i);
}

/* out[t] = scale * (q . rows[t]) for 8 rows (d a multiple of 8): each chunk of q is loaded once for all. The
 * rows are bf16 when bf16 is set (a constant at each call site); q is fp32. */
static inline __attribute__((always_inline)) void dot8(const float *restrict q, const void *const rows[8], int64_t d,
                                                       float scale, float *out, int bf16) {
    f8 acc[8] = {{0}};
    for (int64_t j = 0; j < d; j += 8) {
        f8 qv = load8(q + j);
        for (int t = 0; t < 8; ++t) acc[t] += qv * load8_as(rows[t], j, bf16);
    }
    f8 r = reduce8(acc) * scale;
    __builtin_memcpy(out, &r, sizeof r);
}

/* out[0:d] += sum_t p[t] * rows[t][0:d] over m rows (d a multiple of 8): out is loaded and stored once per
 * 64 columns, not once per row. Rows as in dot8; out is fp32. */
static inline __attribute__((always_inline)) void weighted_sum(float *restrict out, const float *p,
                                                               const void *const *rows, int64_t m, int64_t d,
                                                               int bf16) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
        f8 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = load8(out + c + 8 * i);
        for (int64_t t = 0; t < m; ++t) {
            f8 w = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
            for (int i = 0; i < 8; ++i) acc[i] += w * load8_as(rows[t], c + 8 * i, bf16);
        }
        for (int i = 0; i < 8; ++i) __builtin_memcpy(out + c + 8 * i, &acc[i], sizeof acc[i]);
    }
    for (; c < d; c += 8) {
        f8 acc = load8(out + c);
        for (int64_t t = 0; t < m; ++t) acc += p[t] * load8_as(rows[t], c, bf16);
        __builtin_memcpy(out + c, &acc, sizeof acc);
    }
}

/* The bf16 versions of dot8 and weighted_sum: with AVX-512 BF16 (d % 32 == 0) q . k multiplies pairs of bf16 in
 * one instruction (q is exact in bf16, products are exact in fp32); the weighted sum widens 16 values at a time
 * (d % 16 == 0) and keeps p in fp32. Elsewhere the generic loops above. */
static inline void dot8_bf16(const float *restrict q_wide, const bf16_t *restrict q, const void *const rows[8],
                             int64_t d, float scale, float *out) {
#ifdef __AVX512BF16__
    if (d % 32 == 0) {
        f16 acc[8] = {{0}};
        for (int64_t j = 0; j < d; j += 32) {
            __m512bh qv;
            __builtin_memcpy(&qv, q + j, sizeof qv);
            for (int t = 0; t < 8; ++t) {
                __m512bh kv;
                __builtin_memcpy(&kv, (const bf16_t *)rows[t] + j, sizeof kv);
                acc[t] = (f16)_mm512_dpbf16_ps((__m512)acc[t], kv, qv);
            }
        }
        f8 halves[8];
        for (int t = 0; t < 8; ++t) {
            f8 lo, hi;
            __builtin_memcpy(&lo, &acc[t], sizeof lo);
            __builtin_memcpy(&hi, (const char *)&acc[t] + sizeof lo, sizeof hi);
            halves[t] = lo + hi;
        }
        f8 r = reduce8(halves) * scale;
        __builtin_memcpy(out, &r, sizeof r);
        return;
    }
#endif
    (void)q;
    dot8(q_wide, rows, d, scale, out, 1);
}

static void weighted_sum_bf16(float *restrict out, const float *p, const void *const *rows, int64_t m, int64_t d) {
    if (d % 16) {
        weighted_sum(out, p, rows, m, d, 1);
        return;
    }
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
        f16 acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = load16(out + c + 16 * i);
        for (int64_t t = 0; t < m; ++t)
            for (int i = 0; i < 4; ++i) acc[i] += p[t] * load16_bf16((const bf16_t *)rows[t] + c + 16 * i);
        for (int i = 0; i < 4; ++i) store16(out + c + 16 * i, acc[i]);
    }
    for (; c < d; c += 16) {
        f16 acc = load16(out + c);
        for (int64_t t = 0; t < m; ++t) acc += p[t] * load16_bf16((const bf16_t *)rows[t] + c);
        store16(out + c, acc);
    }
}

/* Work item (sequence b, part of its KV heads): each page's rows for those heads are read front to back,
 * once for the keys of every query head that shares them (GQA) and once for the values. Walking pages in
 * order (rather than one head's 256-byte slice per token, 1 KiB apart) keeps the hardware prefetcher
 * streaming: a per-head walk over pages scattered through the arena stalls on memory latency (measured
 * 2.4 GFLOP/s, one thread, 15 MB of KV). Small batches split the heads so both cores stay busy.
 * A sliding window starts the walk at the page holding token lo = n - window; that page's earlier rows
 * are skipped. Requires head_dim % 8 == 0 and block_size <= MAX_BLOCK (checked by the caller). */
#define MAX_BLOCK 64
static inline const void *element(const void *p, int64_t i, int bf16) { return (const char *)p + i * (bf16 ? 2 : 4); }

/* In bf16 the item's q is widened into fp32 and its output accumulated in fp32 (the last 2 * heads * d floats of
 * the thread's scratch), then rounded once. */
static inline __attribute__((always_inline)) void attention_run(const struct attention_args *a, int64_t tid,
                                                                int bf16) {
    int64_t group = a->num_heads / a->num_kv_heads, d = a->head_dim, bs = a->block_size;
    int64_t kv_per_part = a->num_kv_heads / a->parts, heads = kv_per_part * group;
    float *scores = a->scratch + tid * a->scratch_per_thread; /* [heads of this part][n - lo] */
    float *q_wide = scores + a->scratch_per_thread - 2 * heads * d, *out_wide = q_wide + heads * d;
    for (;;) {
        int64_t item = __atomic_fetch_add(a->next_item, 1, __ATOMIC_RELAXED);
        if (item >= a->batch * a->parts) break;
        int64_t b = item / a->parts, kv0 = (item % a->parts) * kv_per_part, n = a->context_lens[b];
        int64_t lo = a->window > 0 && n > a->window ? n - a->window : 0, len = n - lo;
        const int32_t *table = a->block_tables + b * a->table_stride;
        int64_t first_elem = (b * a->num_heads + kv0 * group) * d;
        const float *q = bf16 ? q_wide : (const float *)a->q + first_elem;
        float *out = bf16 ? out_wide : (float *)a->out + first_elem;
        if (bf16)
            for (int64_t i = 0; i < heads * d; ++i) q_wide[i] = bf16_to_float(((const bf16_t *)a->q)[first_elem + i]);
        for (int64_t i = 0; i < heads * d; ++i) out[i] = 0.0f;
        if (n == 0) {
            if (bf16)
                for (int64_t i = 0; i < heads * d; ++i) ((bf16_t *)a->out)[first_elem + i] = 0;
            continue;
        }
        for (int64_t page = lo / bs, t0 = page * bs; t0 < n; t0 += bs, ++page) {
            const void *base = element(a->k_cache, table[page] * a->page_stride + kv0 * d, bf16);
            int64_t m = n - t0 < bs ? n - t0 : bs, first = lo > t0 ? lo - t0 : 0;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh)
                for (int64_t s0 = first; s0 < m; s0 += 8) {
                    /* Rows past the page's last token repeat it; their scores are dropped. */
                    const void *rows[8];
                    for (int64_t s = 0; s < 8; ++s)
                        rows[s] = element(base, (s0 + s < m ? s0 + s : m - 1) * a->token_stride + kvh * d, bf16);
                    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
                        float block[8];
                        if (bf16)
                            dot8_bf16(q + h * d, (const bf16_t *)a->q + first_elem + h * d, rows, d, a->scale, block);
                        else
                            dot8(q + h * d, rows, d, a->scale, block, 0);
                        for (int64_t s = 0; s < 8 && s0 + s < m; ++s) scores[h * len + t0 + s0 + s - lo] = block[s];
                    }
                }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float *s = scores + h * len, top, total = 0.0f;
            if (a->softcap > 0.0f) /* Gemma 2: scores become softcap * tanh(score / softcap) before the softmax */
                for (int64_t t = 0; t < len; ++t) s[t] = a->softcap * tanhf(s[t] / a->softcap);
            top = s[0];
            for (int64_t t = 1; t < len; ++t) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < len; ++t) total += (s[t] = expf(s[t] - top));
            float inv = 1.0f / total;
            for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        for (int64_t page = lo / bs, t0 = page * bs; t0 < n; t0 += bs, ++page) {
            const void *base = element(a->v_cache, table[page] * a->page_stride + kv0 * d, bf16);
            int64_t m = n - t0 < bs ? n - t0 : bs, first = lo > t0 ? lo - t0 : 0;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh) {
                const void *rows[MAX_BLOCK];
                for (int64_t s = first; s < m; ++s)
                    rows[s - first] = element(base, s * a->token_stride + kvh * d, bf16);
                for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
                    if (bf16)
                        weighted_sum_bf16(out + h * d, scores + h * len + t0 + first - lo, rows, m - first, d);
                    else
                        weighted_sum(out + h * d, scores + h * len + t0 + first - lo, rows, m - first, d, 0);
            }
        }
        if (bf16)
            for (int64_t i = 0; i < heads * d; ++i) ((bf16_t *)a->out)[first_elem + i] = float_to_bf16(out[i]);
    }
}

static void attention_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct attention_args *a = p;
    (void)nthreads;
    if (a->bf16)
        attention_run(a, tid, 1);
    else
        attention_run(a, tid, 0);
}

/* One query token per sequence over its paged K/V, read in place. Caches are one layer's views:
 * token t of sequence b lives at page block_tables[b, t / block_size], slot t % block_size.
 * window > 0 reads only tokens t >= context_lens[b] - window (sliding-window attention); 0 reads all.
 * softcap > 0 caps each scaled score s as softcap * tanh(s / softcap) (Gemma 2); 0 leaves scores as they are.
 * parts divides num_kv_heads; scratch holds num_threads * scratch_per_thread floats
 * (min(max(context_lens), window) * num_heads / parts each, plus 2 * head_dim * num_heads / parts in bf16).
 * bf16 nonzero: q, the caches and out are bf16. */
void paged_attention_decode(const void *q, const void *k_cache, const void *v_cache, int64_t page_stride,
                            int64_t token_stride, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
                            void *out, float *scratch, int64_t scratch_per_thread, int64_t parts, int64_t bf16,
                            int64_t num_threads) {
    int64_t next_item = 0;
    struct attention_args args = {q, k_cache, v_cache, out, scratch, bf16, block_tables, context_lens, page_stride,
                                  token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim,
                                  block_size, scratch_per_thread, parts, window, scale, softcap, &next_item};
    parallel(attention_work, &args, num_threads);
}
