/*
 * A MoE layer's whole expert block for CPUs, in one call, on the experts' weights as loaded.
 *
 * The torch reference runs about six ops per expert with a small-M matmul each; here routing's
 * sort, the gathers, both projections, the activation and the weighted sum run in one parallel
 * region. The projections use gemm_nt.h's tiles on the stacked checkpoint layout, so there is no
 * packed copy: at decode sizes each selected expert's weights are streamed from memory once, and
 * at prefill sizes a block of weight rows stays in L2 while all of its expert's tokens pass.
 *
 * fp32, bf16, and fp32 on bf16 experts: fp32 accumulation in each projection, results rounded
 * where transformers' expert loop rounds them (moe_impl.h). Quantized experts (4-bit or FP8, in
 * omniserve/layers/quantization.py's layout) are decoded, for an expert with one or two tokens,
 * straight into the dot products, and otherwise a tile's rows at a time into a scratch that
 * stays in L1/L2 while every token routed to the expert passes over it: their codes are read
 * from memory once per call. The kernels per activation type are moe_instances.h's. H, I and
 * the groups must be multiples of 32 (the caller checks). Built by omniserve/cpu/build.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_fp8.h"
#include "decode_int4.h"
#include "gemm_nt.h"

#define MOE_BLOCK 48 /* weight rows per work item, 8 tiles (gate and up rows count as two) */
#define DIRECT_ROWS 2 /* most tokens of an expert whose quantized rows skip the scratch */

/* One projection of every expert, [E, N, K]: the weights themselves (codes), or codes with their
 * zero points (4-bit), fp32 scales [E, N, K / group_size] and group size. */
typedef struct {
    const void *codes;
    const uint8_t *zeros;
    const float *scales;
    int64_t group_size;
} moe_weights;

/* moe_impl.h's ROWS for stored weights of type TW */
#define STORED_ROWS(m, e, row, count, K, N, interleaved, scratch)                                 \
    ((const TW *)(m).codes + ((e) * (N) + (row)) * (K))

/* moe_impl.h's ROWS for codes of BITS bits that DECODE turns into TW (DECODE_INTERLEAVED in
 * vec.h's interleaved order) */
#define DEFINE_DECODED_ROWS(NAME, TW, DECODE, DECODE_INTERLEAVED, BITS)                           \
    static inline const TW *NAME(moe_weights m, int64_t e, int64_t row, int64_t count, int64_t K, \
                                 int64_t N, int interleaved, TW *scratch) {                       \
        const int64_t groups = K / m.group_size, first = e * N + row;                             \
        (interleaved ? DECODE_INTERLEAVED : DECODE)(                                              \
            (const uint8_t *)m.codes + first * K * BITS / 8,                                      \
            m.zeros ? m.zeros + first * groups : NULL, m.scales + first * groups, count * groups,  \
            m.group_size, NR * K * BITS / 8, scratch);                                            \
        return scratch;                                                                           \
    }
DEFINE_DECODED_ROWS(int4_rows_f32, float, int4_decode_f32, int4_decode_interleaved_f32, 4)
DEFINE_DECODED_ROWS(int4_rows_bf16, bf16, int4_decode_bf16, int4_decode_bf16, 4)
DEFINE_DECODED_ROWS(fp8_rows_f32, float, fp8_decode_f32, fp8_decode_f32, 8)
DEFINE_DECODED_ROWS(fp8_rows_bf16, bf16, fp8_decode_bf16, fp8_decode_bf16, 8)

#define MOE_PASTE(a, b) a##b
#define MOE_NAME(a, b) MOE_PASTE(a, b) /* expands a and b first */

/* moe_impl.h's direct decoding (DIRECT_STATE, DIRECT_DECODE32), per format; ROUNDW is the
 * instance's rounding of a weight to T's precision, as the decoders above round them */
#define INT4_STATE(m, i) ROUNDW(int4_values((m).zeros[i], (m).scales[i]))
#define INT4_DECODE32(c, s, w) ((w)[0] = int4_decode16((c), (s)), (w)[1] = int4_decode16((c) + 8, (s)))
#define FP8_STATE(m, i) splat((m).scales[i] * 256.0f)
#define FP8_DECODE32(c, s, w) (decode32((c), (s), (w)), (w)[0] = ROUNDW((w)[0]), (w)[1] = ROUNDW((w)[1]))

#define T float
#define SFX f32
#define STOREV(p, v) store((p), (v))
#define LOADT(p) load(p)
#define TO_T(f) (f)
#define ROUND(f) (f)
#define ROUNDV(v) (v)
#define ROUNDW(v) (v)
#define INT4_INTERLEAVABLE 1 /* fp32: 4-bit codes decode in vec.h's interleaved order */
#define INTERLEAVE_ROW interleave_row_f32
#define INTERLEAVED_POSITION interleaved_f32_position
#include "moe_instances.h"
/* fp32 activations on bf16 experts (a bf16 checkpoint computed in fp32) */
#define TW bf16
#define FN(name) name##_f32_bf16w
#define TILE_ROWS tile_rows_f32_bf16w
#define DECODED 0
#define INTERLEAVABLE 0
#define ROWS STORED_ROWS
#include "moe_impl.h"
#undef INTERLEAVABLE
#undef TW
#undef FN
#undef TILE_ROWS
#undef DECODED
#undef ROWS
#undef T
#undef SFX
#undef STOREV
#undef LOADT
#undef TO_T
#undef ROUND
#undef ROUNDV
#undef ROUNDW
#undef INT4_INTERLEAVABLE
#undef INTERLEAVE_ROW
#undef INTERLEAVED_POSITION

#define T bf16
#define SFX bf16
#define STOREV(p, v) store_bf16((p), (v))
#define LOADT(p) load_bf16(p)
#define TO_T(f) to_bf16(f)
#define ROUND(f) from_bf16(to_bf16(f))
#define ROUNDV(v) ((vec)(__builtin_convertvector(round_bf16(v), uvec) << 16))
#define ROUNDW(v) round_bf16_in_place(v)
#define INT4_INTERLEAVABLE 0 /* (bf16's interleaved scratch would take another order) */
#define INTERLEAVE_ROW interleave_row_bf16 /* (never called) */
#define INTERLEAVED_POSITION interleaved_f32_position /* (never called) */
#include "moe_instances.h"
