/* Dense projections on CPU (fp32 or bf16): y = x @ W^T (+ bias) over weights packed in panels.
 *
 * W^T ([in, out]) is packed as panels of PANEL_COLS output columns, each panel [in][PANEL_COLS] contiguous
 * (the last one zero-padded), so a panel streams front to back while a block of up to ROW_BLOCK input rows
 * accumulates 2 x ROW_BLOCK vectors in registers. Measured with bench/linear_cpu.py (the engine benchmark's
 * shapes, one thread of an AVX-512 Xeon): against oneDNN's packed matmul, 1.24-1.37x from 16 to 64 rows (the
 * fetch of the panel ahead, below), 1.03x at 256 and 1,024, and 1.27-1.48x at 1-8 rows, where oneDNN stays
 * below the memory bandwidth. Unlike oneDNN it keeps no code per row count.
 *
 * In bf16 (x, panels and y bf16; bias fp32; fp32 accumulation) a panel holds pairs of input rows interleaved,
 * [in / 2][PANEL_COLS][2] (an odd last row paired with zeros): one 64-byte line is 16 columns x 2 inputs, the
 * operand of AVX-512 BF16's dot-product instruction (and of AMX's tiles). Without that instruction the pairs are
 * widened by a shift and a mask instead.
 */
#include "cpu_common.h"

#define PANEL_COLS 32
#define ROW_BLOCK 8
/* Rows per pass over the panels: a pass's rows of x stay in L2 while the panels stream. */
#define ROWS_PER_PASS 256

/* While a panel is multiplied, the one two places on is fetched into L2: a step of a row block's input loop
 * reads one 128-byte row of its panel, and of B row blocks block b asks for rows b, b + B, b + 2B, ... of the
 * panel ahead, so the fetch is spread evenly over the compute. Before, a panel's first row block streamed it
 * from DRAM at memory speed and its other blocks computed from L2 with the memory idle: at 16-48 rows the
 * time was the sum of the two, not the larger. bench/linear_cpu.py, one thread, 94 MB of weights, ms per pass
 * (before -> after, one session): 8 rows 10.2 -> 7.8, 16 rows 12.7 -> 9.3, 32 rows 17.2 -> 12.6, 64 rows 27.3 ->
 * 21.2.
 * One panel ahead left the small row counts short of the bandwidth; four measured no better than two. */
#define PANEL_LINE 128
#define prefetch_panel_line(p) (__builtin_prefetch((p), 0, 2), __builtin_prefetch((p) + 64, 0, 2))

struct gemm_args {
    const void *x, *w_panels;
    const float *bias;
    void *y;
    int64_t x_stride, y_stride, rows, in_features, out_features, kind;
};

enum { GEMM_FP32, GEMM_BF16, GEMM_BF16_AMX }; /* kind: fp32; bf16; bf16 with AMX tiles (gemm_amx_ready) */

/* y[r, 0:cols] = bias + x[r] @ panel for m rows (m <= ROW_BLOCK). m and first are constants at each call site
 * (see panel_block), so the accumulators stay in registers. `first` marks the first row block of a panel,
 * which pulls the panel into L1 ahead of its reads; later row blocks find it in L1/L2. Steps phase, phase +
 * step, ... of the input loop also fetch that 128-byte row of the panel ahead (`ahead`, NULL: none). */
static inline __attribute__((always_inline)) void panel_rows(const float *restrict x, int64_t x_stride,
                                                             const float *restrict panel, const float *bias,
                                                             int64_t in, float *restrict y, int64_t y_stride, int m,
                                                             int64_t cols, int first, const char *ahead,
                                                             int64_t phase, int64_t step) {
    f16 acc[ROW_BLOCK][2];
    f16 b0 = {0}, b1 = {0};
    if (bias) b0 = load16(bias), b1 = load16(bias + 16);
    for (int r = 0; r < m; ++r) acc[r][0] = b0, acc[r][1] = b1;
    for (int64_t k = 0; k < in; ++k) {
        if (first) __builtin_prefetch(panel + (k + 16) * PANEL_COLS, 0, 3); /* 2 KiB ahead, into L1 */
        if (ahead && k == phase) prefetch_panel_line(ahead + k * PANEL_LINE), phase += step;
        f16 w0 = load16(panel + k * PANEL_COLS), w1 = load16(panel + k * PANEL_COLS + 16);
        for (int r = 0; r < m; ++r) {
            float xv = x[r * x_stride + k];
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
        }
    }
    if (cols == PANEL_COLS) {
        for (int r = 0; r < m; ++r) store16(y + r * y_stride, acc[r][0]), store16(y + r * y_stride + 16, acc[r][1]);
        return;
    }
    for (int r = 0; r < m; ++r) { /* the last, partial panel */
        float out[PANEL_COLS];
        store16(out, acc[r][0]), store16(out + 16, acc[r][1]);
        for (int64_t c = 0; c < cols; ++c) y[r * y_stride + c] = out[c];
    }
}

