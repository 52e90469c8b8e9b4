/*
 * Register tiles of y[i][j] = sum_k x_i[k] * w_j[k] where both operands run along k ("NT"): the
 * checkpoint's [out_features, in_features] layout is used as it is, so no packed copy of a
 * weight ever exists. Each (i, j) pair accumulates a vector of partial sums over k, and four
 * pairs are reduced together at the end (a partial transpose), amortised over K / KSTEP steps.
 *
 * bf16 on a CPU with AVX512-BF16: one vdpbf16ps per 32 k (products of bf16 pairs summed in fp32);
 * elsewhere bf16 is widened to fp32 and multiplied there. fp32 accumulation throughout.
 * x rows are ldx elements apart; w rows are given as NR pointers (so gate and up rows of a MoE
 * expert can share a tile). K must be a multiple of KSTEP.
 */
#ifndef OMNISERVE_GEMM_NT_H
#define OMNISERVE_GEMM_NT_H

#include <stdint.h>

#include "vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MR 4     /* x rows per tile */
#define NR 6     /* w rows per tile (24 accumulators: the best of 6x4, 8x3, 5x5, 4x6, 3x8, 2x12 at
                  * 8-64 rows, measured on the real LM head's shape) */
#define KSTEP 32 /* k per step: 32 bf16 or 2 x 16 fp32 */

/* The sums of the lanes of a, b, c and d (a partial transpose: three shuffle-and-add levels
 * instead of four full horizontal sums). */
static inline void reduce4(vec a, vec b, vec c, vec d, float out[4]) {
    const vec ab = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                           28, 14, 30) +
                   __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                           29, 15, 31);
    const vec cd = __builtin_shufflevector(c, d, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                           28, 14, 30) +
                   __builtin_shufflevector(c, d, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                           29, 15, 31);
    /* ab = [a b a b ...] partial sums, cd alike; now [a b c d] in every group of four */
    const vec abcd = __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                             13, 28, 29) +
                     __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27,
                                             14, 15, 30, 31);
    for (int j = 0; j < 4; ++j) out[j] = (abcd[j] + abcd[j + 4]) + (abcd[j + 8] + abcd[j + 12]);
}

/* y[i][j] = the lane sum of acc[i][j], four pairs at a time. */
static inline __attribute__((always_inline)) void reduce_tile(vec acc[MR][NR], const int mr,
                                                              float y[MR][NR]) {
    for (int i = 0; i < mr; ++i) {
        float sums[4];
        reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y[i]);
        reduce4(acc[i][4], acc[i][5], (vec){0}, (vec){0}, sums);
        y[i][4] = sums[0];
        y[i][5] = sums[1];
    }
}

/* A tile multiplied in fp32: x and w rows loaded (widened where bf16) into fp32 vectors. */
#define DEFINE_TILE_FP32(NAME, TX, LOAD_X, TW, LOAD_W)                                             \
    static inline __attribute__((always_inline)) void NAME(const TX *x, int64_t ldx,              \
                                                           const TW *const w[NR], int64_t K,      \
                                                           float y[MR][NR], const int mr) {       \
        vec acc[MR][NR];                                                                          \
        for (int i = 0; i < mr; ++i)                                                              \
            for (int j = 0; j < NR; ++j) acc[i][j] = (vec){0};                                    \
        for (int64_t k = 0; k < K; k += LANES) {                                                  \
            vec wv[NR];                                                                           \
            for (int j = 0; j < NR; ++j) wv[j] = LOAD_W(w[j] + k);                                \
            for (int i = 0; i < mr; ++i) {                                                        \
                const vec xv = LOAD_X(x + i * ldx + k);                                           \
                for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];                             \
            }                                                                                     \
        }                                                                                         \
        reduce_tile(acc, mr, y);                                                                  \
    }
DEFINE_TILE_FP32(tile_f32, float, load, float, load)
/* fp32 activations on bf16 weights (a bf16 checkpoint computed in fp32): exact widening. */
DEFINE_TILE_FP32(tile_f32_bf16w, float, load, bf16, load_bf16)

