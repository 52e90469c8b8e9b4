/*
 * A LoRA adapter's product added to a layer's output for a few rows (decode steps):
 * y[m] += bt.T @ (a @ x[m]), with a [W, K] (the slot's shrink rows, the checkpoint's lora_A
 * layout) and bt [W, N] (its expand matrix transposed, scaling folded in) packed in blocks of
 * COLS columns, [ceil(N / COLS)][W][COLS] (zero-padded): a block is one contiguous read, where
 * row-major B made each block W reads N elements apart (with the adapter out of cache, as in
 * every decode step, the products of a 1.5B model's step took 14.2 ms instead of 17.2).
 *
 * torch spends ~30-90 us of fixed cost on each of these small bf16 matmuls (two per adapted
 * layer), more than their arithmetic; here both run in one call. The shrink takes gemm_nt.h's
 * tiles (K along both operands); its result stays in fp32 (PEFT computes adapters in fp32 too),
 * and the expand is an axpy over output columns, split across threads, each y element read,
 * accumulated in fp32 and rounded once. K must be a multiple of 32 (the caller checks), W at
 * most LORA_MAX_WIDTH and M at most LORA_MAX_ROWS. Built by omniserve/cpu/build.py.
 */
#include <stdint.h>

#include "gemm_nt.h"

#define LORA_MAX_ROWS 64
#define LORA_MAX_WIDTH 512
#define COLS 64 /* output columns per work item: 4 vectors */
#define ER 4    /* rows per expand tile: 16 accumulators, each bt vector loaded once per tile */

/* y[m..m+mr) columns [n0, n0 + COLS) += shrunk rows @ bt: mr a compile-time constant (the
 * switch below), so the accumulators stay in registers. */
#define EXPAND_TILE(T, LOAD, STORE, mr)                                                           \
    do {                                                                                          \
        vec acc[ER][4];                                                                           \
        for (int i = 0; i < mr; ++i)                                                              \
            for (int v = 0; v < 4; ++v) acc[i][v] = LOAD(y + (m + i) * ldy + n0 + v * LANES);     \
        for (int64_t w = 0; w < W; ++w) {                                                         \
            const T *b = block + w * COLS;                                                        \
            vec bv[4];                                                                            \
            for (int v = 0; v < 4; ++v) bv[v] = LOAD(b + v * LANES);                              \
            for (int i = 0; i < mr; ++i) {                                                        \
                const vec s = splat(shrunk[m + i][w]);                                            \
                for (int v = 0; v < 4; ++v) acc[i][v] += s * bv[v];                               \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < mr; ++i)                                                              \
            for (int v = 0; v < 4; ++v) STORE(y + (m + i) * ldy + n0 + v * LANES, acc[i][v]);     \
    } while (0)

#define DEFINE_LORA(NAME, T, TILE_ROWS, LOAD, STORE, FROM_T, TO_T)                                \
    void NAME(const T *x, int64_t M, int64_t ldx, const T *a, int64_t W, int64_t K, const T *bt,  \
              int64_t N, T *y, int64_t ldy, int num_threads) {                                    \
        static __thread float xa[LORA_MAX_ROWS][LORA_MAX_WIDTH];                                  \
        float(*shrunk)[LORA_MAX_WIDTH] = xa; /* the caller's buffer, shared with the team */     \
        const int64_t m_tiles = (M + MR - 1) / MR, w_tiles = (W + NR - 1) / NR;                   \
        _Pragma("omp parallel num_threads(num_threads)") {                                        \
            _Pragma("omp for schedule(static)") for (int64_t job = 0; job < m_tiles * w_tiles;    \
                                                     ++job) {                                     \
                const int64_t m = job / w_tiles * MR, w = job % w_tiles * NR;                     \
                const int mr = (int)(M - m < MR ? M - m : MR);                                    \
                const T *rows[NR];                                                                \
                for (int c = 0; c < NR; ++c) rows[c] = a + (w + c < W ? w + c : W - 1) * K;       \
                float out[MR][NR];                                                                \
                TILE_ROWS(x + m * ldx, ldx, mr, rows, K, out);                                    \
                for (int i = 0; i < mr; ++i)                                                      \
                    for (int c = 0; c < NR && w + c < W; ++c) shrunk[m + i][w + c] = out[i][c];   \
            }                                                                                     \
            const int64_t chunks = (N + COLS - 1) / COLS;                                         \
            _Pragma("omp for schedule(static)") for (int64_t chunk = 0; chunk < chunks;           \
                                                     ++chunk) {                                   \
                const int64_t n0 = chunk * COLS;                                                  \
                const T *block = bt + chunk * W * COLS;                                           \
                if (n0 + COLS <= N) {                                                             \
                    for (int64_t m = 0; m < M; m += ER) {                                         \
                        switch (M - m < ER ? M - m : ER) {                                        \
                        case 1: EXPAND_TILE(T, LOAD, STORE, 1); break;                            \
                        case 2: EXPAND_TILE(T, LOAD, STORE, 2); break;                            \
                        case 3: EXPAND_TILE(T, LOAD, STORE, 3); break;                            \
                        default: EXPAND_TILE(T, LOAD, STORE, 4); break;                           \
                        }                                                                         \
                    }                                                                             \
                } else { /* the last columns of a width that is not a multiple of COLS */        \
                    for (int64_t m = 0; m < M; ++m)                                               \
                        for (int64_t n = n0; n < N; ++n) {                                        \
                            float sum = FROM_T(y[m * ldy + n]);                                   \
                            for (int64_t w = 0; w < W; ++w)                                       \
                                sum += shrunk[m][w] * FROM_T(block[w * COLS + n - n0]);           \
                            y[m * ldy + n] = TO_T(sum);                                           \
                        }                                                                         \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

#define IDENTITY(v) (v)
DEFINE_LORA(omniserve_lora_f32, float, tile_rows_f32, load, store, IDENTITY, IDENTITY)
DEFINE_LORA(omniserve_lora_bf16, bf16, tile_rows_bf16, load_bf16, store_bf16, from_bf16, to_bf16)
