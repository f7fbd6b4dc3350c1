"""Synchronization that is not an mbarrier: warp reductions, named
barriers, memory/proxy fences, programmatic dependent launch, and what a
bounded wait needs (the global timer, ``trap``)."""

from __future__ import annotations

from cutlass import Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm


@dsl_user_op
def redux_max_u32(value, *, loc=None, ip=None) -> Uint32:
    """``redux.sync.max.u32`` over the full warp."""
    return asm("redux.sync.max.u32 $0, $1, 0xffffffff;", "u", "u", (value,), loc=loc, ip=ip)


@dsl_user_op
def redux_min_u32(value, *, loc=None, ip=None) -> Uint32:
    """``redux.sync.min.u32`` over the full warp."""
    return asm("redux.sync.min.u32 $0, $1, 0xffffffff;", "u", "u", (value,), loc=loc, ip=ip)


@dsl_user_op
def bar_sync(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """``bar.sync barrier, threads`` (named barrier; ``threads`` a multiple of 32)."""
    asm(f"bar.sync {int(barrier)}, {int(threads)};", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def bar_arrive(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """``bar.arrive barrier, threads``."""
    asm(f"bar.arrive {int(barrier)}, {int(threads)};", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """``fence.proxy.async.shared::cta``: this thread's generic-proxy shared
    writes become visible to the async proxy (wgmma/tcgen05 operands, TMA
    stores); put it before the barrier that publishes them."""
    asm("fence.proxy.async.shared::cta;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.gpu``."""
    asm("fence.acq_rel.gpu;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def griddepcontrol_wait(*, loc=None, ip=None) -> None:
    """``griddepcontrol.wait``: blocks until the grids this one depends on
    (programmatic dependent launch) have completed and their writes are
    visible; a no-op without PDL. Read no input before it."""
    asm("griddepcontrol.wait;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def griddepcontrol_launch_dependents(*, loc=None, ip=None) -> None:
    """``griddepcontrol.launch_dependents``: the grid launched after this one
    with programmatic dependent launch may be scheduled once every CTA of this
    grid has issued it (or exited), instead of once every CTA has exited. It
    publishes nothing: the dependent's ``griddepcontrol.wait`` still returns
    only when this grid has completed and its writes are visible. A no-op
    without PDL; one issue per CTA is enough."""
    asm("griddepcontrol.launch_dependents;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """``mov.u64 %globaltimer``: the GPU's global nanosecond timer (it ticks
    in steps of about a microsecond; only differences mean anything)."""
    return asm("mov.u64 $0, %globaltimer;", "l", "", loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """``trap``: aborts the grid; the launch reports an error to the host
    (``CUDA_ERROR_LAUNCH_FAILED`` or similar), and the context is lost."""
    asm("trap;", "", "", memory=True, loc=loc, ip=ip)
