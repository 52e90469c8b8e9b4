/*
 * Paged-attention decode for CPUs (fp32 and bf16): one query token per request attends the
 * request's keys straight from the paged cache.
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
 * bf16 caches hold half the bytes (decode attention is bound by reading them), fp8 caches (e4m3
 * or e5m2 bytes, with an fp32 or bf16 query) a quarter of fp32's; keys, values and the query are
 * widened to fp32 as they are loaded (fp8 exactly, decode_fp8.h), the softmax and the sums run in fp32, and the
 * output is rounded once. As in torch's CPU flash attention (what transformers' SDPA runs), the
 * probabilities that weight the values are rounded to bf16 first (the denominator sums them
 * unrounded): keeping them in fp32 would be more exact but not what the reference computes.
 *
 * Layouts (row-major, fp32 or bf16 for query and out, the same or fp8 for the cache):
 *   query/out:  rows at query + token_rows[i] * q_row_stride, each [num_heads, head_size]
 *   key/value:  [num_blocks, block_size, num_kv_heads, head_size]
 *   block_table [num_reqs, bt_stride] int32, seq_lens [num_reqs] int32
 * An fp8 cache holds values divided by value_scale (the output is multiplied by it; the keys'
 * scale is the caller's to fold into scale). Query head h reads KV head h / (num_heads /
 * num_kv_heads). With window > 0 the query (at position seq_len - 1) sees keys
 * [max(0, seq_len - window), seq_len - 1]. head_size must be a multiple of 16 (the caller
 * checks).
 *
 * Built by omniserve/cpu/build.py; the per-type body is paged_decode_impl.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_fp8.h"
#include "vec.h"

#define MAX_TILE 4   /* query heads of a group processed together; 16 keys are scored together */
#define KV_SPLIT 512 /* keys per softmax block (torch's CPU flash attention uses 512) */
#define ROW (KV_SPLIT + LANES) /* floats per head in the scores scratch: a split and one spill */
#define LANE_INDEX ((ivec){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})

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

#define IDENTITY(x) (x)

#define T float
#define KV float
#define FN(name) name##_f32
#define LOADKV(p) load(p)
#define FROM_T IDENTITY
#define TO_T IDENTITY
#define ROUND_P IDENTITY
#include "paged_decode_impl.h"
#undef KV
#undef FN
#undef LOADKV

#define KV uint8_t
#define FN(name) name##_f32_e4m3
#define LOADKV(p) load16_e4m3(p)
#include "paged_decode_impl.h"
#undef FN
#undef LOADKV

#define FN(name) name##_f32_e5m2
#define LOADKV(p) load16_e5m2(p)
#include "paged_decode_impl.h"
#undef T
#undef KV
#undef FN
#undef LOADKV
#undef FROM_T
#undef TO_T
#undef ROUND_P

#define T bf16
#define KV bf16
#define FN(name) name##_bf16
#define LOADKV(p) load_bf16(p)
#define FROM_T from_bf16
#define TO_T to_bf16
#define ROUND_P(v) ((vec)(__builtin_convertvector(round_bf16(v), uvec) << 16))
#include "paged_decode_impl.h"
#undef KV
#undef FN
#undef LOADKV

#define KV uint8_t
#define FN(name) name##_bf16_e4m3
#define LOADKV(p) load16_e4m3(p)
#include "paged_decode_impl.h"
#undef FN
#undef LOADKV

#define FN(name) name##_bf16_e5m2
#define LOADKV(p) load16_e5m2(p)
#include "paged_decode_impl.h"
