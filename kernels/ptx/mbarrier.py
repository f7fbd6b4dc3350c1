"""mbarrier instructions. Addresses are 32-bit shared-window addresses
(``Int32``, e.g. ``smem_ptr.toint()`` plus a byte offset); remote barriers take a
``shared::cluster`` address from ``cluster.mapa``.

Phases follow PTX: a barrier starts in phase 0; ``mbarrier_wait(bar, p)``
returns once the phase with parity ``p`` has completed.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from ._asm import asm


@dsl_user_op
def mbarrier_init(bar: Int32, count: int, *, loc=None, ip=None) -> None:
    """``mbarrier.init.shared::cta.b64 [bar], count`` (one thread)."""
    asm(f"mbarrier.init.shared::cta.b64 [$0], {int(count)};", "", "r", (bar,),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None) -> None:
    """``fence.mbarrier_init.release.cluster``: makes the inits visible to the
    cluster (before the cluster barrier that lets peers arrive remotely)."""
    asm("fence.mbarrier_init.release.cluster;", "", "", memory=True, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_arrive(bar: Int32, *, loc=None, ip=None) -> None:
    """``mbarrier.arrive.shared::cta.b64`` (release, CTA scope)."""
    asm("mbarrier.arrive.shared::cta.b64 _, [$0];", "", "r", (bar,), memory=True,
        loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def mbarrier_arrive_expect_tx(bar: Int32, nbytes, *, loc=None, ip=None) -> None:
    """``mbarrier.arrive.expect_tx.shared::cta.b64``: one arrival plus
    ``nbytes`` of expected transaction bytes (TMA or st.async)."""
    asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "", "rr", (bar, nbytes),
        memory=True, loc=loc, ip=ip)  # fmt: skip


@dsl_user_op
def mbarrier_wait(bar: Int32, parity, *, loc=None, ip=None) -> None:
    """Spins on ``mbarrier.try_wait.parity.shared::cta.b64`` (acquire, CTA
    scope) until the phase of ``parity`` has completed: for TMA loads and
    arrivals of this CTA's threads."""
    asm(
        "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
        "@!p bra WAIT; }",
        "", "rr", (bar, parity), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def mbarrier_wait_polling(bar: Int32, parity, *, loc=None, ip=None) -> None:
    """Spins on ``mbarrier.test_wait.parity.shared::cta.b64`` (acquire, CTA
    scope), which never suspends the thread (``try_wait`` may)."""
    asm(
        "{ .reg .pred p; WAIT: mbarrier.test_wait.parity.shared::cta.b64 p, [$0], $1; "
        "@!p bra WAIT; }",
        "", "rr", (bar, parity), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def mbarrier_wait_cluster(bar: Int32, parity, *, loc=None, ip=None) -> None:
    """Spins on ``mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64``:
    for phases completed by other CTAs (``st.async`` data, remote arrivals),
    whose writes must be visible after the wait."""
    asm(
        "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 "
        "p, [$0], $1; @!p bra WAIT; }",
        "", "rr", (bar, parity), memory=True, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def cp_async_mbarrier_arrive_noinc(bar: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: one arrival on
    ``bar`` (counted in its init count) once this thread's earlier
    ``cp.async`` copies have landed."""
    asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "", "r", (bar,), memory=True,
        loc=loc, ip=ip)  # fmt: skip
