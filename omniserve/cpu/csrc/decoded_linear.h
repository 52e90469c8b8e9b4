/*
 * The product y = x @ w.T (+ bias) for a few rows of x on a weight stored as codes that a decoder
 * turns into x's type (4-bit codes in linear_int4.c, e4m3 bytes in linear_fp8.c), with one fp32
 * scale per row and group of group_size features (and, for 4-bit, a zero point).
 *
 * Each thread takes a contiguous run of BLOCK-row blocks of w (one stream of codes, prefetched
 * ahead) and decodes them one tile's rows (NR) at a time into its scratch, then runs gemm_nt.h's
 * tiles for every row tile of x over them: the codes are read from memory once per call, whatever
 * M. Rows of more than SLICE features are decoded and multiplied a slice at a time, summed in
 * fp32, so the scratch stays in L1. A decoder may write each CHUNK features in another order
 * (INTERLEAVED); x is then reordered to match once per call: the dot products do not depend on
 * the order. The dequantization decodes the whole [N, K] weight in order, for batches a matmul
 * library multiplies faster. K and the group size must be multiples of 32 (the caller checks).
 *
 * A decoder: (codes, zero points or NULL, scales, groups, group_size, ahead, out) decodes that
 * many groups one after the other (whole rows of w are a run of groups, as their codes, zero
 * points and scales are), prefetching `ahead` bytes past each code it reads.
 */
#ifndef OMNISERVE_DECODED_LINEAR_H
#define OMNISERVE_DECODED_LINEAR_H

#include <stdint.h>
#include <stdlib.h>

#include "gemm_nt.h"

#define BLOCK 48  /* rows of w per work item (8 tiles) */
#define SLICE 2048 /* most features per pass of the tiles (K 3,584 in one pass: 1.06x the time;
                    * in slices of 1,024: 1.27x) */

/* M rows of x (ldx apart) into out ([M, K]) in the interleaved order (vec.h); called by every
 * thread of a team, which share the rows. */
#define DEFINE_INTERLEAVE(NAME, T, ROW)                                                           \
    static void NAME(const T *x, int64_t M, int64_t ldx, int64_t K, T *out) {                     \
        _Pragma("omp for schedule(static)") for (int64_t m = 0; m < M; ++m)                       \
            ROW(x + m * ldx, K, out + m * K);                                                     \
    }
DEFINE_INTERLEAVE(interleave_f32, float, interleave_row_f32)
DEFINE_INTERLEAVE(interleave_bf16, bf16, interleave_row_bf16)

/* omniserve_linear_<FORMAT>_<SUFFIX> (returns 0, or -1 when it cannot allocate its scratch) and
 * omniserve_dequantize_<FORMAT>_<SUFFIX>, for codes of BITS bits decoded by DECODE (in order) and
 * DECODE_INTERLEAVED (used when INTERLEAVED(group_size)). */
