/* Structured outputs: forbid the tokens a grammar's bitmask leaves out, in place, without expanding the mask.
 * Bit b of word w (LSB first) allows token 32 * w + b, the layout llguidance and xgrammar fill. Most words
 * are all ones or all zeros (a JSON grammar allows a few tokens, or nearly all of them), so whole words are
 * skipped or filled and only mixed ones are read bit by bit. */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, int64_t row_stride, const int64_t *rows, int64_t num_rows,
                         const int32_t *bitmask, int64_t words, int64_t vocab) {
    for (int64_t r = 0; r < num_rows; ++r) {
        float *row = logits + rows[r] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w < words; ++w) {
            uint32_t bits = mask[w];
            if (bits == UINT32_MAX)
                continue;
            int64_t first = w * 32, end = first + 32 < vocab ? first + 32 : vocab;
            for (int64_t t = first; t < end; ++t)
                if (!((bits >> (t - first)) & 1u))
                    row[t] = -INFINITY;
        }
        for (int64_t t = words * 32; t < vocab; ++t) /* past the mask: not in the grammar's vocabulary */
            row[t] = -INFINITY;
    }
}
