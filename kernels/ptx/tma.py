"""Tensor-map (TMA) instructions. Tensor maps live in global memory (the
``maps`` kernel parameter, 128 bytes each) and are addressed by ``Int64``
generic/global addresses; shared destinations and barriers are ``Int32``.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm


@dsl_user_op
def tensormap_fence_acquire(tmap: Int64, *, loc=None, ip=None) -> None:
    """``fence.proxy.tensormap::generic.acquire.gpu [tmap], 128``: makes a tensor
    map written through the generic proxy (a host copy) usable by TMA."""
    asm("fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "", "l", (tmap,),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def prefetch_tensormap(tmap: Int64, *, loc=None, ip=None) -> None:
    """``prefetch.tensormap [tmap]``: warms the descriptor cache."""
    asm("prefetch.tensormap [$0];", "", "l", (tmap,), memory=True, loc=loc, ip=ip)


@dsl_user_op
def tma_load_3d(dst: Int32, tmap: Int64, bar: Int32, c0, c1, c2, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes``:
    the box at coordinates (c0, c1, c2) (innermost first, elements) into
    shared ``dst``, completing its bytes on barrier ``bar``."""
    asm(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[$0], [$1, {$3, $4, $5}], [$2];",
        "", "rlrrrr", (dst, tmap, bar, c0, c1, c2), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def create_policy_evict_first(*, loc=None, ip=None) -> Int64:
    """``createpolicy.fractional.L2::evict_first.b64``: an L2 cache policy for
    data read once (streamed weights), for the ``*_hint`` loads."""
    return asm("createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "l", "",
               loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def tma_load_3d_hint(dst: Int32, tmap: Int64, bar: Int32, c0, c1, c2, policy: Int64, *,
                     loc=None, ip=None) -> None:  # fmt: skip
    """``tma_load_3d`` with ``.L2::cache_hint`` (``policy`` from
    ``create_policy_evict_first``)."""
    asm(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [$0], [$1, {$3, $4, $5}], [$2], $6;",
        "", "rlrrrrl", (dst, tmap, bar, c0, c1, c2, policy), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def prefetch_l2_bulk(addr: Int64, nbytes, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.prefetch.L2.global [addr], nbytes``: pulls ``nbytes``
    (a multiple of 16, 16-byte aligned) into L2, no completion to wait for."""
    asm("cp.async.bulk.prefetch.L2.global [$0], $1;", "", "lr", (addr, nbytes), memory=True,
        loc=loc, ip=ip)  # fmt: skip
