/*
 * GELU's tanh form over bf16 elements in one pass (Qwen3-VL's and Qwen3-Omni's vision MLPs),
 * computed in fp32 and rounded once to bf16, as torch's bf16 gelu computes it:
 *   x / 2 (1 + tanh(y)),  y = sqrt(2 / pi) (x + 0.044715 x^3),
 * tanh(|y|) = 1 - 2 / (exp(2 |y|) + 1) carrying y's sign (accurate on both sides, so 1 + tanh(y)
 * cancels where torch's does, to zero far out on the negative side). vec.h's exp is within about
 * 2 ulp, so a result can differ from torch's by a bf16 unit where the fp32 value lies on a
 * rounding boundary. torch's erf form is as fast as this would be, so it keeps it. Built by
 * omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "vec.h"

static inline vec gelu_tanh(vec x) {
    const vec y = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    const vec abs_y = (vec)((uvec)y & 0x7fffffffu);
    const vec tanh_abs = 1.0f - 2.0f / (vexp(2.0f * abs_y) + 1.0f); /* exp clamps: saturates */
    const vec tanh = (vec)(((uvec)y & 0x80000000u) | (uvec)tanh_abs);
    return 0.5f * x * (1.0f + tanh);
}

/* out[i] = gelu_tanh(x[i]) for n contiguous bf16 elements. */
void omniserve_gelu_tanh_bf16(const bf16 *x, int64_t n, bf16 *out, int num_threads) {
    const int64_t blocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * 4096, end = start + 4096 < n ? start + 4096 : n;
        int64_t i = start;
        for (; i + LANES <= end; i += LANES) store_bf16(out + i, gelu_tanh(load_bf16(x + i)));
        for (; i < end; ++i) out[i] = to_bf16(gelu_tanh(splat(from_bf16(x[i])))[0]);
    }
}
