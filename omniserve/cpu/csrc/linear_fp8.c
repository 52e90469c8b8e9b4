/*
 * y = x @ w.T (+ bias) with w stored as FP8 (e4m3fn) bytes, in omniserve/layers/quantization.py's
 * layout: weight [N, K] (a byte per weight) and fp32 scales [N, K / g]; w[n, k] = e4m3(weight[n, k])
 * * scale in fp32, rounded once to the activation type (bf16: to nearest even), exactly as the
 * torch reference dequantizes. The product's loop is decoded_linear.h's, the decoding
 * decode_fp8.h's. Built by omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "decode_fp8.h"
#include "decoded_linear.h"

#define SAME(v) (v)
#define IN_ORDER(group_size) 0
DEFINE_DECODED_LINEAR(fp8, f32, float, gemm_block_f32, SAME, 8, fp8_decode_f32, fp8_decode_f32,
                      IN_ORDER)
DEFINE_DECODED_LINEAR(fp8, bf16, bf16, gemm_block_bf16_f32, to_bf16, 8, fp8_decode_bf16,
                      fp8_decode_bf16, IN_ORDER)

/* omniserve_linear_fp8_rows_*: for up to 7 rows of x, without the scratch. Each thread takes a run
 * of R-row tiles of w (R = 4 / M, at least 1) and decodes them 32 weights at a time straight into
 * the dot products (x read from L1), two accumulators per (x row, w row) so the adds are not one
 * chain; a group's sums are scaled once when it ends (its scale times 2^8). Reads each weight
 * once and stores nothing but y: at one row it streams a decode step's bytes about as fast as
 * the memory gives them, where decoding into a scratch first was compute-bound. How many rows it
 * takes before the scratch's tiles win is measured in omniserve/cpu/linear.py. */
#define DEFINE_FP8_ROWS_TILE(NAME, T, LOAD_X, MM, RR)                                           \
    static inline __attribute__((always_inline)) void NAME(                                     \
        const T *x, int64_t ldx, const uint8_t *w, const float *scales, int64_t K,              \
        int64_t group_size, float out[7][4]) {                                                  \
        const int64_t groups = K / group_size;                                                  \
        vec acc[MM][RR];                                                                        \
        for (int m = 0; m < MM; ++m)                                                            \
            for (int r = 0; r < RR; ++r) acc[m][r] = splat(0.0f);                               \
        for (int64_t g = 0; g < groups; ++g) {                                                  \
            vec part[MM][RR][2];                                                                \
            for (int m = 0; m < MM; ++m)                                                        \
                for (int r = 0; r < RR; ++r) part[m][r][0] = part[m][r][1] = splat(0.0f);       \
            for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 2 * LANES) {        \
                for (int r = 0; r < RR; ++r) {                                                  \
                    const uint8_t *c = w + r * K + k;                                           \
                    if (k % 64 == 0) prefetch_ahead(c, RR * K);                                 \
                    vec v[2];                                                                   \
                    decode32(c, splat(1.0f), v);                                                \
                    for (int m = 0; m < MM; ++m) { /* x from L1 (the same rows for every r) */  \
                        part[m][r][0] += LOAD_X(x + m * ldx + k) * v[0];                        \
                        part[m][r][1] += LOAD_X(x + m * ldx + k + LANES) * v[1];                \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int r = 0; r < RR; ++r) {                                                      \
                const vec scale = splat(scales[r * groups + g] * 256.0f);                       \
                for (int m = 0; m < MM; ++m)                                                    \
                    acc[m][r] += (part[m][r][0] + part[m][r][1]) * scale;                       \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MM; ++m)                                                            \
            for (int r = 0; r < RR; ++r) out[m][r] = lane_sum(acc[m][r]);                       \
    }

#define DEFINE_FP8_ROWS(SUFFIX, T, LOAD_X, FROM_T, TO_T)                                        \
    DEFINE_FP8_ROWS_TILE(rows_tile_1x4_##SUFFIX, T, LOAD_X, 1, 4)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_2x2_##SUFFIX, T, LOAD_X, 2, 2)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_3x1_##SUFFIX, T, LOAD_X, 3, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_4x1_##SUFFIX, T, LOAD_X, 4, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_5x1_##SUFFIX, T, LOAD_X, 5, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_6x1_##SUFFIX, T, LOAD_X, 6, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_7x1_##SUFFIX, T, LOAD_X, 7, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_1x1_##SUFFIX, T, LOAD_X, 1, 1)                               \
    DEFINE_FP8_ROWS_TILE(rows_tile_2x1_##SUFFIX, T, LOAD_X, 2, 1)                               \
    int omniserve_linear_fp8_rows_##SUFFIX(const T *x, int64_t M, int64_t ldx,                  \
                                           const uint8_t *weight, const uint8_t *unused,        \
                                           const float *scales, int64_t N, int64_t K,           \
                                           int64_t group_size, const T *bias, T *y,             \
                                           int64_t ldy, int num_threads) {                      \
        (void)unused;                                                                           \
        if (M < 1 || M > 7) return -1;                                                          \
        const int64_t R = M == 1 ? 4 : M == 2 ? 2 : 1, groups = K / group_size;                 \
        const int64_t tiles = (N + R - 1) / R;                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                   \
        for (int64_t t = 0; t < tiles; ++t) {                                                   \
            const int64_t n = t * R, rows = N - n < R ? N - n : R;                              \
            const uint8_t *w = weight + n * K;                                                  \
            const float *s = scales + n * groups;                                               \
            float out[7][4];                                                                    \
            if (rows == R && M == 1 && R == 4)                                                  \
                rows_tile_1x4_##SUFFIX(x, ldx, w, s, K, group_size, out);                       \
            else if (rows == R && M == 2)                                                       \
                rows_tile_2x2_##SUFFIX(x, ldx, w, s, K, group_size, out);                       \
            else                                                                                \
                for (int64_t r = 0; r < rows; ++r) {                                            \
                    float one[7][4];                                                            \
                    const uint8_t *wr = w + r * K;                                              \
                    const float *sr = s + r * groups;                                           \
                    switch (M) {                                                                \
                    case 1: rows_tile_1x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    case 2: rows_tile_2x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    case 3: rows_tile_3x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    case 4: rows_tile_4x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    case 5: rows_tile_5x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    case 6: rows_tile_6x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one); break;  \
                    default: rows_tile_7x1_##SUFFIX(x, ldx, wr, sr, K, group_size, one);        \
                    }                                                                           \
                    for (int64_t m = 0; m < M; ++m) out[m][r] = one[m][0];                      \
                }                                                                               \
            for (int64_t m = 0; m < M; ++m)                                                     \
                for (int64_t r = 0; r < rows; ++r)                                              \
                    y[m * ldy + n + r] = TO_T(out[m][r] + (bias ? FROM_T(bias[n + r]) : 0.0f)); \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_FP8_ROWS(f32, float, load, SAME, SAME)
DEFINE_FP8_ROWS(bf16, bf16, load_bf16, from_bf16, to_bf16)
