/*
 * y = x @ w.T (+ bias) with w stored as 4-bit codes, in omniserve/layers/quantization.py's layout:
 * qweight uint8 [N, K / 2] (feature 2j in the low nibble of byte j, 2j + 1 in the high one),
 * qzeros uint8 (0-15) and fp32 scales [N, K / g]; w[n, k] = (code - zero) * scale in fp32, rounded
 * once to the activation type (bf16: to nearest even), exactly as the torch reference dequantizes.
 * The product's loop is decoded_linear.h's, the decoding decode_int4.h's (a table lookup).
 * With groups of a multiple of 128, the scratch holds each 128 features in the order their codes
 * come in (decode_interleaved_*) and x is reordered to match once per call: decoding costs a
 * quarter less. Built by omniserve/cpu/build.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "decode_int4.h"
#include "decoded_linear.h"

/* As int4_decode_interleaved_f32 (decode_int4.h), in bf16: words, STRIDE 4. */
static void decode_interleaved_bf16(const uint8_t *codes, const uint8_t *zeros,
                                    const float *scales, int64_t count, int64_t group_size,
                                    int64_t ahead, bf16 *w) {
    const int normal = normal_scales(scales, count);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = int4_values(zeros[g], scales[g]);
#ifdef __AVX512BW__
        const __m512i table = bf16_table(values, normal);
#else
        (void)normal;
        const hvec rounded = round_bf16(values);
#endif
        bf16 *out = w;
        for (const uint8_t *c = codes, *end = codes + group_size / 2; c < end; c += CHUNK / 2) {
            prefetch_ahead(c, ahead);
#ifdef __AVX512BW__
            const __m512i b = _mm512_loadu_si512(c); /* word i: features 4i to 4i + 3 */
            for (int s = 0; s < 4; ++s) {
                const __m512i index = _mm512_srli_epi16(b, 4 * s); /* 5 bits read, see above */
                _mm512_storeu_si512(out + 32 * s, _mm512_permutexvar_epi16(index, table));
            }
#else
            for (int i = 0; i < CHUNK / 4; ++i)
                for (int s = 0; s < 4; ++s)
                    out[s * (CHUNK / 4) + i] = rounded[(c[(4 * i + s) / 2] >> (s % 2 * 4)) & 15];
#endif
            out += CHUNK;
        }
    }
}

#define SAME(v) (v)
#define WHOLE_CHUNKS(group_size) ((group_size) % CHUNK == 0)
DEFINE_DECODED_LINEAR(int4, f32, float, gemm_block_f32, SAME, 4, int4_decode_f32,
                      int4_decode_interleaved_f32, WHOLE_CHUNKS)
DEFINE_DECODED_LINEAR(int4, bf16, bf16, gemm_block_bf16_f32, to_bf16, 4, int4_decode_bf16,
                      decode_interleaved_bf16, WHOLE_CHUNKS)
