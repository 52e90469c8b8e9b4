/*
 * Paged-attention decode for CPUs (fp32): one query token per request attends the request's keys
 * straight from the paged cache.
 *
 * The torch path first gathers every request's keys and values into a padded copy and then runs
 * SDPA over it, so each key is read twice and written once per layer. Here each (request, KV
 * head) task walks its block table and reads every key and value exactly once; the group of query
 * heads sharing a KV head is scored together, so one pass over a key row serves the whole group.
 *
 * Keys are taken 16 at a time: each query head's 16 partial dot products are reduced together
 * into one vector of scores (a transposing add tree), so the online softmax's max, exp and sum
 * run on vectors, and each value row is loaded once for the whole group of query heads.
 *
 * Layouts (row-major, fp32):
 *   query/out:  rows at query + token_rows[i] * q_row_stride, each [num_heads, head_size]
 *   key/value:  [num_blocks, block_size, num_kv_heads, head_size]
 *   block_table [num_reqs, bt_stride] int32, seq_lens [num_reqs] int32
 * Query head h reads KV head h / (num_heads / num_kv_heads). With window > 0 the query (at
 * position seq_len - 1) sees keys [max(0, seq_len - window), seq_len - 1]. head_size must be a
 * multiple of 16 (the caller checks).
 *
 * Built and loaded at run time by omniserve/cpu_kernels.py (gcc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/vec_f32.h"

#define MAX_TILE 4 /* query heads of a group processed together; 16 keys are scored together */

