"""FP32 arithmetic whose exact instruction matters (rounding must match the
torch reference, or a fast approximation is wanted on purpose)."""

from __future__ import annotations

from cutlass import Float32
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    """``div.rn.f32``: IEEE division, correctly rounded (what torch computes),
    so quantization scales and FP8 codes match the reference bit for bit."""
    return asm("div.rn.f32 $0, $1, $2;", "f", "ff", (a, b), side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """``mul.rn.f32``: a product the compiler may not fuse into an FMA."""
    return asm("mul.rn.f32 $0, $1, $2;", "f", "ff", (a, b), side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def ex2_approx(x, *, loc=None, ip=None) -> Float32:
    """``ex2.approx.ftz.f32``: 2^x, about 2 ulp."""
    return asm("ex2.approx.ftz.f32 $0, $1;", "f", "f", (x,), side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def rcp_approx(x, *, loc=None, ip=None) -> Float32:
    """``rcp.approx.ftz.f32``: 1/x, about 1 ulp."""
    return asm("rcp.approx.ftz.f32 $0, $1;", "f", "f", (x,), side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def fmax_abs(a, b, *, loc=None, ip=None) -> Float32:
    """``max(a, |b|)`` as ``abs.f32`` + ``max.NaN.f32``: NaN if either is NaN
    (an amax over a NaN is NaN, as torch's is)."""
    return asm("{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }", "f", "ff", (a, b),
               side_effects=False, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def fmin_nan(a, b, *, loc=None, ip=None) -> Float32:
    """``min.NaN.f32``: the smaller of ``a`` and ``b``, NaN if either is NaN
    (a clamp that must not turn a non-finite value finite)."""
    return asm("min.NaN.f32 $0, $1, $2;", "f", "ff", (a, b), side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def fmax_nan(a, b, *, loc=None, ip=None) -> Float32:
    """``max.NaN.f32``: the larger of ``a`` and ``b``, NaN if either is NaN."""
    return asm("max.NaN.f32 $0, $1, $2;", "f", "ff", (a, b), side_effects=False, loc=loc, ip=ip)
