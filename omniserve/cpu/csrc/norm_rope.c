/*
 * RMSNorm (bf16) and per-head q/k RMSNorm + rotary embedding in one in-place pass (fp32, bf16).
 *
 * In torch these are five to ten elementwise passes, each writing a full-size tensor; here each
 * row is read once, normalised (and rotated) while in cache, and written back. Every result is
 * rounded where transformers' ops round it, so the outputs equal torch's up to the order of the
 * norm's sum of squares:
 *   norm:  y = x * (1 / sqrt(mean(x^2) + eps)) in fp32, rounded to the element type, then
 *          weight * y, rounded again (transformers' RMSNorm: cast back, then scale).
 *   rope (neox): (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product and sum rounded to the
 *          element type (bf16 ops round every result; fp32 ones too, hence fp-contract off);
 *          with fp32 angles for bf16 q/k (the vision towers'), computed in fp32 and rounded
 *          once (transformers' apply_rotary_pos_emb_vision).
 *
 * q: head h of token t at q + t * q_stride + h * head_size (contiguous head rows); k alike.
 * cos/sin: [T, rotary_dim] rows cs_stride apart, in the element type or fp32.
 * Built by omniserve/cpu/build.py.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec.h"

#define IDENTITY(v) (v)
#define ROUND_F32(f) (f)
#define ROUND_BF16(f) from_bf16(to_bf16(f))

/* One row: norm (when weight is given) then rotation, in place; angles of type A, products
 * rounded by ROTATE_ROUND. */
#define DEFINE_NORM_ROTATE_ROW(NAME, T, A, LOAD_T, LOAD_A, STORE_T, ROUND, ROTATE_ROUND)          \
    __attribute__((optimize("fp-contract=off"))) static void NAME(                                \
        T *x, int64_t head_size, const T *weight, float eps, const A *cos, const A *sin,          \
        int64_t rotary_dim) {                                                                     \
        if (weight != NULL) {                                                                     \
            float total = 0.0f;                                                                   \
            for (int64_t d = 0; d < head_size; ++d) total += LOAD_T(x[d]) * LOAD_T(x[d]);        \
            const float inv = 1.0f / sqrtf(total / (float)head_size + eps);                      \
            for (int64_t d = 0; d < head_size; ++d)                                               \
                x[d] = STORE_T(LOAD_T(weight[d]) * ROUND(LOAD_T(x[d]) * inv));                    \
        }                                                                                         \
        const int64_t half = rotary_dim / 2;                                                      \
        for (int64_t d = 0; d < half; ++d) {                                                      \
            const float x1 = LOAD_T(x[d]), x2 = LOAD_T(x[d + half]);                              \
            x[d] = STORE_T(ROTATE_ROUND(x1 * LOAD_A(cos[d])) -                                    \
                           ROTATE_ROUND(x2 * LOAD_A(sin[d])));                                    \
            x[d + half] = STORE_T(ROTATE_ROUND(x2 * LOAD_A(cos[d + half])) +                      \
                                  ROTATE_ROUND(x1 * LOAD_A(sin[d + half])));                      \
        }                                                                                         \
    }

#define DEFINE_QK_NORM_ROPE(NAME, T, A, ROW)                                                      \
    void NAME(T *q, int64_t q_stride, int64_t num_heads, T *k, int64_t k_stride,                  \
              int64_t num_kv_heads, int64_t num_tokens, int64_t head_size, const T *q_weight,     \
              const T *k_weight, float eps, const A *cos, const A *sin, int64_t cs_stride,        \
              int64_t rotary_dim, int num_threads) {                                              \
        const int64_t heads = num_heads + num_kv_heads;                                           \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                     \
        for (int64_t t = 0; t < num_tokens; ++t) {                                                \
            const A *c = cos + t * cs_stride, *s = sin + t * cs_stride;                           \
            for (int64_t h = 0; h < heads; ++h) {                                                 \
                const int is_q = h < num_heads;                                                   \
                T *row = is_q ? q + t * q_stride + h * head_size                                  \
                              : k + t * k_stride + (h - num_heads) * head_size;                   \
                ROW(row, head_size, is_q ? q_weight : k_weight, eps, c, s, rotary_dim);           \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_NORM_ROTATE_ROW(norm_rotate_row_f32, float, float, IDENTITY, IDENTITY, IDENTITY, ROUND_F32,
                       ROUND_F32)
DEFINE_NORM_ROTATE_ROW(norm_rotate_row_bf16, bf16, bf16, from_bf16, from_bf16, to_bf16, ROUND_BF16,
                       ROUND_BF16)
DEFINE_NORM_ROTATE_ROW(norm_rotate_row_bf16_f32, bf16, float, from_bf16, IDENTITY, to_bf16,
                       ROUND_BF16, ROUND_F32)
DEFINE_QK_NORM_ROPE(omniserve_qk_norm_rope_f32, float, float, norm_rotate_row_f32)
DEFINE_QK_NORM_ROPE(omniserve_qk_norm_rope_bf16, bf16, bf16, norm_rotate_row_bf16)
/* bf16 q/k rotated by fp32 angles */
DEFINE_QK_NORM_ROPE(omniserve_qk_norm_rope_bf16_f32, bf16, float, norm_rotate_row_bf16_f32)

/* out[r] = RMSNorm(s[r]) for bf16 rows of `cols`, where s = x + residual (rounded to bf16, as
 * torch's bf16 add rounds; written to summed) when residual is given, else s = x (x rows
 * x_stride apart, residual rows r_stride apart, out and summed contiguous). */
void omniserve_rms_norm_bf16(const bf16 *x, int64_t rows, int64_t cols, int64_t x_stride,
                             const bf16 *residual, int64_t r_stride, const bf16 *weight,
                             float eps, bf16 *summed, bf16 *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *src = x + r * x_stride;
        bf16 *dst = out + r * cols;
        if (residual != NULL) { /* the rounded sum is what the norm reads */
            const bf16 *res = residual + r * r_stride;
            bf16 *sum_row = summed + r * cols;
            int64_t d = 0;
            for (; d + LANES <= cols; d += LANES)
                store_bf16(sum_row + d, load_bf16(res + d) + load_bf16(src + d));
            for (; d < cols; ++d) sum_row[d] = to_bf16(from_bf16(res[d]) + from_bf16(src[d]));
            src = sum_row;
        }
        vec sum = (vec){0};
        int64_t d = 0;
        for (; d + LANES <= cols; d += LANES) {
            const vec v = load_bf16(src + d);
            sum += v * v;
        }
        float total = lane_sum(sum);
        for (; d < cols; ++d) total += from_bf16(src[d]) * from_bf16(src[d]);
        const float inv = 1.0f / sqrtf(total / (float)cols + eps);
        for (d = 0; d + LANES <= cols; d += LANES) {
            const vec y = (vec)((uvec)__builtin_convertvector(round_bf16(load_bf16(src + d) * inv),
                                                              uvec) << 16);
            store_bf16(dst + d, load_bf16(weight + d) * y);
        }
        for (; d < cols; ++d)
            dst[d] = to_bf16(from_bf16(weight[d]) * from_bf16(to_bf16(from_bf16(src[d]) * inv)));
    }
}
