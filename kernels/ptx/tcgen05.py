"""Fifth-generation tensor core instructions (``tcgen05``, sm_100a): Tensor
Memory (TMEM) allocation, the FP8 UMMA, its commit to an mbarrier, TMEM loads
and the thread-sync fences, plus the two descriptors the UMMA reads.

Addresses: shared memory is a 32-bit shared-window address (``Int32``); a TMEM
address is ``Int32`` ``lane << 16 | column`` (what ``tcgen05_alloc`` writes).
Every instruction here is CTA-group 1 (one CTA's tensor core, no pairs).

Descriptor formats follow the PTX ISA "Matrix Descriptors" and "Instruction
descriptor" sections for ``tcgen05.mma``; the values were checked against
``cutlass.experimental.primitives.Tcgen05SmemDesc`` / ``Tcgen05InstrDesc`` for
the cases used here (E4M3 x E4M3 -> F32, both K-major, 128-byte swizzle).

The last section composes these instructions into the few steps both sm_100a
kernels take (a 128-K UMMA block, wait-then-fence, load-then-wait, release).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm
from .mbarrier import mbarrier_wait

#: TMEM has 128 lanes and 512 32-bit columns per SM; an allocation is a power
#: of two between 32 and 512 columns.
TMEM_LANES = 128
TMEM_MAX_COLUMNS = 512
TMEM_MIN_COLUMNS = 32

#: The shapes ``tcgen05_ld_32x32b`` can load per thread (``.num`` = x1..x128).
LD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


def instruction_desc_e4m3(m: int, n: int) -> int:
    """32-bit instruction descriptor of ``kind::f8f6f4`` E4M3 x E4M3 -> F32,
    dense, A and B K-major, no negation, shape M x N (x K 32).

    Fields: bits 4-5 D format (1 = F32), 7-9 A format and 10-12 B format
    (0 = E4M3), 15/16 A/B major (0 = K), 17-22 N >> 3, 24-28 M >> 4."""
    if m not in (64, 128):
        raise ValueError(f"UMMA M {m}: cta_group::1 supports 64 or 128")
    if n % (8 if m == 64 else 16) or not 8 <= n <= 256:
        raise ValueError(f"UMMA N {n}: must be a multiple of {8 if m == 64 else 16} in 8..256")
    return (1 << 4) | ((n >> 3) << 17) | ((m >> 4) << 24)


#: Constant bits of a K-major 128-byte-swizzle shared memory descriptor: leading
#: byte offset 16 B (unused for swizzled K-major, encoded as 1), stride byte
#: offset 1024 B (8 rows of 128 B between core-matrix groups), version 1
#: (bit 46, sm_100 format), layout 2 = 128-byte swizzle (bits 61-63).
SW128_K_DESC_BITS = (1 << 16) | ((1024 >> 4) << 32) | (1 << 46) | (2 << 61)


def smem_desc_sw128(addr) -> Int64:
    """The UMMA descriptor of a K-major, 128-byte swizzled operand at shared
    address ``addr`` (``Int32``, 1024-byte aligned for the pattern): rows of
    128 bytes of K, 8-row groups 1024 bytes apart. Adding ``b >> 4`` to the
    result moves the start by ``b`` bytes (``+2`` = the next 32 K bytes)."""
    start = (Int64(addr) & Int64(0x3FFFF)) >> Int64(4)
    return start | Int64(SW128_K_DESC_BITS)


@dsl_user_op
def tcgen05_alloc(dst: Int32, columns: int, *, loc=None, ip=None) -> None:
    """``tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [dst], columns``
    (warp-collective): allocates ``columns`` TMEM columns (all 128 lanes) and
    writes their address to shared ``dst``."""
    _check_columns(columns)
    asm(f"tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [$0], {int(columns)};",
        "", "r", (dst,), memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def tcgen05_relinquish_alloc_permit(*, loc=None, ip=None) -> None:
    """``tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned``
    (warp-collective): this CTA allocates no more, so a co-resident CTA's
    ``tcgen05_alloc`` need not wait for it."""
    asm("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;", "", "",
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def tcgen05_dealloc(taddr: Int32, columns: int, *, loc=None, ip=None) -> None:
    """``tcgen05.dealloc.cta_group::1.sync.aligned.b32 taddr, columns``
    (warp-collective, the allocating warp, before the CTA exits)."""
    _check_columns(columns)
    asm(f"tcgen05.dealloc.cta_group::1.sync.aligned.b32 $0, {int(columns)};",
        "", "r", (taddr,), memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def tcgen05_mma_f8f6f4(d: Int32, adesc: Int64, bdesc: Int64, idesc, accumulate,
                       *, loc=None, ip=None) -> None:  # fmt: skip
    """``tcgen05.mma.cta_group::1.kind::f8f6f4 [d], adesc, bdesc, idesc, p``
    with ``p = accumulate != 0``: D (TMEM) = A * B^T (+ D if accumulate), one
    K32 step of FP8, issued by one thread (wrap in ``elect_one``);
    asynchronous, tracked by ``tcgen05_commit``."""
    asm(
        "{ .reg .pred p; setp.ne.b32 p, $4, 0; "
        "tcgen05.mma.cta_group::1.kind::f8f6f4 [$0], $1, $2, $3, p; }",
        "", "rllrr", (d, adesc, bdesc, idesc, accumulate), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def tcgen05_commit(bar: Int32, *, loc=None, ip=None) -> None:
    """``tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64
    [bar]``: one arrival on ``bar`` once every UMMA this thread issued before
    has completed (their smem reads done, their TMEM writes visible). One
    thread."""
    asm("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [$0];",
        "", "r", (bar,), memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def tcgen05_ld_32x32b(taddr: Int32, count: int, *, loc=None, ip=None) -> tuple:
    """``tcgen05.ld.sync.aligned.32x32b.x{count}.b32`` (warp-collective): lane
    i of the warp gets TMEM lane ``(taddr >> 16) + i``, columns ``taddr +
    0..count-1``, as ``count`` Float32. Warp w may only address lanes
    ``32 * (w % 4)`` to ``+31``. Asynchronous: ``tcgen05_wait_ld`` before the
    values are used."""
    if count not in LD_COUNTS:
        raise ValueError(f"tcgen05.ld 32x32b count {count}: one of {LD_COUNTS}")
    regs = ", ".join(f"${i}" for i in range(count))
    got = asm(f"tcgen05.ld.sync.aligned.32x32b.x{count}.b32 {{{regs}}}, [${count}];",
              "f" * count, "r", (taddr,), memory=True, loc=loc, ip=ip)  # fmt: skip
    return (got,) if count == 1 else got


@dsl_user_op
def tcgen05_wait_ld(*, loc=None, ip=None) -> None:
    """``tcgen05.wait::ld.sync.aligned``: every ``tcgen05.ld`` of this thread
    has landed in its registers."""
    asm("tcgen05.wait::ld.sync.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_before_thread_sync(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::before_thread_sync``: orders this thread's earlier
    tcgen05 operations (TMEM loads, UMMAs) before a following barrier or
    mbarrier arrive."""
    asm("tcgen05.fence::before_thread_sync;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after_thread_sync(*, loc=None, ip=None) -> None:
    """``tcgen05.fence::after_thread_sync``: orders this thread's later tcgen05
    operations after a preceding barrier or mbarrier wait."""
    asm("tcgen05.fence::after_thread_sync;", "", "", memory=True, loc=loc, ip=ip)


def _check_columns(columns: int) -> None:
    columns = int(columns)
    if columns < TMEM_MIN_COLUMNS or columns > TMEM_MAX_COLUMNS or columns & (columns - 1):
        raise ValueError(
            f"TMEM columns {columns}: a power of two in {TMEM_MIN_COLUMNS}..{TMEM_MAX_COLUMNS}"
        )


# -- compositions both sm_100a kernels use ---------------------------------------------------


@cute.jit
def umma_k128(d: Int32, adesc: Int64, bdesc: Int64, idesc, accumulate):
    """Four K32 FP8 UMMAs over one 128-byte K block of K-major SW128 operands
    (each step moves both descriptors by 32 bytes: ``+2``) into TMEM ``d``;
    the first accumulates iff ``accumulate``, the others always. One thread
    (inside ``elect_one``)."""
    tcgen05_mma_f8f6f4(d, adesc, bdesc, idesc, Int32(accumulate))
    for k in cutlass.range_constexpr(1, 4):
        tcgen05_mma_f8f6f4(d, adesc + 2 * k, bdesc + 2 * k, idesc, Int32(1))


@cute.jit
def commit_elected(bar: Int32):
    """``tcgen05_commit`` from the warp's elected lane (the lane that issued
    the UMMAs: ``elect.sync`` picks the same lane of a converged warp)."""
    with cute.arch.elect_one():
        tcgen05_commit(bar)


@cute.jit
def wait_tmem(bar: Int32, phase):
    """Waits for phase ``phase`` of a barrier completed by TMA, a UMMA commit
    or a thread's arrival, then orders this thread's later tcgen05 operations
    after it."""
    mbarrier_wait(bar, phase)
    tcgen05_fence_after_thread_sync()


@cute.jit
def load_tmem(taddr: Int32, count: cutlass.Constexpr[int]):
    """``count`` accumulator columns of this thread's TMEM lane, landed
    (``tcgen05_ld_32x32b`` + ``tcgen05_wait_ld``)."""
    got = tcgen05_ld_32x32b(taddr, count)
    tcgen05_wait_ld()
    return got


@cute.jit
def release_tmem(
    taddr: Int32, columns: cutlass.Constexpr[int], warp, owner: cutlass.Constexpr[int]
):
    """Every thread of the CTA: once all TMEM loads and UMMAs are done (CTA
    barrier), warp ``owner`` (the one that allocated) frees the columns."""
    tcgen05_fence_before_thread_sync()
    cute.arch.sync_threads()
    if warp == owner:
        tcgen05_fence_after_thread_sync()
        tcgen05_dealloc(taddr, columns)
