/* Multi-LoRA on CPU (fp32, or bf16 x, y and arena with fp32 arithmetic): for every segment g with adapter slot
 * s != -1 and every slice k of a fused projection group (projection p), reading the adapter rows in place in the
 * arena:
 *   v[t, i] = x[t] . arena[a_rows[s, p, i] : + in_features]                 (i < rank)
 *   y[t, out_offset_k : + width_k] += scale[s, p] * sum_i v[t, i] * arena[b_rows[s, p, i] : + width_k]
 * One call per layer and group replaces hundreds of tiny torch ops. Loaded through ctypes by torch_ops.py.
 *
 * Segments arrive cut into chunks of a few dozen tokens (torch_ops.py), so a long prefill spreads over the
 * threads and each chunk's adapter rows stay in L1/L2 while all its tokens pass over them. The shrink of
 * row i warms B^T row i for the expand that follows. Measured on all layers of a recorded decode step
 * (86 MB of adapter rows, interleaved rounds, an older host): 8.9 -> 12.5 GB/s on one thread, 15.1 -> 19.5
 * GB/s on two with the prefetches.
 *
 * In bf16 the shrink multiplies pairs with AVX-512 BF16's dot-product instruction where the build has it (else
 * it widens by a shift), and the expand keeps each output vector in fp32 over all ranks: y is rounded once.
 */
#include "cpu_common.h"

/* Adapter rows come from DRAM once per decode step, in blocks of 2-64 KiB scattered over the pool, too short
 * for the hardware prefetcher to ramp up on its own. The loops prefetch (into L2) this far ahead of their
 * reads. */
#define PREFETCH_AHEAD 1024 /* floats (4 KiB) */
#define prefetch_l2(p) __builtin_prefetch((p), 0, 1)

/* out[t] = a . xs[t] for M (1..4) vectors: each chunk of the adapter row is loaded once for all of them,
 * and two accumulators per vector keep the FMA units busy when M is small. a and xs are bf16 when bf16 is set
 * (a constant at each call site). */
#define TOKEN_BLOCK 4
static inline __attribute__((always_inline)) void dot_m(const void *restrict a, const void *const *xs, int m,
                                                        int64_t n, float *out, int bf16) {
    f16 acc[TOKEN_BLOCK][2] = {{{0}}};
    int64_t j = 0, size = bf16 ? 2 : 4;
#ifdef __AVX512BF16__
    for (; bf16 && j + 64 <= n; j += 64) {
        prefetch_l2((const char *)a + 2 * j + PREFETCH_AHEAD * 4);
        prefetch_l2((const char *)a + 2 * j + PREFETCH_AHEAD * 4 + 64);
        __m512bh w0, w1;
        __builtin_memcpy(&w0, (const bf16_t *)a + j, sizeof w0);
        __builtin_memcpy(&w1, (const bf16_t *)a + j + 32, sizeof w1);
        for (int t = 0; t < m; ++t) {
            __m512bh x0, x1;
            __builtin_memcpy(&x0, (const bf16_t *)xs[t] + j, sizeof x0);
            __builtin_memcpy(&x1, (const bf16_t *)xs[t] + j + 32, sizeof x1);
            acc[t][0] = (f16)_mm512_dpbf16_ps((__m512)acc[t][0], w0, x0);
            acc[t][1] = (f16)_mm512_dpbf16_ps((__m512)acc[t][1], w1, x1);
        }
    }
#endif
    for (; j + 32 <= n; j += 32) {
        /* a row's successor follows it in the pool; prefetches never fault */
        prefetch_l2((const char *)a + size * j + PREFETCH_AHEAD * 4);
        prefetch_l2((const char *)a + size * j + PREFETCH_AHEAD * 4 + 64);
        f16 w0 = load16_as(a, j, bf16), w1 = load16_as(a, j + 16, bf16);
        for (int t = 0; t < m; ++t) {
            acc[t][0] += w0 * load16_as(xs[t], j, bf16);
            acc[t][1] += w1 * load16_as(xs[t], j + 16, bf16);
        }
    }
    for (; j + 16 <= n; j += 16) {
        f16 w = load16_as(a, j, bf16);
        for (int t = 0; t < m; ++t) acc[t][0] += w * load16_as(xs[t], j, bf16);
    }
    for (int t = 0; t < m; ++t) {
        out[t] = hsum16(acc[t][0] + acc[t][1]);
        for (int64_t k = j; k < n; ++k) out[t] += load_as(a, k, bf16) * load_as(xs[t], k, bf16);
    }
}

static void dot_block(const float *restrict a, const float *const *xs, int64_t m, int64_t n, float *out) {
    /* Constant M per call site lets the compiler unroll the token loop into registers. */
    switch (m) {
    case 1: dot_m(a, (const void *const *)xs, 1, n, out, 0); break;
    case 2: dot_m(a, (const void *const *)xs, 2, n, out, 0); break;
    case 3: dot_m(a, (const void *const *)xs, 3, n, out, 0); break;
    default: dot_m(a, (const void *const *)xs, 4, n, out, 0); break;
    }
}

