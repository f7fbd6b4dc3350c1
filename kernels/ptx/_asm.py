"""The one place that turns a PTX string plus DSL values into ``llvm.inline_asm``.

Operand kinds (one letter each, in ``outs`` / ``ins`` strings):

=====  ==========  ======================================
kind   constraint  DSL type
=====  ==========  ======================================
``r``  ``r``       Int32 (32-bit register)
``u``  ``r``       Uint32
``l``  ``l``       Int64 (64-bit register: gmem address, descriptor)
``q``  ``l``       Uint64
``f``  ``f``       Float32
``h``  ``h``       Int16 (16-bit register)
=====  ==========  ======================================

Read-write operands are written as tied operands (``"+f"`` crashes the 4.8.1
compiler): ``tied=n`` ties the first ``n`` inputs to the first ``n`` outputs.
"""

from __future__ import annotations

from cutlass import Float32, Int16, Int32, Int64, Uint32, Uint64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

_KINDS = {
    "r": ("r", Int32, T.i32),
    "u": ("r", Uint32, T.i32),
    "l": ("l", Int64, T.i64),
    "q": ("l", Uint64, T.i64),
    "f": ("f", Float32, T.f32),
    "h": ("h", Int16, T.i16),
}


def asm(code: str, outs: str, ins: str, args=(), *, tied: int = 0, memory: bool = False,
        side_effects: bool = True, loc=None, ip=None):  # fmt: skip
    """Emits ``code`` with outputs ``$0..`` of kinds ``outs`` and inputs of kinds
    ``ins`` taken from ``args``; returns None, one value or a tuple.

    ``memory`` adds a ``~{memory}`` clobber (the asm reads or writes memory the
    compiler must not cache across it); ``side_effects=False`` lets the
    compiler drop or merge the asm when its results are unused or repeated."""
    assert len(ins) == len(args), (ins, len(args))
    constraints = [f"={_KINDS[k][0]}" for k in outs]
    constraints += [str(i) if i < tied else _KINDS[k][0] for i, k in enumerate(ins)]
    if memory:
        constraints.append("~{memory}")
    values = [_KINDS[k][1](a).ir_value(loc=loc, ip=ip) for k, a in zip(ins, args, strict=True)]
    if not outs:
        result_type = None
    elif len(outs) == 1:
        result_type = _KINDS[outs[0]][2]()
    else:
        names = ",".join(str(_KINDS[k][2]()) for k in outs)
        result_type = ir.Type.parse(f"!llvm.struct<({names})>")
    result = llvm.inline_asm(
        result_type, values, code, ",".join(constraints),
        has_side_effects=side_effects, asm_dialect=0, loc=loc, ip=ip,
    )  # fmt: skip
    if not outs:
        return None
    if len(outs) == 1:
        return _KINDS[outs[0]][1](result)
    return tuple(
        _KINDS[k][1](llvm.extractvalue(_KINDS[k][2](), result, [i], loc=loc, ip=ip))
        for i, k in enumerate(outs)
    )
