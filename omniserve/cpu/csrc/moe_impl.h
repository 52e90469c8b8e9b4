/*
 * Body of one MoE kernel, included once per element type and weight format (by moe_instances.h,
 * and by moe.c for fp32 on bf16 experts) with these defined:
 *   T          the element type of x and out (float or bf16)
 *   TW         the element type of the weight rows the tiles read (T, or bf16 under float x:
 *              widened exactly)
 *   FN(name)   the exported name for this instance
 *   TILE_ROWS  the gemm_nt.h tile for T rows on TW weights
 *   ROWS(m, e, row, count, K, N, interleaved, scratch)  a pointer to `count` rows (K apart) of
 *              expert e's [N, K] matrix from `row` on, in TW: the stored rows themselves, or the
 *              rows decoded into `scratch` (NR x max(H, I) TW per thread) when DECODED is 1, in
 *              vec.h's interleaved order when `interleaved`
 *   INTERLEAVABLE  1 where 4-bit codes may decode in vec.h's interleaved order (groups, H and I
 *              whole CHUNKs): x's rows, and the activations between the projections, are then
 *              kept in that order (INTERLEAVE_ROW, INTERLEAVED_POSITION) and decoding costs less
 *   LOADT(p)   16 T at p -> vec
 *   STOREV(p, v) vec -> 16 T at p (rounded)
 *   TO_T(f)    float -> T (rounded)
 *   ROUND(f), ROUNDV(v)  a float / vec rounded to T's precision (identity for float)
 *   and when DECODED is 1, for up to DIRECT_ROWS tokens of an expert:
 *   CODE_BITS  bits per code
 *   DIRECT_STATE(m, i)  what decoding group i (of the whole stacked matrix) needs, as a vec
 *   DIRECT_DECODE32(c, state, w)  32 weights from codes c into w[2], rounded to T's precision
 *                                 (by ROUNDW, ROUNDV for values that are not NaN)
 *
 * Rounding follows transformers' expert loop op by op: the gate and up outputs, silu(gate), its
 * product with up, the down output and its weighted value are each rounded to T, and each
 * token's output is summed expert by expert in increasing id, rounded after every add (its
 * index_add_). Accumulation inside each projection is fp32.
 */

#if DECODED
/* The dot products of MM rows of x (ldx apart) with rows[0..3] of expert e's [N, K] matrix,
 * decoded 32 weights at a time straight into the sums (x read from L1): with one or two tokens
 * on an expert, decoding into the scratch first and reading it back cost more than the codes'
 * bytes (the tiles then have one row of x to reuse each weight for). `ahead`: the bytes to the
 * same codes of the rows decoded next. */
