/* Dense projections on CPU (fp32): y = x @ W^T (+ bias) over weights packed in panels.
 *
 * W^T ([in, out]) is packed as panels of PANEL_COLS output columns, each panel [in][PANEL_COLS] contiguous
 * (the last one zero-padded), so a panel streams front to back while a block of up to ROW_BLOCK input rows
 * accumulates 2 x ROW_BLOCK vectors in registers. Measured with bench/linear_cpu.py (the engine benchmark's
 * shapes, both cores of a Zen 5 host): against oneDNN's packed matmul, 0.99-1.05x from 16 to 256 rows, 1.1x
 * at 1,024, and 1.3-2x at 1-8 rows, where oneDNN stays well below the memory bandwidth. Unlike oneDNN it
 * keeps no code per row count.
 */
#include "cpu_common.h"

#define PANEL_COLS 32
#define ROW_BLOCK 8
/* Rows per pass over the panels: a pass's rows of x stay in L2 while the panels stream. */
#define ROWS_PER_PASS 256

struct gemm_args {
    const float *x, *w_panels, *bias;
    float *y;
    int64_t x_stride, y_stride, rows, in_features, out_features;
};

/* y[r, 0:cols] = bias + x[r] @ panel for m rows (m <= ROW_BLOCK). m and first are constants at each call site
 * (see panel_block), so the accumulators stay in registers. `first` marks the first row block of a panel,
 * which streams the panel in from memory and prefetches it ahead; later row blocks find it in L2. */
static inline __attribute__((always_inline)) void panel_rows(const float *restrict x, int64_t x_stride,
                                                             const float *restrict panel, const float *bias,
                                                             int64_t in, float *restrict y, int64_t y_stride, int m,
                                                             int64_t cols, int first) {
    f16 acc[ROW_BLOCK][2];
    f16 b0 = {0}, b1 = {0};
    if (bias) b0 = load16(bias), b1 = load16(bias + 16);
    for (int r = 0; r < m; ++r) acc[r][0] = b0, acc[r][1] = b1;
    for (int64_t k = 0; k < in; ++k) {
        if (first) __builtin_prefetch(panel + (k + 16) * PANEL_COLS, 0, 3); /* 2 KiB ahead, into L1 */
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
                        float *y, int64_t y_stride, int64_t m, int64_t cols, int first) {
    /* A constant row count (and first) per call lets the compiler keep the accumulators in registers. */
#define ROWS(n)                                                                                                  \
    if (first)                                                                                                   \
        panel_rows(x, x_stride, panel, bias, in, y, y_stride, n, cols, 1);                                       \
    else                                                                                                         \
        panel_rows(x, x_stride, panel, bias, in, y, y_stride, n, cols, 0);                                       \
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

static void gemm_work(const void *p, int64_t tid, int64_t nthreads) {
    const struct gemm_args *a = p;
    int64_t in = a->in_features, panels = (a->out_features + PANEL_COLS - 1) / PANEL_COLS;
    /* Contiguous panel ranges: each thread streams one stretch of the packed weight. */
    int64_t first = panels * tid / nthreads, last = panels * (tid + 1) / nthreads;
    for (int64_t r0 = 0; r0 < a->rows; r0 += ROWS_PER_PASS) {
        int64_t r1 = a->rows - r0 < ROWS_PER_PASS ? a->rows : r0 + ROWS_PER_PASS;
        for (int64_t p = first; p < last; ++p) {
            const float *panel = a->w_panels + p * in * PANEL_COLS;
            const float *bias = a->bias ? a->bias + p * PANEL_COLS : 0;
            int64_t left = a->out_features - p * PANEL_COLS, cols = left < PANEL_COLS ? left : PANEL_COLS;
            for (int64_t m0 = r0; m0 < r1; m0 += ROW_BLOCK)
                panel_block(a->x + m0 * a->x_stride, a->x_stride, panel, bias, in,
                            a->y + m0 * a->y_stride + p * PANEL_COLS, a->y_stride,
                            r1 - m0 < ROW_BLOCK ? r1 - m0 : ROW_BLOCK, cols, m0 == r0);
        }
    }
}

/* y = x @ W^T (+ bias) for `rows` rows; w_panels as described above, bias (or NULL) padded to whole panels. */
void panel_linear(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t rows, int64_t in_features,
                  int64_t out_features, const float *w_panels, const float *bias, int64_t num_threads) {
    struct gemm_args args = {x, w_panels, bias, y, x_stride, y_stride, rows, in_features, out_features};
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
