/*
 * y = x @ w.T (+ bias) with fp32 activations and bf16 weights, for CPUs that multiply bf16 only
 * by emulation: the weights stay bf16 in memory (half of fp32's bytes to hold and to stream per
 * decode step) and are widened in registers, which is exact, so the product is fp32's.
 *
 * w is packed once into panels of NP = 32 output features: panel p holds, for each k, one
 * 64-byte row of 16 uint32 lanes, lane j carrying w[32p + j][k] in its upper half and
 * w[32p + 16 + j][k] in its lower half, so widening a row into two fp32 vectors is one AND and
 * one shift. A register tile is MR rows of x by one panel (2 * MR accumulators): each k step
 * loads one panel row, broadcasts MR values of x and issues 2 * MR FMAs. Blocking: K in slices
 * of KC (a panel's slice stays in L1 across the row tiles; one tile of rows takes K whole, so
 * the weight streams in memory order, prefetched), rows in blocks of MC, copied k-major
 * per tile (contiguous broadcasts; x's own rows, a multiple of 4 KB apart, would share L1 sets),
 * kept in L2 across the panels; threads own disjoint ranges of panels. Built for AVX-512 (the
 * tile needs 31 vector registers) by omniserve/cpu/build.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#ifdef __AVX512F__
#include <immintrin.h>
/* x[0] in every lane, loaded by the broadcast itself (vec.h's splat adds a zero first, which
 * costs a shuffle on the FMA's port). */
static inline vec broadcast(const float *x) { return (vec)_mm512_set1_ps(*x); }
#else
static inline vec broadcast(const float *x) { return splat(*x); }
#endif

#define NP 32  /* output features per panel */
#define MR 14  /* x rows per register tile: 28 accumulators, 3 temporaries of 32 registers */
#define KC 512 /* k per slice: a panel's slice is 32 KB, kept in L1 across a block's tiles */
#define MC 196 /* x rows per block (14 tiles): a block's slice is 392 KB, kept in L2 */
#define PREFETCH 4096 /* bytes of the panel ahead: a few rows stream the weight at 34 GB/s with it
                       * (a 1.5B model's gate/up projection, one row, 2 threads), 22 without */

/* Pack w [N, K] (bf16) into ceil(N / NP) panels of K x 16 uint32 (rows past N are zeros). */
void omniserve_pack_bf16_panels(const bf16 *w, int64_t N, int64_t K, uint32_t *packed,
                                int num_threads) {
    const int64_t panels = (N + NP - 1) / NP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        uint32_t *dst = packed + p * K * 16;
        for (int j = 0; j < 16; ++j) {
            const int64_t hi = p * NP + j, lo = hi + 16;
            for (int64_t k = 0; k < K; ++k) {
                const uint32_t h = hi < N ? w[hi * K + k] : 0, l = lo < N ? w[lo * K + k] : 0;
                dst[k * 16 + j] = h << 16 | l;
            }
        }
    }
}

/* Rows [n0, n1) of w widened to fp32 into out [n1 - n0, K]: the weight for a oneDNN product of
 * many rows (prefill chunks), where its blocking outruns the tile. Each thread takes whole
 * panels and writes their 32 rows a cache line at a time. */
void omniserve_unpack_bf16_panels(const uint32_t *packed, int64_t K, int64_t n0, int64_t n1,
                                  float *out, int num_threads) {
    const int64_t p_first = n0 / NP, p_last = (n1 + NP - 1) / NP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = p_first; p < p_last; ++p) {
        const uint32_t *src = packed + p * K * 16;
        uint32_t *hi[16], *lo[16]; /* rows 32p + j and 32p + 16 + j (NULL: outside the range) */
        for (int j = 0; j < 16; ++j) {
            const int64_t h = p * NP + j, l = h + 16;
            hi[j] = h >= n0 && h < n1 ? (uint32_t *)(out + (h - n0) * K) : NULL;
            lo[j] = l >= n0 && l < n1 ? (uint32_t *)(out + (l - n0) * K) : NULL;
        }
        /* 16 k at a time: a row's 64-byte line is written whole (rows K floats apart, often a
         * multiple of 4 KB, would share L1 sets if each k touched all 32). */
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            const int64_t k1 = K - k0 < 16 ? K : k0 + 16;
            for (int j = 0; j < 16; ++j) {
                if (hi[j])
                    for (int64_t k = k0; k < k1; ++k) hi[j][k] = src[k * 16 + j] & 0xffff0000u;
                if (lo[j])
                    for (int64_t k = k0; k < k1; ++k) lo[j][k] = src[k * 16 + j] << 16;
            }
        }
    }
}

