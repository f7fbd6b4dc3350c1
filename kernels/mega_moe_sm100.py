"""Mega MoE kernel for sm_100a (B200/GB200): the seed's kernel
(``shared/seeds/mega_moe.clean.txt``), ported to this project's helpers.

Routed experts of a few decode tokens in one launch: one 16-CTA cluster per
(token, expert) route. GEMM1 (W31: up rows, then gate rows): CTA ``r`` owns
row tile ``r // 2`` (128 of the 2I rows) and K half ``r % 2`` (16 of the 32 K
blocks); the two halves meet over DSMEM, gate tiles hand their values to the
matching up tile, and each up tile's CTA sends its FP8 hidden block (clamped
SwiGLU, one scale per 128) to all 16 CTAs. GEMM2: CTA ``r`` owns H/16 output
rows (two row tiles) over all I/128 hidden K blocks.

The block scales are not powers of two, so the tensor core cannot apply them:
each of a CTA's 16 K blocks puts the token in its own B column (UMMA N = 16,
the other columns zero), one TMEM accumulator then holds every K block's
unscaled partial in its own column, the UMMAs run back to back as weight stages
land, and the epilogue scales and sums the 16 columns once.

Warp roles (192 threads): warp 0 lane 0 streams weight stages with TMA, warp 1
issues the UMMAs (one elected lane) and commits them to mbarriers, warps 2-5
(the epilogue) route, quantize the token into the B tiles, and read, scale and
reduce the TMEM accumulators. Every warp redoes its token's top-k from the
logits (cheaper than a kernel boundary).

The seed's unshown helpers: ``alloc`` is the DSL's ``SmemAllocator``;
``load_tma3`` ``ptx.tma_load_3d``; ``smem_desc``, ``wait_tmem``, ``load_tmem``,
``release_tmem`` and the UMMA / commit steps are in ``kernels.ptx.tcgen05``;
``wait`` ``ptx.mbarrier_wait`` (``_cluster``); ``store_async_dsmem`` is
``mapa`` + ``st.async`` below; ``pack_fp8``, ``sigmoid``, ``redux``, ``div_rn``
are ``kernels.ptx`` / ``kernels.moe_common``; ``_weight_map`` is the runtime's
tensor maps (artifacts/FORMAT.md) and ``_logical_rows``
``runtime.layout.logical_rows`` (the ``rows1`` / ``rows2`` parameters).

Differences from the seed, none of them in the algorithm: shared addresses are
32-bit integers (``kernels.ptx`` convention); the waits on barriers completed by
peer CTAs (``st.async`` data: ``pair``, ``gate_recv``, ``hrecv``) acquire at
cluster scope, which the PTX memory model asks for (the seed waits at CTA
scope); routing, quantization and SwiGLU are ``kernels.moe_common``'s (IEEE
divisions where the seed multiplied by a reciprocal, so codes match the
reference bit for bit); the launch's dynamic shared memory is the layout size
(the dynamic window is declared 1024-aligned, so the seed's extra 1024 bytes
of alignment slack are not needed).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from kernels import moe_common as mc
from kernels import ptx
from kernels.grouped_plan import SMEM_LIMIT
from kernels.ptx import tcgen05 as tc
from kernels.shapes import TILE
from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param, entry_from_ptx

ARCH = "sm_100a"
ENTRY_PREFIX = "moe_mega_sm100"

CLUSTER = 16  # CTAs per route: 8 GEMM1 row tiles x 2 K halves
COLUMNS = 16  # K blocks of a GEMM1 K half = UMMA N (one B column each)
#: Weight stages in flight. Two CTAs share an SM (``MIN_BLOCKS``), so each
#: gets about half of its shared memory: 4 stages of 16 KiB plus 40 KiB of B
#: tiles (hopper.md: 4 to 6 stages of 16 KiB reach the streaming floor).
STAGES = 4
STAGE_BYTES = TILE * TILE  # one FP8 128 x 128 weight box (TMA, 128B swizzle)
B_BYTES = COLUMNS * TILE  # one B tile: 16 rows (columns of B) of 128 K bytes
THREADS = 192  # producer warp, MMA warp, 4 epilogue warps
EPILOGUE = 2  # first epilogue warp
MIN_BLOCKS = 2  # CTAs per SM the launch asks ptxas to allow (.minnctapersm)
SMEM_CARVEOUT = 100  # percent of the unified L1/shared memory given to shared
#: TMEM columns: the GEMM1 accumulator (16 columns) and one per GEMM2 row tile.
TMEM_COLUMNS = 64
#: UMMA instruction descriptor: E4M3 x E4M3 -> F32, M = 128 weight rows, N = 16.
IDESC = tc.instruction_desc_e4m3(TILE, COLUMNS)

#: ABI order (kernels/spec.py PARAMETER_NAMES); every parameter a pointer.
PARAMS = (
    "maps", "w13_scale", "w2_scale", "x", "logits", "bias", "rows1", "rows2", "out",
    "ids", "weights",
)  # fmt: skip
TENSOR_MAPS = ("w13", "w2")


@dataclass(frozen=True)
class MegaLayout:
    """Static quantities and the shared-memory layout (bytes from the 1024-
    aligned dynamic base) of one mega variant."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: int

    @property
    def nk1(self) -> int:  # GEMM1 K blocks
        return self.hidden // TILE

    @property
    def nk2(self) -> int:  # GEMM2 K blocks (= up tiles)
        return self.inter // TILE

    @property
    def tiles1(self) -> int:  # GEMM1 row tiles (W31: up, then gate)
        return 2 * self.inter // TILE

    @property
    def blocks1(self) -> int:  # GEMM1 K blocks of one CTA (a K half)
        return self.nk1 // 2

    @property
    def rows2(self) -> int:  # GEMM2 output rows of one CTA
        return self.hidden // CLUSTER

    @property
    def tiles2(self) -> int:
        return self.rows2 // TILE

    @property
    def loads(self) -> int:  # weight stages one CTA streams
        return self.blocks1 + self.tiles2 * self.nk2

    @property
    def routes(self) -> int:
        return self.tokens * self.top_k

    off_b1 = property(lambda self: STAGES * STAGE_BYTES)  # GEMM1 B tiles
    off_b2 = property(lambda self: self.off_b1 + self.blocks1 * B_BYTES)  # GEMM2 B tiles
    off_partial = property(lambda self: self.off_b2 + self.nk2 * B_BYTES)  # K half 1's sums
    off_gate = property(lambda self: self.off_partial + TILE * 4)  # gate rows, logical
    off_stage = property(lambda self: self.off_gate + TILE * 4)  # FP8 hidden block
    off_amax = property(lambda self: self.off_stage + TILE)  # per-warp amax
    off_hscale = property(lambda self: self.off_amax + 16)  # hidden scales
    off_xscale = property(lambda self: self.off_hscale + 16)  # activation scales
    off_bar = property(lambda self: self.off_xscale + COLUMNS * 4)
    #: full[STAGES], empty[STAGES], acc1, b_ready, acc2[tiles2], pair,
    #: gate_recv, hrecv and one spare (the seed's count).
    bars = property(lambda self: 2 * STAGES + 2 + self.tiles2 + 4)
    off_tmem = property(lambda self: self.off_bar + self.bars * 8)  # TMEM address
    smem = property(lambda self: self.off_tmem + 16)

    def stage_box(self, rank: int, n: int, expert: int) -> tuple[int, int, int]:
        """(tensor map index, first row, K block) of CTA ``rank``'s n-th weight
        stage for ``expert``: the plain-Python statement of ``produce``."""
        if n < self.blocks1:
            return 0, rank // 2 * TILE, expert * self.nk1 + rank % 2 * self.blocks1 + n
        m = n - self.blocks1
        return 1, rank * self.rows2 + m // self.nk2 * TILE, expert * self.nk2 + m % self.nk2

    def problems(self) -> list[str]:
        """Why the seed's cluster split cannot serve this shape (empty: it can)."""
        reasons = []
        if self.tiles1 * 2 != CLUSTER:
            reasons.append(f"inter {self.inter}: 2 * inter / 128 * 2 must be {CLUSTER}")
        if self.blocks1 != COLUMNS or self.nk1 % 2:
            reasons.append(f"hidden {self.hidden}: hidden / 128 / 2 must be {COLUMNS}")
        if self.hidden % (CLUSTER * TILE):
            reasons.append(f"hidden {self.hidden}: GEMM2 rows must split into 128-row tiles")
        elif COLUMNS * (1 + self.tiles2) > TMEM_COLUMNS:
            reasons.append(f"{self.tiles2} GEMM2 tiles need more than {TMEM_COLUMNS} TMEM columns")
        if self.nk2 > 4:
            reasons.append(f"inter {self.inter}: at most 4 hidden blocks (hidden scale slots)")
        if self.experts % 32:
            reasons.append(f"experts {self.experts} must be a multiple of 32 (lanes hold 32)")
        if not 1 <= self.top_k <= 32:
            reasons.append(f"top_k {self.top_k} must be in 1..32")
        if self.smem > SMEM_LIMIT[ARCH]:
            reasons.append(f"{self.smem} B of shared memory exceed {SMEM_LIMIT[ARCH]}")
        return reasons

    def regions(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes) of every shared-memory region, in order."""
        names = ["b1", "b2", "partial", "gate", "stage", "amax", "hscale", "xscale", "bar",
                 "tmem"]  # fmt: skip
        starts = [0] + [getattr(self, "off_" + n) for n in names]
        ends = starts[1:] + [self.smem]
        return [(n, s, e - s) for n, s, e in zip(["stages", *names], starts, ends, strict=True)]


def layout_of(spec: KernelSpec) -> MegaLayout:
    layout = MegaLayout(spec.hidden, spec.inter, spec.experts, spec.top_k, spec.tokens)
    problems = layout.problems()
    if problems:
        raise ValueError(f"mega/{ARCH} cannot serve this shape: " + "; ".join(problems))
    return layout


class MegaKernel:
    """BF16 [routes, hidden] expert outputs of each route (finalize-ready),
    int32 [routes] experts and FP32 [routes] routing weights."""

    def __init__(self, layout: MegaLayout, *, scale: float, limit: float, ue8m0: bool,
                 logits_bf16: bool):  # fmt: skip
        self.layout = layout
        self.scale, self.limit, self.ue8m0 = scale, limit, ue8m0
        self.logits_bf16 = logits_bf16

    @cute.jit
    def __call__(
        self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
        x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor,
        rows2: cute.Tensor, out: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
        stream,
    ):  # fmt: skip
        self.kernel(
            maps, w13_scale, w2_scale, x, logits, bias, rows1, rows2, out, ids, weights
        ).launch(
            grid=(CLUSTER * self.layout.routes, 1, 1),
            block=(THREADS, 1, 1),
            cluster=(CLUSTER, 1, 1),
            smem=self.layout.smem,
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=MIN_BLOCKS,
            # Both CTAs of an SM need the full shared-memory carveout. Given
            # here, the DSL also stops asking a (missing) device for its size.
            preferred_smem_carveout=SMEM_CARVEOUT,
        )

    @cute.kernel
    def kernel(
        self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
        x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor,
        rows2: cute.Tensor, out: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
    ):  # fmt: skip
        lay = self.layout
        tiles2, nk2 = lay.tiles2, lay.nk2
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(ptx.cluster_ctarank())
        route = cta // CLUSTER
        tile = rank // 2
        half = rank % 2
        first = half * lay.blocks1

        storage = cutlass.memory.SmemAllocator().allocate_tensor(
            Uint8, cute.make_layout(lay.smem), byte_alignment=1024
        )
        sm = storage.iterator.toint()
        full = sm + lay.off_bar
        empty = full + 8 * STAGES
        acc1 = full + 16 * STAGES
        b_ready = acc1 + 8
        acc2 = acc1 + 16
        pair = acc2 + 8 * tiles2  # K half 1's sums arrived (half 0)
        gate_recv = pair + 8  # the gate tile's values arrived (up tiles)
        hrecv = pair + 16  # every hidden block and its scale arrived
        maps_at = maps.iterator.toint()

        if tid == 0:
            for s in cutlass.range_constexpr(STAGES):
                ptx.mbarrier_init(full + 8 * s, 1)
                ptx.mbarrier_init(empty + 8 * s, 1)
            ptx.mbarrier_init(acc1, 1)
            ptx.mbarrier_init(b_ready, 4)
            for t in cutlass.range_constexpr(tiles2):
                ptx.mbarrier_init(acc2 + 8 * t, 1)
            for b in cutlass.range_constexpr(3):
                ptx.mbarrier_init(pair + 8 * b, 1)
            if half == 0:
                ptx.mbarrier_arrive_expect_tx(pair, TILE * 4)
                if tile < nk2:
                    ptx.mbarrier_arrive_expect_tx(gate_recv, TILE * 4)
            # Every up tile's FP8 hidden block and its scale.
            ptx.mbarrier_arrive_expect_tx(hrecv, nk2 * (TILE + 4))
            ptx.fence_mbarrier_init()
            ptx.tensormap_fence_acquire(maps_at)
            ptx.tensormap_fence_acquire(maps_at + 128)
        if warp == 1:
            tc.tcgen05_alloc(sm + lay.off_tmem, TMEM_COLUMNS)
            tc.tcgen05_relinquish_alloc_permit()
        # GEMM2's B tiles get remote hidden rows: zero them before the cluster
        # barrier releases any sender.
        chunks = nk2 * B_BYTES // 16
        for i in cutlass.range_constexpr(-(-chunks // THREADS)):
            if i * THREADS + tid < chunks:
                zero = Uint32(0)
                ptx.st_shared_v4_u32(sm + lay.off_b2 + (i * THREADS + tid) * 16, zero, zero,
                                     zero, zero)  # fmt: skip
        ptx.fence_proxy_async_shared()
        ptx.cluster_arrive()
        tc.tcgen05_fence_before_thread_sync()
        cute.arch.sync_threads()
        tc.tcgen05_fence_after_thread_sync()
        tmem = Int32(ptx.ld_shared_u32(sm + lay.off_tmem))

        # No early launch_dependents: the finalize publish reads the routing
        # weights this kernel writes before its own PDL wait, so it may only
        # launch once this grid has exited.
        ptx.griddepcontrol_wait()
        expert, weight = self.top_k_pick(logits, bias, route, lane)
        if rank == 0 and tid == 0:
            ptx.st_global_u32(ids.iterator.toint() + Int64(route) * 4, Uint32(expert))
            ptx.st_global_f32(weights.iterator.toint() + Int64(route) * 4, weight)

        if warp == 0:
            if lane == 0:
                self.produce(sm, maps_at, full, empty, rank, tile, first, Int64(expert))
        elif warp == 1:
            self.issue(sm, tmem, full, empty, acc1, b_ready, acc2, hrecv)
        else:
            self.epilogue(
                sm, tmem, warp, lane, rank, route, tile, half, first, Int64(expert),
                w13_scale, w2_scale, x, rows1, rows2, out,
                b_ready, acc1, acc2, pair, gate_recv, hrecv,
            )  # fmt: skip
        if warp < EPILOGUE:
            ptx.cluster_wait()
        tc.release_tmem(tmem, TMEM_COLUMNS, warp, 1)

    @cute.jit
    def top_k_pick(self, logits: cute.Tensor, bias: cute.Tensor, route, lane):
        """(expert, weight) of route ``route`` (route % top_k of token route //
        top_k) in every lane: the warp routes the token (``moe_common``), lane
        k holding route k, and broadcasts route k."""
        lay = self.layout
        token = route // lay.top_k
        k = route % lay.top_k
        row_bytes = lay.experts * (2 if cutlass.const_expr(self.logits_bf16) else 4)
        mine, weight = mc.route_token(
            logits.iterator.toint() + Int64(token) * row_bytes, bias.iterator.toint(), lane,
            lay.experts, lay.top_k, self.scale, self.logits_bf16,
        )  # fmt: skip
        return cute.arch.shuffle_sync(mine, k), cute.arch.shuffle_sync(weight, k)

    @cute.jit
    def produce(self, sm, maps_at, full, empty, rank, tile, first, expert):
        """Warp 0 lane 0: the CTA's GEMM1 K half of its row tile, then its
        GEMM2 row tiles' K blocks, one TMA box a stage through the ring."""
        lay = self.layout
        nk2 = lay.nk2
        for n in cutlass.range(lay.loads, unroll=1):
            slot = n % STAGES
            if n >= STAGES:
                ptx.mbarrier_wait(empty + 8 * slot, ((n // STAGES) - 1) % 2)
            ptx.mbarrier_arrive_expect_tx(full + 8 * slot, STAGE_BYTES)
            dst = sm + slot * STAGE_BYTES
            if n < lay.blocks1:
                block = Int32(expert * lay.nk1 + first + n)
                ptx.tma_load_3d(dst, maps_at, full + 8 * slot, 0, tile * TILE, block)
            else:
                m = n - lay.blocks1
                row = rank * lay.rows2 + (m // nk2) * TILE
                block = Int32(expert * nk2 + m % nk2)
                ptx.tma_load_3d(dst, maps_at + 128, full + 8 * slot, 0, row, block)

    @cute.jit
    def issue(self, sm, tmem, full, empty, acc1, b_ready, acc2, hrecv):
        """Warp 1: the UMMAs of every stage as it lands (GEMM1 K block n into
        accumulator column n; GEMM2 row tile t's K block kb into column
        ``COLUMNS * (1 + t) + kb``), each stage committed to its empty barrier,
        the accumulators to ``acc1`` / ``acc2[t]``."""
        lay = self.layout
        nk2 = lay.nk2
        adesc = tc.smem_desc_sw128(sm)
        b1desc = tc.smem_desc_sw128(sm + lay.off_b1)
        b2desc = tc.smem_desc_sw128(sm + lay.off_b2)
        ptx.mbarrier_wait(b_ready, 0)
        for n in cutlass.range(lay.blocks1, unroll=1):
            slot = n % STAGES
            tc.wait_tmem(full + 8 * slot, (n // STAGES) % 2)
            self.umma_block(
                tmem, adesc + slot * (STAGE_BYTES >> 4), b1desc + n * (B_BYTES >> 4), n > 0,
                empty + 8 * slot,
            )  # fmt: skip
            cute.arch.sync_warp()
        tc.commit_elected(acc1)
        ptx.mbarrier_wait_cluster(hrecv, 0)
        ptx.fence_proxy_async_shared()
        for m in cutlass.range(lay.tiles2 * nk2, unroll=1):
            n = lay.blocks1 + m
            slot = n % STAGES
            kb = m % nk2
            tc.wait_tmem(full + 8 * slot, (n // STAGES) % 2)
            self.umma_block(
                tmem + COLUMNS * (1 + m // nk2), adesc + slot * (STAGE_BYTES >> 4),
                b2desc + kb * (B_BYTES >> 4), kb > 0, empty + 8 * slot,
            )  # fmt: skip
            cute.arch.sync_warp()
            if kb == nk2 - 1:
                tc.commit_elected(acc2 + 8 * (m // nk2))

    @cute.jit
    def epilogue(
        self, sm, tmem, warp, lane, rank, route, tile, half, first, expert,
        w13_scale: cute.Tensor, w2_scale: cute.Tensor, x: cute.Tensor, rows1: cute.Tensor,
        rows2: cute.Tensor, out: cute.Tensor,
        b_ready, acc1, acc2, pair, gate_recv, hrecv,
    ):  # fmt: skip
        """Warps 2-5: the token's B tiles, then GEMM1's sums (K halves over
        DSMEM, gate to up), the hidden block, and GEMM2's output rows."""
        lay = self.layout
        nk2, blocks1 = lay.nk2, lay.blocks1
        e = (warp - EPILOGUE) * 32 + lane
        quadrant = warp % 4  # TMEM lanes 32 * (warp % 4).. are this warp's
        row = quadrant * 32 + lane
        tl = tmem + (Int32(quadrant * 32) << 16)
        token = Int64(route // lay.top_k)

        # K block kb of the token, FP8 per 128 like per_token_group_quant_fp8,
        # as row (B column) kb of B tile kb, the rest zero; rows are
        # 128B-swizzled (16B chunk c at c ^ (row % 8)). Thread e quantizes 16
        # values.
        kb = e // 8
        chunk = e % 8
        source = x.iterator.toint() + (token * lay.hidden + (first + kb) * TILE + chunk * 16) * 2
        values = cute.make_rmem_tensor(cute.make_layout((16,)), Float32)
        mc.load_bf16x8(source, values, 0)
        mc.load_bf16x8(source + 16, values, 8)
        words, x_scale = mc.quantize_activations(values, 8, self.ue8m0)
        if chunk == 0:
            ptx.st_shared_f32(sm + lay.off_xscale + kb * 4, x_scale)
        zero = Uint32(0)
        for i in cutlass.range_constexpr(blocks1 * B_BYTES // (128 * 16)):
            ptx.st_shared_v4_u32(sm + lay.off_b1 + (i * 128 + e) * 16, zero, zero, zero, zero)
        ptx.bar_sync(1, 128)
        target = sm + lay.off_b1 + kb * B_BYTES + kb * TILE + (chunk ^ (kb % 8)) * 16
        ptx.st_shared_v4_u32(target, words[0], words[1], words[2], words[3])
        ptx.fence_proxy_async_shared()
        cute.arch.sync_warp()
        if lane == 0:
            ptx.mbarrier_arrive(b_ready)

        # GEMM1: scale and sum the 16 K-block columns.
        w_scale = w13_scale.iterator.toint() + ((expert * lay.tiles1 + tile) * lay.nk1 + first) * 4
        scales = cute.make_rmem_tensor(cute.make_layout((COLUMNS,)), Float32)
        for n in cutlass.range_constexpr(COLUMNS):
            scales[n] = ptx.ld_global_nc_f32(w_scale + n * 4) * ptx.ld_shared_f32(
                sm + lay.off_xscale + n * 4
            )
        tc.wait_tmem(acc1, 0)
        sums = tc.load_tmem(tl, COLUMNS)
        acc = Float32(0.0)
        for n in cutlass.range_constexpr(COLUMNS):
            acc = acc + sums[n] * scales[n]
        local = mc.logical_row(rows1.iterator.toint(), tile * TILE + row) - tile * TILE

        ptx.cluster_wait()
        if half == 1:
            self.store_async_dsmem(sm + lay.off_partial + row * 4, ptx.float_bits(acc), pair,
                                   rank - 1)  # fmt: skip
        else:
            ptx.mbarrier_wait_cluster(pair, 0)
            acc = acc + ptx.ld_shared_f32(sm + lay.off_partial + row * 4)
            if tile >= nk2:
                # Gate tile: hand the gate values to the matching up tile.
                self.store_async_dsmem(
                    sm + lay.off_gate + local * 4, ptx.float_bits(acc), gate_recv,
                    2 * (tile - nk2),
                )  # fmt: skip
            else:
                self.hidden_block(sm, acc, local, lane, quadrant, e, tile, gate_recv, hrecv)

        # GEMM2: this CTA's rows, K blocks in B columns 0..nk2-1.
        ptx.mbarrier_wait_cluster(hrecv, 0)
        h_scales = cute.make_rmem_tensor(cute.make_layout((nk2,)), Float32)
        for kb2 in cutlass.range_constexpr(nk2):
            h_scales[kb2] = ptx.ld_shared_f32(sm + lay.off_hscale + kb2 * 4)
        for t in cutlass.range_constexpr(lay.tiles2):
            first_row = rank * lay.rows2 + t * TILE
            w2 = (
                w2_scale.iterator.toint()
                + ((expert * (lay.hidden // TILE) + first_row // TILE) * nk2) * 4
            )
            tc.wait_tmem(acc2 + 8 * t, 0)
            parts = tc.load_tmem(tl + COLUMNS * (1 + t), nk2)
            value = Float32(0.0)
            for kb2 in cutlass.range_constexpr(nk2):
                value = value + parts[kb2] * (ptx.ld_global_nc_f32(w2 + kb2 * 4) * h_scales[kb2])
            logical = mc.logical_row(rows2.iterator.toint(), first_row + row)
            self.store_bf16(
                out.iterator.toint() + (Int64(route) * lay.hidden + Int64(logical)) * 2, value
            )

    @cute.jit
    def hidden_block(self, sm, up, local, lane, quadrant, e, tile, gate_recv, hrecv):
        """Clamped SwiGLU of this up tile, FP8 per 128 (scale amax / 448), sent as
        hidden K block ``tile`` (logical order, row ``tile`` of B tile ``tile``)
        with its scale to every CTA of the cluster."""
        lay = self.layout
        ptx.mbarrier_wait_cluster(gate_recv, 0)
        act = mc.swiglu(ptx.ld_shared_f32(sm + lay.off_gate + local * 4), up, self.limit)
        amax = mc.group_amax(ptx.fmax_abs(Float32(0.0), act), 32)
        if lane == 0:
            ptx.st_shared_f32(sm + lay.off_amax + quadrant * 4, amax)
        ptx.bar_sync(1, 128)
        amax = cute.arch.fmax(
            cute.arch.fmax(ptx.ld_shared_f32(sm + lay.off_amax), ptx.ld_shared_f32(sm + lay.off_amax + 4)),
            cute.arch.fmax(ptx.ld_shared_f32(sm + lay.off_amax + 8), ptx.ld_shared_f32(sm + lay.off_amax + 12)),
        )  # fmt: skip
        scale = mc.hidden_scale(amax)
        ptx.st_shared_u8(sm + lay.off_stage + local, mc.fp8_code(act, scale))
        ptx.bar_sync(1, 128)
        # Thread e sends 16-byte chunk e % 8 to CTA e // 8 (16 CTAs x 8 chunks).
        peer = e // 8
        chunk = e % 8
        words = ptx.ld_shared_v4_u32(sm + lay.off_stage + chunk * 16)
        dst = sm + lay.off_b2 + tile * B_BYTES + tile * TILE + (chunk ^ (tile % 8)) * 16
        self.store_async_dsmem_v4(dst, words, hrecv, peer)
        if chunk == 0:
            self.store_async_dsmem(sm + lay.off_hscale + tile * 4, ptx.float_bits(scale), hrecv,
                                   peer)  # fmt: skip

    # -- helpers the seed calls but does not show ------------------------------------------

    @cute.jit
    def umma_block(self, d, a, b, accumulate, empty):
        """Four K32 FP8 UMMAs of one 128-K block into ``d`` (the first
        accumulates iff ``accumulate``) from the elected lane, then commit the
        weight stage to ``empty``."""
        with cute.arch.elect_one():
            tc.umma_k128(d, a, b, Int32(IDESC), accumulate)
            tc.tcgen05_commit(empty)

    @cute.jit
    def store_async_dsmem(self, local_addr, value, local_bar, peer):
        """``st.async`` of one word to the same shared offset in CTA ``peer``,
        completing 4 bytes on that CTA's barrier at ``local_bar``'s offset."""
        ptx.st_async_b32(ptx.mapa(local_addr, peer), value, ptx.mapa(local_bar, peer))

    @cute.jit
    def store_async_dsmem_v4(self, local_addr, words, local_bar, peer):
        """16-byte ``st.async`` (``local_addr`` 16-byte aligned) to CTA ``peer``."""
        ptx.st_async_v4_b32(
            ptx.mapa(local_addr, peer), words[0], words[1], words[2], words[3],
            ptx.mapa(local_bar, peer),
        )  # fmt: skip

    @cute.jit
    def store_bf16(self, addr, value):
        """One BF16 (round to nearest even) to global ``addr``."""
        ptx.st_global_u16(addr, ptx.cvt_bf16(value))


MegaKernel.kernel.set_name_prefix(ENTRY_PREFIX, remove_cutlass_symbol=True, keep_mangled_name=False)


def fake_arguments(layout: MegaLayout, logits_bf16: bool) -> list:
    """Static-shaped stand-ins of the kernel's parameters (ABI order)."""
    e, h, i, m = layout.experts, layout.hidden, layout.inter, layout.tokens
    shapes = {
        "maps": (Uint8, (len(TENSOR_MAPS) * 128,)),
        "w13_scale": (Float32, (e, 2 * i // TILE, h // TILE)),
        "w2_scale": (Float32, (e, h // TILE, i // TILE)),
        "x": (BFloat16, (m, h)),
        "logits": (BFloat16 if logits_bf16 else Float32, (m, e)),
        "bias": (Float32, (e,)),
        "rows1": (Int32, (2 * i,)),
        "rows2": (Int32, (h,)),
        "out": (BFloat16, (layout.routes, h)),
        "ids": (Int32, (layout.routes,)),
        "weights": (Float32, (layout.routes,)),
    }
    return [make_fake_compact_tensor(*shapes[name], assumed_align=16) for name in PARAMS]


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one mega variant for sm_100a (no GPU needed; the process must
    have been started for sm_100a, see ``kernels.registry``)."""
    if spec.kernel != "mega" or spec.arch != ARCH:
        raise ValueError(f"{__name__} builds mega/{ARCH}, not {spec.kernel}/{spec.arch}")
    layout = layout_of(spec)
    bf16 = spec.logits_dtype == "bfloat16"
    kernel = MegaKernel(layout, scale=spec.scale, limit=spec.limit, ue8m0=spec.ue8m0,
                        logits_bf16=bf16)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="moe-mega-sm100-") as dump:
        compiled = cute.compile(
            kernel, *fake_arguments(layout, bf16), make_fake_stream(),
            options=f"--keep-ptx --keep-cubin --dump-dir={dump}",
        )  # fmt: skip
        cubin, ptx_text = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    if not cubin or not ptx_text:
        raise RuntimeError("the DSL kept no cubin/PTX for the mega kernel")
    entry = entry_from_ptx(ptx_text, ENTRY_PREFIX)
    notes = {
        "stages": STAGES,
        "stage_bytes": STAGE_BYTES,
        "threads": THREADS,
        "cluster_ctas": CLUSTER,
        "non_portable_cluster": CLUSTER > 8,  # needs NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        "min_blocks_per_sm": MIN_BLOCKS,
        "preferred_smem_carveout": SMEM_CARVEOUT,
        "tmem_columns": TMEM_COLUMNS,
        "idesc": f"{IDESC:#010x}",
        "loads_per_cta": layout.loads,
        "smem_layout": {name: [off, size] for name, off, size in layout.regions()},
        "smem_limit": SMEM_LIMIT[ARCH],
        "shape": asdict(layout),
    }
    return CompiledKernel(
        cubin=bytes(cubin),
        entry=entry,
        params=tuple(Param(name, "pointer") for name in PARAMS),
        launch=LaunchShape(
            grid=(CLUSTER * layout.routes, 1, 1),
            block=(THREADS, 1, 1),
            cluster=(CLUSTER, 1, 1),
            smem=layout.smem,
            pdl=True,
        ),
        tensor_maps=TENSOR_MAPS,
        ptx=ptx_text,
        notes=notes,
    )
