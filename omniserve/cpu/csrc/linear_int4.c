/*
 * y = x @ w.T (+ bias) with w stored as 4-bit codes, in omniserve/layers/quantization.py's layout:
 * qweight uint8 [N, K / 2] (feature 2j in the low nibble of byte j, 2j + 1 in the high one),
 * qzeros uint8 (0-15) and fp32 scales [N, K / g]; w[n, k] = (code - zero) * scale in fp32, rounded
 * once to the activation type (bf16: to nearest even), exactly as the torch reference dequantizes.
 *
 * Decoding is a table lookup: a group's 16 possible weights are computed (and rounded) once, then
 * each code picks its value with one permute (vpermw: 32 bf16 per instruction; vpermps: 16 fp32).
 *
 * omniserve_linear_int4_*: for a few rows of x. Each thread takes a contiguous run of BLOCK-row
 * blocks of w (one stream of codes, prefetched ahead) and decodes them one tile's rows (NR) at a
 * time into its scratch, then runs gemm_nt.h's tiles for every row tile of x over them: the codes
 * are read from memory once per call, whatever M (a quarter of a bf16 weight's bytes). Rows of
 * more than SLICE features are decoded and multiplied a slice at a time, summed in fp32, so the
 * scratch stays in L1. With groups of a multiple of 128, the scratch holds each 128 features in
 * the order their codes come in (decode_interleaved_*) and x is reordered to match once per call:
 * the dot products do not depend on the order, and decoding costs a quarter less.
 * omniserve_dequantize_int4_*: the whole [N, K] weight in order, for batches a matmul library
 * multiplies faster. K and the group size must be multiples of 32 (the caller checks). Built by
 * omniserve/cpu/build.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gemm_nt.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BLOCK 48  /* rows of w per work item (8 tiles) */
#define CHUNK 128 /* features per interleaved chunk: 64 bytes of codes */
#define SLICE 2048 /* most features per pass of the tiles (K 3,584 in one pass: 1.06x the time;
                    * in slices of 1,024: 1.27x) */

/* Ask for the codes a tile's rows ahead (ahead bytes: the same place in the next NR rows, which
 * the thread decodes next), into L2: with the hardware prefetchers alone (they stop at page
 * bounds) a decode step took 1.3x as long (measured on a 2-core Xeon). */
static inline void prefetch_ahead(const uint8_t *codes, int64_t ahead) {
    __builtin_prefetch(codes + ahead, 0, 2);
}

/* (code - zero) for each code (lanes) and zero point (index): a group's 16 weights in fp32 are
 * one product with its scale away, rounded as (code - zero) * scale is. */
static inline void code_offsets(vec offsets[16]) {
    const vec codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int z = 0; z < 16; ++z) offsets[z] = codes - (float)z;
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

/* count groups of weights into w, one after the other: whole rows of w (K elements apart) are a
 * run of groups, as their codes, zeros and scales are. */
static void dequantize_f32(const uint8_t *codes, const uint8_t *zeros, const float *scales,
                           int64_t count, int64_t group_size, int64_t ahead, float *w) {
    vec offsets[16];
    code_offsets(offsets);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = offsets[zeros[g] & 15] * scales[g];
#ifdef __AVX512F__
        float *out = w;
        for (const uint8_t *c = codes, *end = codes + group_size / 2; c < end; c += 8) {
            prefetch_ahead(c, ahead);
            /* 8 bytes -> 8 qwords b | b << 28: dword 2i's low 4 bits (all vpermps reads) are
             * byte i's low nibble, dword 2i + 1 is its high nibble. */
            const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const void *)c));
            const __m512i index = _mm512_or_si512(b, _mm512_slli_epi64(b, 28));
            _mm512_storeu_ps(out, _mm512_permutexvar_ps(index, (__m512)values));
            out += LANES;
        }
#else
        (void)ahead;
        for (int64_t i = 0; i < group_size / 2; ++i) {
            w[2 * i] = values[codes[i] & 15];
            w[2 * i + 1] = values[codes[i] >> 4];
        }
#endif
    }
}

