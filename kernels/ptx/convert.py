"""Conversions: FP32 -> FP8 e4m3 / BF16 packing, BF16 -> FP32 unpacking and
FP32 <-> bit-pattern casts."""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ._asm import asm


@dsl_user_op
def float_bits(value: Float32, *, loc=None, ip=None) -> Uint32:
    """The IEEE bits of an FP32 value (a free bitcast)."""
    return Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_float(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """The FP32 value of a bit pattern (a free bitcast)."""
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def cvt_e4m3x4(a, b, c, d, *, loc=None, ip=None) -> Uint32:
    """Four FP32 values as four e4m3 bytes (``a`` in the lowest byte):
    ``cvt.rn.satfinite.e4m3x2.f32`` twice (saturating at +-448; the first
    source of each cvt is its upper byte). ``moe_common.e4m3x4`` rounds with
    ``round_e4m3`` first."""
    return asm(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "u", "ffff", (a, b, c, d), side_effects=False, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def round_e4m3(value, *, loc=None, ip=None) -> Float32:
    """``value`` rounded to the nearest e4m3 value (ties to even), kept in
    FP32 (no saturation), in integer arithmetic: the e4m3 codes then follow
    torch's software conversion (the reference's) by construction, whatever
    the conversion instruction does inside (identical on 7M test values in
    torch). Normal range (|v| >= 2^-6): the mantissa rounded to 3 bits;
    subnormals: to a multiple of 2^-9 (``cvt.rni``); NaN stays NaN (the
    integer rounding would carry a NaN's all-ones mantissa into the sign and
    make it -0). About 12 instructions."""
    return asm(
        "{ .reg .b32 b, l; .reg .f32 s; .reg .pred p, n; "
        "abs.f32 s, $1; setp.lt.f32 p, s, 0f3C800000; testp.notanumber.f32 n, $1; "
        "mov.b32 b, $1; shr.u32 l, b, 20; and.b32 l, l, 1; add.u32 b, b, l; "
        "add.u32 b, b, 0x7FFFF; and.b32 b, b, 0xFFF00000; mov.b32 $0, b; "
        "@p mul.f32 s, $1, 0f44000000; @p cvt.rni.f32.f32 s, s; @p mul.f32 $0, s, 0f3B000000; "
        "@n mov.f32 $0, $1; }",
        "f", "f", (value,), side_effects=False, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def cvt_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    """Two FP32 values as two BF16 halves of one word (``lo`` in the low half):
    ``cvt.rn.bf16x2.f32``."""
    return asm("cvt.rn.bf16x2.f32 $0, $2, $1;", "u", "ff", (lo, hi), side_effects=False,
               loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def cvt_bf16(value, *, loc=None, ip=None) -> Uint32:
    """One FP32 value as BF16 bits in the low half of a word: ``cvt.rn.bf16.f32``."""
    return asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.u32.u16 $0, h; }", "u", "f", (value,),
               side_effects=False, loc=loc, ip=ip)  # fmt: skip


def bf16_low(word: Uint32) -> Float32:
    """The FP32 value of the BF16 in the low half of ``word`` (exact)."""
    return bits_float(Uint32(word) << 16)


def bf16_high(word: Uint32) -> Float32:
    """The FP32 value of the BF16 in the high half of ``word`` (exact)."""
    return bits_float(Uint32(word) & Uint32(0xFFFF0000))


@dsl_user_op
def float_order_key(value, *, loc=None, ip=None) -> Uint32:
    """A uint32 key with the order of the FP32 ``value`` (larger float, larger
    key; -0 < +0): flip every bit of a negative, only the sign of the rest.
    Key 0 is a negative NaN's, below every number (a "taken" marker)."""
    return asm(
        "{ .reg .b32 m; shr.s32 m, $1, 31; or.b32 m, m, 0x80000000; xor.b32 $0, $1, m; }",
        "u", "u", (float_bits(value, loc=loc, ip=ip),), side_effects=False, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def order_key_float(key, *, loc=None, ip=None) -> Float32:
    """The FP32 value of a ``float_order_key`` key (its inverse): flip only
    the sign of a key with the top bit set (a non-negative float), every bit
    of the rest."""
    bits = asm(
        "{ .reg .b32 m; not.b32 m, $1; shr.s32 m, m, 31; or.b32 m, m, 0x80000000; "
        "xor.b32 $0, $1, m; }",
        "u", "u", (Uint32(key),), side_effects=False, loc=loc, ip=ip,
    )  # fmt: skip
    return bits_float(bits, loc=loc, ip=ip)
