/*
 * Body of one MoE kernel, included by moe.c once per element type and weight format with these
 * defined:
 *   T          the element type of x and out (float or bf16)
 *   TW         the element type of the weight rows the tiles read (T, or bf16 under float x:
 *              widened exactly)
 *   FN(name)   the exported name for this instance
 *   TILE_ROWS  the gemm_nt.h tile for T rows on TW weights
 *   ROWS(m, e, row, count, K, N, scratch)  a pointer to `count` rows (K apart) of expert e's
 *              [N, K] matrix from `row` on, in TW: the stored rows themselves, or the rows
 *              decoded into `scratch` (NR x max(H, I) TW per thread) when DECODED is 1
 *   STOREV(p, v) vec -> 16 T at p (rounded)
 *   TO_T(f)    float -> T (rounded)
 *   ROUND(f), ROUNDV(v)  a float / vec rounded to T's precision (identity for float)
 *
 * Rounding follows transformers' expert loop op by op: the gate and up outputs, silu(gate), its
 * product with up, the down output and its weighted value are each rounded to T, and each
 * token's output is summed expert by expert in increasing id, rounded after every add (its
 * index_add_). Accumulation inside each projection is fp32.
 */

/* out[t] = sum over t's experts e, in increasing e, of weight * down_e(silu(gate_e x) * up_e x).
 * x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I] (moe.c's moe_weights:
 * stored rows, or codes with their zero points, scales and group size); topk [T, k]; out [T, H].
 * Returns 0, -1 on an expert id outside [0, E), -2 on an allocation failure. */
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
        if (topk_ids[p] < 0 || topk_ids[p] >= E) return -1;
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    int64_t *fill = calloc((size_t)E, sizeof *fill);
    int64_t *slot_of = malloc(sizeof *slot_of * (size_t)pairs); /* pair -> row sorted by expert */
    T *xs = malloc(sizeof *xs * (size_t)pairs * (size_t)H);      /* gathered inputs */
    T *act = malloc(sizeof *act * (size_t)pairs * (size_t)I);    /* silu(gate) * up */
    float *ys = malloc(sizeof *ys * (size_t)pairs * (size_t)H);  /* expert outputs */
    int status = 0;
    if (!start || !fill || !slot_of || !xs || !act || !ys) {
        status = -2;
        goto done;
    }
    for (int64_t p = 0; p < pairs; ++p) ++start[topk_ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
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
            memcpy(xs + slot_of[p] * H, x + (p / top_k) * H, sizeof *xs * (size_t)H);
        /* gate/up: each tile takes NR / 2 gate rows and the matching up rows (read or decoded
         * once for all of the expert's tokens), so silu(g) * u is formed from the tile's sums */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * up_blocks; ++item) {
            const int64_t e = item / up_blocks;
            if (start[e + 1] == start[e] || (DECODED && scratch == NULL)) continue;
            const int64_t j0 = item % up_blocks * (MOE_BLOCK / 2);
            const int64_t j1 = j0 + MOE_BLOCK / 2 < I ? j0 + MOE_BLOCK / 2 : I;
            for (int64_t j = j0; j < j1; j += NR / 2) {
                const int64_t n = j1 - j < NR / 2 ? j1 - j : NR / 2;
                const TW *gate = ROWS(gate_up, e, j, n, H, 2 * I, scratch);
                const TW *up = ROWS(gate_up, e, I + j, n, H, 2 * I, scratch + NR / 2 * H);
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
                            act[(r + m) * I + j + c] = TO_T(ROUND(g / (1.0f + expf(-g))) * u);
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
            for (int64_t h = h0; h < h1; h += NR) {
                const int64_t n = h1 - h < NR ? h1 - h : NR;
                const TW *rows = ROWS(down, e, h, n, I, H, scratch);
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
