"""Thread-block cluster and distributed shared memory (sm_90+).

Shared addresses are 32-bit (``Int32``); ``mapa`` turns a local address into
the ``shared::cluster`` address of the same offset in CTA ``rank``.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm


@dsl_user_op
def cluster_ctarank(*, loc=None, ip=None) -> Int32:
    """``%cluster_ctarank``: this CTA's rank in its cluster."""
    return asm("mov.u32 $0, %cluster_ctarank;", "r", "", side_effects=False, loc=loc, ip=ip)


@dsl_user_op
def mapa(addr: Int32, rank, *, loc=None, ip=None) -> Int32:
    """``mapa.shared::cluster.u32``: the cluster address of local shared
    ``addr`` in CTA ``rank``."""
    return asm("mapa.shared::cluster.u32 $0, $1, $2;", "r", "rr", (addr, rank),
               side_effects=False, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def cluster_arrive(*, loc=None, ip=None) -> None:
    """``barrier.cluster.arrive.release.aligned`` (all threads of the CTA)."""
    asm("barrier.cluster.arrive.release.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def cluster_arrive_relaxed(*, loc=None, ip=None) -> None:
    """``barrier.cluster.arrive.relaxed.aligned``: no memory ordering."""
    asm("barrier.cluster.arrive.relaxed.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None) -> None:
    """``barrier.cluster.wait.acquire.aligned``."""
    asm("barrier.cluster.wait.acquire.aligned;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def cluster_wait_divergent(*, loc=None, ip=None) -> None:
    """``barrier.cluster.wait.acquire`` (no ``.aligned``): for a thread whose
    warp is not converged, e.g. one producer lane inside its load loop."""
    asm("barrier.cluster.wait.acquire;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def st_async_b32(addr: Int32, value, bar: Int32, *, loc=None, ip=None) -> None:
    """``st.async.shared::cluster.mbarrier::complete_tx::bytes.b32``: 4 bytes
    to cluster address ``addr``, completing 4 bytes on the receiver's barrier
    ``bar`` (a cluster address in the same CTA as ``addr``)."""
    asm("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [$0], $1, [$2];",
        "", "rur", (addr, value, bar), memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def st_async_v4_b32(addr: Int32, v0, v1, v2, v3, bar: Int32, *, loc=None, ip=None) -> None:
    """``st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32``: 16
    bytes (``addr`` 16-byte aligned), completing 16 bytes on ``bar``."""
    asm(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
        "", "ruuuur", (addr, v0, v1, v2, v3, bar), memory=True, loc=loc, ip=ip,
    )  # fmt: skip
