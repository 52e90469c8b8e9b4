/*
 * 16-float vectors for omniserve's C kernels, in GCC vector extensions: the compiler maps them to
 * one AVX-512 register, two AVX2 registers, or whatever -march=native offers. bf16 values are
 * the upper half of an fp32's bits: widening is a shift, narrowing rounds to nearest even as
 * torch does.
 */
#ifndef OMNISERVE_VEC_H
#define OMNISERVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
typedef uint32_t uvec __attribute__((vector_size(64)));
typedef uint16_t hvec __attribute__((vector_size(32))); /* 16 bf16 */
typedef uint16_t bf16;
#define LANES 16

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec splat(float x) { return (vec){0} + x; }

static inline vec load_bf16(const bf16 *p) {
    hvec h;
    memcpy(&h, p, sizeof h);
    return (vec)(__builtin_convertvector(h, uvec) << 16);
}

/* Round to nearest even (NaNs stay NaNs), as torch's float -> bfloat16 cast does. */
static inline hvec round_bf16(vec v) {
    const uvec u = (uvec)v;
    const uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uvec quiet_nan = (u >> 16) | 0x40u;
    const uvec is_nan = (uvec)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((rounded & ~is_nan) | (quiet_nan & is_nan), hvec);
}

/* round_bf16 kept in fp32 lanes, for values that are not NaN (decoded weights): no narrowing
 * and widening back. */
static inline vec round_bf16_in_place(vec v) {
    const uvec u = (uvec)v;
    return (vec)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

static inline void store_bf16(bf16 *p, vec v) {
    const hvec h = round_bf16(v);
    memcpy(p, &h, sizeof h);
}

static inline bf16 to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(bf16 x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Lane-wise max(x, lo) and min(x, hi). */
static inline vec clamp(vec x, float lo, float hi) {
    const ivec below = x < lo, above = x > hi; /* all ones where true */
    x = (vec)(((ivec)x & ~below) | ((ivec)splat(lo) & below));
    return (vec)(((ivec)x & ~above) | ((ivec)splat(hi) & above));
}

static inline float lane_sum(vec v) {
    typedef float half __attribute__((vector_size(32)));
    typedef float quarter __attribute__((vector_size(16)));
    const half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                      __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) to about 2 ulp for x in [-87, 88] (clamped to it: below, the result is the order of
 * the smallest normal float): x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-6 polynomial
 * for exp(r), 2^n built in the exponent bits. */
static inline vec vexp(vec x) {
    x = clamp(x, -87.0f, 88.0f);
    const vec shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vec n = (x * 1.44269504088896341f + shifter) - shifter;
    const vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return p * (vec)bits;
}

#define CHUNK 128 /* features per interleaved chunk (decode_int4.h's order) */

/* One row of K features into `out` in decode_int4.h's interleaved order for STRIDE-lane words:
 * in each CHUNK, feature STRIDE * i + s goes to s * (CHUNK / STRIDE) + i. */
#define DEFINE_INTERLEAVE_ROW(NAME, T, STRIDE)                                                    \
    static inline void NAME(const T *row, int64_t K, T *out) {                                    \
        for (int64_t c = 0; c < K; c += CHUNK)                                                    \
            for (int s = 0; s < STRIDE; ++s)                                                      \
                for (int i = 0; i < CHUNK / STRIDE; ++i)                                          \
                    out[c + s * (CHUNK / STRIDE) + i] = row[c + STRIDE * i + s];                  \
    }
DEFINE_INTERLEAVE_ROW(interleave_row_f32, float, 8)
DEFINE_INTERLEAVE_ROW(interleave_row_bf16, bf16, 4)

/* Where feature f of a row goes in interleave_row_f32's order. */
static inline int64_t interleaved_f32_position(int64_t f) {
    return f - f % CHUNK + f % 8 * (CHUNK / 8) + f % CHUNK / 8;
}

/* Ask for the codes a tile's rows ahead (ahead bytes: the same place in the next NR rows, which
 * the thread decodes next), into L2: with the hardware prefetchers alone (they stop at page
 * bounds) a decode step took 1.3x as long (measured on a 2-core Xeon). */
static inline void prefetch_ahead(const uint8_t *codes, int64_t ahead) {
    __builtin_prefetch(codes + ahead, 0, 2);
}

#endif