static void panel_block(const float *x, int64_t x_stride, const float *panel, const float *bias, int64_t in,
                        float *y, int64_t y_stride, int64_t m, int64_t cols, int first, const char *ahead,
                        int64_t phase, int64_t step) {
    /* A constant row count (and first) per call lets the compiler keep the accumulators in registers. */
#define ROWS(n)                                                                                                  \
    if (first)                                                                                                   \
        panel_rows(x, x_stride, panel, bias, in, y, y_stride, n, cols, 1, ahead, phase, step);                   \
    else                                                                                                         \
        panel_rows(x, x_stride, panel, bias, in, y, y_stride, n, cols, 0, ahead, phase, step);                   \
    break;
    switch (m) {
    case 1: ROWS(1)
    case 2: ROWS(2)
    case 3: ROWS(3)
    case 4: ROWS(4)
    case 5: ROWS(5)
    case 6: ROWS(6)
    case 7: ROWS(7)
    default: ROWS(ROW_BLOCK)
    }
#undef ROWS
}

/* panel_rows for bf16 x, panel (pair layout) and y: the same blocking, two input rows per step. */
static inline __attribute__((always_inline)) void panel_rows_bf16(const bf16_t *restrict x, int64_t x_stride,
                                                                  const bf16_t *restrict panel, const float *bias,
                                                                  int64_t in, bf16_t *restrict y, int64_t y_stride,
                                                                  int m, int64_t cols, int first, const char *ahead,
                                                                  int64_t phase, int64_t step) {
    f16 acc[ROW_BLOCK][2];
    f16 b0 = {0}, b1 = {0};
    if (bias) b0 = load16(bias), b1 = load16(bias + 16);
    for (int r = 0; r < m; ++r) acc[r][0] = b0, acc[r][1] = b1;
    int64_t pairs = in / 2;
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
        const bf16_t *w = panel + k2 * 2 * PANEL_COLS;
        if (first) __builtin_prefetch(w + 32 * PANEL_COLS, 0, 3); /* 2 KiB ahead, into L1 */
        if (ahead && k2 == phase) prefetch_panel_line(ahead + k2 * PANEL_LINE), phase += step;
#ifdef __AVX512BF16__
        __m512bh w0, w1;
        __builtin_memcpy(&w0, w, sizeof w0);
        __builtin_memcpy(&w1, w + PANEL_COLS, sizeof w1);
        for (int r = 0; r < m; ++r) {
            int32_t xp;
            __builtin_memcpy(&xp, x + r * x_stride + 2 * k2, sizeof xp);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
            acc[r][0] = (f16)_mm512_dpbf16_ps((__m512)acc[r][0], w0, xv);
            acc[r][1] = (f16)_mm512_dpbf16_ps((__m512)acc[r][1], w1, xv);
        }
#else
        u32x16 p0, p1, high = {0};
        high -= 0x10000u; /* 0xffff0000 in every lane */
        __builtin_memcpy(&p0, w, sizeof p0);
        __builtin_memcpy(&p1, w + PANEL_COLS, sizeof p1);
        u32x16 e0u = p0 << 16, o0u = p0 & high, e1u = p1 << 16, o1u = p1 & high;
        f16 e0, o0, e1, o1;
        __builtin_memcpy(&e0, &e0u, sizeof e0), __builtin_memcpy(&o0, &o0u, sizeof o0);
        __builtin_memcpy(&e1, &e1u, sizeof e1), __builtin_memcpy(&o1, &o1u, sizeof o1);
        for (int r = 0; r < m; ++r) {
            float x0 = bf16_to_float(x[r * x_stride + 2 * k2]), x1 = bf16_to_float(x[r * x_stride + 2 * k2 + 1]);
            acc[r][0] += x0 * e0 + x1 * o0;
            acc[r][1] += x0 * e1 + x1 * o1;
        }
#endif
    }
    if (in & 1) { /* the odd last input row: its pair's second half is zero padding */
        u32x16 p0, p1;
        __builtin_memcpy(&p0, panel + pairs * 2 * PANEL_COLS, sizeof p0);
        __builtin_memcpy(&p1, panel + pairs * 2 * PANEL_COLS + PANEL_COLS, sizeof p1);
        p0 <<= 16, p1 <<= 16;
        f16 e0, e1;
        __builtin_memcpy(&e0, &p0, sizeof e0), __builtin_memcpy(&e1, &p1, sizeof e1);
        for (int r = 0; r < m; ++r) {
            float xv = bf16_to_float(x[r * x_stride + in - 1]);
            acc[r][0] += xv * e0;
            acc[r][1] += xv * e1;
        }
    }
    if (cols == PANEL_COLS) {
        for (int r = 0; r < m; ++r)
            store16_bf16(y + r * y_stride, acc[r][0]), store16_bf16(y + r * y_stride + 16, acc[r][1]);
        return;
    }
    for (int r = 0; r < m; ++r) { /* the last, partial panel */
        float out[PANEL_COLS];
        store16(out, acc[r][0]), store16(out + 16, acc[r][1]);
        for (int64_t c = 0; c < cols; ++c) y[r * y_stride + c] = float_to_bf16(out[c]);
    }
}

