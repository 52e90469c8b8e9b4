/*
 * Body of the paged-decode kernel, included by paged_decode.c once per (element type, cache type)
 * with T (query and out), KV (the cache's elements: T, or an fp8 format's bytes), FN(name),
 * LOADKV(p) (16 KV -> vec), FROM_T and TO_T (scalar conversions) and ROUND_P (the
 * probabilities' rounding before they weight the values) defined.
 */


/* Scores of keys [0, n) (n <= 16) at rows of `keys` slot_stride apart for `tile` query heads,
 * scale * (q . k), into scores[g * ROW + at ...] (16 slots, the first n meaningful).
 *
 * A block's rows of one head are scattered (head_size elements every slot_stride) and the next
 * block is elsewhere in the cache, which the hardware prefetcher does not follow: while scoring
 * key t, the row of key t of the next block (`ahead`, or NULL) is requested. */
static inline __attribute__((always_inline)) void
FN(score_keys)(const Heads *h, const KV *keys, const KV *ahead, int64_t n, int64_t head_size,
               int64_t slot_stride, float scale, float *scores, int64_t at, const int tile) {
    vec partial[MAX_TILE][LANES];
    for (int g = 0; g < tile; ++g)
        for (int t = 0; t < LANES; ++t) partial[g][t] = (vec){0};
    for (int64_t t = 0; t < n; ++t) {
        const KV *k = keys + t * slot_stride;
        if (ahead != NULL)
            for (int64_t d = 0; d < head_size; d += LANES) __builtin_prefetch(ahead + t * slot_stride + d);
        for (int64_t d = 0; d < head_size; d += LANES) {
            const vec kv = LOADKV(k + d);
            for (int g = 0; g < tile; ++g) partial[g][t] += load(h->q + g * head_size + d) * kv;
        }
    }
    for (int g = 0; g < tile; ++g) store(scores + g * ROW + at, reduce_rows(partial[g]) * scale);
}

/* acc[g] += sum over keys [0, n) of probs[g * ROW + at + t] * v_t. */
static inline __attribute__((always_inline)) void
FN(accumulate_values)(const Heads *h, const KV *values, const KV *ahead, int64_t n,
                      int64_t head_size, int64_t slot_stride, const float *probs, int64_t at,
                      const int tile) {
    if (ahead != NULL)
        for (int64_t t = 0; t < n; ++t)
            for (int64_t d = 0; d < head_size; d += LANES) __builtin_prefetch(ahead + t * slot_stride + d);
    for (int64_t d = 0; d < head_size; d += LANES) {
        vec acc[MAX_TILE];
        for (int g = 0; g < tile; ++g) acc[g] = load(h->acc + g * head_size + d);
        for (int64_t t = 0; t < n; ++t) {
            const vec v = LOADKV(values + t * slot_stride + d);
            for (int g = 0; g < tile; ++g) acc[g] += probs[g * ROW + at + t] * v;
        }
        for (int g = 0; g < tile; ++g) store(h->acc + g * head_size + d, acc[g]);
    }
}

/* Keys [lo, hi) of one request for `tile` query heads of one KV head, in splits of KV_SPLIT keys
 * as torch's CPU flash attention takes them: score the split, take its max, fold it into the
 * running softmax (rescaling what came before), then weight the values. */
