/*
 * Small-batch fp32 matmuls for CPUs: a linear layer and a whole MoE expert block for a few rows.
 *
 * Decoding multiplies a handful of rows by every weight of the model once per step, so its
 * matmuls are bound by reading the weights. BLAS libraries tune for large M and read small-M
 * weights at a fraction of the memory bandwidth; these kernels stream each weight row once and
 * multiply it by all M input rows while it is in registers (M x NR accumulators).
 *
 * Each output is a dot product summed lane-wise over K in 16-float vectors, the lanes then added
 * pairwise: the result of a row does not depend on M or on the other rows (batch-invariant).
 *
 * Layouts (row-major fp32): x [M, K] (row stride ldx), w [N, K], y [M, N] (row stride ldy).
 * MoE: x [T, H], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I], top-k [T, k].
 *
 * Built and loaded at run time by omniserve/cpu_kernels.py (gcc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64))); /* 16 floats; the compiler maps it to the CPU */
#define LANES 16
#define MR 4      /* input rows per register tile */
#define NR 4      /* weight rows per register tile */
#define CHUNK 32  /* output columns per parallel work item */

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
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

/* y[m, n - n0] = x[m, :] . w[n, :] for m < M and n in [n0, n1); w rows are ldw apart. */
static void gemm_rows(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                      float *y, int64_t ldy, int64_t M, int64_t n0, int64_t n1) {
    const int64_t kv = K / LANES * LANES;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        const float *wr[NR];
        for (int j = 0; j < NR; ++j) wr[j] = w + (n + (j < nr ? j : 0)) * ldw;
        for (int64_t m = 0; m < M; m += MR) {
            const int mr = M - m < MR ? (int)(M - m) : MR;
            const float *xr[MR];
            for (int i = 0; i < MR; ++i) xr[i] = x + (m + (i < mr ? i : 0)) * ldx;
            vec acc[MR][NR];
            for (int i = 0; i < MR; ++i)
                for (int j = 0; j < NR; ++j) acc[i][j] = (vec){0};
            for (int64_t k = 0; k < kv; k += LANES) {
                vec wv[NR], xv[MR];
                for (int j = 0; j < NR; ++j) wv[j] = load(wr[j] + k);
                for (int i = 0; i < MR; ++i) xv[i] = load(xr[i] + k);
                for (int i = 0; i < MR; ++i)
                    for (int j = 0; j < NR; ++j) acc[i][j] += xv[i] * wv[j];
            }
            for (int i = 0; i < mr; ++i)
                for (int j = 0; j < nr; ++j) {
                    float total = lane_sum(acc[i][j]);
                    for (int64_t k = kv; k < K; ++k) total += xr[i][k] * wr[j][k];
                    y[(m + i) * ldy + (n + j - n0)] = total;
                }
        }
    }
}

int omniserve_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                         int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t items = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t n0 = item * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        gemm_rows(x, ldx, w, K, K, y + n0, ldy, M, n0, n1);
        if (bias != NULL)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] += bias[n];
    }
    return 0;
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
    /* Token-expert pairs sorted by expert, tokens in order within an expert. */
    int64_t *start = calloc((size_t)E + 1, sizeof *start);
    int64_t *slot_of = malloc(sizeof *slot_of * (size_t)pairs); /* pair -> sorted slot */
    float *rows = malloc(sizeof *rows * (size_t)pairs * (size_t)(2 * H + I));
    int64_t *fill = calloc((size_t)E, sizeof *fill);
    int status = 0;
    if (!start || !slot_of || !rows || !fill) {
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
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] - start[e] > max_rows) max_rows = start[e + 1] - start[e];
    const int64_t i_items = (I + CHUNK - 1) / CHUNK, h_items = (H + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(num_threads)
    {
        float *gate = malloc(sizeof *gate * (size_t)(2 * max_rows * CHUNK));
        if (gate == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p)
            memcpy(xs + slot_of[p] * H, x + (p / top_k) * H, sizeof *xs * (size_t)H);
        /* silu(gate) * up, one expert and CHUNK intermediate columns per item */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * i_items; ++item) {
            const int64_t e = item / i_items, n0 = item % i_items * CHUNK;
            const int64_t n1 = n0 + CHUNK < I ? n0 + CHUNK : I, m = start[e + 1] - start[e];
            if (m == 0 || gate == NULL) continue;
            const float *we = gate_up + e * 2 * I * H, *xe = xs + start[e] * H;
            float *up = gate + max_rows * CHUNK;
            gemm_rows(xe, H, we, H, H, gate, CHUNK, m, n0, n1);
            gemm_rows(xe, H, we + I * H, H, H, up, CHUNK, m, n0, n1);
            for (int64_t r = 0; r < m; ++r)
                for (int64_t n = 0; n < n1 - n0; ++n) {
                    const float g = gate[r * CHUNK + n];
                    act[(start[e] + r) * I + n0 + n] = g / (1.0f + expf(-g)) * up[r * CHUNK + n];
                }
        }
        /* down projection, one expert and CHUNK hidden columns per item */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < E * h_items; ++item) {
            const int64_t e = item / h_items, n0 = item % h_items * CHUNK;
            const int64_t n1 = n0 + CHUNK < H ? n0 + CHUNK : H, m = start[e + 1] - start[e];
            if (m == 0) continue;
            gemm_rows(act + start[e] * I, I, down + e * H * I, I, I, ys + start[e] * H + n0, H, m,
                      n0, n1);
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
        free(gate);
    }
done:
    free(start);
    free(slot_of);
    free(rows);
    free(fill);
    return status;
}
