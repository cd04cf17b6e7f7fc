/* CPU loops (fp32) for what torch does poorly at serving shapes: fused multi-LoRA shrink + expand, and
 * paged decode attention. Both read the arena in place. Loaded through ctypes by torch_ops.py (no torch
 * headers needed).
 *
 * LoRA, for every segment g with adapter slot s != -1 and every slice k of the group (projection p):
 *   v[t, i] = x[t] . arena[a_rows[s, p, i] : + in_features]                 (i < rank)
 *   y[t, out_offset_k : + width_k] += scale[s, p] * sum_i v[t, i] * arena[b_rows[s, p, i] : + width_k]
 * One call per layer and group replaces hundreds of tiny torch ops. Segments arrive cut into chunks of a
 * few dozen tokens (torch_ops.py), so a long prefill spreads over the threads and each chunk's adapter
 * rows stay in L1/L2 while all its tokens pass over them.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* GCC/Clang vector extensions: 8 floats (AVX when available, two SSE registers otherwise). */
typedef float f8 __attribute__((vector_size(32)));

static inline f8 load8(const float *p) {
    f8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(f8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* Adapter rows come from DRAM once per decode step, in blocks of 2-64 KiB scattered over the pool, too short
 * for the hardware prefetcher to ramp up on its own. The loops prefetch (into L2) this far ahead of their
 * reads, and the shrink of row i warms B^T row i for the expand that follows. Measured on all layers of a
 * recorded decode step (86 MB of adapter rows, interleaved rounds): 8.9 -> 12.5 GB/s on one thread,
 * 15.1 -> 19.5 GB/s on two; the machine reads 19 and 27 GB/s sequentially. */
#define PREFETCH_AHEAD 1024 /* floats (4 KiB) */
#define prefetch_l2(p) __builtin_prefetch((p), 0, 1)

/* out[t] = a . xs[t] for M (1..4) vectors: each chunk of the adapter row is loaded once for all of them,
 * and two accumulators per vector keep the FMA units busy when M is small. */
#define TOKEN_BLOCK 4
static inline __attribute__((always_inline)) void dot_m(const float *restrict a, const float *const *xs, int m,
                                                        int64_t n, float *out) {
    f8 acc[TOKEN_BLOCK][2] = {{{0}}};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        prefetch_l2(a + j + PREFETCH_AHEAD); /* a row's successor follows it in the pool; prefetches never fault */
        f8 w0 = load8(a + j), w1 = load8(a + j + 8);
        for (int t = 0; t < m; ++t) {
            acc[t][0] += w0 * load8(xs[t] + j);
            acc[t][1] += w1 * load8(xs[t] + j + 8);
        }
    }
    for (; j + 8 <= n; j += 8) {
        f8 w = load8(a + j);
        for (int t = 0; t < m; ++t) acc[t][0] += w * load8(xs[t] + j);
    }
    for (int t = 0; t < m; ++t) {
        out[t] = hsum(acc[t][0] + acc[t][1]);
        for (int64_t k = j; k < n; ++k) out[t] += a[k] * xs[t][k];
    }
}

static void dot_block(const float *restrict a, const float *const *xs, int64_t m, int64_t n, float *out) {
    /* Constant M per call site lets the compiler unroll the token loop into registers. */
    switch (m) {
    case 1: dot_m(a, xs, 1, n, out); break;
    case 2: dot_m(a, xs, 2, n, out); break;
    case 3: dot_m(a, xs, 3, n, out); break;
    default: dot_m(a, xs, 4, n, out); break;
    }
}

/* ys[t][0:n] += sum_i c[t][i] * bs[i][0:n] for m (1..4) rows and RANK_BLOCK ranks; ranks past the real
 * count carry zero coefficients (and point at a valid row), which costs less than a branchy tail. */
#define RANK_BLOCK 4
static inline __attribute__((always_inline)) void expand_m(float *const *ys, const float *const *bs,
                                                           const float c[TOKEN_BLOCK][RANK_BLOCK], int m,
                                                           int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        if (j % 16 == 0)
            for (int i = 0; i < RANK_BLOCK; ++i) prefetch_l2(bs[i] + j + PREFETCH_AHEAD / RANK_BLOCK);
        f8 b0 = load8(bs[0] + j), b1 = load8(bs[1] + j), b2 = load8(bs[2] + j), b3 = load8(bs[3] + j);
        for (int t = 0; t < m; ++t) {
            f8 acc = load8(ys[t] + j);
            acc += c[t][0] * b0;
            acc += c[t][1] * b1;
            acc += c[t][2] * b2;
            acc += c[t][3] * b3;
            __builtin_memcpy(ys[t] + j, &acc, sizeof acc);
        }
    }
    for (; j < n; ++j)
        for (int t = 0; t < m; ++t)
            ys[t][j] += c[t][0] * bs[0][j] + c[t][1] * bs[1][j] + c[t][2] * bs[2][j] + c[t][3] * bs[3][j];
}