static inline __attribute__((always_inline)) void
FN(attend_range)(const Heads *h, const KV *key_cache, const KV *value_cache,
                 const int32_t *blocks, int64_t lo, int64_t hi, int64_t head_size,
                 int64_t kv_offset, int64_t slot_stride, int64_t block_size, float scale,
                 float *scores, const int tile) {
    for (int64_t split = lo; split < hi; split += KV_SPLIT) {
        const int64_t split_hi = split + KV_SPLIT < hi ? split + KV_SPLIT : hi;
        for (int pass = 0; pass < 2; ++pass) {
            if (pass == 1) { /* softmax over the split, probabilities in place of the scores */
                const int64_t len = split_hi - split;
                for (int g = 0; g < tile; ++g) {
                    float *row = scores + g * ROW;
                    float split_max = -INFINITY;
                    for (int64_t t = 0; t < len; ++t) split_max = row[t] > split_max ? row[t] : split_max;
                    const float new_max = split_max > h->max_score[g] ? split_max : h->max_score[g];
                    const float rescale = expf(h->max_score[g] - new_max);
                    vec sum = (vec){0};
                    for (int64_t t = 0; t < len; t += LANES) {
                        const ivec valid = LANE_INDEX < (int32_t)(len - t);
                        const vec p = (vec)((ivec)vexp(load(row + t) - new_max) & valid);
                        sum += p;
                        store(row + t, ROUND_P(p));
                    }
                    h->denominator[g] = h->denominator[g] * rescale + lane_sum(sum);
                    h->max_score[g] = new_max;
                    for (int64_t d = 0; d < head_size; ++d) h->acc[g * head_size + d] *= rescale;
                }
            }
            const KV *cache = pass == 0 ? key_cache : value_cache;
            for (int64_t b = split / block_size; b * block_size < split_hi; ++b) {
                const int64_t first = b * block_size;
                const int64_t t0 = first > split ? first : split;
                const int64_t t1 = first + block_size < split_hi ? first + block_size : split_hi;
                const KV *rows = cache + (int64_t)blocks[b] * block_size * slot_stride + kv_offset;
                const KV *ahead = first + block_size < split_hi
                    ? cache + (int64_t)blocks[b + 1] * block_size * slot_stride + kv_offset : NULL;
                for (int64_t t = t0; t < t1; t += LANES) {
                    const int64_t n = t1 - t < LANES ? t1 - t : LANES, row = (t - first) * slot_stride;
                    if (pass == 0)
                        FN(score_keys)(h, rows + row, ahead ? ahead + row : NULL, n, head_size,
                                       slot_stride, scale, scores, t - split, tile);
                    else
                        FN(accumulate_values)(h, rows + row, ahead ? ahead + row : NULL, n,
                                              head_size, slot_stride, scores, t - split, tile);
                }
            }
        }
    }
}

/* Returns 0 on success, -1 on a block id outside [0, num_blocks), -2 on an allocation failure. */
int FN(omniserve_paged_decode)(const T *query, int64_t q_row_stride, T *out,
                               int64_t out_row_stride, const int64_t *token_rows,
                               const KV *key_cache, const KV *value_cache,
                               const int32_t *block_table, int64_t bt_stride,
                               const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                               int64_t num_blocks, float scale, float value_scale,
                               int64_t window, int num_threads) {
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
        float *scratch = malloc(sizeof(float) * (size_t)(tile * (2 * head_size + 2 + ROW)));
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
        float *scores = scratch + 2 * tile * head_size + 2 * tile; /* [tile][ROW] */
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < num_reqs * (group / tile) * num_kv_heads; ++task) {
            if (scratch == NULL) continue;
            const int64_t req = task / (num_heads / tile), head0 = task % (num_heads / tile) * tile;
            const int64_t hi = seq_lens[req];
            const int64_t lo = (window > 0 && hi > window) ? hi - window : 0;
            const T *q_src = query + token_rows[req] * q_row_stride + head0 * head_size;
            for (int64_t i = 0; i < tile * head_size; ++i) h.q[i] = FROM_T(q_src[i]);
            memset(h.acc, 0, sizeof(float) * (size_t)(tile * head_size));
            for (int g = 0; g < tile; ++g) {
                h.max_score[g] = -INFINITY;
                h.denominator[g] = 0.0f;
            }
            const int32_t *blocks = block_table + req * bt_stride;
            const int64_t kv_offset = head0 / group * head_size;
            if (tile == 4)
                FN(attend_range)(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                                 slot_stride, block_size, scale, scores, 4);
            else if (tile == 2)
                FN(attend_range)(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                                 slot_stride, block_size, scale, scores, 2);
            else
                FN(attend_range)(&h, key_cache, value_cache, blocks, lo, hi, head_size, kv_offset,
                                 slot_stride, block_size, scale, scores, 1);
            T *dst = out + token_rows[req] * out_row_stride + head0 * head_size;
            for (int g = 0; g < tile; ++g) {
                const float inv = value_scale / h.denominator[g];
                for (int64_t d = 0; d < head_size; ++d)
                    dst[g * head_size + d] = TO_T(h.acc[g * head_size + d] * inv);
            }
        }
        free(scratch);
    }
    return status;
}
