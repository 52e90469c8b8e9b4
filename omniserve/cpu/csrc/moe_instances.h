/*
 * moe_impl.h's kernels for one activation type, included by moe.c with T, SFX (its name suffix:
 * f32 or bf16) and T's macros defined: omniserve_moe_<SFX> on experts stored in T, and
 * omniserve_moe_int4_<SFX> / omniserve_moe_fp8_<SFX> on 4-bit and FP8 experts decoded to T.
 */
#define TW T
#define TILE_ROWS MOE_NAME(tile_rows_, SFX)

#define DECODED 0
#define INTERLEAVABLE 0
#define ROWS STORED_ROWS
#define FN(name) MOE_NAME(name, MOE_NAME(_, SFX))
#include "moe_impl.h"
#undef FN
#undef ROWS
#undef DECODED
#undef INTERLEAVABLE

#define DECODED 1
#define INTERLEAVABLE INT4_INTERLEAVABLE
#define CODE_BITS 4
#define DIRECT_STATE INT4_STATE
#define DIRECT_DECODE32 INT4_DECODE32
#define ROWS MOE_NAME(int4_rows_, SFX)
#define FN(name) MOE_NAME(name, MOE_NAME(_int4_, SFX))
#include "moe_impl.h"
#undef FN
#undef ROWS
#undef CODE_BITS
#undef DIRECT_STATE
#undef DIRECT_DECODE32
#undef INTERLEAVABLE

#define INTERLEAVABLE 0
#define CODE_BITS 8
#define DIRECT_STATE FP8_STATE
#define DIRECT_DECODE32 FP8_DECODE32
#define ROWS MOE_NAME(fp8_rows_, SFX)
#define FN(name) MOE_NAME(name, MOE_NAME(_fp8_, SFX))
#include "moe_impl.h"
#undef FN
#undef ROWS
#undef CODE_BITS
#undef DIRECT_STATE
#undef DIRECT_DECODE32
#undef INTERLEAVABLE
#undef DECODED

#undef TW
#undef TILE_ROWS
