"""What every Triton kernel of omniserve shares: interpreter detection and a dot that is right
under the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

# NOTE: read once at import, the moment @triton.jit decides between compiled and interpreted
# kernels. Triton 3.8's interpreter multiplies bf16 dot operands as raw uint16 bits, so interpreted
# kernels upcast dot operands to fp32 (exact for bf16/fp16 products, still fp32-accumulated).
INTERPRETED: bool = triton.knobs.runtime.interpret


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # type: ignore[no-untyped-def]
    """``acc + a @ b``; ``PRECISION`` "ieee" keeps fp32 operands out of TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)