/* acc (mr x 32) += x[0:mr, 0:kc] @ panel slice; x packed k-major (mr values per k). */
static inline __attribute__((always_inline)) void tile(const float *x, const uvec *b, int64_t kc,
                                                       vec acc[][2], const int mr) {
    const uvec upper = (uvec){0} + 0xffff0000u;
    for (int64_t k = 0; k < kc; ++k) {
        uvec row;
        __builtin_prefetch((const char *)(b + k) + PREFETCH);
        memcpy(&row, b + k, sizeof row);
        const vec hi = (vec)(row & upper), lo = (vec)(row << 16);
        for (int i = 0; i < mr; ++i) {
            const vec xv = broadcast(x + k * mr + i);
            acc[i][0] += xv * hi;
            acc[i][1] += xv * lo;
        }
    }
}

/* One register tile over one K slice: start from bias (first slice) or from y, store to y.
 * cols < NP only in the last panel, whose y and bias are read and written element-wise. */
static inline __attribute__((always_inline)) void
tile_pass(const float *x, const uvec *b, int64_t kc, const float *bias, float *y,
          int64_t ldy, int first, int cols, const int mr) {
    vec acc[MR][2];
    for (int i = 0; i < mr; ++i) {
        if (cols == NP && !first) {
            acc[i][0] = load(y + i * ldy);
            acc[i][1] = load(y + i * ldy + LANES);
            continue;
        }
        for (int h = 0; h < 2; ++h) {
            float start[LANES];
            for (int l = 0; l < LANES; ++l) {
                const int c = h * LANES + l;
                start[l] = c >= cols ? 0.0f : first ? (bias ? bias[c] : 0.0f) : y[i * ldy + c];
            }
            acc[i][h] = load(start);
        }
    }
    tile(x, b, kc, acc, mr);
    for (int i = 0; i < mr; ++i) {
        if (cols == NP) {
            store(y + i * ldy, acc[i][0]);
            store(y + i * ldy + LANES, acc[i][1]);
        } else {
            for (int c = 0; c < cols; ++c) y[i * ldy + c] = acc[i][c / LANES][c % LANES];
        }
    }
}

/* tile_pass with the row count a compile-time constant, so the accumulators stay in registers. */
static void tile_rows(const float *x, const uvec *b, int64_t kc, const float *bias,
                      float *y, int64_t ldy, int first, int cols, int mr) {
#define TILE_CASE(R)                                                                              \
    case R: tile_pass(x, b, kc, bias, y, ldy, first, cols, R); break;
    _Static_assert(MR == 14, "one case per row count below MR");
    switch (mr) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
        TILE_CASE(13)
        default: tile_pass(x, b, kc, bias, y, ldy, first, cols, MR); break;
    }
#undef TILE_CASE
}

/* Copy rows [m0, m1) x columns [k0, k0 + kc) of x into tiles of MR rows, each k-major. */
static void pack_rows(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k0,
                      int64_t kc, float *out) {
    for (int64_t m = m0; m < m1; m += MR) {
        const int64_t mr = m1 - m < MR ? m1 - m : MR;
        for (int64_t i = 0; i < mr; ++i) {
            const float *src = x + (m + i) * ldx + k0;
            for (int64_t k = 0; k < kc; ++k) out[k * mr + i] = src[k];
        }
        out += mr * kc;
    }
}

/* Returns nonzero when a thread could not allocate its copy of the rows. */
int omniserve_linear_bf16w(const float *x, int64_t M, int64_t ldx, const uint32_t *packed,
                           int64_t N, int64_t K, const float *bias, float *y, int64_t ldy,
                           int num_threads) {
    const int64_t panels = (N + NP - 1) / NP;
    /* One tile of rows streams the weight once, each thread's panels in memory order. */
    const int64_t kc_block = M <= MR ? K : KC;
    const int64_t mc_max = M < MC ? M : MC, kc_max = K < kc_block ? K : kc_block;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
        /* Each thread packs its own copy of the rows: a block's slice is small next to the
         * products over the thread's panels, and no thread waits for another. */
        float *rows = p0 < p1 ? malloc(sizeof(float) * mc_max * kc_max) : NULL;
        failed = p0 < p1 && rows == NULL;
        for (int64_t k0 = 0; k0 < K && !failed; k0 += kc_block) {
            const int64_t kc = K - k0 < kc_block ? K - k0 : kc_block;
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t m1 = M - m0 < MC ? M : m0 + MC;
                pack_rows(x, ldx, m0, m1, k0, kc, rows);
                for (int64_t p = p0; p < p1; ++p) {
                    const uvec *b = (const uvec *)(packed + (p * K + k0) * 16);
                    const int cols = (int)(N - p * NP < NP ? N - p * NP : NP);
                    for (int64_t m = m0; m < m1; m += MR) {
                        const int mr = (int)(m1 - m < MR ? m1 - m : MR);
                        tile_rows(rows + (m - m0) * kc, b, kc, bias ? bias + p * NP : NULL,
                                  y + m * ldy + p * NP, ldy, k0 == 0, cols, mr);
                    }
                }
            }
        }
        free(rows);
    }
    return failed;
}
