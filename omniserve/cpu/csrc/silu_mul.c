/*
 * SwiGLU's activation, silu(gate) * up, over bf16 rows [gate | up] (the merged gate/up
 * projection's output) in one pass; torch makes two passes and writes the activation between them.
 * Rounded where torch rounds: silu(g) = g / (1 + exp(-g)) in fp32, rounded to bf16, then the
 * product in fp32, rounded again. exp is vec.h's (about 2 ulp; torch's about 1), so a result
 * can differ from torch's by one bf16 unit where the fp32 value lies on a rounding boundary.
 * Built by omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "vec.h"

static inline vec silu_rounded(vec g) {
    const vec act = g / (1.0f + vexp(-g));
    return (vec)(__builtin_convertvector(round_bf16(act), uvec) << 16);
}

void omniserve_silu_and_mul_bf16(const bf16 *x, int64_t rows, int64_t d, int64_t ldx, bf16 *out,
                                 int64_t ldo, int num_threads) {
    const int64_t blocks = (d + 255) / 256; /* rows x blocks of 256: a decode row splits too */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t job = 0; job < rows * blocks; ++job) {
        const int64_t r = job / blocks, start = (job % blocks) * 256;
        const int64_t end = start + 256 < d ? start + 256 : d;
        const bf16 *gate = x + r * ldx, *up = gate + d;
        bf16 *o = out + r * ldo;
        int64_t i = start;
        for (; i + LANES <= end; i += LANES)
            store_bf16(o + i, silu_rounded(load_bf16(gate + i)) * load_bf16(up + i));
        for (; i < end; ++i) { /* a width that is not a multiple of 16 */
            const float g = from_bf16(gate[i]);
            const vec act = silu_rounded(splat(g));
            o[i] = to_bf16(act[0] * from_bf16(up[i]));
        }
    }
}
