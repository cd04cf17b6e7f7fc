/* CPU loops (fp32) for what costs more in torch op dispatch than in arithmetic at decode time:
 * fused multi-LoRA shrink + expand for short segments, and paged decode attention. Both read the
 * arena in place. Loaded through ctypes by kernels/torch_ops.py (no torch headers needed).
 *
 * LoRA, for every segment g with adapter slot s != -1 and every slice k of the group (projection p):
 *   v[t, i] = x[t] . arena[a_rows[s, p, i] : + in_features]                 (i < rank)
 *   y[t, out_offset_k : + width_k] += scale[s, p] * sum_i v[t, i] * arena[b_rows[s, p, i] : + width_k]
 * One call per layer and group replaces hundreds of tiny torch ops; each adapter row is read once per
 * segment while it sits in L1.
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

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    f8 acc0 = {0}, acc1 = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        acc0 += load8(a + j) * load8(b + j);
        acc1 += load8(a + j + 8) * load8(b + j + 8);
    }
    for (; j + 8 <= n; j += 8) acc0 += load8(a + j) * load8(b + j);
    float sum = hsum(acc0 + acc1);
    for (; j < n; ++j) sum += a[j] * b[j];
    return sum;
}

/* out[t] = a . xs[t] for M (1..4) vectors: each chunk of the adapter row is loaded once for all of them,
 * and two accumulators per vector keep the FMA units busy when M is small. */
#define TOKEN_BLOCK 4
static inline __attribute__((always_inline)) void dot_m(const float *restrict a, const float *const *xs, int m,
                                                        int64_t n, float *out) {
    f8 acc[TOKEN_BLOCK][2] = {{{0}}};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
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

static void axpy(float *restrict y, float c, const float *restrict x, int64_t n) {
    f8 cv = {c, c, c, c, c, c, c, c};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        f8 r = load8(y + j) + cv * load8(x + j);
        __builtin_memcpy(y + j, &r, sizeof r);
    }
    for (; j < n; ++j) y[j] += c * x[j];
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
    const int32_t *seg_starts, *seg_lengths, *seg_slots, *seg_use, *ranks;
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
        if (slot < 0 || length == 0 || !a->seg_use[g]) continue;
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
 * workspace holds num_threads * workspace_per_thread floats (longest used segment * widest rank each). */
void lora_segments(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *arena,
                   int64_t in_features, int64_t num_segments, const int32_t *seg_starts,
                   const int32_t *seg_lengths, const int32_t *seg_slots, const int32_t *seg_use,
                   const int64_t *token_index, int64_t num_slices, const int64_t *projections,
                   const int64_t *out_offsets, const int64_t *out_widths, const int64_t *a_rows,
                   const int64_t *b_rows, int64_t rows_slot_stride, int64_t rows_proj_stride,
                   const int32_t *ranks, const float *scales, int64_t meta_slot_stride, int64_t meta_proj_stride,
                   float *workspace, int64_t workspace_per_thread, int64_t num_threads) {
    int64_t next_item = 0;
    struct lora_args args = {x, arena, scales, y, workspace, x_stride, y_stride, in_features, num_segments,
                             num_slices, seg_starts, seg_lengths, seg_slots, seg_use, ranks, token_index,
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
    int64_t scratch_per_thread;
    float scale;
};

/* Work item (sequence b, KV head): keys read once for every query head sharing it (GQA), then values once. */
static void attention_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct attention_args *a = p;
    int64_t group = a->num_heads / a->num_kv_heads, d = a->head_dim;
    float *scratch = a->scratch + tid * a->scratch_per_thread;
    for (int64_t item = tid; item < a->batch * a->num_kv_heads; item += nthreads) {
        int64_t b = item / a->num_kv_heads, kvh = item % a->num_kv_heads, n = a->context_lens[b];
        const int32_t *table = a->block_tables + b * a->table_stride;
        const float *qh = a->q + (b * a->num_heads + kvh * group) * d;
        float *oh = a->out + (b * a->num_heads + kvh * group) * d;
        for (int64_t h = 0; h < group * d; ++h) oh[h] = 0.0f;
        if (n == 0) continue;
        for (int64_t t = 0; t < n; ++t) {
            const float *key = a->k_cache + table[t / a->block_size] * a->page_stride +
                               (t % a->block_size) * a->token_stride + kvh * d;
            for (int64_t h = 0; h < group; ++h) scratch[h * n + t] = a->scale * dot(qh + h * d, key, d);
        }
        for (int64_t h = 0; h < group; ++h) {
            float *s = scratch + h * n, top = s[0], total = 0.0f;
            for (int64_t t = 1; t < n; ++t) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < n; ++t) total += (s[t] = expf(s[t] - top));
            for (int64_t t = 0; t < n; ++t) s[t] /= total;
        }
        for (int64_t t = 0; t < n; ++t) {
            const float *value = a->v_cache + table[t / a->block_size] * a->page_stride +
                                 (t % a->block_size) * a->token_stride + kvh * d;
            for (int64_t h = 0; h < group; ++h) axpy(oh + h * d, scratch[h * n + t], value, d);
        }
    }
}

/* One query token per sequence over its paged K/V, read in place. Caches are one layer's views:
 * token t of sequence b lives at page block_tables[b, t / block_size], slot t % block_size.
 * scratch holds num_threads * scratch_per_thread floats (max(context_lens) * group each). */
void paged_attention_decode(const float *q, const float *k_cache, const float *v_cache, int64_t page_stride,
                            int64_t token_stride, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float *out, float *scratch,
                            int64_t scratch_per_thread, int64_t num_threads) {
    struct attention_args args = {q, k_cache, v_cache, out, scratch, block_tables, context_lens, page_stride,
                                  token_stride, table_stride, batch, num_heads, num_kv_heads, head_dim,
                                  block_size, scratch_per_thread, scale};
    parallel(attention_work, &args, num_threads);
}