static void dot_block_bf16(const bf16_t *restrict a, const bf16_t *const *xs, int64_t m, int64_t n, float *out) {
    switch (m) {
    case 1: dot_m(a, (const void *const *)xs, 1, n, out, 1); break;
    case 2: dot_m(a, (const void *const *)xs, 2, n, out, 1); break;
    case 3: dot_m(a, (const void *const *)xs, 3, n, out, 1); break;
    default: dot_m(a, (const void *const *)xs, 4, n, out, 1); break;
    }
}

/* ys[t][0:n] += sum_i c[t][i] * bs[i][0:n] for m (1..4) rows and RANK_BLOCK ranks; ranks past the real
 * count carry zero coefficients (and point at a valid row), which costs less than a branchy tail. */
#define RANK_BLOCK 4
static inline __attribute__((always_inline)) void expand_m(float *const *ys, const float *const *bs,
                                                           const float c[TOKEN_BLOCK][RANK_BLOCK], int m,
                                                           int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        for (int i = 0; i < RANK_BLOCK; ++i) prefetch_l2(bs[i] + j + PREFETCH_AHEAD / RANK_BLOCK);
        f16 b0 = load16(bs[0] + j), b1 = load16(bs[1] + j), b2 = load16(bs[2] + j), b3 = load16(bs[3] + j);
        for (int t = 0; t < m; ++t) {
            f16 acc = load16(ys[t] + j);
            acc += c[t][0] * b0;
            acc += c[t][1] * b1;
            acc += c[t][2] * b2;
            acc += c[t][3] * b3;
            store16(ys[t] + j, acc);
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

/* ys[t][0:n] += sum_i v[t * rank + i] * bs[i][0:n] over all ranks, bf16 ys and bs: each 16 columns of an output
 * row are widened once, accumulate every rank in fp32, and are rounded once. The B^T rows are in L2 already
 * (the shrink prefetched them). */
static inline __attribute__((always_inline)) void expand_bf16_m(bf16_t *const *ys, const bf16_t *const *bs,
                                                                const float *v, int64_t rank, int m, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        f16 acc[TOKEN_BLOCK];
        for (int t = 0; t < m; ++t) acc[t] = load16_bf16(ys[t] + j);
        for (int64_t i = 0; i < rank; ++i) {
            f16 b = load16_bf16(bs[i] + j);
            for (int t = 0; t < m; ++t) acc[t] += v[t * rank + i] * b;
        }
        for (int t = 0; t < m; ++t) store16_bf16(ys[t] + j, acc[t]);
    }
    for (; j < n; ++j)
        for (int t = 0; t < m; ++t) {
            float acc = bf16_to_float(ys[t][j]);
            for (int64_t i = 0; i < rank; ++i) acc += v[t * rank + i] * bf16_to_float(bs[i][j]);
            ys[t][j] = float_to_bf16(acc);
        }
}

static void expand_bf16(bf16_t *const *ys, const bf16_t *const *bs, const float *v, int64_t rank, int64_t m,
                        int64_t n) {
    switch (m) {
    case 1: expand_bf16_m(ys, bs, v, rank, 1, n); break;
    case 2: expand_bf16_m(ys, bs, v, rank, 2, n); break;
    case 3: expand_bf16_m(ys, bs, v, rank, 3, n); break;
    default: expand_bf16_m(ys, bs, v, rank, 4, n); break;
    }
}

static inline int64_t token_row(int64_t pos, const int64_t *token_index) {
    return token_index ? token_index[pos] : pos;
}

struct lora_args {
    const void *x, *arena; /* fp32, or bf16 in lora_work_bf16 (y too) */
    const float *scales;
    void *y;
    float *workspace;
    int64_t x_stride, y_stride, in_features, num_segments, num_slices;
    const int32_t *seg_starts, *seg_lengths, *seg_slots, *ranks;
    const int64_t *token_index, *projections, *out_offsets, *out_widths, *a_rows, *b_rows;
    int64_t rows_slot_stride, rows_proj_stride, meta_slot_stride, meta_proj_stride, workspace_per_thread;
    int64_t *next_item; /* shared counter: threads claim items as they free up (ranks vary 8x in cost) */
};

/* One work item (as lora_work below) in bf16: the same shrink, then the expand over all ranks at once. */
static void lora_item_bf16(const struct lora_args *a, float *v, const int64_t *a_off, const int64_t *b_off,
                           int64_t rank, float scale, int64_t start, int64_t length, int64_t width, int64_t offset) {
    const bf16_t *arena = a->arena, *x = a->x;
    bf16_t *y = a->y;
    for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
        int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
        const bf16_t *xs[TOKEN_BLOCK];
        for (int64_t t = 0; t < m; ++t) xs[t] = x + token_row(start + t0 + t, a->token_index) * a->x_stride;
        for (int64_t i = 0; i < rank; ++i) {
            float out[TOKEN_BLOCK];
            if (t0 == 0)
                for (int64_t l = 0; l < width; l += 32) prefetch_l2(arena + b_off[i] + l);
            dot_block_bf16(arena + a_off[i], xs, m, a->in_features, out);
            for (int64_t t = 0; t < m; ++t) v[(t0 + t) * rank + i] = scale * out[t];
        }
    }
    const bf16_t *bs[rank];
    for (int64_t i = 0; i < rank; ++i) bs[i] = arena + b_off[i];
    for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
        int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
        bf16_t *ys[TOKEN_BLOCK];
        for (int64_t t = 0; t < m; ++t) ys[t] = y + token_row(start + t0 + t, a->token_index) * a->y_stride + offset;
        expand_bf16(ys, bs, v + t0 * rank, rank, m, width);
    }
}

