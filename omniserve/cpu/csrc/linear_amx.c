/*
 * y = x @ w.T (+ bias) in bf16 on AMX tiles, on two layouts of w.
 *
 * AMX multiplies an A tile (16 rows x 32 bf16) by a B tile whose rows hold pairs of k for 16
 * columns (the "VNNI" layout), into a C tile of 16 x 16 fp32 sums.
 * - Packed: w is packed once into B tiles (``omniserve_pack_amx_bf16``, replacing the layer's
 *   weight), A tiles are 16 rows of x as they lie, and each C tile is 16 rows of y.
 * - Plain, for weights that must keep the checkpoint's [N, K]
 *   layout (a head tied to the embedding): the roles are swapped, A tiles are 16 rows of w as
 *   they lie, B is x transposed into the pair layout (small next to the weight), and each C tile
 *   holds y.T, transposed back when it is written out.
 * Rows of x go in blocks that fit L2 beside a thread's 32 rows of w for one K-chunk, which every
 * 32-row chunk of the block then reads from L2; a decode step's rows are one block, so the
 * weight streams from memory once. With 4 or more chunks (a prefill), each chunk also prefetches
 * a share of the next group's B tiles into L2, so no chunk waits on memory for them (9-12% on
 * the products of 2,048 rows). Tiles: tmm0-3 the four C tiles of a 32 x 32 block, tmm4-5
 * two A tiles, tmm6-7 two B tiles. fp32 accumulation over the whole K (partial sums kept between
 * K-chunks), the bias added in fp32, rounded to bf16 once (to nearest even), as torch's bf16
 * linear rounds. K must be a multiple of 32 and N of 16 (the caller checks). Built by
 * omniserve/cpu/build.py.
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

/* Asks Linux for the AMX state, which the process's threads then share; 0 when granted. The
 * caller asks once per process before any product (cpu/linear_amx.py). */
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

/* C tile `t` into buffer (16 rows of 16 fp32). */
static inline void store_c(int t, float *buffer) {
    switch (t) { /* tile ids are immediates */
    case 0: _tile_stored(0, buffer, 64); break;
    case 1: _tile_stored(1, buffer, 64); break;
    case 2: _tile_stored(2, buffer, 64); break;
    default: _tile_stored(3, buffer, 64); break;
    }
}

static inline __m512 load_bias(const bf16 *bias) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)bias)), 16));
}

