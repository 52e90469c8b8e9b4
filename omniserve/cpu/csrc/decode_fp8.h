/*
 * FP8 (e4m3fn) weights decoded to fp32 or bf16, for the kernels that read omniserve/layers/
 * quantization.py's FP8 layout (linear_fp8.c, moe.c): w[n, k] = e4m3(weight[n, k]) * scale in
 * fp32, rounded once to the activation type (bf16: to nearest even). And an fp8 KV cache's
 * e4m3 or e5m2 bytes decoded to fp32 for paged_decode.c.
 *
 * Decoding moves each byte's bits into an fp16 (exactly 2^-8 times the e4m3 value, subnormals
 * included), which the CPU widens to fp32 (vcvtph2ps); the group's scale is taken times 2^8. The
 * two NaN codes, which no checkpoint holds, decode as +-480 times the scale.
 */
#ifndef OMNISERVE_DECODE_FP8_H
#define OMNISERVE_DECODE_FP8_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* 32 e4m3 bytes -> the fp16 values 2^-8 times theirs: the magnitude's 7 bits shifted under the
 * fp16 exponent (bias 15 for e4m3's 7) and mantissa, subnormals to subnormals, and the sign from
 * bit 14 to 15 (t + (t & 0x4000) moves it). Then the hardware widens them to fp32 exactly. */
#ifdef __AVX512BW__
static inline void decode32(const uint8_t *c, vec scale, vec out[2]) {
    const __m512i t = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const void *)c)), 7);
    const __m512i half = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));
    out[0] = (vec)_mm512_cvtph_ps(_mm512_castsi512_si256(half)) * scale;
    out[1] = (vec)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)) * scale;
}
#else
static inline void decode32(const uint8_t *c, vec scale, vec out[2]) {
    for (int i = 0; i < 2 * LANES; ++i) {
        const uint32_t mag = c[i] & 0x7fu;
        float value = (float)mag * 0x1p-17f; /* subnormal: mantissa * 2^-9, times 2^-8 */
        if (mag >= 8) {
            const uint32_t bits = (mag << 20) + (112u << 23); /* exponent bias 7 + 8 -> 127 */
            memcpy(&value, &bits, sizeof value);
        }
        out[i / LANES][i % LANES] = c[i] & 0x80u ? -value : value;
    }
    out[0] *= scale;
    out[1] *= scale;
}
#endif

/* 16 e4m3 bytes (an fp8 KV cache's) -> their exact values, decode32's way. */
static inline vec load16_e4m3(const uint8_t *c) {
#ifdef __AVX512BW__
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)c)), 7);
    const __m256i half = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    return (vec)_mm512_cvtph_ps(half) * 256.0f;
#else
    vec out;
    for (int i = 0; i < LANES; ++i) {
        const uint32_t mag = c[i] & 0x7fu;
        float value = (float)mag * 0x1p-9f; /* subnormal: mantissa * 2^-9 */
        if (mag >= 8) {
            const uint32_t bits = (mag << 20) + (120u << 23); /* exponent bias 7 -> 127 */
            memcpy(&value, &bits, sizeof value);
        }
        out[i] = c[i] & 0x80u ? -value : value;
    }
    return out;
#endif
}

/* 16 e5m2 bytes -> their exact values: e5m2 is the upper byte of an fp16. */
static inline vec load16_e5m2(const uint8_t *c) {
#ifdef __AVX512BW__
    const __m256i half = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)c)), 8);
    return (vec)_mm512_cvtph_ps(half);
#else
    vec out;
    for (int i = 0; i < LANES; ++i) {
        uint16_t bits = (uint16_t)(c[i] << 8);
        _Float16 h;
        memcpy(&h, &bits, sizeof h);
        out[i] = (float)h;
    }
    return out;
#endif
}

/* count groups of group_size weights into w, one after the other (the decoder of decoded_linear.h and moe.c);
 * each group's scale times 2^8 undoes decode32's 2^-8 exactly. */
#define DEFINE_DECODE(NAME, T, STORE)                                                             \
    static void NAME(const uint8_t *codes, const uint8_t *zeros, const float *scales,             \
                     int64_t count, int64_t group_size, int64_t ahead, T *w) {                    \
        (void)zeros;                                                                              \
        for (int64_t g = 0; g < count; ++g, codes += group_size, w += group_size) {               \
            const vec scale = splat(scales[g] * 256.0f);                                          \
            for (int64_t i = 0; i < group_size; i += 2 * LANES) {                                 \
                if (i % 64 == 0) prefetch_ahead(codes + i, ahead);                                \
                vec v[2];                                                                         \
                decode32(codes + i, scale, v);                                                    \
                STORE(w + i, v[0]);                                                               \
                STORE(w + i + LANES, v[1]);                                                       \
            }                                                                                     \
        }                                                                                         \
    }
DEFINE_DECODE(fp8_decode_f32, float, store)
DEFINE_DECODE(fp8_decode_bf16, bf16, store_bf16)

#endif