static inline float lane_max(vec v) {
    float m = v[0];
    for (int i = 1; i < LANES; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

/* r[t] = sum of the lanes of v[t], t < 16: four levels of pairwise shuffles and adds, each
 * halving the partial sums per vector while doubling the vectors per register. */
static inline vec reduce_rows(const vec v[LANES]) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

/* Running state of `tile` query heads: scaled query rows, output accumulators, max, sum. */
typedef struct {
    float *q, *acc, *max_score, *denominator;
} Heads;

/* Keys [0, n) (n <= 16) at rows of keys/values slot_stride apart, for `tile` query heads: score,
 * fold into the online softmax (rescaling what came before), accumulate the values.
 *
 * A block's rows of one head are scattered (head_size floats every slot_stride) and the next
 * block is elsewhere in the cache, which the hardware prefetcher does not follow: while scoring
 * key t, the rows of key t of the next block (`ahead`, or NULL) are requested, a few lines at a
 * time so the requests never fill the miss queues. */
static inline __attribute__((always_inline)) void
attend_keys(const Heads *h, const float *keys, const float *values, const float *ahead_keys,
            const float *ahead_values, int64_t n, int64_t head_size, int64_t slot_stride,
            const int tile) {
    vec partial[MAX_TILE][LANES], probs[MAX_TILE];
    float rescale[MAX_TILE];
    for (int g = 0; g < tile; ++g)
        for (int t = 0; t < LANES; ++t) partial[g][t] = (vec){0};
    for (int64_t t = 0; t < n; ++t) {
        const float *k = keys + t * slot_stride;
        if (ahead_keys != NULL)
            for (int64_t d = 0; d < head_size; d += LANES) {
                __builtin_prefetch(ahead_keys + t * slot_stride + d);
                __builtin_prefetch(ahead_values + t * slot_stride + d);
            }
        for (int64_t d = 0; d < head_size; d += LANES) {
            const vec kv = load(k + d);
            for (int g = 0; g < tile; ++g) partial[g][t] += load(h->q + g * head_size + d) * kv;
        }
    }
    for (int g = 0; g < tile; ++g) {
        vec scores = reduce_rows(partial[g]);
        for (int64_t t = n; t < LANES; ++t) scores[t] = -INFINITY;
        const float block_max = lane_max(scores);
        const float new_max = block_max > h->max_score[g] ? block_max : h->max_score[g];
        vec p = vexp(scores - new_max);
        for (int64_t t = n; t < LANES; ++t) p[t] = 0.0f;
        rescale[g] = expf(h->max_score[g] - new_max);
        h->denominator[g] = h->denominator[g] * rescale[g] + lane_sum(p);
        h->max_score[g] = new_max;
        probs[g] = p;
    }
    for (int64_t d = 0; d < head_size; d += LANES) {
        vec acc[MAX_TILE];
        for (int g = 0; g < tile; ++g) acc[g] = load(h->acc + g * head_size + d) * rescale[g];
        for (int64_t t = 0; t < n; ++t) {
            const vec v = load(values + t * slot_stride + d);
            for (int g = 0; g < tile; ++g) acc[g] += probs[g][t] * v;
        }
        for (int g = 0; g < tile; ++g) store(h->acc + g * head_size + d, acc[g]);
    }
}

/* Keys [lo, hi) of one request for `tile` query heads of one KV head, block by block. */
static inline __attribute__((always_inline)) void
attend_range(const Heads *h, const float *key_cache, const float *value_cache,
             const int32_t *blocks, int64_t lo, int64_t hi, int64_t head_size, int64_t kv_offset,
             int64_t slot_stride, int64_t block_size, const int tile) {
    for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t first = b * block_size;
        const int64_t t0 = first > lo ? first : lo;
        const int64_t t1 = first + block_size < hi ? first + block_size : hi;
        const float *keys = key_cache + (int64_t)blocks[b] * block_size * slot_stride + kv_offset;
        const float *values =
            value_cache + (int64_t)blocks[b] * block_size * slot_stride + kv_offset;
        const float *ahead_keys = NULL, *ahead_values = NULL;
        if (first + block_size < hi) {
            const int64_t next = (int64_t)blocks[b + 1] * block_size * slot_stride + kv_offset;
            ahead_keys = key_cache + next;
            ahead_values = value_cache + next;
        }
        for (int64_t t = t0; t < t1; t += LANES) {
            const int64_t n = t1 - t < LANES ? t1 - t : LANES, row = (t - first) * slot_stride;
            attend_keys(h, keys + row, values + row, ahead_keys ? ahead_keys + row : NULL,
                        ahead_values ? ahead_values + row : NULL, n, head_size, slot_stride, tile);
        }
    }
}

/* Returns 0 on success, -1 on a block id outside [0, num_blocks), -2 on an allocation failure. */
int omniserve_paged_decode_f32(const float *query, int64_t q_row_stride, float *out,
                               int64_t out_row_stride, const int64_t *token_rows,
                               const float *key_cache, const float *value_cache,
                               const int32_t *block_table, int64_t bt_stride,
                               const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                               int64_t num_blocks, float scale, int64_t window,
                               int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int tile = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
    const int64_t slot_stride = num_kv_heads * head_size;
    for (int64_t req = 0; req < num_reqs; ++req) { /* validate before any thread reads */
        const int32_t *blocks = block_table + req * bt_stride;
        for (int64_t b = 0; b * block_size < seq_lens[req]; ++b)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return -1;
    }
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(tile * (2 * head_size + 2)));
        if (scratch == NULL) {
#pragma omp atomic write
            status = -2;
        }
        const Heads h = {
            .q = scratch,
            .acc = scratch + tile * head_size,
            .max_score = scratch + 2 * tile * head_size,
            .denominator = scratch + 2 * tile * head_size + tile,
        };
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < num_reqs * (group / tile) * num_kv_heads; ++task) {
            if (scratch == NULL) continue;
            const int64_t req = task / (num_heads / tile), head0 = task % (num_heads / tile) * tile;
            const int64_t hi = seq_lens[req];
            const int64_t lo = (window > 0 && hi > window) ? hi - window : 0;
            const float *q_src = query + token_rows[req] * q_row_stride + head0 * head_size;
            for (int64_t i = 0; i < tile * head_size; ++i) h.q[i] = q_src[i] * scale;
            memset(h.acc, 0, sizeof(float) * (size_t)(tile * head_size));
            for (int g = 0; g < tile; ++g) {
                h.max_score[g] = -INFINITY;
                h.denominator[g] = 0.0f;
            }
            const int32_t *blocks = block_table + req * bt_stride;
            const int64_t kv_offset = head0 / group * head_size;
            if (tile == 4)
                attend_range(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                             slot_stride, block_size, 4);
            else if (tile == 2)
                attend_range(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                             slot_stride, block_size, 2);
            else
                attend_range(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                             slot_stride, block_size, 1);
            float *dst = out + token_rows[req] * out_row_stride + head0 * head_size;
            for (int g = 0; g < tile; ++g) {
                const float inv = 1.0f / h.denominator[g];
                for (int64_t d = 0; d < head_size; ++d)
                    dst[g * head_size + d] = h.acc[g * head_size + d] * inv;
            }
        }
        free(scratch);
    }
    return status;
}
