"""Loads, stores and atomics. Global addresses are ``Int64`` byte addresses
(``tensor.iterator.toint()`` plus an offset), shared addresses ``Int32``.

Which global load an input takes:
  * ``.nc`` only for parameters no grid writes while calls run (block
    scales, row tables): ``.nc`` promises data read-only for the kernel's
    whole life, and ptxas acts on it, moving such loads across
    ``griddepcontrol.wait``, even an unconditional one in the same block
    (``docs/notes/mega-sm90.md``, "Weak loads for the previous grid's
    outputs");
  * weak ``ld.global`` for what a previous grid may write while this one
    has started (x, the router logits; the routing bias beside them): the
    wait makes that grid's writes visible to the loads it orders, and
    ptxas keeps a weak load after a wait that dominates it (a wait in one
    branch does not, for the code after the branches meet);
  * ``.cg`` or acquire for what other CTAs of this grid write.
Ordered accesses state their semantics and scope in the name.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm

# -- global, parameters (constant while calls run) ----------------------------------------


@dsl_user_op
def ld_global_nc_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """``ld.global.nc.b32``."""
    return asm("ld.global.nc.b32 $0, [$1];", "u", "l", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_nc_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """``ld.global.nc.f32``."""
    return asm("ld.global.nc.f32 $0, [$1];", "f", "l", (addr,), memory=True, loc=loc, ip=ip)


# -- global, the previous grid's outputs (weak), and ordered ------------------------------


@dsl_user_op
def ld_global_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """``ld.global.f32`` (weak)."""
    return asm("ld.global.f32 $0, [$1];", "f", "l", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_u16(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """``ld.global.u16`` (weak), zero-extended (a BF16 in the low half)."""
    return asm("ld.global.u16 $0, [$1];", "u", "l", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_v4_u32(addr: Int64, *, loc=None, ip=None) -> tuple:
    """``ld.global.v4.b32`` (weak; 16-byte aligned): four words."""
    return asm("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "uuuu", "l", (addr,),
               memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def ld_global_cg_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """``ld.global.cg.b32``: cached in L2 only (data other CTAs wrote in this
    kernel, read after an acquire: no stale L1 line)."""
    return asm("ld.global.cg.b32 $0, [$1];", "u", "l", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """``ld.global.cg.f32`` (L2 only, see ``ld_global_cg_u32``)."""
    return asm("ld.global.cg.f32 $0, [$1];", "f", "l", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_cg_v4_u32(addr: Int64, *, loc=None, ip=None) -> tuple:
    """``ld.global.cg.v4.b32`` (L2 only, 16-byte aligned): four words."""
    return asm("ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];", "uuuu", "l", (addr,),
               memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def ld_acquire_gpu_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """``ld.acquire.gpu.global.b32``."""
    return asm("ld.acquire.gpu.global.b32 $0, [$1];", "u", "l", (addr,), memory=True,
               loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def st_global_u32(addr: Int64, value, *, loc=None, ip=None) -> None:
    """``st.global.b32``."""
    asm("st.global.b32 [$0], $1;", "", "lu", (addr, value), memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_f32(addr: Int64, value, *, loc=None, ip=None) -> None:
    """``st.global.f32``."""
    asm("st.global.f32 [$0], $1;", "", "lf", (addr, value), memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_u8(addr: Int64, value, *, loc=None, ip=None) -> None:
    """``st.global.b8`` of the low byte of ``value`` (an FP8 store)."""
    asm("{ .reg .b16 h; cvt.u16.u32 h, $1; st.global.b8 [$0], h; }", "", "lu", (addr, value),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def st_global_u16(addr: Int64, value, *, loc=None, ip=None) -> None:
    """``st.global.b16`` of the low half of ``value`` (a BF16 store)."""
    asm("{ .reg .b16 h; cvt.u16.u32 h, $1; st.global.b16 [$0], h; }", "", "lu", (addr, value),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def st_global_v4_u32(addr: Int64, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    """``st.global.v4.b32`` (16-byte aligned)."""
    asm("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "", "luuuu", (addr, v0, v1, v2, v3),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def atom_add_release_gpu_u32(addr: Int64, value, *, loc=None, ip=None) -> Uint32:
    """``atom.release.gpu.global.add.u32``: returns the old value."""
    return asm("atom.release.gpu.global.add.u32 $0, [$1], $2;", "u", "lu", (addr, value),
               memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def red_add_release_gpu_u32(addr: Int64, value, *, loc=None, ip=None) -> None:
    """``red.release.gpu.global.add.u32``."""
    asm("red.release.gpu.global.add.u32 [$0], $1;", "", "lu", (addr, value), memory=True,
        loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def atom_inc_relaxed_gpu_u32(addr: Int64, limit, *, loc=None, ip=None) -> Uint32:
    """``atom.inc.relaxed.gpu.global.u32``: ``old >= limit ? 0 : old + 1``;
    returns the old value."""
    return asm("atom.inc.relaxed.gpu.global.u32 $0, [$1], $2;", "u", "lu", (addr, limit),
               memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def cp_async_cg_16(dst: Int32, src: Int64, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global [dst], [src], 16``: 16 bytes from global
    (L2 only) to shared, both 16-byte aligned; completes on an mbarrier with
    ``mbarrier.cp_async_mbarrier_arrive_noinc`` (or ``cp.async.wait_all``)."""
    asm("cp.async.cg.shared.global [$0], [$1], 16;", "", "rl", (dst, src), memory=True,
        loc=loc, ip=ip)  # fmt: skip


# -- shared -------------------------------------------------------------------------------


@dsl_user_op
def ld_shared_u32(addr: Int32, *, loc=None, ip=None) -> Uint32:
    """``ld.shared.b32``."""
    return asm("ld.shared.b32 $0, [$1];", "u", "r", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    """``ld.shared.f32``."""
    return asm("ld.shared.f32 $0, [$1];", "f", "r", (addr,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_v4_u32(addr: Int32, *, loc=None, ip=None) -> tuple:
    """``ld.shared.v4.b32`` (16-byte aligned)."""
    return asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "uuuu", "r", (addr,),
               memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def st_shared_u32(addr: Int32, value, *, loc=None, ip=None) -> None:
    """``st.shared.b32``."""
    asm("st.shared.b32 [$0], $1;", "", "ru", (addr, value), memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_f32(addr: Int32, value, *, loc=None, ip=None) -> None:
    """``st.shared.f32``."""
    asm("st.shared.f32 [$0], $1;", "", "rf", (addr, value), memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_u8(addr: Int32, value, *, loc=None, ip=None) -> None:
    """``st.shared.b8`` of the low byte of ``value``."""
    asm("{ .reg .b16 h; cvt.u16.u32 h, $1; st.shared.b8 [$0], h; }", "", "ru", (addr, value),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def red_or_shared_u32(addr: Int32, value, *, loc=None, ip=None) -> None:
    """``red.shared.or.b32``."""
    asm("red.shared.or.b32 [$0], $1;", "", "ru", (addr, value), memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4_u32(addr: Int32, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    """``st.shared.v4.b32`` (16-byte aligned)."""
    asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "", "ruuuu", (addr, v0, v1, v2, v3),
        memory=True, loc=loc, ip=ip)  # fmt: skip
