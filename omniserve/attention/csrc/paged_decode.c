/*
 * Paged-attention decode for CPUs (fp32): one query token per request attends the request's keys
 * straight from the paged cache.
 *
 * The torch path first gathers every request's keys and values into a padded copy and then runs
 * SDPA over it, so each key is read twice and written once per layer. Here each (request, KV
 * head) task walks its block table and reads every key and value exactly once; the group of query
 * heads sharing a KV head is scored together, so one pass over a key row serves the whole group.
 *
 * Layouts (row-major, fp32):
 *   query/out:  rows at query + token_rows[i] * q_row_stride, each [num_heads, head_size]
 *   key/value:  [num_blocks, block_size, num_kv_heads, head_size]
 *   block_table [num_reqs, bt_stride] int32, seq_lens [num_reqs] int32
 * Query head h reads KV head h / (num_heads / num_kv_heads). With window > 0 the query (at
 * position seq_len - 1) sees keys [max(0, seq_len - window), seq_len - 1].
 *
 * Built and loaded at run time by omniserve/attention/cpu_kernel.py (gcc -O3 -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* one AVX-512 vector of fp32; the compiler maps it to what the CPU has */
#define GROUP_TILE 4 /* query heads scored together: independent FMA chains per key row */

/* scores[g * stride] = q[g] . k for GROUP_TILE query rows (padded with zeros) and one key row.
 * head_size is a multiple of LANES here. */
