"""Warpgroup MMA (sm_90a only): FP8 ``wgmma.mma_async`` with register
accumulators, its fences, and the shared-memory matrix descriptor.

Accumulator fragment of ``m64nNk32`` (N/2 FP32 registers per thread, as
CUTLASS's ``CLayout_64xN``; verified on the H200): thread t of the warpgroup
holds rows ``16*(t//32) + (t%32)//4`` and that ``+ 8``; register ``4*j + 2*h + c``
holds row ``... + 8*h``, column ``8*j + 2*(t%4) + c``.

Both operands are K-major FP8 in 128B-swizzled shared memory (rows of 128
bytes, 8-row / 1024-byte swizzle atoms, 16-byte chunk c of row j stored at
chunk ``c ^ (j % 8)``), 1024-byte aligned.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm

#: Descriptor bits other than the start address: leading byte offset 16 B
#: (unused with swizzling), stride byte offset 1024 B (one 8-row atom) and
#: layout type 1 = 128-byte swizzle (bits 62-63).
_SW128_FIELDS = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)

#: Add this to a descriptor to step its start 32 bytes along K (one k32 step
#: of FP8): the start address field counts 16-byte units.
DESC_K32 = 2


def smem_desc_sw128(addr: Int32) -> Int64:
    """64-bit wgmma matrix descriptor of the K-major 128B-swizzled operand at
    shared address ``addr`` (1024-byte aligned; bit-identical to what cute.gemm
    builds). Step along K with ``+ DESC_K32``, along rows with ``+ (bytes >> 4)``."""
    return ((Int64(addr) & 0x3FFFF) >> 4) | Int64(_SW128_FIELDS)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """``wgmma.fence.sync.aligned``: orders register/shared accesses before the
    next ``wgmma.mma_async`` (needed before the first one)."""
    asm("wgmma.fence.sync.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    """``wgmma.commit_group.sync.aligned``: closes the group of the
    ``wgmma.mma_async`` issued since the last commit."""
    asm("wgmma.commit_group.sync.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """``wgmma.wait_group.sync.aligned pending``: returns once at most
    ``pending`` committed groups are still in flight. Pass the accumulators
    through ``fence_operands`` after it before reading them."""
    asm(f"wgmma.wait_group.sync.aligned {int(pending)};", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def fence_operands(values: list, *, loc=None, ip=None) -> list:
    """An empty asm that takes and returns ``values`` (FP32 registers): the
    compiler cannot move their reads or writes across it (use after
    ``wgmma_wait`` and before ``wgmma_fence``, like CUTLASS's
    ``warpgroup_fence_operand``)."""
    n = len(values)
    out = asm("// fence operands", "f" * n, "f" * n, tuple(values), tied=n, loc=loc, ip=ip)
    return list(out) if n > 1 else [out]


@dsl_user_op
def wgmma_e4m3(acc: list, desc_a: Int64, desc_b: Int64, accumulate, *, loc=None,
               ip=None) -> list:  # fmt: skip
    """``wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3`` with N =
    2 * len(acc): D (+)= A[64 x 32] . B[N x 32]^T, A and B K-major in shared
    memory; ``accumulate`` is scale-d (False / 0: D = A.B), a Python bool
    (folded into the instruction) or an Int32. Returns the new accumulators
    (tied registers; read them only after ``wgmma_wait``)."""
    n = len(acc)
    # Operands: n outputs, n tied inputs (numbered too), then the descriptors.
    assert n in (4, 8, 16, 32, 64), n
    regs = ",".join(f"${i}" for i in range(n))
    ins, args = "f" * n + "ll", [*acc, desc_a, desc_b]
    if isinstance(accumulate, bool):
        predicate = f"setp.ne.b32 p, {int(accumulate)}, 0; "
    else:
        predicate = f"setp.ne.b32 p, ${2 * n + 2}, 0; "
        ins, args = ins + "r", [*args, Int32(accumulate)]
    code = (
        "{ .reg .pred p; " + predicate
        + f"wgmma.mma_async.sync.aligned.m64n{2 * n}k32.f32.e4m3.e4m3 "
        f"{{{regs}}}, ${2 * n}, ${2 * n + 1}, p, 1, 1; }}"
    )  # fmt: skip
    return list(asm(code, "f" * n, ins, tuple(args), tied=n, loc=loc, ip=ip))
