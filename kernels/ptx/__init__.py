"""Inline-PTX device helpers shared by every kernel: one small ``@dsl_user_op``
per PTX instruction, grouped by instruction family.

=================  ============================================================
module             instructions
=================  ============================================================
``mbarrier``       mbarrier init / arrive / arrive.expect_tx, spin waits
                   (try_wait, test_wait; CTA scope or cluster acquire),
                   ``cp.async`` arrive, ``fence.mbarrier_init``
``tma``            tensor-map acquire fence and prefetch, 3-D
                   ``cp.async.bulk.tensor`` loads and L2 prefetches, L2 evict-first
                   policy
``wgmma``          (sm_90a only) FP8 ``wgmma.mma_async`` m64nNk32, fence /
                   commit / wait, the 128B-swizzle smem descriptor
``cluster``        ``%cluster_ctarank``, ``mapa``, cluster barrier, ``st.async``
                   to distributed shared memory
``fmath``          ``div.rn``, ``mul.rn``, ``ex2.approx``, ``rcp.approx``, max-abs,
                   NaN-propagating ``min``/``max``
``convert``        FP32 -> e4m3 x4 / BF16 packing, BF16 unpacking, bit casts
``memory``         global loads (``.nc``, ``.cg``, weak, acquire), stores,
                   release / relaxed atomics and reductions, ``cp.async``,
                   shared loads / stores / ``red.or``
``sync``           ``redux.sync`` u32, named barriers, proxy / ``acq_rel.gpu``
                   fences, ``griddepcontrol`` wait and launch_dependents,
                   ``%globaltimer``, ``trap``
``tcgen05``        (sm_100a only; its own owner) TMEM, UMMA, commit
=================  ============================================================

Conventions: shared-memory addresses (own CTA or ``shared::cluster`` from
``mapa``) are 32-bit ``Int32``; global addresses and tensor maps are ``Int64``
byte addresses; values travel as ``Int32``/``Uint32``/``Float32``. Every
helper names its exact instruction in its docstring. The re-exports below let
kernels write ``from kernels import ptx`` and ``ptx.mbarrier_wait(...)``;
the architecture-specific families (``wgmma``, ``tcgen05``) are imported as
modules (``from kernels.ptx import wgmma``).
"""

from .cluster import (  # noqa: F401
    cluster_arrive,
    cluster_arrive_relaxed,
    cluster_ctarank,
    cluster_wait,
    cluster_wait_divergent,
    mapa,
    st_async_b32,
    st_async_v4_b32,
)
from .convert import (  # noqa: F401
    bf16_high,
    bf16_low,
    bits_float,
    cvt_bf16,
    cvt_bf16x2,
    cvt_e4m3x4,
    float_bits,
    float_order_key,
    order_key_float,
    round_e4m3,
)
from .fmath import (  # noqa: F401
    div_rn,
    ex2_approx,
    fmax_abs,
    fmax_nan,
    fmin_nan,
    mul_rn,
    rcp_approx,
)
from .mbarrier import (  # noqa: F401
    cp_async_mbarrier_arrive_noinc,
    fence_mbarrier_init,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    mbarrier_wait_cluster,
    mbarrier_wait_polling,
)
from .memory import (  # noqa: F401
    atom_add_release_gpu_u32,
    atom_inc_relaxed_gpu_u32,
    cp_async_cg_16,
    ld_acquire_gpu_u32,
    ld_global_cg_f32,
    ld_global_cg_u32,
    ld_global_cg_v4_u32,
    ld_global_f32,
    ld_global_nc_f32,
    ld_global_nc_u32,
    ld_global_u16,
    ld_global_v4_u32,
    ld_shared_f32,
    ld_shared_u32,
    ld_shared_v4_u32,
    red_add_release_gpu_u32,
    red_or_shared_u32,
    st_global_f32,
    st_global_u8,
    st_global_u16,
    st_global_u32,
    st_global_v4_u32,
    st_shared_f32,
    st_shared_u8,
    st_shared_u32,
    st_shared_v4_u32,
)
from .sync import (  # noqa: F401
    bar_arrive,
    bar_sync,
    fence_acq_rel_gpu,
    fence_proxy_async_shared,
    globaltimer,
    griddepcontrol_launch_dependents,
    griddepcontrol_wait,
    redux_max_u32,
    redux_min_u32,
    trap,
)
from .tma import (  # noqa: F401
    create_policy_evict_first,
    prefetch_l2_bulk,
    prefetch_tensormap,
    tensormap_fence_acquire,
    tma_load_3d,
    tma_load_3d_hint,
)