#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void
tile_bf16(const bf16 *x, int64_t ldx, const bf16 *const w[NR], int64_t K, float y[MR][NR],
          const int mr) {
    vec acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = (vec){0};
    for (int64_t k = 0; k < K; k += KSTEP) {
        __m512i wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w[j] + k);
        for (int i = 0; i < mr; ++i) {
            const __m512i xv = _mm512_loadu_si512(x + i * ldx + k);
            for (int j = 0; j < NR; ++j)
                acc[i][j] = (vec)_mm512_dpbf16_ps((__m512)acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    reduce_tile(acc, mr, y);
}
#else
DEFINE_TILE_FP32(tile_bf16, bf16, load_bf16, bf16, load_bf16)
#endif

/* The tiles with the row count a compile-time constant, so the accumulators stay in registers. */
#define DEFINE_TILE_ROWS(NAME, TILE, TX, TW)                                                      \
    static void NAME(const TX *x, int64_t ldx, int mr, const TW *const w[NR], int64_t K,          \
                     float y[MR][NR]) {                                                           \
        switch (mr) {                                                                             \
        case 1: TILE(x, ldx, w, K, y, 1); break;                                                  \
        case 2: TILE(x, ldx, w, K, y, 2); break;                                                  \
        case 3: TILE(x, ldx, w, K, y, 3); break;                                                  \
        default: TILE(x, ldx, w, K, y, 4); break;                                                 \
        }                                                                                         \
    }
DEFINE_TILE_ROWS(tile_rows_f32, tile_f32, float, float)
DEFINE_TILE_ROWS(tile_rows_f32_bf16w, tile_f32_bf16w, float, bf16)
DEFINE_TILE_ROWS(tile_rows_bf16, tile_bf16, bf16, bf16)

/* y[i][c] = x_i . w_c (+ bias[c]) for every row i < M of x and the rows c < rows of a block of w
 * (ldw elements apart): each row tile of x passes over the whole block, which stays in cache
 * between them. bias (or NULL, of x's type T) and y start at the block's first row; y (of type Y:
 * T, or fp32 for partial sums) is rounded once. w is of type TW (T, or bf16 under fp32 x). With
 * accumulate, the products add to y: a K-slice of a longer product. */
#define DEFINE_GEMM_BLOCK(NAME, T, TW, Y, TILE_ROWS, TO_Y, FROM_Y, FROM_T)                         \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const T *x, int64_t M, int64_t ldx, const TW *w, int64_t ldw, int64_t rows, int64_t K,    \
        const T *bias, Y *y, int64_t ldy, int accumulate) {                                       \
        for (int64_t m = 0; m < M; m += MR) {                                                     \
            const int mr = (int)(M - m < MR ? M - m : MR);                                        \
            for (int64_t n = 0; n < rows; n += NR) {                                              \
                const TW *tile[NR];                                                               \
                for (int c = 0; c < NR; ++c)                                                      \
                    tile[c] = w + (n + c < rows ? n + c : rows - 1) * ldw;                        \
                float out[MR][NR];                                                                \
                TILE_ROWS(x + m * ldx, ldx, mr, tile, K, out);                                    \
                for (int i = 0; i < mr; ++i)                                                      \
                    for (int c = 0; c < NR && n + c < rows; ++c) {                                \
                        Y *dst = y + (m + i) * ldy + n + c;                                       \
                        float sum = out[i][c] + (bias ? FROM_T(bias[n + c]) : 0.0f);              \
                        if (accumulate) sum += FROM_Y(*dst);                                      \
                        *dst = TO_Y(sum);                                                         \
                    }                                                                             \
            }                                                                                     \
        }                                                                                         \
    }
#define GEMM_NT_SAME(v) (v)
DEFINE_GEMM_BLOCK(gemm_block_f32, float, float, float, tile_rows_f32, GEMM_NT_SAME, GEMM_NT_SAME,
                  GEMM_NT_SAME)
DEFINE_GEMM_BLOCK(gemm_block_f32_bf16w, float, bf16, float, tile_rows_f32_bf16w, GEMM_NT_SAME,
                  GEMM_NT_SAME, GEMM_NT_SAME)
DEFINE_GEMM_BLOCK(gemm_block_bf16, bf16, bf16, bf16, tile_rows_bf16, to_bf16, from_bf16,
                  from_bf16)
DEFINE_GEMM_BLOCK(gemm_block_bf16_f32, bf16, bf16, float, tile_rows_bf16, GEMM_NT_SAME,
                  GEMM_NT_SAME, from_bf16)

#endif