#define DEFINE_DECODED_LINEAR(FORMAT, SUFFIX, T, SLICE_BLOCK, TO_T, BITS, DECODE,                 \
                              DECODE_INTERLEAVED, INTERLEAVED)                                    \
    int omniserve_linear_##FORMAT##_##SUFFIX(const T *x, int64_t M, int64_t ldx,                  \
                                       const uint8_t *qweight, const uint8_t *qzeros,             \
                                       const float *scales, int64_t N, int64_t K,                 \
                                       int64_t group_size, const T *bias, T *y, int64_t ldy,      \
                                       int num_threads) {                                         \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / group_size;                  \
        const int64_t slices = (K + SLICE - 1) / SLICE;                                           \
        const int64_t width = (groups + slices - 1) / slices * group_size; /* whole groups */     \
        const int interleaved = INTERLEAVED(group_size);                                          \
        T *xi = interleaved ? malloc(sizeof(T) * (size_t)(M * K)) : NULL; /* x reordered */       \
        if (interleaved && xi == NULL) return -1;                                                 \
        const T *xs = interleaved ? xi : x;                                                       \
        const int64_t ldxs = interleaved ? K : ldx;                                               \
        int status = 0;                                                                           \
        _Pragma("omp parallel num_threads(num_threads)") {                                        \
            if (interleaved) interleave_##SUFFIX(x, M, ldx, K, xi); /* then a barrier */          \
            /* a tile's rows of a K-slice of w [NR, width] (width * sizeof(T) is a multiple of    \
             * 64), and the slices' fp32 sums [M, NR] */                                          \
            T *w = aligned_alloc(64, sizeof(T) * (size_t)(NR * width));                           \
            float *sums = slices > 1 ? malloc(sizeof(float) * (size_t)(M * NR)) : NULL;           \
            const int ready = w != NULL && (slices == 1 || sums != NULL);                         \
            if (!ready) {                                                                         \
                _Pragma("omp atomic write") status = -1;                                          \
            }                                                                                     \
            _Pragma("omp for schedule(static)") for (int64_t b = 0; b < blocks; ++b) {            \
                if (!ready) continue;                                                             \
                const int64_t n1 = (b + 1) * BLOCK < N ? (b + 1) * BLOCK : N;                     \
                for (int64_t n = b * BLOCK; n < n1; n += NR) {                                    \
                    const int64_t rows = n1 - n < NR ? n1 - n : NR;                               \
                    for (int64_t k = 0; k < K; k += width) {                                      \
                        const int64_t cols = K - k < width ? K - k : width;                       \
                        /* the slice's groups row by row (whole rows: one run) */         \
                        const int64_t runs = cols == K ? 1 : rows;                                \
                        for (int64_t r = 0; r < runs; ++r) {                                      \
                            const int64_t g = (n + r) * groups + k / group_size;                  \
                            (interleaved ? DECODE_INTERLEAVED : DECODE)(                          \
                                qweight + g * group_size * BITS / 8, qzeros ? qzeros + g : NULL,  \
                                scales + g, cols / group_size * (rows / runs), group_size,        \
                                NR * K * BITS / 8,                                                \
                                w + r * cols);                                                    \
                        }                                                                         \
                        if (slices == 1)                                                          \
                            gemm_block_##SUFFIX(xs, M, ldxs, w, cols, rows, cols,                 \
                                                bias ? bias + n : NULL, y + n, ldy, 0);           \
                        else                                                                      \
                            SLICE_BLOCK(xs + k, M, ldxs, w, cols, rows, cols,                     \
                                        bias && k == 0 ? bias + n : NULL, sums, NR, k > 0);       \
                    }                                                                             \
                    if (slices > 1)                                                               \
                        for (int64_t i = 0; i < M; ++i)                                           \
                            for (int64_t c = 0; c < rows; ++c)                                    \
                                y[i * ldy + n + c] = TO_T(sums[i * NR + c]);                      \
                }                                                                                 \
            }                                                                                     \
            free(w);                                                                              \
            free(sums);                                                                           \
        }                                                                                         \
        free(xi);                                                                                 \
        return status;                                                                            \
    }                                                                                             \
                                                                                                  \
    void omniserve_dequantize_##FORMAT##_##SUFFIX(const uint8_t *qweight, const uint8_t *qzeros,  \
                                            const float *scales, int64_t N, int64_t K,            \
                                            int64_t group_size, T *w, int num_threads) {          \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / group_size;                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                     \
        for (int64_t b = 0; b < blocks; ++b) {                                                    \
            const int64_t n = b * BLOCK, rows = N - n < BLOCK ? N - n : BLOCK;                    \
            DECODE(qweight + n * K * BITS / 8, qzeros ? qzeros + n * groups : NULL,               \
                   scales + n * groups, rows * groups, group_size, NR * K * BITS / 8, w + n * K); \
        }                                                                                         \
    }

#endif
