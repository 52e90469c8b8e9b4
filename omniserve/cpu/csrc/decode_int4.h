/*
 * 4-bit weights decoded to fp32 or bf16, for the kernels that read omniserve/layers/
 * quantization.py's 4-bit layout (linear_int4.c, moe.c): codes uint8 [N, K / 2] (feature 2j in
 * the low nibble of byte j), zero points uint8 (0-15) and fp32 scales [N, K / g]; w[n, k] = (code
 * - zero) * scale in fp32, rounded once to the activation type (bf16: to nearest even).
 *
 * Decoding is a table lookup: a group's 16 possible weights are computed (and rounded) once, then
 * each code picks its value with one permute (vpermw: 32 bf16 per instruction; vpermps: 16 fp32).
 */
#ifndef OMNISERVE_DECODE_INT4_H
#define OMNISERVE_DECODE_INT4_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* A group's 16 possible weights, (code - zero) * scale for each code (lanes), in fp32. */
static inline vec int4_values(uint8_t zero, float scale) {
    const vec codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return (codes - (float)(zero & 15)) * scale;
}

/* 16 weights (8 bytes of codes, in order) of a group whose 16 possible values are `values`. */
static inline vec int4_decode16(const uint8_t *c, vec values) {
#ifdef __AVX512F__
    /* 8 bytes -> 8 qwords b | b << 28: dword 2i's low 4 bits (all vpermps reads) are byte i's
     * low nibble, dword 2i + 1 is its high nibble. */
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const void *)c));
    const __m512i index = _mm512_or_si512(b, _mm512_slli_epi64(b, 28));
    return (vec)_mm512_permutexvar_ps(index, (__m512)values);
#else
    vec out;
    for (int i = 0; i < LANES / 2; ++i) {
        out[2 * i] = values[c[i] & 15];
        out[2 * i + 1] = values[c[i] >> 4];
    }
    return out;
#endif
}

/* Whether every scale is a normal, finite number (then no weight is denormal nor NaN). */
static inline int normal_scales(const float *scales, int64_t count) {
    int normal = 1;
    for (int64_t g = 0; g < count; ++g) {
        uint32_t bits;
        memcpy(&bits, scales + g, sizeof bits);
        normal &= ((bits >> 23) & 0xff) - 1u < 254u; /* exponent neither 0 nor 255 */
    }
    return normal;
}

#ifdef __AVX512BW__
/* A group's 16 weights in bf16, twice over (entries 16-31 repeat 0-15: vpermw reads 5 bits of
 * each index, and the decoders leave the next code's lowest bit in the fifth). */
static inline __m512i bf16_table(vec values, int normal) {
#ifdef __AVX512BF16__
    /* One instruction that rounds to nearest even as round_bf16 does but flushes denormals to
     * zero, which normal scales never make. */
    if (normal) return (__m512i)_mm512_cvtne2ps_pbh((__m512)values, (__m512)values);
#else
    (void)normal;
#endif
    const hvec rounded = round_bf16(values);
    return (__m512i)__builtin_shufflevector(rounded, rounded, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                            11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                            11, 12, 13, 14, 15);
}
#endif

/* count groups of weights into w, one after the other (the decoder of decoded_linear.h and
 * moe.c): whole rows of w (K elements apart) are a run of groups, as their codes, zeros and
 * scales are. */
static void int4_decode_f32(const uint8_t *codes, const uint8_t *zeros, const float *scales,
                            int64_t count, int64_t group_size, int64_t ahead, float *w) {
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = int4_values(zeros[g], scales[g]);
        for (int64_t i = 0; i < group_size / 2; i += LANES / 2) {
            prefetch_ahead(codes + i, ahead);
            store(w + 2 * i, int4_decode16(codes + i, values));
        }
    }
}

/* CHUNK weights (CHUNK / 2 bytes of codes) of a group whose 16 possible values are `values`, in
 * the order the codes come in as dwords (vec.h's interleaved order, STRIDE 8): out[s] holds
 * features 8 i + s. One 64-byte load serves all eight permutes, each reading its codes shifted
 * by 4 s bits, with no widening. */
static inline void int4_decode128(const uint8_t *c, vec values, vec out[8]) {
#ifdef __AVX512F__
    const __m512i b = _mm512_loadu_si512(c); /* dword i: features 8i to 8i + 7 */
    for (int s = 0; s < 8; ++s) /* vpermps reads 4 bits */
        out[s] = (vec)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4 * s), (__m512)values);
#else
    for (int i = 0; i < CHUNK / 8; ++i)
        for (int s = 0; s < 8; ++s) out[s][i] = values[(c[(8 * i + s) / 2] >> (s % 2 * 4)) & 15];
#endif
}

/* As int4_decode_f32, for groups of a multiple of CHUNK features, each chunk in
 * int4_decode128's order (x reordered to match: the dot products do not depend on the order):
 * decoding costs a quarter less. */
static void int4_decode_interleaved_f32(const uint8_t *codes, const uint8_t *zeros,
                                        const float *scales, int64_t count, int64_t group_size,
                                        int64_t ahead, float *w) {
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = int4_values(zeros[g], scales[g]);
        for (int64_t k = 0; k < group_size; k += CHUNK) {
            prefetch_ahead(codes + k / 2, ahead);
            vec out[8];
            int4_decode128(codes + k / 2, values, out);
            for (int s = 0; s < 8; ++s) store(w + k + LANES * s, out[s]);
        }
    }
}

static void int4_decode_bf16(const uint8_t *codes, const uint8_t *zeros, const float *scales,
                             int64_t count, int64_t group_size, int64_t ahead, bf16 *w) {
    const int normal = normal_scales(scales, count);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = int4_values(zeros[g], scales[g]);
#ifdef __AVX512BW__
        const __m512i table = bf16_table(values, normal);
        bf16 *out = w;
        for (const uint8_t *c = codes, *end = codes + group_size / 2; c < end; c += 16) {
            prefetch_ahead(c, ahead);
            /* 16 bytes -> 16 dwords b | b << 12: word 2i's low 4 bits are byte i's low nibble,
             * word 2i + 1 is its high nibble. */
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)c));
            const __m512i index = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
            _mm512_storeu_si512(out, _mm512_permutexvar_epi16(index, table));
            out += 32;
        }
#else
        (void)normal, (void)ahead;
        const hvec rounded = round_bf16(values);
        for (int64_t i = 0; i < group_size / 2; ++i) {
            w[2 * i] = rounded[codes[i] & 15];
            w[2 * i + 1] = rounded[codes[i] >> 4];
        }
#endif
    }
}

#endif
