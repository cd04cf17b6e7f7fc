/* Paged decode attention on CPU (fp32): one query token per sequence over its KV pages, read in place.
 * Loaded through ctypes by torch_ops.py, built together with the other cpu_*.c loops. */
#include <math.h>

#include "cpu_common.h"

struct attention_args {
    const float *q, *k_cache, *v_cache;
    float *out, *scratch;
    const int32_t *block_tables, *context_lens;
    int64_t page_stride, token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim, block_size;
    int64_t scratch_per_thread, parts, window; /* window 0: full attention */
    float scale;
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

/* out[t] = scale * (q . rows[t]) for 8 rows (d a multiple of 8): each chunk of q is loaded once for all. */
static inline void dot8(const float *restrict q, const float *const rows[8], int64_t d, float scale, float *out) {
    f8 acc[8] = {{0}};
    for (int64_t j = 0; j < d; j += 8) {
        f8 qv = load8(q + j);
        for (int t = 0; t < 8; ++t) acc[t] += qv * load8(rows[t] + j);
    }
    f8 r = reduce8(acc) * scale;
    __builtin_memcpy(out, &r, sizeof r);
}

/* out[0:d] += sum_t p[t] * rows[t][0:d] over m rows (d a multiple of 8): out is loaded and stored once per
 * 64 columns, not once per row. */
static void weighted_sum(float *restrict out, const float *p, const float *const *rows, int64_t m, int64_t d) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
        f8 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = load8(out + c + 8 * i);
        for (int64_t t = 0; t < m; ++t) {
            f8 w = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
            for (int i = 0; i < 8; ++i) acc[i] += w * load8(rows[t] + c + 8 * i);
        }
        for (int i = 0; i < 8; ++i) __builtin_memcpy(out + c + 8 * i, &acc[i], sizeof acc[i]);
    }
    for (; c < d; c += 8) {
        f8 acc = load8(out + c);
        for (int64_t t = 0; t < m; ++t) acc += p[t] * load8(rows[t] + c);
        __builtin_memcpy(out + c, &acc, sizeof acc);
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
static void attention_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct attention_args *a = p;
    int64_t group = a->num_heads / a->num_kv_heads, d = a->head_dim, bs = a->block_size;
    int64_t kv_per_part = a->num_kv_heads / a->parts, heads = kv_per_part * group;
    float *scores = a->scratch + tid * a->scratch_per_thread; /* [heads of this part][n - lo] */
    (void)nthreads;
    for (;;) {
        int64_t item = __atomic_fetch_add(a->next_item, 1, __ATOMIC_RELAXED);
        if (item >= a->batch * a->parts) break;
        int64_t b = item / a->parts, kv0 = (item % a->parts) * kv_per_part, n = a->context_lens[b];
        int64_t lo = a->window > 0 && n > a->window ? n - a->window : 0, len = n - lo;
        const int32_t *table = a->block_tables + b * a->table_stride;
        const float *q = a->q + (b * a->num_heads + kv0 * group) * d;
        float *out = a->out + (b * a->num_heads + kv0 * group) * d;
        for (int64_t i = 0; i < heads * d; ++i) out[i] = 0.0f;
        if (n == 0) continue;
        for (int64_t page = lo / bs, t0 = page * bs; t0 < n; t0 += bs, ++page) {
            const float *base = a->k_cache + table[page] * a->page_stride + kv0 * d;
            int64_t m = n - t0 < bs ? n - t0 : bs, first = lo > t0 ? lo - t0 : 0;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh)
                for (int64_t s0 = first; s0 < m; s0 += 8) {
                    /* Rows past the page's last token repeat it; their scores are dropped. */
                    const float *rows[8];
                    for (int64_t s = 0; s < 8; ++s)
                        rows[s] = base + (s0 + s < m ? s0 + s : m - 1) * a->token_stride + kvh * d;
                    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
                        float block[8];
                        dot8(q + h * d, rows, d, a->scale, block);
                        for (int64_t s = 0; s < 8 && s0 + s < m; ++s) scores[h * len + t0 + s0 + s - lo] = block[s];
                    }
                }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float *s = scores + h * len, top = s[0], total = 0.0f;
            for (int64_t t = 1; t < len; ++t) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < len; ++t) total += (s[t] = expf(s[t] - top));
            float inv = 1.0f / total;
            for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        for (int64_t page = lo / bs, t0 = page * bs; t0 < n; t0 += bs, ++page) {
            const float *base = a->v_cache + table[page] * a->page_stride + kv0 * d;
            int64_t m = n - t0 < bs ? n - t0 : bs, first = lo > t0 ? lo - t0 : 0;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh) {
                const float *rows[MAX_BLOCK];
                for (int64_t s = first; s < m; ++s) rows[s - first] = base + s * a->token_stride + kvh * d;
                for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
                    weighted_sum(out + h * d, scores + h * len + t0 + first - lo, rows, m - first, d);
            }
        }
    }
}

/* One query token per sequence over its paged K/V, read in place. Caches are one layer's views:
 * token t of sequence b lives at page block_tables[b, t / block_size], slot t % block_size.
 * window > 0 reads only tokens t >= context_lens[b] - window (sliding-window attention); 0 reads all.
 * parts divides num_kv_heads; scratch holds num_threads * scratch_per_thread floats
 * (min(max(context_lens), window) * num_heads / parts each). */
void paged_attention_decode(const float *q, const float *k_cache, const float *v_cache, int64_t page_stride,
                            int64_t token_stride, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t window, float scale, float *out,
                            float *scratch, int64_t scratch_per_thread, int64_t parts, int64_t num_threads) {
    int64_t next_item = 0;
    struct attention_args args = {q, k_cache, v_cache, out, scratch, block_tables, context_lens, page_stride,
                                  token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim,
                                  block_size, scratch_per_thread, parts, window, scale, &next_item};
    parallel(attention_work, &args, num_threads);
}