static void dequantize_bf16(const uint8_t *codes, const uint8_t *zeros, const float *scales,
                            int64_t count, int64_t group_size, int64_t ahead, bf16 *w) {
    vec offsets[16];
    code_offsets(offsets);
    const int normal = normal_scales(scales, count);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = offsets[zeros[g] & 15] * scales[g];
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

/* As dequantize_*, for groups of a multiple of CHUNK features, with each chunk's features in the
 * order its codes come in as words (bf16, STRIDE 4) or dwords (fp32, STRIDE 8): feature
 * STRIDE * i + s goes to s * (CHUNK / STRIDE) + i. Each permute then reads its codes straight
 * from one 64-byte load shifted by 4 s bits, with no widening. */
static void decode_interleaved_f32(const uint8_t *codes, const uint8_t *zeros,
                                   const float *scales, int64_t count, int64_t group_size,
                                   int64_t ahead, float *w) {
    vec offsets[16];
    code_offsets(offsets);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = offsets[zeros[g] & 15] * scales[g];
        float *out = w;
        for (const uint8_t *c = codes, *end = codes + group_size / 2; c < end; c += CHUNK / 2) {
            prefetch_ahead(c, ahead);
#ifdef __AVX512F__
            const __m512i b = _mm512_loadu_si512(c); /* dword i: features 8i to 8i + 7 */
            for (int s = 0; s < 8; ++s) {
                const __m512i index = _mm512_srli_epi32(b, 4 * s); /* vpermps reads 4 bits */
                _mm512_storeu_ps(out + LANES * s, _mm512_permutexvar_ps(index, (__m512)values));
            }
#else
            for (int i = 0; i < CHUNK / 8; ++i)
                for (int s = 0; s < 8; ++s)
                    out[s * (CHUNK / 8) + i] = values[(c[(8 * i + s) / 2] >> (s % 2 * 4)) & 15];
#endif
            out += CHUNK;
        }
    }
}

static void decode_interleaved_bf16(const uint8_t *codes, const uint8_t *zeros,
                                    const float *scales, int64_t count, int64_t group_size,
                                    int64_t ahead, bf16 *w) {
    vec offsets[16];
    code_offsets(offsets);
    const int normal = normal_scales(scales, count);
    for (int64_t g = 0; g < count; ++g, codes += group_size / 2, w += group_size) {
        const vec values = offsets[zeros[g] & 15] * scales[g];
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

/* M rows of x (ldx apart) into out ([M, K]) in decode_interleaved_*'s order; called by every
 * thread of a team, which share the rows. */
#define DEFINE_INTERLEAVE(NAME, T, STRIDE)                                                        \
    static void NAME(const T *x, int64_t M, int64_t ldx, int64_t K, T *out) {                     \
        _Pragma("omp for schedule(static)") for (int64_t m = 0; m < M; ++m) {                     \
            const T *row = x + m * ldx;                                                           \
            for (int64_t c = 0; c < K; c += CHUNK)                                                \
                for (int s = 0; s < STRIDE; ++s)                                                  \
                    for (int i = 0; i < CHUNK / STRIDE; ++i)                                      \
                        out[m * K + c + s * (CHUNK / STRIDE) + i] = row[c + STRIDE * i + s];      \
        }                                                                                         \
    }
DEFINE_INTERLEAVE(interleave_f32, float, 8)
DEFINE_INTERLEAVE(interleave_bf16, bf16, 4)

/* The product returns 0, or -1 when it cannot allocate its scratch. */
#define DEFINE_LINEAR_INT4(SUFFIX, T, SLICE_BLOCK, TO_T)                                          \
    int omniserve_linear_int4_##SUFFIX(const T *x, int64_t M, int64_t ldx,                        \
                                       const uint8_t *qweight, const uint8_t *qzeros,             \
                                       const float *scales, int64_t N, int64_t K,                 \
                                       int64_t group_size, const T *bias, T *y, int64_t ldy,      \
                                       int num_threads) {                                         \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / group_size;                  \
        const int64_t slices = (K + SLICE - 1) / SLICE;                                           \
        const int64_t width = (groups + slices - 1) / slices * group_size; /* whole groups */     \
        const int interleaved = group_size % CHUNK == 0;                                          \
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
                            (interleaved ? decode_interleaved_##SUFFIX : dequantize_##SUFFIX)(    \
                                qweight + g * group_size / 2, qzeros + g, scales + g,             \
                                cols / group_size * (rows / runs), group_size, NR * K / 2,        \
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
    void omniserve_dequantize_int4_##SUFFIX(const uint8_t *qweight, const uint8_t *qzeros,        \
                                            const float *scales, int64_t N, int64_t K,            \
                                            int64_t group_size, T *w, int num_threads) {          \
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, groups = K / group_size;                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                     \
        for (int64_t b = 0; b < blocks; ++b) {                                                    \
            const int64_t n = b * BLOCK, rows = N - n < BLOCK ? N - n : BLOCK;                    \
            dequantize_##SUFFIX(qweight + n * (K / 2), qzeros + n * groups, scales + n * groups,  \
                                rows * groups, group_size, NR * K / 2, w + n * K);                \
        }                                                                                         \
    }

#define SAME(v) (v)
DEFINE_LINEAR_INT4(f32, float, gemm_block_f32, SAME)
DEFINE_LINEAR_INT4(bf16, bf16, gemm_block_bf16_f32, to_bf16)