static void score_tile(const float *q, const float *k, int64_t head_size, float *scores,
                       int64_t stride) {
    float acc[GROUP_TILE][LANES] = {{0}};
    for (int64_t d = 0; d < head_size; d += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; ++j) {
            const float kj = k[d + j];
            for (int g = 0; g < GROUP_TILE; ++g) acc[g][j] += q[g * head_size + d + j] * kj;
        }
    }
    for (int g = 0; g < GROUP_TILE; ++g) {
        float total = 0.0f;
        for (int j = 0; j < LANES; ++j) total += acc[g][j];
        scores[g * stride] = total;
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

static void axpy(float *y, float alpha, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

static void scale_rows(float *y, float alpha, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) y[d] *= alpha;
}

/* Scratch of one task, in floats: the group's scaled query rows and output accumulators
 * (padded_group * head_size each), one block's scores (padded_group * block_size), and each
 * query head's running max and softmax denominator. */
typedef struct {
    float *q, *acc, *scores, *max_score, *denominator;
} Scratch;

/* Scores of the keys [t0, t1) of one cache block (keys = its row of position ``first``) for
 * every query head of the group. */
static void score_block(const Scratch *w, const float *keys, int64_t first, int64_t t0, int64_t t1,
                        int64_t padded_group, int64_t head_size, int64_t slot_stride,
                        int64_t block_size) {
    const int tiled = head_size % LANES == 0;
    for (int64_t t = t0; t < t1; ++t) {
        const float *k = keys + (t - first) * slot_stride;
        for (int64_t g = 0; g < padded_group; g += tiled ? GROUP_TILE : 1) {
            float *out = w->scores + g * block_size + (t - t0);
            if (tiled)
                score_tile(w->q + g * head_size, k, head_size, out, block_size);
            else
                *out = dot(w->q + g * head_size, k, head_size);
        }
    }
}

/* A block's rows of one head are scattered (head_size floats every slot_stride), which the
 * hardware prefetcher does not follow across blocks: request them while this block computes. */
static void prefetch_block(const float *key_cache, const float *value_cache, int64_t slot,
                           int64_t block_size, int64_t head_size, int64_t slot_stride,
                           int64_t kv_offset) {
    for (int64_t r = 0; r < block_size; ++r) {
        const char *k = (const char *)(key_cache + (slot + r) * slot_stride + kv_offset);
        const char *v = (const char *)(value_cache + (slot + r) * slot_stride + kv_offset);
        for (int64_t byte = 0; byte < head_size * (int64_t)sizeof(float); byte += 64) {
            __builtin_prefetch(k + byte);
            __builtin_prefetch(v + byte);
        }
    }
}

/* One (request, KV head), one cache block at a time (online softmax, as in flash decoding):
 * each block's keys are scored for the whole group, the running max rescales what came before,
 * then the block's values are accumulated. Keys and values are read once, block by block. */
static void attend_one(const Scratch *w, float *out, const float *key_cache,
                       const float *value_cache, const int32_t *blocks, int64_t lo, int64_t hi,
                       int64_t group, int64_t padded_group, int64_t head_size, int64_t kv_offset,
                       int64_t slot_stride, int64_t block_size) {
    for (int64_t g = 0; g < group; ++g) {
        w->max_score[g] = -INFINITY;
        w->denominator[g] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * padded_group * head_size);
    for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t t0 = b * block_size > lo ? b * block_size : lo;
        const int64_t t1 = (b + 1) * block_size < hi ? (b + 1) * block_size : hi;
        const int64_t first = b * block_size, slot = blocks[b] * block_size;
        const float *keys = key_cache + slot * slot_stride + kv_offset;
        const float *values = value_cache + slot * slot_stride + kv_offset;
        if ((b + 1) * block_size < hi) /* the next block is elsewhere in the cache: fetch ahead */
            prefetch_block(key_cache, value_cache, blocks[b + 1] * block_size, block_size,
                           head_size, slot_stride, kv_offset);
        score_block(w, keys, first, t0, t1, padded_group, head_size, slot_stride, block_size);
        for (int64_t g = 0; g < group; ++g) {
            float *s = w->scores + g * block_size, block_max = w->max_score[g];
            for (int64_t i = 0; i < t1 - t0; ++i) block_max = s[i] > block_max ? s[i] : block_max;
            const float rescale = expf(w->max_score[g] - block_max);
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < t1 - t0; ++i) {
                s[i] = expf(s[i] - block_max);
                total += s[i];
            }
            w->denominator[g] = w->denominator[g] * rescale + total;
            w->max_score[g] = block_max;
            if (rescale != 1.0f) scale_rows(w->acc + g * head_size, rescale, head_size);
        }
        for (int64_t t = t0; t < t1; ++t) {
            const float *v = values + (t - first) * slot_stride;
            for (int64_t g = 0; g < group; ++g)
                axpy(w->acc + g * head_size, w->scores[g * block_size + (t - t0)], v, head_size);
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        const float *acc = w->acc + g * head_size;
        const float inv = 1.0f / w->denominator[g];
        for (int64_t d = 0; d < head_size; ++d) out[g * head_size + d] = acc[d] * inv;
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
    const int64_t padded_group = (group + GROUP_TILE - 1) / GROUP_TILE * GROUP_TILE;
    for (int64_t req = 0; req < num_reqs; ++req) { /* validate before any thread reads */
        const int32_t *blocks = block_table + req * bt_stride;
        for (int64_t b = 0; b * block_size < seq_lens[req]; ++b)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return -1;
    }
    int status = 0;
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t task = 0; task < num_reqs * num_kv_heads; ++task) {
        const int64_t req = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t hi = seq_lens[req];
        const int64_t lo = (window > 0 && hi > window) ? hi - window : 0;
        const int64_t rows = padded_group * (2 * head_size + block_size + 2);
        float *scratch = malloc(sizeof(float) * (size_t)rows);
        if (scratch == NULL) {
#pragma omp atomic write
            status = -2;
            continue;
        }
        const Scratch w = {
            .q = scratch,
            .acc = scratch + padded_group * head_size,
            .scores = scratch + 2 * padded_group * head_size,
            .max_score = scratch + padded_group * (2 * head_size + block_size),
            .denominator = scratch + padded_group * (2 * head_size + block_size + 1),
        };
        const int64_t head0 = kv_head * group * head_size;
        const float *q_src = query + token_rows[req] * q_row_stride + head0;
        for (int64_t i = 0; i < padded_group * head_size; ++i)
            w.q[i] = i < group * head_size ? q_src[i] * scale : 0.0f;
        attend_one(&w, out + token_rows[req] * out_row_stride + head0, key_cache, value_cache,
                   block_table + req * bt_stride, lo, hi, group, padded_group, head_size,
                   kv_head * head_size, num_kv_heads * head_size, block_size);
        free(scratch);
    }
    return status;
}
