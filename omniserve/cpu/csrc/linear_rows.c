/*
 * y = x @ w.T (+ bias) for a few rows of x, on w in the checkpoint's [N, K] layout.
 *
 * For weights that must keep that layout because another layer reads them too (an LM head tied
 * to the token embedding): oneDNN's fast path needs its own packed copy. With a few rows the
 * product is bound by streaming w, which gemm_nt.h's tiles read once per block of rows while
 * every row tile of x passes over it (from L2). fp32 and bf16 (fp32 accumulation, bf16 output
 * rounded once). K must be a multiple of 32 (the caller checks). Built by omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "gemm_nt.h"

#define BLOCK 48 /* rows of w per work item (8 tiles): stays in L2 across the row tiles of x */

#define DEFINE_LINEAR_ROWS(NAME, T, TILE_ROWS, TO_T, FROM_T)                                      \
    void NAME(const T *x, int64_t M, int64_t ldx, const T *w, int64_t N, int64_t K,              \
              const T *bias, T *y, int64_t ldy, int num_threads) {                                \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK;                                           \
        _Pragma("omp parallel for schedule(dynamic) num_threads(num_threads)")                    \
        for (int64_t b = 0; b < blocks; ++b) {                                                    \
            const int64_t n1 = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;                         \
            for (int64_t m = 0; m < M; m += MR) {                                                 \
                const int mr = (int)(M - m < MR ? M - m : MR);                                    \
                for (int64_t n = b * BLOCK; n < n1; n += NR) {                                    \
                    const T *rows[NR];                                                            \
                    for (int c = 0; c < NR; ++c) rows[c] = w + (n + c < n1 ? n + c : n1 - 1) * K; \
                    float out[MR][NR];                                                            \
                    TILE_ROWS(x + m * ldx, ldx, mr, rows, K, out);                                \
                    for (int i = 0; i < mr; ++i)                                                  \
                        for (int c = 0; c < NR && n + c < n1; ++c)                                \
                            y[(m + i) * ldy + n + c] =                                            \
                                TO_T(out[i][c] + (bias ? FROM_T(bias[n + c]) : 0.0f));            \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

#define IDENTITY(v) (v)
DEFINE_LINEAR_ROWS(omniserve_linear_rows_f32, float, tile_rows_f32, IDENTITY, IDENTITY)
DEFINE_LINEAR_ROWS(omniserve_linear_rows_bf16, bf16, tile_rows_bf16, to_bf16, from_bf16)