static void panel_block_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *panel, const float *bias, int64_t in,
                             bf16_t *y, int64_t y_stride, int64_t m, int64_t cols, int first, const char *ahead,
                             int64_t phase, int64_t step) {
#define ROWS(n)                                                                                                  \
    if (first)                                                                                                   \
        panel_rows_bf16(x, x_stride, panel, bias, in, y, y_stride, n, cols, 1, ahead, phase, step);              \
    else                                                                                                         \
        panel_rows_bf16(x, x_stride, panel, bias, in, y, y_stride, n, cols, 0, ahead, phase, step);              \
    break;
    switch (m) {
    case 1: ROWS(1)
    case 2: ROWS(2)
    case 3: ROWS(3)
    case 4: ROWS(4)
    case 5: ROWS(5)
    case 6: ROWS(6)
    case 7: ROWS(7)
    default: ROWS(ROW_BLOCK)
    }
#undef ROWS
}

/* AMX (where the build targets it and the kernel grants the tiles): blocks of up to 32 rows x one panel, tiles
 * 0-3 accumulating [rows 0-15, 16-31] x [columns 0-15, 16-31] in fp32, 4-5 the rows of x, 6-7 the panel's two
 * halves (its pair layout is AMX's B operand, 128 bytes a row). 32 inputs per step, so in % 32 == 0. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_K 32

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles of x and of the output hold m rows (1..16); the panel tiles always 16 pairs of inputs. */
static void amx_configure(int m) {
    struct tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = t < 6 ? m : 16;
    _tile_loadconfig(&config);
}

/* y[0:m, 0:cols] for m rows of x (the configured tile rows, or twice them when two) and one panel. */
static void amx_block(const bf16_t *x, int64_t x_stride, const bf16_t *panel, const float *bias, int64_t in,
                      bf16_t *y, int64_t y_stride, int64_t cols, int64_t m, int two) {
    float out[32][PANEL_COLS];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < in; k += AMX_K) {
        _tile_loadd(6, panel + k * PANEL_COLS, 4 * PANEL_COLS);
        _tile_loadd(7, panel + k * PANEL_COLS + 32, 4 * PANEL_COLS);
        _tile_loadd(4, x + k, 2 * x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * x_stride + k, 2 * x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out[0], 4 * PANEL_COLS);
    _tile_stored(1, out[0] + 16, 4 * PANEL_COLS);
    if (two) {
        _tile_stored(2, out[16], 4 * PANEL_COLS);
        _tile_stored(3, out[16] + 16, 4 * PANEL_COLS);
    }
    f16 b0 = {0}, b1 = {0};
    if (bias) b0 = load16(bias), b1 = load16(bias + 16);
    for (int64_t r = 0; r < m; ++r) {
        f16 v0 = load16(out[r]) + b0, v1 = load16(out[r] + 16) + b1;
        if (cols == PANEL_COLS) {
            store16_bf16(y + r * y_stride, v0), store16_bf16(y + r * y_stride + 16, v1);
            continue;
        }
        store16(out[r], v0), store16(out[r] + 16, v1);
        for (int64_t c = 0; c < cols; ++c) y[r * y_stride + c] = float_to_bf16(out[r][c]);
    }
}

/* Every row of panels first..last-1 through the tiles: whole blocks of 16 rows in passes (as gemm_work), then
 * the last rows (fewer than 16) with the tiles cut to them. */