static void expand_block(float *const *ys, const float *const *bs, const float c[TOKEN_BLOCK][RANK_BLOCK],
                         int64_t m, int64_t n) {
    switch (m) {
    case 1: expand_m(ys, bs, c, 1, n); break;
    case 2: expand_m(ys, bs, c, 2, n); break;
    case 3: expand_m(ys, bs, c, 3, n); break;
    default: expand_m(ys, bs, c, 4, n); break;
    }
}

static inline int64_t token_row(int64_t pos, const int64_t *token_index) {
    return token_index ? token_index[pos] : pos;
}

/* Runs work(args, tid, nthreads) on nthreads threads and waits for all. The threads are OpenMP's: built
 * with -fopenmp this library binds to the libgomp torch already loaded (same soname), so its workers
 * are torch's intra-op workers, still spinning from the op before ours, and take the work at once.
 * Threads of our own would fight those spinning workers for the cores (measured 1.6x slower on 2 cores). */
typedef void (*work_fn)(const void *args, int64_t tid, int64_t nthreads);

static void parallel(work_fn work, const void *args, int64_t nthreads) {
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        work(args, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    work(args, 0, 1);
}

struct lora_args {
    const float *x, *arena, *scales;
    float *y, *workspace;
    int64_t x_stride, y_stride, in_features, num_segments, num_slices;
    const int32_t *seg_starts, *seg_lengths, *seg_slots, *ranks;
    const int64_t *token_index, *projections, *out_offsets, *out_widths, *a_rows, *b_rows;
    int64_t rows_slot_stride, rows_proj_stride, meta_slot_stride, meta_proj_stride, workspace_per_thread;
    int64_t *next_item; /* shared counter: threads claim items as they free up (ranks vary 8x in cost) */
};

/* Work item (segment g, slice k) writes only rows of g and columns of k: items never overlap. */
static void lora_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct lora_args *a = p;
    float *v = a->workspace + tid * a->workspace_per_thread;
    (void)nthreads;
    for (;;) {
        int64_t item = __atomic_fetch_add(a->next_item, 1, __ATOMIC_RELAXED);
        if (item >= a->num_segments * a->num_slices) break;
        int64_t g = item / a->num_slices, k = item % a->num_slices;
        int64_t slot = a->seg_slots[g], length = a->seg_lengths[g];
        if (slot < 0 || length == 0) continue;
        int64_t proj = a->projections[k], meta = slot * a->meta_slot_stride + proj * a->meta_proj_stride;
        int64_t rank = a->ranks[meta];
        if (rank == 0) continue;
        float scale = a->scales[meta];
        const int64_t *a_off = a->a_rows + slot * a->rows_slot_stride + proj * a->rows_proj_stride;
        const int64_t *b_off = a->b_rows + slot * a->rows_slot_stride + proj * a->rows_proj_stride;
        int64_t width = a->out_widths[k], offset = a->out_offsets[k], start = a->seg_starts[g];
        for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
            int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
            const float *xs[TOKEN_BLOCK];
            for (int64_t t = 0; t < m; ++t) xs[t] = a->x + token_row(start + t0 + t, a->token_index) * a->x_stride;
            for (int64_t i = 0; i < rank; ++i) {
                float out[TOKEN_BLOCK];
                if (t0 == 0)
                    for (int64_t l = 0; l < width; l += 16) prefetch_l2(a->arena + b_off[i] + l);
                dot_block(a->arena + a_off[i], xs, m, a->in_features, out);
                for (int64_t t = 0; t < m; ++t) v[(t0 + t) * rank + i] = scale * out[t];
            }
        }
        /* Blocks of up to 4 tokens x 4 ranks: each output vector is loaded and stored once per 4 ranks, and
         * the 4 B^T rows stream through front to back (a short segment's output rows stay in L1/L2). */
        for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
            int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
            float *ys[TOKEN_BLOCK];
            for (int64_t t = 0; t < m; ++t)
                ys[t] = a->y + token_row(start + t0 + t, a->token_index) * a->y_stride + offset;
            for (int64_t i0 = 0; i0 < rank; i0 += RANK_BLOCK) {
                int64_t q = rank - i0 < RANK_BLOCK ? rank - i0 : RANK_BLOCK;
                const float *bs[RANK_BLOCK];
                float c[TOKEN_BLOCK][RANK_BLOCK] = {{0}};
                for (int64_t i = 0; i < RANK_BLOCK; ++i) bs[i] = a->arena + b_off[i0 + (i < q ? i : 0)];
                for (int64_t t = 0; t < m; ++t)
                    for (int64_t i = 0; i < q; ++i) c[t][i] = v[(t0 + t) * rank + i0 + i];
                expand_block(ys, bs, c, m, width);
            }
        }
    }
}

/* Table views are [slots, 7, max_rank] (rows) and [slots, 7] (ranks, scales) with the given element strides.
 * workspace holds num_threads * workspace_per_thread floats (longest segment * widest rank each). */
