/*
 * Per-head RMSNorm (optional) and rotary embedding of queries and keys, in place, in one pass.
 *
 * In torch this is about ten elementwise passes over every query and key of a prefill (pow,
 * mean, rsqrt, two multiplies per norm; four multiplies and two adds for the rotation), each
 * writing a fresh full-size tensor. Here each head row is read once, normalised and rotated
 * while in cache, and written back.
 *
 * q: head h of token t at q + t * q_stride + h * head_size (fp32, contiguous head rows); k alike.
 * cos/sin: [T, rotary_dim] rows cs_stride apart, the neox layout (both halves hold the same
 * angles). Norm as transformers computes it: x * rsqrt(mean(x^2) + eps), then weight * x.
 * Rotation of the first rotary_dim features: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
 *
 * Built and loaded at run time by omniserve/cpu_kernels.py (gcc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Products and sums rounded one by one, as torch's elementwise ops round them. */
__attribute__((optimize("fp-contract=off"))) static void
norm_rotate_row(float *x, int64_t head_size, const float *weight, float eps, const float *cos,
                const float *sin, int64_t rotary_dim) {
    if (weight != NULL) {
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t d = 0; d < head_size; ++d) total += x[d] * x[d];
        const float inv = 1.0f / sqrtf(total / (float)head_size + eps);
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) x[d] = weight[d] * (x[d] * inv);
    }
    const int64_t half = rotary_dim / 2;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * cos[d] - x2 * sin[d];
        x[d + half] = x2 * cos[d + half] + x1 * sin[d + half];
    }
}

void omniserve_qk_norm_rope_f32(float *q, int64_t q_stride, int64_t num_heads, float *k,
                                int64_t k_stride, int64_t num_kv_heads, int64_t num_tokens,
                                int64_t head_size, const float *q_weight, const float *k_weight,
                                float eps, const float *cos, const float *sin, int64_t cs_stride,
                                int64_t rotary_dim, int num_threads) {
    const int64_t heads = num_heads + num_kv_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; ++h) {
            const int is_q = h < num_heads;
            float *row = is_q ? q + t * q_stride + h * head_size
                              : k + t * k_stride + (h - num_heads) * head_size;
            norm_rotate_row(row, head_size, is_q ? q_weight : k_weight, eps, c, s, rotary_dim);
        }
    }
}
