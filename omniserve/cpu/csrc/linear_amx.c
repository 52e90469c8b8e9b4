/*
 * y = x @ w.T (+ bias) in bf16 on AMX tiles, with w in the checkpoint's [N, K] layout.
 *
 * AMX multiplies an A tile (16 rows x 32 bf16) by a B tile whose rows hold pairs of k for 16
 * columns (the "VNNI" layout). The roles are swapped here so that the weight needs no packed copy:
 * A is 16 rows of w as they lie in memory (one 64-byte piece of each row per step), B is x
 * transposed into that pair layout (small next to the weight), and each C tile holds y.T for 16
 * output features x 16 rows of x, transposed back when it is written out. For weights that must
 * keep their layout (a head tied to the embedding). Rows of x go in blocks that fit L2 beside a
 * thread's 32 rows of w, which every 32-row chunk of the block then reads from L2; a decode
 * step's rows are one block, so the weight streams from memory once.
 *
 * Tiles: tmm0-3 the four C tiles of a 32 x 32 block (features x rows of x), tmm4-5 two A tiles
 * (32 rows of w), tmm6-7 two B tiles (32 rows of x). fp32 accumulation over the whole K, the
 * bias added in fp32, rounded to bf16 once (to nearest even), as torch's bf16 linear rounds.
 * K must be a multiple of 32 and N of 16 (the caller checks). Built by omniserve/cpu/build.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16;

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PIECE 512 /* bf16 per B tile: 16 pairs of k x 16 rows of x */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The kernel asks Linux for the AMX state once per process (threads inherit the permission);
 * 0 when granted. */