void lora_segments(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *arena,
                   int64_t in_features, int64_t num_segments, const int32_t *seg_starts,
                   const int32_t *seg_lengths, const int32_t *seg_slots,
                   const int64_t *token_index, int64_t num_slices, const int64_t *projections,
                   const int64_t *out_offsets, const int64_t *out_widths, const int64_t *a_rows,
                   const int64_t *b_rows, int64_t rows_slot_stride, int64_t rows_proj_stride,
                   const int32_t *ranks, const float *scales, int64_t meta_slot_stride, int64_t meta_proj_stride,
                   float *workspace, int64_t workspace_per_thread, int64_t num_threads) {
    int64_t next_item = 0;
    struct lora_args args = {x, arena, scales, y, workspace, x_stride, y_stride, in_features, num_segments,
                             num_slices, seg_starts, seg_lengths, seg_slots, ranks, token_index,
                             projections, out_offsets, out_widths, a_rows, b_rows, rows_slot_stride,
                             rows_proj_stride, meta_slot_stride, meta_proj_stride, workspace_per_thread,
                             &next_item};
    parallel(lora_work, &args, num_threads);
}

struct attention_args {
    const float *q, *k_cache, *v_cache;
    float *out, *scratch;
    const int32_t *block_tables, *context_lens;
    int64_t page_stride, token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim, block_size;
    int64_t scratch_per_thread, parts;
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
 * Requires head_dim % 8 == 0 and block_size <= MAX_BLOCK (checked by the caller). */
#define MAX_BLOCK 64
static void attention_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct attention_args *a = p;
    int64_t group = a->num_heads / a->num_kv_heads, d = a->head_dim, bs = a->block_size;
    int64_t kv_per_part = a->num_kv_heads / a->parts, heads = kv_per_part * group;
    float *scores = a->scratch + tid * a->scratch_per_thread; /* [heads of this part][n] */
    (void)nthreads;
    for (;;) {
        int64_t item = __atomic_fetch_add(a->next_item, 1, __ATOMIC_RELAXED);
        if (item >= a->batch * a->parts) break;
        int64_t b = item / a->parts, kv0 = (item % a->parts) * kv_per_part, n = a->context_lens[b];
        const int32_t *table = a->block_tables + b * a->table_stride;
        const float *q = a->q + (b * a->num_heads + kv0 * group) * d;
        float *out = a->out + (b * a->num_heads + kv0 * group) * d;
        for (int64_t i = 0; i < heads * d; ++i) out[i] = 0.0f;
        if (n == 0) continue;
        for (int64_t t0 = 0, page = 0; t0 < n; t0 += bs, ++page) {
            const float *base = a->k_cache + table[page] * a->page_stride + kv0 * d;
            int64_t m = n - t0 < bs ? n - t0 : bs;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh)
                for (int64_t s0 = 0; s0 < m; s0 += 8) {
                    /* Rows past the page's last token repeat it; their scores are dropped. */
                    const float *rows[8];
                    for (int64_t s = 0; s < 8; ++s)
                        rows[s] = base + (s0 + s < m ? s0 + s : m - 1) * a->token_stride + kvh * d;
                    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
                        float block[8];
                        dot8(q + h * d, rows, d, a->scale, block);
                        for (int64_t s = 0; s < 8 && s0 + s < m; ++s) scores[h * n + t0 + s0 + s] = block[s];
                    }
                }
        }
        for (int64_t h = 0; h < heads; ++h) {
            float *s = scores + h * n, top = s[0], total = 0.0f;
            for (int64_t t = 1; t < n; ++t) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < n; ++t) total += (s[t] = expf(s[t] - top));
            float inv = 1.0f / total;
            for (int64_t t = 0; t < n; ++t) s[t] *= inv;
        }
        for (int64_t t0 = 0, page = 0; t0 < n; t0 += bs, ++page) {
            const float *base = a->v_cache + table[page] * a->page_stride + kv0 * d;
            int64_t m = n - t0 < bs ? n - t0 : bs;
            for (int64_t kvh = 0; kvh < kv_per_part; ++kvh) {
                const float *rows[MAX_BLOCK];
                for (int64_t s = 0; s < m; ++s) rows[s] = base + s * a->token_stride + kvh * d;
                for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
                    weighted_sum(out + h * d, scores + h * n + t0, rows, m, d);
            }
        }
    }
}

/* One query token per sequence over its paged K/V, read in place. Caches are one layer's views:
 * token t of sequence b lives at page block_tables[b, t / block_size], slot t % block_size.
 * parts divides num_kv_heads; scratch holds num_threads * scratch_per_thread floats
 * (max(context_lens) * num_heads / parts each). */
void paged_attention_decode(const float *q, const float *k_cache, const float *v_cache, int64_t page_stride,
                            int64_t token_stride, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float *out, float *scratch,
                            int64_t scratch_per_thread, int64_t parts, int64_t num_threads) {
    int64_t next_item = 0;
    struct attention_args args = {q, k_cache, v_cache, out, scratch, block_tables, context_lens, page_stride,
                                  token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim,
                                  block_size, scratch_per_thread, parts, scale, &next_item};
    parallel(attention_work, &args, num_threads);
}
