/*
 * y = x @ w.T (+ bias) for a few rows of x, on w in the checkpoint's [N, K] layout.
 *
 * For weights that must keep that layout because another layer reads them too (an LM head tied
 * to the token embedding): oneDNN's fast path needs its own packed copy. With a few rows the
 * product is bound by streaming w, which gemm_nt.h's tiles read once per block of rows while
 * every row tile of x passes over it (from L2). fp32, bf16 (fp32 accumulation, bf16 output
 * rounded once), and fp32 rows on a bf16 weight (widened exactly). K must be a multiple of 32 (the
 * caller checks). Built by omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "gemm_nt.h"

#define BLOCK 48 /* rows of w per work item (8 tiles): stays in L2 across the row tiles of x */

#define DEFINE_LINEAR_ROWS(NAME, T, TW, GEMM_BLOCK)                                               \
    void NAME(const T *x, int64_t M, int64_t ldx, const TW *w, int64_t N, int64_t K,             \
              const T *bias, T *y, int64_t ldy, int num_threads) {                                \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK;                                           \
        _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")                    \
        for (int64_t b = 0; b < blocks; ++b) {                                                    \
            const int64_t n0 = b * BLOCK, rows = N - n0 < BLOCK ? N - n0 : BLOCK;                 \
            GEMM_BLOCK(x, M, ldx, w + n0 * K, K, rows, K, bias ? bias + n0 : NULL, y + n0, ldy,   \
                       0);                                                                        \
        }                                                                                         \
    }

DEFINE_LINEAR_ROWS(omniserve_linear_rows_f32, float, float, gemm_block_f32)
DEFINE_LINEAR_ROWS(omniserve_linear_rows_bf16, bf16, bf16, gemm_block_bf16)
/* fp32 rows on a bf16 weight (a tied head of a bf16 checkpoint computed in fp32) */
DEFINE_LINEAR_ROWS(omniserve_linear_rows_f32_bf16w, float, bf16, gemm_block_f32_bf16w)