int omniserve_amx_request(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* The two-source permutes of transpose16's stages (b = 8, 4, 2, 1): lane c of the first row
 * of each pair takes the first b lanes of each 2b-lane chunk from row i then from row i + b
 * (lanes of the second source count from 16); the second row takes the last b of each. */
#define STAGE_INDEX(b, c, hi) \
    ((c) % (2 * (b)) < (b) ? (c) / (2 * (b)) * 2 * (b) + (hi) * (b) + (c) % (2 * (b)) \
                           : 16 + (c) / (2 * (b)) * 2 * (b) + (hi) * (b) + (c) % (2 * (b)) - (b))
#define STAGE_ROW(b, hi)                                                                         \
    { STAGE_INDEX(b, 0, hi),  STAGE_INDEX(b, 1, hi),  STAGE_INDEX(b, 2, hi),                   \
      STAGE_INDEX(b, 3, hi),  STAGE_INDEX(b, 4, hi),  STAGE_INDEX(b, 5, hi),                   \
      STAGE_INDEX(b, 6, hi),  STAGE_INDEX(b, 7, hi),  STAGE_INDEX(b, 8, hi),                   \
      STAGE_INDEX(b, 9, hi),  STAGE_INDEX(b, 10, hi), STAGE_INDEX(b, 11, hi),                  \
      STAGE_INDEX(b, 12, hi), STAGE_INDEX(b, 13, hi), STAGE_INDEX(b, 14, hi),                  \
      STAGE_INDEX(b, 15, hi) }
static const int32_t STAGES[4][2][16] __attribute__((aligned(64))) = {
    {STAGE_ROW(8, 0), STAGE_ROW(8, 1)},
    {STAGE_ROW(4, 0), STAGE_ROW(4, 1)},
    {STAGE_ROW(2, 0), STAGE_ROW(2, 1)},
    {STAGE_ROW(1, 0), STAGE_ROW(1, 1)},
};

/* r[j][i] = r[i][j] for 16 x 16 32-bit lanes: four stages, each swapping the off-diagonal
 * blocks of every 2b x 2b block (b = 8, 4, 2, 1). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
        const int b = 8 >> s;
        const __m512i lo = _mm512_load_si512(STAGES[s][0]), hi = _mm512_load_si512(STAGES[s][1]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
            if (i & b) continue;
            const __m512i a = r[i], c = r[i + b];
            r[i] = _mm512_permutex2var_epi32(a, lo, c);
            r[i + b] = _mm512_permutex2var_epi32(a, hi, c);
        }
    }
}

/* x's rows [16 h, 16 h + 16) and features [32 kb, 32 kb + 32) as one B tile: 16 pairs of k, each
 * a 32-bit word, for each of the 16 rows (rows past M are zeros). */
static void pack_piece(const bf16 *x, int64_t M, int64_t ldx, int64_t h, int64_t kb, bf16 *out) {
    __m512i r[16];
    for (int m = 0; m < 16; ++m) {
        const int64_t row = 16 * h + m;
        r[m] = row < M ? _mm512_loadu_si512(x + row * ldx + 32 * kb) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + 32 * p, r[p]);
}

/* One C tile (16 features x 16 rows of x) into y: transposed, plus bias, rounded to bf16. */
static void store_tile(int tile_id, float *buffer, const bf16 *bias, int64_t rows, bf16 *y,
                       int64_t ldy) {
    switch (tile_id) { /* tile ids are immediates */
    case 0: _tile_stored(0, buffer, 64); break;
    case 1: _tile_stored(1, buffer, 64); break;
    case 2: _tile_stored(2, buffer, 64); break;
    default: _tile_stored(3, buffer, 64); break;
    }
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(buffer + 16 * n);
    transpose16(r);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16))
                          : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
        const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(r[m]), b);
        _mm256_storeu_si256((void *)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

#define KC_MAX 2048        /* features per K-chunk: a thread's 32 rows of w for it stay in L2 */
#define BLOCK_BYTES (1 << 20) /* x's share of L2: rows of x per block, times the chunk's bytes */

/* How K splits into chunks of whole pieces (at most KC_MAX features each) and how many rows of
 * x one block holds. */
static void plan(int64_t M, int64_t K, int64_t *kc, int64_t *chunks, int64_t *block_rows) {
    *chunks = (K + KC_MAX - 1) / KC_MAX;
    *kc = ((K / 32 + *chunks - 1) / *chunks) * 32;
    *chunks = (K + *kc - 1) / *kc;
    const int64_t rows = BLOCK_BYTES / (2 * *kc) / 32 * 32;
    *block_rows = rows < 32 ? 32 : rows > M ? (M + 31) / 32 * 32 : rows;
}

/* Bytes of scratch a call needs: one block of x's rows transposed into B tiles, and with more
 * than one K-chunk the fp32 partial sums of that block's C tiles. */
int64_t omniserve_linear_amx_scratch_bytes(int64_t M, int64_t N, int64_t K) {
    int64_t kc, chunks, block_rows;
    plan(M, K, &kc, &chunks, &block_rows);
    return block_rows * K * 2 + (chunks > 1 ? block_rows / 32 * ((N + 31) / 32) * 4096 : 0);
}

/* One 32 x 32 block of y.T: features [32 g, 32 g + 32) x rows of x [16 c, 16 c + 32), over the
 * K-chunk [k0, k1); partial sums kept in `partial` between chunks. */
static void block(const bf16 *w, int64_t N, int64_t K, const bf16 *packed, int64_t KB,
                  int64_t halves, int64_t M, int64_t g, int64_t c, int64_t k0, int64_t k1,
                  float *partial, const bf16 *bias, bf16 *y, int64_t ldy, float *buffer) {
    const bf16 *w0 = w + 32 * g * K, *w1 = w0 + 16 * K;
    const int two_a = 32 * g + 16 < N, two_b = c + 1 < halves; /* N or M may end mid-block */
    const bf16 *b0 = packed + c * KB * PIECE, *b1 = b0 + KB * PIECE;
    if (partial && k0 > 0) {
        _tile_loadd(0, partial, 64);
        _tile_loadd(1, partial + 256, 64);
        _tile_loadd(2, partial + 512, 64);
        _tile_loadd(3, partial + 768, 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = k0 / 32; kb < k1 / 32; ++kb) {
        _tile_loadd(4, w0 + 32 * kb, 2 * K);
        _tile_loadd(6, b0 + kb * PIECE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
            _tile_loadd(7, b1 + kb * PIECE, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_a) {
            _tile_loadd(5, w1 + 32 * kb, 2 * K);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (partial && k1 < K) {
        _tile_stored(0, partial, 64);
        _tile_stored(1, partial + 256, 64);
        _tile_stored(2, partial + 512, 64);
        _tile_stored(3, partial + 768, 64);
        return;
    }
    for (int t = 0; t < 4; ++t) {
        const int a = t / 2, bh = t % 2;
        if ((a && !two_a) || (bh && !two_b)) continue;
        const int64_t m0 = 16 * (c + bh), n0 = 32 * g + 16 * a;
        const int64_t rows = M - m0 < 16 ? M - m0 : 16;
        store_tile(t, buffer, bias ? bias + n0 : NULL, rows, y + m0 * ldy + n0, ldy);
    }
}

/* scratch holds omniserve_linear_amx_scratch_bytes(M, N, K); returns 0, or -1 where the process
 * may not use AMX. Each block of x's rows is transposed, then passes over the weight one K-chunk
 * at a time, the threads splitting the weight's rows. */
int omniserve_linear_amx_bf16(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N,
                              int64_t K, const bf16 *bias, bf16 *y, int64_t ldy, void *scratch,
                              int num_threads) {
    static int permission = 1; /* 1: not asked yet */
    if (permission == 1) permission = omniserve_amx_request();
    if (permission != 0) return -1;
    int64_t kc, chunks, block_rows;
    plan(M, K, &kc, &chunks, &block_rows);
    const int64_t KB = K / 32, groups = (N + 31) / 32;
    bf16 *packed = scratch;
    float *partials = chunks > 1 ? (float *)(packed + block_rows * K) : NULL;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
        float buffer[256] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
            const int64_t rows = M - m0 < block_rows ? M - m0 : block_rows;
            const int64_t halves = (rows + 15) / 16;
            const bf16 *xb = x + m0 * ldx;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < halves * KB; ++i)
                pack_piece(xb, rows, ldx, i / KB, i % KB, packed + i * PIECE);
            for (int64_t k0 = 0; k0 < K; k0 += kc) {
                const int64_t k1 = k0 + kc < K ? k0 + kc : K;
#pragma omp for schedule(static)
                for (int64_t g = 0; g < groups; ++g)
                    for (int64_t c = 0; c < halves; c += 2)
                        block(w, N, K, packed, KB, halves, rows, g, c, k0, k1,
                              partials ? partials + (g * (block_rows / 32) + c / 2) * 1024 : NULL,
                              bias, y + m0 * ldy, ldy, buffer);
            }
        }
        _tile_release();
    }
    return 0;
}
