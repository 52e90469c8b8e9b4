/*
 * A MoE layer's whole expert block for CPUs (fp32), in one call, on panel-packed weights.
 *
 * The torch reference runs about six ops per expert and MKL's small-M matmuls; here routing's
 * sort, the gathers, both matmuls, the activation and the weighted sum run in one parallel
 * region, on weights packed once into column panels: a weight [N, K] becomes [N / 16][K][16],
 * so a register tile of up to 6 rows x 64 columns is accumulated from one broadcast input float
 * and four contiguous 16-float weight rows per k, with no horizontal sums (the layout of BLAS
 * micro-kernels). The activation runs on the gate and up tiles while they are in registers.
 *
 * Layouts (row-major fp32): x [T, H]; gate_up panels [E][2I / 16][H][16] (gate columns, then
 * up columns); down panels [E][H / 16][I][16]; top-k weights and ids [T, k]; out [T, H].
 * I must be a multiple of 32 and H of 64 (the caller checks).
 *
 * Built and loaded at run time by omniserve/cpu_kernels.py (gcc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/vec_f32.h"

#define MR 6 /* rows per register tile */
#define NB 4 /* 16-column panels per register tile */

/* acc[m][b] = sum_k x[m][k] * panel_b[k] for m < mr (rows ldx apart) and NB panels. The sums
 * run in local registers and are written out once: accumulating into `acc` itself would store
 * every step, as acc may alias the inputs. */
static inline __attribute__((always_inline)) void
panel_tile(const float *x, int64_t ldx, const int mr, const float *const panel[NB], int64_t K,
           vec acc[MR][NB]) {
    vec sum[MR][NB];
    for (int m = 0; m < mr; ++m)
        for (int b = 0; b < NB; ++b) sum[m][b] = (vec){0};
    for (int64_t k = 0; k < K; ++k) {
        vec w[NB];
        for (int b = 0; b < NB; ++b) w[b] = load(panel[b] + k * LANES);
        for (int m = 0; m < mr; ++m) {
            const float xm = x[m * ldx + k];
            for (int b = 0; b < NB; ++b) sum[m][b] += xm * w[b];
        }
    }
    for (int m = 0; m < mr; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = sum[m][b];
}

/* panel_tile with the row count a compile-time constant, so the accumulators stay in
 * registers. */
static void tile_rows(const float *x, int64_t ldx, int mr, const float *const panel[NB],
                      int64_t K, vec acc[MR][NB]) {
    switch (mr) {
    case 1: panel_tile(x, ldx, 1, panel, K, acc); break;
    case 2: panel_tile(x, ldx, 2, panel, K, acc); break;
    case 3: panel_tile(x, ldx, 3, panel, K, acc); break;
    case 4: panel_tile(x, ldx, 4, panel, K, acc); break;
    case 5: panel_tile(x, ldx, 5, panel, K, acc); break;
    default: panel_tile(x, ldx, 6, panel, K, acc); break;
    }
}

/* out[t] = sum over t's experts e, in increasing e, of weight * down_e(silu(gate_e x) * up_e x):
 * the same expert order transformers accumulates in. Returns 0, -1 on an expert id outside
 * [0, E), -2 on an allocation failure. */
int omniserve_moe_f32(const float *x, int64_t T, int64_t H, const float *gate_up,
                      const float *down, int64_t E, int64_t I, const float *topk_weights,
                      const int64_t *topk_ids, int64_t top_k, float *out, int num_threads) {
    const int64_t pairs = T * top_k;
    for (int64_t p = 0; p < pairs; ++p)
        if (topk_ids[p] < 0 || topk_ids[p] >= E) return -1;
    const int64_t gate_groups = I / (LANES * NB / 2), down_groups = H / (LANES * NB);
    /* Token-expert pairs sorted by expert, tokens in order within an expert. */
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    int64_t *fill = calloc((size_t)E, sizeof *fill);
    int64_t *slot_of = malloc(sizeof *slot_of * (size_t)pairs); /* pair -> sorted row */
    float *rows = malloc(sizeof *rows * (size_t)pairs * (size_t)(2 * H + I));
    int status = 0;
    if (!start || !fill || !slot_of || !rows) {
        status = -2;
        goto done;
    }
    for (int64_t p = 0; p < pairs; ++p) ++start[topk_ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = topk_ids[p];
        slot_of[p] = start[e] + fill[e]++;
    }
    float *xs = rows, *act = rows + pairs * H, *ys = act + pairs * I;
    for (int64_t p = 0; p < pairs; ++p)
        memcpy(xs + slot_of[p] * H, x + (p / top_k) * H, sizeof *xs * (size_t)H);
    const int64_t gate_panels = 2 * I / LANES, down_panels = H / LANES;
#pragma omp parallel num_threads(num_threads)
    {
        /* silu(gate) * up: per item one expert's rows, tile by tile, against NB / 2 gate
         * panels and the matching up panels (which stay in cache from tile to tile) */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * gate_groups; ++item) {
            const int64_t e = item / gate_groups, first = item % gate_groups * (NB / 2);
            const float *base = gate_up + e * gate_panels * H * LANES;
            const float *panel[NB];
            for (int b = 0; b < NB / 2; ++b) {
                panel[b] = base + (first + b) * H * LANES;
                panel[b + NB / 2] = base + (gate_panels / 2 + first + b) * H * LANES;
            }
            for (int64_t row = start[e]; row < start[e + 1]; row += MR) {
                const int mr = (int)(start[e + 1] - row < MR ? start[e + 1] - row : MR);
                vec acc[MR][NB];
                tile_rows(xs + row * H, H, mr, panel, H, acc);
                for (int m = 0; m < mr; ++m)
                    for (int b = 0; b < NB / 2; ++b) {
                        const vec g = acc[m][b];
                        store(act + (row + m) * I + (first + b) * LANES,
                              g / (1.0f + vexp(-g)) * acc[m][b + NB / 2]);
                    }
            }
        }
        /* down projection: NB panels (64 hidden columns) per tile */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * down_groups; ++item) {
            const int64_t e = item / down_groups, first = item % down_groups * NB;
            const float *base = down + e * down_panels * I * LANES;
            const float *panel[NB];
            for (int b = 0; b < NB; ++b) panel[b] = base + (first + b) * I * LANES;
            for (int64_t row = start[e]; row < start[e + 1]; row += MR) {
                const int mr = (int)(start[e + 1] - row < MR ? start[e + 1] - row : MR);
                vec acc[MR][NB];
                tile_rows(act + row * I, I, mr, panel, I, acc);
                for (int m = 0; m < mr; ++m)
                    for (int b = 0; b < NB; ++b)
                        store(ys + (row + m) * H + (first + b) * LANES, acc[m][b]);
            }
        }
        /* each token's experts in increasing id, weighted, summed from zero */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float *o = out + t * H;
            memset(o, 0, sizeof *o * (size_t)H);
            int64_t order[top_k]; /* t's choices by increasing expert id (insertion sort) */
            for (int64_t j = 0; j < top_k; ++j) {
                int64_t i = j;
                for (; i > 0 && topk_ids[t * top_k + order[i - 1]] > topk_ids[t * top_k + j]; --i)
                    order[i] = order[i - 1];
                order[i] = j;
            }
            for (int64_t j = 0; j < top_k; ++j) {
                const int64_t p = t * top_k + order[j];
                const float weight = topk_weights[p], *y = ys + slot_of[p] * H;
                for (int64_t d = 0; d < H; ++d) o[d] += y[d] * weight;
            }
        }
    }
done:
    free(start);
    free(fill);
    free(slot_of);
    free(rows);
    return status;
}
