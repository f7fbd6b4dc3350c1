"""The mega kernel on Blackwell (sm_100a): UMMA (tcgen05) into TMEM.

Every (token, expert) route of M tokens, and each token's shared expert, runs
as one cluster of 2I/128 x ``split`` CTAs in one launch (``kernels/mega_plan.py``:
CTA ``rank`` owns GEMM1 row tile ``rank // split`` over K part ``rank %
split`` and GEMM2 row tiles ``mega_plan.gemm2_tile``; GLM-5: 16 CTAs, 2 K
parts; ``kernels/mega_common.py``: which cluster is which,
routing, quantization, the hidden block). A cluster writes one unweighted
BF16 row (``out[token * top_k + k]`` or ``shared_out[token]``); rank 0 of a
route's cluster writes ``ids`` and ``weights``. A shared cluster runs the
same code on tensor maps s13/s2 (maps 2 and 3), expert 0 and the shared
scales. The MoE output ``final[token]`` comes out of the same launch: the
last of a token's clusters to write a CTA rank's slice of columns sums it
(``mega_common.finish_slice``, the ``arrivals`` workspace; no CTA waits on
another). Without a shared expert the kernel has the routed-only ABI.

The block scales are not powers of two, so the tensor core cannot apply them:
each of a CTA's ``blocks1`` K blocks puts the token in its own B column (UMMA
N = 16, the other columns zero), TMEM accumulators of 16 columns
(``sets1`` of them) then hold every K block's unscaled partial in its own
column, the UMMAs run back to back as weight stages land, and the epilogue
scales and sums the columns once. TMEM: ``plan.tmem_alloc`` columns a CTA.

Warp roles (192 threads):
  * warp 0 lane 0, the producer: the CTA's weight stages by TMA
    (``mega_plan.gemm1_box``, then ``gemm2_box``) through a ring of 4;
  * warp 1, the MMA warp: one elected lane issues the UMMAs of each landed
    stage (GEMM1 K block n into accumulator column n; GEMM2 row tile t's
    hidden block kb into column 16 (1 + t) + kb) and commits each stage to
    its ``empty`` barrier and the accumulators to ``acc1`` / ``acc2[t]``;
  * warps 2-5, the epilogue: quantize the token into the GEMM1 B tiles, read,
    scale and sum the TMEM accumulators, meet the other K part and the gate
    tile over DSMEM, build the hidden block, and store the output row.
Every warp routes its token from the logits (cheaper than a kernel boundary).

Barriers (arrive counts): ``full[s]`` 1 + one box's bytes; ``empty[s]`` 1 (the
UMMA commit); ``acc1`` and ``acc2[t]`` 1 (commits); ``b_ready`` 4 (one per
epilogue warp, after its B-tile stores and proxy fence); ``pair`` (K part 0)
1 + (split - 1) * 512 bytes, the other parts' row sums; ``gate_recv`` (up tiles) 1 + 512
bytes; ``hrecv`` 1 + nk2 * (128 + 4) bytes, every hidden block and scale.
Waits on barriers completed by peers' ``st.async`` acquire at cluster scope.
The cluster barrier (arrive after barrier init, B2 zeroing and the TMEM
allocation; wait before the first DSMEM store and, for warps 0-1, before
exit) keeps every peer's barriers alive while it is written to. Named
barrier 1: the epilogue warps.

Not run on a Blackwell GPU yet: compiled, with its SASS checked
(tests/test_mega_sm100.py) and its launch built by the runtime
(tests/test_sm100_launch.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from kernels import mega_common as mgc
from kernels import mega_plan as mp
from kernels import moe_common as mc
from kernels import ptx
from kernels.ptx import tcgen05 as tc
from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param, Routing, Workspace
from runtime.constants import TILE

ARCH = "sm_100a"
ENTRY_PREFIX = "moe_mega_sm100"
STAGE_BYTES = mp.STAGE_BYTES
COLUMNS = mp.ARCH[ARCH].b_rows  # K blocks of a GEMM1 K part = UMMA N (one B column each)
THREADS = 192  # producer warp, MMA warp, 4 epilogue warps
EPILOGUE = 2  # first epilogue warp
SMEM_CARVEOUT = 100  # percent of the unified L1/shared memory given to shared
#: UMMA instruction descriptor: E4M3 x E4M3 -> F32, M = 128 weight rows, N = 16.
IDESC = tc.instruction_desc_e4m3(TILE, COLUMNS)
EPILOGUE_BARRIER = 1


class MegaKernel(mgc.MegaEntries):
    """One variant (its ``mega_plan.MegaPlan``) of the Blackwell mega kernel."""

    ENTRY = ENTRY_PREFIX

    def __init__(self, plan: mp.MegaPlan, *, scale: float, limit: float | None, ue8m0: bool,
                 logits_bf16: bool, routing: Routing):  # fmt: skip
        self.plan = plan
        self.scale, self.limit, self.ue8m0 = scale, limit, ue8m0
        self.logits_bf16, self.routing = logits_bf16, routing

    def launch_shape(self) -> LaunchShape:
        plan = self.plan
        return LaunchShape(grid=(plan.grid, 1, 1), block=(THREADS, 1, 1),
                           cluster=(plan.cluster, 1, 1), smem=plan.smem, pdl=True)  # fmt: skip

    def launch(self, kernel, stream):
        shape = self.launch_shape()
        kernel.launch(
            grid=shape.grid, block=shape.block, cluster=shape.cluster, smem=shape.smem,
            stream=stream, use_pdl=True, min_blocks_per_mp=self.plan.ctas_per_sm,
            # Both CTAs of an SM need the full shared-memory carveout. Given
            # here, the DSL also stops asking a (missing) device for its size.
            preferred_smem_carveout=SMEM_CARVEOUT,
        )  # fmt: skip

    @cute.jit
    def body(self, maps: Int64, w13_scale: Int64, w2_scale: Int64, s13_scale: Int64,
             s2_scale: Int64, x: Int64, logits: Int64, bias: Int64, rows1: Int64, rows2: Int64,
             out: Int64, shared_out: Int64, final: Int64, ids: Int64, weights: Int64,
             arrivals: Int64):  # fmt: skip
        plan = self.plan
        tiles2, nk2 = plan.tiles2, plan.nk2
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(ptx.cluster_ctarank())
        route, token, k, is_shared, map1, map2, scale1, scale2, row = mgc.resolve(
            plan, cta // plan.cluster, maps, w13_scale, w2_scale, s13_scale, s2_scale, out,
            shared_out,
        )  # fmt: skip
        tile = rank // plan.split
        half = rank % plan.split

        storage = cutlass.memory.SmemAllocator().allocate_tensor(
            cutlass.Uint8, cute.make_layout(plan.smem), byte_alignment=1024
        )
        sm = storage.iterator.toint()
        full = sm + plan.offset("bar")
        empty = full + 8 * plan.stages
        gate_recv = full + 16 * plan.stages  # the gate tile's values arrived (up tiles)
        hrecv = gate_recv + 8  # every hidden block and its scale arrived
        acc1 = hrecv + 8
        b_ready = acc1 + 8
        acc2 = b_ready + 8
        pair = acc2 + 8 * tiles2  # the other K parts' sums arrived (part 0)

        if tid == 0:
            for s in cutlass.range_constexpr(plan.stages):
                ptx.mbarrier_init(full + 8 * s, 1)
                ptx.mbarrier_init(empty + 8 * s, 1)
            for b in (gate_recv, hrecv, acc1, pair):
                ptx.mbarrier_init(b, 1)
            ptx.mbarrier_init(b_ready, 4)
            for t in cutlass.range_constexpr(tiles2):
                ptx.mbarrier_init(acc2 + 8 * t, 1)
            if half == 0:
                if cutlass.const_expr(plan.split > 1):
                    # The other K parts' row sums.
                    ptx.mbarrier_arrive_expect_tx(pair, (plan.split - 1) * TILE * 4)
                if tile < nk2:
                    ptx.mbarrier_arrive_expect_tx(gate_recv, TILE * 4)
            # Every up tile's FP8 hidden block and its scale.
            ptx.mbarrier_arrive_expect_tx(hrecv, nk2 * (TILE + 4))
            ptx.fence_mbarrier_init()
            ptx.tensormap_fence_acquire(map1)
            ptx.tensormap_fence_acquire(map2)
        if warp == 1:
            tc.tcgen05_alloc(sm + plan.offset("tmem"), plan.tmem_alloc)
            tc.tcgen05_relinquish_alloc_permit()
        # GEMM2's B tiles get remote hidden rows: zero them before the cluster
        # barrier releases any sender.
        mgc.zero_b_tiles(plan, sm + plan.offset("b2"), nk2, tid, THREADS, False)
        ptx.fence_proxy_async_shared()
        ptx.cluster_arrive()
        tc.tcgen05_fence_before_thread_sync()
        cute.arch.sync_threads()
        tc.tcgen05_fence_after_thread_sync()
        tmem = Int32(ptx.ld_shared_u32(sm + plan.offset("tmem")))

        # No launch_dependents, as on sm_90a (docs/notes/mega-sm90.md, "Early
        # launch of the next call").
        ptx.griddepcontrol_wait()
        expert = Int32(0)
        weight = Float32(0.0)
        dsize = 2 if self.logits_bf16 else 4
        row_logits = logits + Int64(token) * (plan.experts * dsize)
        record = (rank == 0) & (warp == 0)
        # A shared cluster routes too (no record): the finalize needs the
        # token's weights in whichever cluster arrives last.
        if cutlass.const_expr(plan.shared > 0):
            if is_shared:
                _, weight = mgc.route_and_record(plan, row_logits, bias, lane, k, route, ids,
                                                 weights, False, self.scale,
                                                 self.logits_bf16, self.routing)  # fmt: skip
            else:
                expert, weight = mgc.route_and_record(plan, row_logits, bias, lane, k, route, ids,
                                                      weights, record, self.scale,
                                                      self.logits_bf16, self.routing)  # fmt: skip
        else:
            expert, weight = mgc.route_and_record(plan, row_logits, bias, lane, k, route, ids,
                                                  weights, record, self.scale,
                                                  self.logits_bf16, self.routing)  # fmt: skip

        if warp == 0:
            if lane == 0:
                self.produce(sm, map1, map2, full, empty, rank, expert)
        elif warp == 1:
            self.issue(sm, tmem, full, empty, acc1, b_ready, acc2, hrecv)
        else:
            self.epilogue(
                sm, tmem, warp, lane, rank, token, tile, half, expert, scale1, scale2, x,
                rows1, rows2, row, b_ready, acc1, acc2, pair, gate_recv, hrecv,
            )  # fmt: skip
            mgc.finish_slice(plan, sm, (warp - EPILOGUE) * 32 + lane, token, rank, weight, out,
                             shared_out, final, arrivals, EPILOGUE_BARRIER)  # fmt: skip
        if warp < EPILOGUE:
            ptx.cluster_wait()
        tc.release_tmem(tmem, plan.tmem_alloc, warp, 1)

    @cute.jit
    def produce(self, sm, map1, map2, full, empty, rank, expert):
        """Warp 0 lane 0: the CTA's GEMM1 K part of its row tile, then its
        GEMM2 row tiles' hidden blocks, one TMA box a stage through the ring."""
        plan = self.plan
        stages = plan.stages
        for n in cutlass.range(plan.loads, unroll=1):
            slot = n % stages
            if n >= stages:
                ptx.mbarrier_wait(empty + 8 * slot, ((n // stages) - 1) % 2)
            ptx.mbarrier_arrive_expect_tx(full + 8 * slot, STAGE_BYTES)
            dst = sm + slot * STAGE_BYTES
            if n < plan.blocks1:
                first, block = mp.gemm1_box(plan, rank, n, expert)
                ptx.tma_load_3d(dst, map1, full + 8 * slot, 0, first, Int32(block))
            else:
                first, block = mp.gemm2_box(plan, rank, n - plan.blocks1, expert, cutlass.min)
                ptx.tma_load_3d(dst, map2, full + 8 * slot, 0, first, Int32(block))

    @cute.jit
    def issue(self, sm, tmem, full, empty, acc1, b_ready, acc2, hrecv):
        """Warp 1: the UMMAs of every stage as it lands (GEMM1 K block n into
        column n % COLUMNS of accumulator n // COLUMNS; GEMM2 row tile t's K
        block kb into column ``COLUMNS * (sets1 + t) + kb``), each stage
        committed to its empty barrier, the accumulators to ``acc1`` /
        ``acc2[t]``."""
        plan = self.plan
        nk2, stages = plan.nk2, plan.stages
        adesc = tc.smem_desc_sw128(sm)
        b1desc = tc.smem_desc_sw128(sm + plan.offset("b1"))
        b2desc = tc.smem_desc_sw128(sm + plan.offset("b2"))
        ptx.mbarrier_wait(b_ready, 0)
        for n in cutlass.range(plan.blocks1, unroll=1):
            slot = n % stages
            tc.wait_tmem(full + 8 * slot, (n // stages) % 2)
            self.umma_block(
                tmem + COLUMNS * (n // COLUMNS), adesc + slot * (STAGE_BYTES >> 4),
                b1desc + n * (plan.b_bytes >> 4), n % COLUMNS > 0, empty + 8 * slot,
            )  # fmt: skip
            cute.arch.sync_warp()
        tc.commit_elected(acc1)
        ptx.mbarrier_wait_cluster(hrecv, 0)
        ptx.fence_proxy_async_shared()
        for m in cutlass.range(plan.tiles2 * nk2, unroll=1):
            n = plan.blocks1 + m
            slot = n % stages
            kb = m % nk2
            tc.wait_tmem(full + 8 * slot, (n // stages) % 2)
            self.umma_block(
                tmem + COLUMNS * (plan.sets1 + m // nk2), adesc + slot * (STAGE_BYTES >> 4),
                b2desc + kb * (plan.b_bytes >> 4), kb > 0, empty + 8 * slot,
            )  # fmt: skip
            cute.arch.sync_warp()
            if kb == nk2 - 1:
                tc.commit_elected(acc2 + 8 * (m // nk2))

    @cute.jit
    def epilogue(self, sm, tmem, warp, lane, rank, token, tile, half, expert, w13_scale: Int64,
                 w2_scale: Int64, x: Int64, rows1: Int64, rows2: Int64, out_row: Int64,
                 b_ready, acc1, acc2, pair, gate_recv, hrecv):  # fmt: skip
        """Warps 2-5: the token's B tiles, then GEMM1's sums (K parts over
        DSMEM, gate to up), the hidden block, and GEMM2's output row at
        ``out_row`` (the scales are the expert set's: ``expert`` indexes them)."""
        plan = self.plan
        nk2, blocks1 = plan.nk2, plan.blocks1
        first = half * blocks1
        e = (warp - EPILOGUE) * 32 + lane
        quadrant = warp % 4  # TMEM lanes 32 * (warp % 4).. are this warp's
        row = quadrant * 32 + lane
        tl = tmem + (Int32(quadrant * 32) << 16)

        # K block kb of the token's K part, FP8 per 128, as row (B column)
        # kb % COLUMNS of B tile kb, the rest zero. Thread e quantizes 16
        # values of K blocks e // 8 + 16 j; past the part's last block (blocks1
        # not a multiple of 16) the 8 lanes of a block quantize the last one
        # again (the amax is a shuffle of all 8) and keep nothing.
        passes = -(-blocks1 // 16)
        chunk = e % 8
        x_row = x + Int64(token) * (plan.hidden * 2)
        codes = cute.make_rmem_tensor(cute.make_layout((4 * passes,)), cutlass.Uint32)
        for j in cutlass.range_constexpr(passes):
            kb = e // 8 + 16 * j
            words, x_scale = mgc.quantize_chunk(x_row, first + cutlass.min(kb, blocks1 - 1),
                                                chunk, self.ue8m0)  # fmt: skip
            for w in cutlass.range_constexpr(4):
                codes[4 * j + w] = words[w]
            if chunk == 0:
                if kb < blocks1:
                    ptx.st_shared_f32(sm + plan.offset("xscale") + kb * 4, x_scale)
        b1 = sm + plan.offset("b1")
        mgc.zero_b_tiles(plan, b1, blocks1, e, mgc.GROUP_THREADS, False)
        ptx.bar_sync(EPILOGUE_BARRIER, mgc.GROUP_THREADS)
        for j in cutlass.range_constexpr(passes):
            kb = e // 8 + 16 * j
            if kb < blocks1:
                mgc.store_b_chunk(plan, b1, kb, kb % COLUMNS, chunk,
                                  [codes[4 * j + w] for w in range(4)])  # fmt: skip
        ptx.fence_proxy_async_shared()
        cute.arch.sync_warp()
        if lane == 0:
            ptx.mbarrier_arrive(b_ready)

        # GEMM1: scale and sum the K-block columns (accumulator s holds K
        # blocks 16 s .. 16 s + 15 of the part).
        w_scale = w13_scale + ((Int64(expert) * plan.tiles1 + tile) * plan.nk1 + first) * 4
        acc = Float32(0.0)
        for s in cutlass.range_constexpr(plan.sets1):
            cols = min(COLUMNS, blocks1 - COLUMNS * s)
            scales = cute.make_rmem_tensor(cute.make_layout((cols,)), Float32)
            for c in cutlass.range_constexpr(cols):
                n = COLUMNS * s + c
                scales[c] = ptx.ld_global_nc_f32(w_scale + n * 4) * ptx.ld_shared_f32(
                    sm + plan.offset("xscale") + n * 4
                )
            if cutlass.const_expr(s == 0):
                tc.wait_tmem(acc1, 0)
            sums = tc.load_tmem(tl + COLUMNS * s, COLUMNS)
            for c in cutlass.range_constexpr(cols):
                acc = acc + sums[c] * scales[c]
        local = mc.logical_row(rows1, tile * TILE + row) - tile * TILE

        ptx.cluster_wait()
        mgc.meet_k_parts(plan, sm, acc, row, rank, half, pair,
                         lambda whole: self.gate_or_up(sm, whole, local, e, lane, tile,
                                                       gate_recv, hrecv))  # fmt: skip

        # GEMM2: this CTA's rows, hidden blocks in B columns 0..nk2-1.
        ptx.mbarrier_wait_cluster(hrecv, 0)
        h_scales = cute.make_rmem_tensor(cute.make_layout((nk2,)), Float32)
        for kb2 in cutlass.range_constexpr(nk2):
            h_scales[kb2] = ptx.ld_shared_f32(sm + plan.offset("hscale") + kb2 * 4)
        # TMEM loads come in powers of two: the columns past nk2 hold zeros.
        width = 1 << (nk2 - 1).bit_length()
        for t in cutlass.range_constexpr(plan.tiles2):
            first_row = mp.gemm2_tile(plan, rank, t, cutlass.min) * TILE
            w2 = w2_scale + ((Int64(expert) * plan.tiles_out + first_row // TILE) * nk2) * 4
            tc.wait_tmem(acc2 + 8 * t, 0)
            parts = tc.load_tmem(tl + COLUMNS * (plan.sets1 + t), width)
            value = Float32(0.0)
            for kb2 in cutlass.range_constexpr(nk2):
                value = value + parts[kb2] * (ptx.ld_global_nc_f32(w2 + kb2 * 4) * h_scales[kb2])
            if cutlass.const_expr(plan.even2):
                mgc.store_output(out_row, mc.logical_row(rows2, first_row + row), value)
            else:
                if mp.stores_tile(plan, rank, t):
                    mgc.store_output(out_row, mc.logical_row(rows2, first_row + row), value)

    @cute.jit
    def gate_or_up(self, sm, acc, local, e, lane, tile, gate_recv, hrecv):
        """Part 0 of row tile ``tile`` with its whole sums ``acc``: a gate
        tile hands them to its up tile; an up tile waits for the gate values
        and builds the hidden block (``mega_common.hidden_block``)."""
        plan, nk2 = self.plan, self.plan.nk2
        if tile >= nk2:
            # Gate tile: hand the gate values to the matching up tile.
            mgc.send_word(sm + plan.offset("gate") + local * 4, ptx.float_bits(acc), gate_recv,
                          plan.split * (tile - nk2))  # fmt: skip
        else:
            ptx.mbarrier_wait_cluster(gate_recv, 0)
            mgc.hidden_block(plan, sm, acc, local, e, lane, tile, hrecv, EPILOGUE_BARRIER,
                             self.limit)  # fmt: skip

    @cute.jit
    def umma_block(self, d, a, b, accumulate, empty):
        """Four K32 FP8 UMMAs of one 128-K block into ``d`` (the first
        accumulates iff ``accumulate``) from the elected lane, then commit the
        weight stage to ``empty``."""
        with cute.arch.elect_one():
            tc.umma_k128(d, a, b, Int32(IDESC), accumulate)
            tc.tcgen05_commit(empty)


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one mega variant for sm_100a (no GPU needed; the process must
    have been started for sm_100a, see ``kernels.registry``)."""
    if spec.kernel != "mega" or spec.arch != ARCH:
        raise ValueError(f"{__name__} builds mega/{ARCH}, not {spec.kernel}/{spec.arch}")
    plan = mp.plan_of(spec)
    kernel = MegaKernel(plan, scale=spec.scale, limit=spec.limit, ue8m0=spec.ue8m0,
                        logits_bf16=spec.logits_dtype == "bfloat16",
                        routing=spec.routing)  # fmt: skip
    entry = kernel if plan.shared else kernel.routed_only
    cubin, ptx_text, name, params, maps = mgc.compile_mega(
        entry, plan, spec.logits_dtype, ENTRY_PREFIX
    )
    notes = mgc.notes(
        plan, THREADS,
        non_portable_cluster=plan.cluster > 8,  # needs NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        preferred_smem_carveout=SMEM_CARVEOUT, tmem_columns=plan.tmem_alloc, idesc=f"{IDESC:#010x}",
    )  # fmt: skip
    return CompiledKernel(
        cubin=cubin, entry=name, params=tuple(Param(p, "pointer") for p in params),
        launch=kernel.launch_shape(), tensor_maps=maps,
        workspace=tuple(Workspace(n, b, True) for n, b in mgc.workspace(plan).items()),
        ptx=ptx_text, notes=notes,
    )  # fmt: skip
