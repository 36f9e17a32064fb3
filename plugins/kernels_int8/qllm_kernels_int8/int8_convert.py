"""Exact int8 -> float conversions for the int8 kernels, without Triton's ``I2F``-based casts
where those cost: inline PTX on CUDA (``FAST``), the same arithmetic elementwise elsewhere (the
interpreter cannot run PTX).

- ``int8_to_f32`` (the GEMV, ``triton_gemv``): ``q`` is exact in fp32 as ``bits(2^23 + 128 + q)
  - (2^23 + 128)``: the byte, biased by 128, as the low mantissa bits of 2^23. The PTX takes 4
  weights per 32-bit register: an xor, then per weight a ``prmt`` and a subtraction. Triton's
  cast (``I2F``) runs at a quarter of the FMA rate, 16 per clock per SM: about the HBM byte
  rate, so it would bound the GEMV.
- ``int8_to_half`` (the swap-AB GEMM, ``triton_w8a16``): two weights at a time (the two
  adjacent K columns a thread holds per register of the MMA's A operand, loaded as one 16-bit
  word), placed as the low bytes of two 16-bit floats of fixed exponent by one ``prmt``. bf16:
  ``0x43`` above the byte is ``128 + (q & 0x7f)`` with bit 7 cleared, ``128`` or ``256`` with
  only bit 7 kept; their difference is ``q``. fp16: ``0x64`` above ``q ^ 0x80`` is ``1024 + q +
  128``, minus ``1152``. One packed subtraction (``HADD2``) per two weights. Triton's cast of
  the same tile, compiled for sm_90, first spreads each 16-bit load over two registers and packs
  them again (4.5 byte permutes per two weights instead of one).
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(8388736.0)  # 2^23 + 128
MAGIC_BITS = tl.constexpr(0x4B000080)  # its fp32 bits
INT8_TO_F32_PTX = tl.constexpr("""{
    .reg .b32 biased;
    xor.b32 biased, $4, 0x80808080;
    prmt.b32 $0, biased, 0x4B000000, 0x7540;
    prmt.b32 $1, biased, 0x4B000000, 0x7541;
    prmt.b32 $2, biased, 0x4B000000, 0x7542;
    prmt.b32 $3, biased, 0x4B000000, 0x7543;
    sub.f32 $0, $0, 0f4B000080;
    sub.f32 $1, $1, 0f4B000080;
    sub.f32 $2, $2, 0f4B000080;
    sub.f32 $3, $3, 0f4B000080;
}""")  # byte i of $4, xor 0x80 (+128), into the low byte of 0x4B000000 (2^23) -> $i
INT8_TO_BF16X2_PTX = tl.constexpr("""{
    .reg .b32 word, low, high;
    cvt.u32.u16 word, $1;
    prmt.b32 word, word, 0x43, 0x4140;
    and.b32 low, word, 0xff7fff7f;
    and.b32 high, word, 0xff80ff80;
    sub.rn.bf16x2 $0, low, high;
}""")  # bytes 0 and 1 of $1 below 0x43 each -> (128 + (q & 0x7f)) - (128 or 256)
INT8_TO_F16X2_PTX = tl.constexpr("""{
    .reg .b32 word, bias;
    cvt.u32.u16 word, $1;
    xor.b32 word, word, 0x8080;
    prmt.b32 word, word, 0x64, 0x4140;
    mov.b32 bias, 0x64806480;
    sub.rn.f16x2 $0, word, bias;
}""")  # bytes 0 and 1 of $1, xor 0x80, below 0x64 each -> (1024 + q + 128) - 1152


@triton.jit
def int8_to_f32(q, FAST: tl.constexpr):
    """``q`` (int8) as fp32, exactly: ``FAST``, the inline PTX (CUDA only); else the same
    arithmetic elementwise."""
    if FAST:
        return tl.inline_asm_elementwise(INT8_TO_F32_PTX, "=r,=r,=r,=r,r", [q],
                                         dtype=tl.float32, is_pure=True, pack=4)
    return (q.to(tl.int32) + MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def int8_to_half(q, dtype: tl.constexpr, FAST: tl.constexpr):
    """``q`` (int8) as ``dtype``, exactly: ``FAST`` (CUDA) and ``dtype`` bf16 or fp16, the
    inline PTX on pairs of adjacent elements; else Triton's cast."""
    if FAST and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(INT8_TO_BF16X2_PTX, "=r,h", [q], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    if FAST and dtype == tl.float16:
        return tl.inline_asm_elementwise(INT8_TO_F16X2_PTX, "=r,h", [q], dtype=tl.float16,
                                         is_pure=True, pack=2)
    return q.to(dtype)