static void amx_rows(const struct gemm_args *a, int64_t first, int64_t last) {
    int64_t in = a->in_features, full = a->rows / 16 * 16, tail = a->rows - full, stride = in + (in & 1);
    const bf16_t *x = a->x;
    bf16_t *y = a->y;
    if (full) amx_configure(16);
    for (int64_t r0 = 0; r0 < full; r0 += ROWS_PER_PASS) {
        int64_t r1 = full - r0 < ROWS_PER_PASS ? full : r0 + ROWS_PER_PASS;
        for (int64_t p = first; p < last; ++p) {
            int64_t left = a->out_features - p * PANEL_COLS, cols = left < PANEL_COLS ? left : PANEL_COLS;
            for (int64_t m0 = r0; m0 < r1; m0 += 32)
                amx_block(x + m0 * a->x_stride, a->x_stride, (const bf16_t *)a->w_panels + p * stride * PANEL_COLS,
                          a->bias ? a->bias + p * PANEL_COLS : 0, in, y + m0 * a->y_stride + p * PANEL_COLS,
                          a->y_stride, cols, r1 - m0 >= 32 ? 32 : 16, r1 - m0 >= 32);
        }
    }
    if (tail) {
        amx_configure(tail);
        for (int64_t p = first; p < last; ++p) {
            int64_t left = a->out_features - p * PANEL_COLS, cols = left < PANEL_COLS ? left : PANEL_COLS;
            amx_block(x + full * a->x_stride, a->x_stride, (const bf16_t *)a->w_panels + p * stride * PANEL_COLS,
                      a->bias ? a->bias + p * PANEL_COLS : 0, in, y + full * a->y_stride + p * PANEL_COLS,
                      a->y_stride, cols, tail, 0);
        }
    }
    _tile_release();
}
#endif

/* Asks the kernel for the AMX tile state (once per process); 1 when this build can use it and it was granted. */
int gemm_amx_ready(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

static void gemm_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct gemm_args *a = p;
    int64_t in = a->in_features, panels = (a->out_features + PANEL_COLS - 1) / PANEL_COLS;
    /* Contiguous panel ranges: each thread streams one stretch of the packed weight. */
    int64_t first = panels * tid / nthreads, last = panels * (tid + 1) / nthreads;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    /* The tiles win from one row on: 512 x 1408, one thread, 21 us against 33 us for the vector loop at 1 row,
     * 41 against 300 us (fp32) at 32 rows, 1.5 against 8.7 ms at 1,024 (oneDNN's AMX bf16: 1.2 ms). */
    if (a->kind == GEMM_BF16_AMX && in % AMX_K == 0) {
        amx_rows(a, first, last);
        return;
    }
#endif
    int64_t panel_bytes = a->kind == GEMM_FP32 ? in * PANEL_COLS * 4 : (in + (in & 1)) * PANEL_COLS * 2;
    for (int64_t r0 = 0; r0 < a->rows; r0 += ROWS_PER_PASS) {
        int64_t r1 = a->rows - r0 < ROWS_PER_PASS ? a->rows : r0 + ROWS_PER_PASS;
        int64_t blocks = (r1 - r0 + ROW_BLOCK - 1) / ROW_BLOCK;
        for (int64_t p = first; p < last; ++p) {
            const float *bias = a->bias ? a->bias + p * PANEL_COLS : 0;
            int64_t left = a->out_features - p * PANEL_COLS, cols = left < PANEL_COLS ? left : PANEL_COLS;
            const char *panel = (const char *)a->w_panels + p * panel_bytes;
            const char *ahead = p + 2 < last ? panel + 2 * panel_bytes : 0;
            for (int64_t m0 = r0, b = 0; m0 < r1; m0 += ROW_BLOCK, ++b) {
                int64_t m = r1 - m0 < ROW_BLOCK ? r1 - m0 : ROW_BLOCK;
                if (a->kind != GEMM_FP32)
                    panel_block_bf16((const bf16_t *)a->x + m0 * a->x_stride, a->x_stride, (const bf16_t *)panel,
                                     bias, in, (bf16_t *)a->y + m0 * a->y_stride + p * PANEL_COLS, a->y_stride, m,
                                     cols, m0 == r0, ahead, b, blocks);
                else
                    panel_block((const float *)a->x + m0 * a->x_stride, a->x_stride, (const float *)panel, bias,
                                in, (float *)a->y + m0 * a->y_stride + p * PANEL_COLS, a->y_stride, m, cols,
                                m0 == r0, ahead, b, blocks);
            }
        }
    }
}

/* y = x @ W^T (+ bias) for `rows` rows; w_panels as described above, bias (or NULL, fp32) padded to whole
 * panels. kind GEMM_BF16 or GEMM_BF16_AMX: x, w_panels and y are bf16. */
void panel_linear(const void *x, int64_t x_stride, void *y, int64_t y_stride, int64_t rows, int64_t in_features,
                  int64_t out_features, const void *w_panels, const float *bias, int64_t kind, int64_t num_threads) {
    struct gemm_args args = {x, w_panels, bias, y, x_stride, y_stride, rows, in_features, out_features, kind};
    parallel(gemm_work, &args, num_threads);
}

/* Whether this build computes with 512-bit vectors (the panels beat oneDNN only where it does). */
int gemm_uses_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
