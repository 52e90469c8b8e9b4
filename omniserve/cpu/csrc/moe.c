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
 * where transformers' expert loop rounds them (moe_impl.h). H and I must be multiples of 32 (the caller checks).
 * Built by omniserve/cpu/build.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_nt.h"

#define MOE_BLOCK 48 /* weight rows per work item, 8 tiles (gate and up rows count as two) */

#define T float
#define STOREV(p, v) store((p), (v))
#define TO_T(f) (f)
#define ROUND(f) (f)
#define ROUNDV(v) (v)
#define TW float
#define FN(name) name##_f32
#define TILE_ROWS tile_rows_f32
#include "moe_impl.h"
#undef TW
#undef FN
#undef TILE_ROWS
/* fp32 activations on bf16 experts (a bf16 checkpoint computed in fp32) */
#define TW bf16
#define FN(name) name##_f32_bf16w
#define TILE_ROWS tile_rows_f32_bf16w
#include "moe_impl.h"
#undef TW
#undef FN
#undef TILE_ROWS
#undef T
#undef STOREV
#undef TO_T
#undef ROUND
#undef ROUNDV

#define T bf16
#define TW bf16
#define FN(name) name##_bf16
#define TILE_ROWS tile_rows_bf16
#define STOREV(p, v) store_bf16((p), (v))
#define TO_T(f) to_bf16(f)
#define ROUND(f) from_bf16(to_bf16(f))
#define ROUNDV(v) ((vec)(__builtin_convertvector(round_bf16(v), uvec) << 16))
#include "moe_impl.h"