/* Work item (segment g, slice k) writes only rows of g and columns of k: items never overlap. */
static inline __attribute__((always_inline)) void lora_run(const struct lora_args *a, int64_t tid, int bf16) {
    float *v = a->workspace + tid * a->workspace_per_thread;
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
        if (bf16) {
            lora_item_bf16(a, v, a_off, b_off, rank, scale, start, length, width, offset);
            continue;
        }
        for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
            int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
            const float *xs[TOKEN_BLOCK];
            for (int64_t t = 0; t < m; ++t)
                xs[t] = (const float *)a->x + token_row(start + t0 + t, a->token_index) * a->x_stride;
            for (int64_t i = 0; i < rank; ++i) {
                float out[TOKEN_BLOCK];
                if (t0 == 0)
                    for (int64_t l = 0; l < width; l += 16) prefetch_l2((const float *)a->arena + b_off[i] + l);
                dot_block((const float *)a->arena + a_off[i], xs, m, a->in_features, out);
                for (int64_t t = 0; t < m; ++t) v[(t0 + t) * rank + i] = scale * out[t];
            }
        }
        /* Blocks of up to 4 tokens x 4 ranks: each output vector is loaded and stored once per 4 ranks, and
         * the 4 B^T rows stream through front to back (a short segment's output rows stay in L1/L2). */
        for (int64_t t0 = 0; t0 < length; t0 += TOKEN_BLOCK) {
            int64_t m = length - t0 < TOKEN_BLOCK ? length - t0 : TOKEN_BLOCK;
            float *ys[TOKEN_BLOCK];
            for (int64_t t = 0; t < m; ++t)
                ys[t] = (float *)a->y + token_row(start + t0 + t, a->token_index) * a->y_stride + offset;
            for (int64_t i0 = 0; i0 < rank; i0 += RANK_BLOCK) {
                int64_t q = rank - i0 < RANK_BLOCK ? rank - i0 : RANK_BLOCK;
                const float *bs[RANK_BLOCK];
                float c[TOKEN_BLOCK][RANK_BLOCK] = {{0}};
                for (int64_t i = 0; i < RANK_BLOCK; ++i) bs[i] = (const float *)a->arena + b_off[i0 + (i < q ? i : 0)];
                for (int64_t t = 0; t < m; ++t)
                    for (int64_t i = 0; i < q; ++i) c[t][i] = v[(t0 + t) * rank + i0 + i];
                expand_block(ys, bs, c, m, width);
            }
        }
    }
}

static void lora_work(const void *p, int64_t tid, int64_t nthreads) {
    (void)nthreads;
    lora_run(p, tid, 0);
}

static void lora_work_bf16(const void *p, int64_t tid, int64_t nthreads) {
    (void)nthreads;
    lora_run(p, tid, 1);
}

/* Table views are [slots, 7, max_rank] (rows) and [slots, 7] (ranks, scales) with the given element strides.
 * workspace holds num_threads * workspace_per_thread floats (longest segment * widest rank each). bf16 nonzero:
 * x, y and arena are bf16 (scales and workspace stay fp32). */
void lora_segments(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *arena,
                   int64_t in_features, int64_t num_segments, const int32_t *seg_starts,
                   const int32_t *seg_lengths, const int32_t *seg_slots,
                   const int64_t *token_index, int64_t num_slices, const int64_t *projections,
                   const int64_t *out_offsets, const int64_t *out_widths, const int64_t *a_rows,
                   const int64_t *b_rows, int64_t rows_slot_stride, int64_t rows_proj_stride,
                   const int32_t *ranks, const float *scales, int64_t meta_slot_stride, int64_t meta_proj_stride,
                   float *workspace, int64_t workspace_per_thread, int64_t bf16, int64_t num_threads) {
    int64_t next_item = 0;
    struct lora_args args = {x, arena, scales, y, workspace, x_stride, y_stride, in_features, num_segments,
                             num_slices, seg_starts, seg_lengths, seg_slots, ranks, token_index,
                             projections, out_offsets, out_widths, a_rows, b_rows, rows_slot_stride,
                             rows_proj_stride, meta_slot_stride, meta_proj_stride, workspace_per_thread,
                             &next_item};
    parallel(bf16 ? lora_work_bf16 : lora_work, &args, num_threads);
}