#define DEFINE_DIRECT_DOTS(NAME, MM)                                                             \
    static inline __attribute__((always_inline)) void NAME(                                      \
        const T *x, int64_t ldx, moe_weights m, int64_t e, int64_t N, const int64_t rows[4],     \
        int64_t K, int interleaved, int64_t ahead, float out[2][4]) {                            \
        const int64_t groups = K / m.group_size, row_bytes = K * CODE_BITS / 8;                 \
        vec acc[MM][4][2];                                                                       \
        for (int i = 0; i < MM; ++i)                                                             \
            for (int r = 0; r < 4; ++r) acc[i][r][0] = acc[i][r][1] = splat(0.0f);               \
        for (int64_t g = 0; g < groups; ++g) {                                                   \
            vec state[4];                                                                        \
            const uint8_t *c[4];                                                                 \
            for (int r = 0; r < 4; ++r) {                                                        \
                const int64_t row = e * N + rows[r];                                             \
                state[r] = DIRECT_STATE(m, row * groups + g);                                    \
                c[r] = (const uint8_t *)m.codes + row * row_bytes + g * m.group_size * CODE_BITS / 8; \
            }                                                                                    \
            for (int64_t k = 0; INTERLEAVABLE && interleaved && k < m.group_size; k += CHUNK) {  \
                const T *xk = x + g * m.group_size + k;                                          \
                for (int r = 0; r < 4; ++r) {                                                    \
                    if (k / 2 % 64 == 0) prefetch_ahead(c[r] + k / 2, ahead);                    \
                    vec w[8];                                                                    \
                    int4_decode128(c[r] + k / 2, state[r], w);                                   \
                    for (int i = 0; i < MM; ++i)                                                 \
                        for (int s = 0; s < 8; ++s)                                              \
                            acc[i][r][s & 1] += LOADT(xk + i * ldx + LANES * s) * w[s];          \
                }                                                                                \
            }                                                                                    \
            for (int64_t k = 0; !(INTERLEAVABLE && interleaved) && k < m.group_size;             \
                 k += 2 * LANES) {                                                               \
                const T *xk = x + g * m.group_size + k;                                          \
                for (int r = 0; r < 4; ++r) {                                                    \
                    const uint8_t *ck = c[r] + k * CODE_BITS / 8;                                \
                    if (k * CODE_BITS / 8 % 64 == 0) prefetch_ahead(ck, ahead);                  \
                    vec w[2];                                                                    \
                    DIRECT_DECODE32(ck, state[r], w);                                            \
                    for (int i = 0; i < MM; ++i) {                                               \
                        acc[i][r][0] += LOADT(xk + i * ldx) * w[0];                              \
                        acc[i][r][1] += LOADT(xk + i * ldx + LANES) * w[1];                      \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < MM; ++i)                                                             \
            for (int r = 0; r < 4; ++r) out[i][r] = lane_sum(acc[i][r][0] + acc[i][r][1]);       \
    }
DEFINE_DIRECT_DOTS(FN(direct_dots_1), 1)
DEFINE_DIRECT_DOTS(FN(direct_dots_2), 2)
#undef DEFINE_DIRECT_DOTS

/* direct_dots for 1 or 2 rows of x */
static inline void FN(direct_dots)(const T *x, int64_t ldx, int mr, moe_weights m, int64_t e,
                                   int64_t N, const int64_t rows[4], int64_t K, int interleaved,
                                   int64_t ahead, float out[2][4]) {
    if (mr == 1)
        FN(direct_dots_1)(x, ldx, m, e, N, rows, K, interleaved, ahead, out);
    else
        FN(direct_dots_2)(x, ldx, m, e, N, rows, K, interleaved, ahead, out);
}
#endif

/* where feature f of an activation row is kept */
#define FEATURE(f) (interleaved ? INTERLEAVED_POSITION(f) : (f))

/* out[t] = sum over t's experts e, in increasing e, of weight * down_e(silu(gate_e x) * up_e x).
 * x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I] (moe.c's moe_weights:
 * stored rows, or codes with their zero points, scales and group size); topk [T, k]; out [T, H].
 * An id of E is another rank's expert (expert parallelism): its pairs are skipped.
 * Returns 0, -1 on an expert id outside [0, E], -2 on an allocation failure. */
int FN(omniserve_moe)(const T *x, int64_t num_tokens, int64_t H, const void *gate_up_codes,
                      const uint8_t *gate_up_zeros, const float *gate_up_scales,
                      int64_t gate_up_group, const void *down_codes, const uint8_t *down_zeros,
                      const float *down_scales, int64_t down_group, int64_t E, int64_t I,
                      const float *topk_weights, const int64_t *topk_ids, int64_t top_k, T *out,
                      int num_threads) {
    const moe_weights gate_up = {gate_up_codes, gate_up_zeros, gate_up_scales, gate_up_group};
    const moe_weights down = {down_codes, down_zeros, down_scales, down_group};
    const int64_t pairs = num_tokens * top_k;
    for (int64_t p = 0; p < pairs; ++p)
        if (topk_ids[p] < 0 || topk_ids[p] > E) return -1;
    int64_t *start = calloc((size_t)E + 2, sizeof *start); /* (E: the skipped pairs, last) */
    int64_t *fill = calloc((size_t)E + 1, sizeof *fill);
    int64_t *slot_of = malloc(sizeof *slot_of * (size_t)pairs); /* pair -> row sorted by expert */
    T *xs = malloc(sizeof *xs * (size_t)pairs * (size_t)H);      /* gathered inputs */
    T *act = malloc(sizeof *act * (size_t)pairs * (size_t)I);    /* silu(gate) * up */
    float *ys = malloc(sizeof *ys * (size_t)pairs * (size_t)H);  /* expert outputs */
    int status = 0;
    const int interleaved = INTERLEAVABLE && gate_up.group_size % CHUNK == 0 &&
                            down.group_size % CHUNK == 0 && H % CHUNK == 0 && I % CHUNK == 0;
    if (!start || !fill || !slot_of || !xs || !act || !ys) {
        status = -2;
        goto done;
    }
    for (int64_t p = 0; p < pairs; ++p) ++start[topk_ids[p] + 1];
    for (int64_t e = 0; e <= E; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = topk_ids[p];
        slot_of[p] = start[e] + fill[e]++;
    }
    /* Work items: (expert, block of weight rows). A block is small enough to stay in L2 while
     * every row tile of its expert passes over it, so a weight is read from memory once. */
    const int64_t up_blocks = (I + MOE_BLOCK / 2 - 1) / (MOE_BLOCK / 2);
    const int64_t down_blocks = (H + MOE_BLOCK - 1) / MOE_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        TW *scratch = DECODED ? aligned_alloc(64, sizeof(TW) * NR * (size_t)(H > I ? H : I)) : NULL;
        if (DECODED && scratch == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p)
            if (interleaved)
                INTERLEAVE_ROW(x + (p / top_k) * H, H, xs + slot_of[p] * H);
            else
                memcpy(xs + slot_of[p] * H, x + (p / top_k) * H, sizeof *xs * (size_t)H);
        /* gate/up: each tile takes NR / 2 gate rows and the matching up rows (read or decoded
         * once for all of the expert's tokens), so silu(g) * u is formed from the tile's sums */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * up_blocks; ++item) {
            const int64_t e = item / up_blocks;
            if (start[e + 1] == start[e] || (DECODED && scratch == NULL)) continue;
            const int64_t j0 = item % up_blocks * (MOE_BLOCK / 2);
            const int64_t j1 = j0 + MOE_BLOCK / 2 < I ? j0 + MOE_BLOCK / 2 : I;
#if DECODED
            if (start[e + 1] - start[e] <= DIRECT_ROWS) { /* two gate and two up rows a time */
                const int mr = (int)(start[e + 1] - start[e]);
                for (int64_t j = j0; j < j1; j += 2) {
                    const int64_t n = j1 - j < 2 ? j1 - j : 2;
                    const int64_t rows[4] = {j, j + n - 1, I + j, I + j + n - 1};
                    float y[2][4];
                    FN(direct_dots)(xs + start[e] * H, H, mr, gate_up, e, 2 * I, rows, H,
                                    interleaved, 2 * H * CODE_BITS / 8, y);
                    for (int m = 0; m < mr; ++m)
                        for (int c = 0; c < n; ++c) {
                            const float g = ROUND(y[m][c]), u = ROUND(y[m][2 + c]);
                            act[(start[e] + m) * I + FEATURE(j + c)] =
                                TO_T(ROUND(g / (1.0f + expf(-g))) * u);
                        }
                }
                continue;
            }
#endif
            for (int64_t j = j0; j < j1; j += NR / 2) {
                const int64_t n = j1 - j < NR / 2 ? j1 - j : NR / 2;
                const TW *gate = ROWS(gate_up, e, j, n, H, 2 * I, interleaved, scratch);
                const TW *up =
                    ROWS(gate_up, e, I + j, n, H, 2 * I, interleaved, scratch + NR / 2 * H);
                const TW *w[NR];
                for (int c = 0; c < NR / 2; ++c) { /* a short tail repeats its last row */
                    const int64_t row = c < n ? c : n - 1;
                    w[c] = gate + row * H;
                    w[c + NR / 2] = up + row * H;
                }
                for (int64_t r = start[e]; r < start[e + 1]; r += MR) {
                    const int mr = (int)(start[e + 1] - r < MR ? start[e + 1] - r : MR);
                    float y[MR][NR];
                    TILE_ROWS(xs + r * H, H, mr, w, H, y);
                    for (int m = 0; m < mr; ++m)
                        for (int c = 0; c < n; ++c) {
                            const float g = ROUND(y[m][c]), u = ROUND(y[m][c + NR / 2]);
                            act[(r + m) * I + FEATURE(j + c)] =
                                TO_T(ROUND(g / (1.0f + expf(-g))) * u);
                        }
                }
            }
        }
        /* down: act rows against NR rows of the expert's down projection at a time */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * down_blocks; ++item) {
            const int64_t e = item / down_blocks;
            if (start[e + 1] == start[e] || (DECODED && scratch == NULL)) continue;
            const int64_t h0 = item % down_blocks * MOE_BLOCK;
            const int64_t h1 = h0 + MOE_BLOCK < H ? h0 + MOE_BLOCK : H;
#if DECODED
            if (start[e + 1] - start[e] <= DIRECT_ROWS) { /* four rows a time */
                const int mr = (int)(start[e + 1] - start[e]);
                for (int64_t h = h0; h < h1; h += 4) {
                    const int64_t n = h1 - h < 4 ? h1 - h : 4;
                    int64_t rows[4];
                    for (int c = 0; c < 4; ++c) rows[c] = h + (c < n ? c : n - 1);
                    float y[2][4];
                    FN(direct_dots)(act + start[e] * I, I, mr, down, e, H, rows, I,
                                    interleaved, 4 * I * CODE_BITS / 8, y);
                    for (int m = 0; m < mr; ++m)
                        for (int c = 0; c < n; ++c) ys[(start[e] + m) * H + h + c] = ROUND(y[m][c]);
                }
                continue;
            }
#endif
            for (int64_t h = h0; h < h1; h += NR) {
                const int64_t n = h1 - h < NR ? h1 - h : NR;
                const TW *rows = ROWS(down, e, h, n, I, H, interleaved, scratch);
                const TW *w[NR];
                for (int c = 0; c < NR; ++c) w[c] = rows + (c < n ? c : n - 1) * I;
                for (int64_t r = start[e]; r < start[e + 1]; r += MR) {
                    const int mr = (int)(start[e + 1] - r < MR ? start[e + 1] - r : MR);
                    float y[MR][NR];
                    TILE_ROWS(act + r * I, I, mr, w, I, y);
                    for (int m = 0; m < mr; ++m)
                        for (int c = 0; c < n; ++c) ys[(r + m) * H + h + c] = ROUND(y[m][c]);
                }
            }
        }
        /* each token's experts in increasing id, weighted, summed from zero */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            int64_t order[top_k]; /* t's choices by increasing expert id (insertion sort) */
            for (int64_t j = 0; j < top_k; ++j) {
                int64_t i = j;
                for (; i > 0 && topk_ids[t * top_k + order[i - 1]] > topk_ids[t * top_k + j]; --i)
                    order[i] = order[i - 1];
                order[i] = j;
            }
            for (int64_t d = 0; d < H; d += LANES) {
                vec sum = (vec){0};
                for (int64_t j = 0; j < top_k; ++j) {
                    const int64_t p = t * top_k + order[j];
                    if (topk_ids[p] == E) break; /* (sorted last: the rest are skipped too) */
                    sum = ROUNDV(sum + ROUNDV(load(ys + slot_of[p] * H + d) * topk_weights[p]));
                }
                STOREV(out + t * H + d, sum);
            }
        }
        free(scratch);
    }
done:
    free(start);
    free(fill);
    free(slot_of);
    free(xs);
    free(act);
    free(ys);
    return status;
}
#undef FEATURE