/* One C tile of 16 rows of y (16 features each) into y, plus bias, rounded to bf16. */
static void write_rows(int t, float *buffer, const bf16 *bias, int64_t rows, bf16 *y,
                       int64_t ldy) {
    store_c(t, buffer);
    const __m512 b = bias ? load_bias(bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(buffer + 16 * m), b);
        _mm256_storeu_si256((void *)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* One C tile of y.T (16 features x 16 rows of x) into y: transposed, plus bias, rounded. */
static void write_transposed(int t, float *buffer, const bf16 *bias, int64_t rows, bf16 *y,
                             int64_t ldy) {
    store_c(t, buffer);
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_load_si512(buffer + 16 * n);
    transpose16(r);
    const __m512 b = bias ? load_bias(bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
        const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(r[m]), b);
        _mm256_storeu_si256((void *)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* The operands of one 32 x 32 block of C: A tiles from two row pointers (lda elements apart;
 * 32 k further each step), B tiles from two runs of pieces (b_step elements apart per step);
 * a1 / b1 NULL where the block ends half-way. */
typedef struct {
    const bf16 *a0, *a1, *b0, *b1;
    int64_t lda0, lda1, b_step;
    const char *prefetch; /* lines to bring into L2 meanwhile, `per_step` a step (or NULL) */
    int64_t per_step;
} operands;

/* C (tmm0-3) = the block's sums over steps [s0, s1), starting from `partial` (or zero) and,
 * unless `last`, saved back there. */
static void multiply(const operands *o, int64_t s0, int64_t s1, float *partial, int last) {
    if (partial && s0 > 0) {
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
    for (int64_t s = s0; s < s1; ++s) {
        if (o->prefetch)
            for (int64_t line = 0; line < o->per_step; line += 64)
                _mm_prefetch(o->prefetch + (s - s0) * o->per_step + line, _MM_HINT_T1);
        _tile_loadd(4, o->a0 + 32 * s, 2 * o->lda0);
        _tile_loadd(6, o->b0 + s * o->b_step, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (o->b1) {
            _tile_loadd(7, o->b1 + s * o->b_step, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (o->a1) {
            _tile_loadd(5, o->a1 + 32 * s, 2 * o->lda1);
            _tile_dpbf16ps(2, 5, 6);
            if (o->b1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (partial && !last) {
        _tile_stored(0, partial, 64);
        _tile_stored(1, partial + 256, 64);
        _tile_stored(2, partial + 512, 64);
        _tile_stored(3, partial + 768, 64);
    }
}

#define KC_MAX 2048           /* features per K-chunk: a thread's 32 rows of w for it stay in L2 */
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

/* Bytes of scratch a call needs: for the plain layout one block of x's rows transposed into B
 * tiles, for the packed one x's last rows padded to 16; with more than one K-chunk the fp32
 * partial sums of a block's C tiles. */
int64_t omniserve_linear_amx_scratch_bytes(int64_t M, int64_t N, int64_t K, int packed) {
    int64_t kc, chunks, block_rows;
    plan(M, K, &kc, &chunks, &block_rows);
    return (packed ? 16 : block_rows) * K * 2 +
           (chunks > 1 ? block_rows / 32 * ((N + 31) / 32) * 4096 : 0);
}

/* w [N, K] into B tiles: [N / 32 groups][K / 32 steps][2 halves of 16 features][16 pairs of k]
 * [16 features][2] (a last group of 16 features has zeros for its second half). */
void omniserve_pack_amx_bf16(const bf16 *w, int64_t N, int64_t K, bf16 *out, int num_threads) {
    const int64_t KB = K / 32, groups = (N + 31) / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < groups * KB * 2; ++i) {
        const int64_t g = i / (KB * 2), kb = i / 2 % KB, n0 = 32 * g + 16 * (i % 2);
        __m512i r[16];
        for (int n = 0; n < 16; ++n)
            r[n] = n0 + n < N ? _mm512_loadu_si512(w + (n0 + n) * K + 32 * kb)
                              : _mm512_setzero_si512();
        transpose16(r); /* r[p]: pair p of k for each of the 16 features */
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + i * PIECE + 32 * p, r[p]);
    }
}

/* One product: x [M, K] (rows ldx apart), the weight (plain [N, K] or packed), y [M, N]. */
typedef struct {
    const bf16 *x, *w, *bias;
    bf16 *y;
    int64_t M, N, K, ldx, ldy;
    int64_t kc, block_rows; /* plan()'s */
    int packed;
    bf16 *scratch; /* plain: a block's rows transposed; packed: x's last rows padded to 16 */
    float *partials;
    int64_t full; /* packed: rows of x an A tile may read in place (the rest from scratch) */
} product;

/* One 32 x 32 block of C for steps [s0, s1) of a K-chunk, written out after the last: rows
 * [c, c + 32) of the block of x at m0 x features [n0, n0 + 32) (plain: C holds y.T). */
static void block(const product *p, int64_t m0, int64_t rows, int64_t n0, int64_t c, int64_t s0,
                  int64_t s1, float *partial, float *buffer) {
    const int64_t chunks = (rows + 31) / 32, group_bytes = (s1 - s0) * 2 * PIECE * 2;
    const int64_t KB = p->K / 32, K = p->K, r0 = m0 + c, r1 = r0 + 16;
    const int more_rows = c + 16 < rows, more_features = n0 + 16 < p->N;
    operands o;
    if (p->packed) {
        const bf16 *wg = p->w + n0 / 32 * KB * 2 * PIECE;
        /* The next group's B tiles for these steps, a share per 32-row chunk: they come from
         * memory while this group's are read from L2 by the block's other chunks. */
        const int prefetch = chunks >= 4 && n0 + 32 < p->N;
        o = (operands){r0 < p->full ? p->x + r0 * p->ldx : p->scratch,
                       !more_rows ? NULL : r1 < p->full ? p->x + r1 * p->ldx : p->scratch,
                       wg, more_features ? wg + PIECE : NULL,
                       r0 < p->full ? p->ldx : K, r1 < p->full ? p->ldx : K, 2 * PIECE,
                       prefetch ? (const char *)(wg + KB * 2 * PIECE + s0 * 2 * PIECE)
                                      + c / 32 * (group_bytes / chunks) : NULL,
                       (group_bytes / chunks / (s1 - s0) + 63) / 64 * 64};
    } else {
        const bf16 *xt = p->scratch + c / 16 * KB * PIECE;
        o = (operands){p->w + n0 * K, more_features ? p->w + (n0 + 16) * K : NULL,
                       xt, more_rows ? xt + KB * PIECE : NULL, K, K, PIECE, NULL, 0};
    }
    const int last = s1 == KB;
    multiply(&o, s0, s1, partial, last);
    if (!last) return;
    for (int t = 0; t < 4; ++t) { /* tmm t holds A tile t / 2 times B tile t % 2 */
        const int a = t / 2, b = t % 2;
        const int64_t mt = c + 16 * (p->packed ? a : b), nt = n0 + 16 * (p->packed ? b : a);
        if (nt >= p->N || mt >= rows) continue;
        (p->packed ? write_rows : write_transposed)(t, buffer, p->bias ? p->bias + nt : NULL,
                                                    rows - mt < 16 ? rows - mt : 16,
                                                    p->y + (m0 + mt) * p->ldy + nt, p->ldy);
    }
}

/* Blocks of x's rows (the plain layout first transposes each), K-chunks, then the weight's
 * 32-feature groups split among the threads, each over the block's 32-row chunks. */
static void run(const product *p, int num_threads) {
    const int64_t kc = p->kc, block_rows = p->block_rows;
    const int64_t KB = p->K / 32, groups = (p->N + 31) / 32;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
        float buffer[256] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < p->M; m0 += block_rows) {
            const int64_t rows = p->M - m0 < block_rows ? p->M - m0 : block_rows;
            if (!p->packed) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < (rows + 15) / 16 * KB; ++i)
                    pack_piece(p->x + m0 * p->ldx, rows, p->ldx, i / KB, i % KB,
                               p->scratch + i * PIECE);
            }
            for (int64_t k0 = 0; k0 < p->K; k0 += kc) {
                const int64_t s0 = k0 / 32, s1 = (k0 + kc < p->K ? k0 + kc : p->K) / 32;
#pragma omp for schedule(static)
                for (int64_t g = 0; g < groups; ++g)
                    for (int64_t c = 0; c < rows; c += 32) {
                        float *partial = p->partials
                            ? p->partials + (g * (block_rows / 32) + c / 32) * 1024 : NULL;
                        block(p, m0, rows, 32 * g, c, s0, s1, partial, buffer);
                    }
            }
        }
        _tile_release();
    }
}

/* y = x @ w.T + bias on w [N, K] as it lies, or (packed) on omniserve_pack_amx_bf16's layout;
 * scratch holds omniserve_linear_amx_scratch_bytes(M, N, K, packed). */
void omniserve_linear_amx_bf16(const bf16 *x, int64_t M, int64_t ldx, const bf16 *w, int64_t N,
                               int64_t K, const bf16 *bias, bf16 *y, int64_t ldy, void *scratch,
                               int packed, int num_threads) {
    int64_t kc, chunks, block_rows;
    plan(M, K, &kc, &chunks, &block_rows);
    product p = {x, w, bias, y, M, N, K, ldx, ldy, kc, block_rows, packed, scratch, NULL,
                 M / 16 * 16};
    const int64_t staged = (packed ? 16 : block_rows) * K; /* bf16 before the partial sums */
    if (chunks > 1) p.partials = (float *)((bf16 *)scratch + staged);
    if (packed && p.full < M) { /* A tiles read 16 rows: the last few come padded */
        memset(scratch, 0, 16 * K * 2);
        for (int64_t m = p.full; m < M; ++m)
            memcpy(p.scratch + (m - p.full) * K, x + m * ldx, K * 2);
    }
    run(&p, num_threads);
}
