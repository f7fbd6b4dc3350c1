"""The mega kernel on Hopper (sm_90a): warpgroup MMA into registers.

Every (token, expert) route of M tokens (M = 1..4), and each token's shared
expert, runs as one cluster of C = 2I/128 x ``split`` CTAs in one launch:
CTA ``rank`` owns GEMM1 row tile ``rank // split`` over K part ``rank %
split`` (``mega_plan.mega_split``: 1, or more where the split grid is still
one wave, 2 for the TP8 shards at M = 1..4;
``kernels/mega_plan.py``: work split, ring depth, cluster order, shared
memory; ``kernels/mega_common.py``: routing, quantization, the hidden block).
A cluster writes one unweighted BF16 row (``out[token * top_k + k]`` or
``shared_out[token]``); rank 0 of a route's cluster writes ``ids`` and
``weights``; and the MoE output ``final[token]`` comes out of the same launch:
the last of a token's clusters to write a CTA rank's slice of columns sums
that slice (``mega_common.finish_slice``: an arrival count per (token, rank)
in the ``arrivals`` workspace, no CTA waiting on another). Without a shared
expert the kernel has the routed-only ABI.

Warp roles (160 threads):
  * warps 0-3, the MMA warpgroup: quantize the CTA's K part of the token
    (``blocks1`` K blocks) into the GEMM1 B tiles, then take the route's
    expert from the producer warp (``PICK_BARRIER``; it indexes the block
    scales), issue GEMM1 and GEMM2 (``wgmma m64n8k32``, FP8, FP32
    accumulators in registers), scale and reduce the accumulators, run the
    DSMEM exchange (K parts' row sums to part 0, gate values to the up tile,
    the hidden broadcast), store the output row, and take the routing
    weights (``WEIGHTS_BARRIER``) for the finalize;
  * warp 4, the producer: a route's warp picks its expert
    (``moe_common.route_pick``: selection stopped at round k; a shared
    cluster needs none and starts before ``griddepcontrol.wait``) and
    leaves it in shared ``pick``; lane 0 issues the loads that wait on no
    free stage (the first ``stages``, TMA: ``mega_plan.gemm1_box``, then
    ``gemm2_box``); then the whole warp waits on the previous grid again,
    on every path (a wait in the route's branch does not order the loads
    after the branches meet: ``moe_common.route_token``), and routes the
    token in full (``mega_common.route_and_record``: lane j's weight of
    route j into shared ``route_weights``; rank 0 of a route's cluster
    records ids and weights); lane 0 then streams the remaining stages,
    the other lanes wait on the cluster barrier. So the first loads wait on
    the pick only, and the MMA warps, after the PDL wait and the token's
    quantization, on the pick, not on the whole routing.

Rings and barriers (arrive counts):
  * ``full[s]``: 1 (the producer's expect_tx) + the TMA bytes of one box;
  * ``empty[s]``: 4, one per MMA warp, after the ``wgmma.wait_group`` that
    retires the MMA reading stage s (one group later than its issue);
  * ``gate_in`` (K part 0 of each up tile): 1 + 512 bytes, the 128 values
    of part 0 of the matching gate tile (``st.async``);
  * ``pair`` (K part 0 of each row tile, only where split > 1): 1 + (split
    - 1) * 512 bytes, each other part's 128 row sums (``st.async`` into
    ``partial``);
  * ``hrecv``: 1 + nk2 * (128 + 4) bytes, every up tile's FP8 hidden block
    and its scale (sent by part 0 of each up tile);
  * the cluster barrier: arrived (relaxed) by every thread after barrier
    init and B-tile zeroing; waited by the MMA warps at entry, before the
    PDL wait, where the plan runs 2 or more CTAs per SM, else just before
    GEMM1 (``mega_plan.MegaPlan.entry_cluster_wait``), by the producer's
    lane 0 before its first wait on a free stage, and by its other lanes
    after the full routing, so every wait on a peer's DSMEM writes comes
    after every peer's barriers exist;
  * named barrier 1: the MMA warpgroup (B-tile refills, the hidden block,
    the finalize's arrival);
  * named barriers 2 (``PICK_BARRIER``) and 3 (``WEIGHTS_BARRIER``), 160
    threads: the producer warp arrives once its pick, then its weights, are
    in shared memory; the MMA warps sync on 2 after quantizing the token,
    on 3 before the finalize;
  * ``arrivals[token, rank]`` (global, u32): one ``atom.release.gpu.add``
    per cluster of the token after its CTA of that rank stored its slice;
    the CTA that reads ``top_k + shared - 1`` acquires, sums and re-zeroes.

GEMM1 (the "column trick"): block scales are not powers of two, so K block
kb's token block is B column kb % 8 of an N = 8 tile (the other columns
zero): each K block's unscaled partial lands in its own accumulator column
(sets of 8 columns), the MMAs of the CTA's K blocks run back to back, and
the epilogue scales and sums the columns once. The B operand is 8 rotating
1 KB tiles: tile b only holds a token block in row b, refilled 4 K blocks at
a time once the MMA that read it has retired. With split > 1, parts 1.. of a
row tile first send their row sums to part 0. Part 0 of gate tile t >= I/128
(rank t * split) hands its 128 gate values to part 0 of up tile t - I/128,
which builds the hidden block and broadcasts it to all C CTAs: two DSMEM
hops, three with a K split. GEMM2: hidden block kb is B column kb.

Measurements (per bucket timings, the cluster-order and ring-depth A/B
runs, what compute-sanitizer's racecheck needed, accuracy on the H200):
``docs/notes/mega-sm90.md``.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import mega_common as mgc
from kernels import mega_plan as mp
from kernels import ptx
from kernels.moe_common import logical_row, route_pick
from kernels.ptx import wgmma
from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param, Workspace
from runtime.constants import TILE

ARCH = "sm_90a"
STAGE_BYTES = mp.STAGE_BYTES
REFILL = 4  # GEMM1 K blocks per B refill (one warp's 32 stores, one barrier)
MMA_THREADS = mgc.GROUP_THREADS  # the MMA warpgroup (warps 0-3)
THREADS = MMA_THREADS + 32  # + the producer warp
PRODUCER_WARP = MMA_THREADS // 32
ENTRY = "moe_mega_sm90"
WG_BARRIER = 1  # named barrier of the MMA warpgroup (0 is __syncthreads)
PICK_BARRIER = 2  # the producer warp's pick is in shared memory (all THREADS)
WEIGHTS_BARRIER = 3  # the producer warp's routing weights are (all THREADS)


class MegaMoeSm90(mgc.MegaEntries):
    """One variant (its ``mega_plan.MegaPlan``) of the Hopper mega kernel:
    host launch and device code."""

    ENTRY = ENTRY

    def __init__(self, spec: KernelSpec):
        self.plan = plan = mp.plan_of(spec)
        if plan.arch != ARCH:
            raise ValueError(f"{__name__} builds mega/{ARCH}, not mega/{plan.arch}")
        self.hidden, self.experts, self.top_k = plan.hidden, plan.experts, plan.top_k
        self.scale, self.limit, self.ue8m0 = spec.scale, spec.limit, spec.ue8m0
        self.logits_bf16 = spec.logits_dtype == "bfloat16"
        self.routing = spec.routing
        self.stages, self.ctas_per_sm, self.cluster = plan.stages, plan.ctas_per_sm, plan.cluster
        self.nk1, self.nk2, self.tiles2, self.rows2 = plan.nk1, plan.nk2, plan.tiles2, plan.rows2

    # -- host ----------------------------------------------------------------------------

    def launch_shape(self) -> LaunchShape:
        return LaunchShape(
            grid=(self.plan.grid, 1, 1), block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1), smem=self.plan.smem, pdl=True,
        )  # fmt: skip

    def launch(self, kernel, stream):
        shape = self.launch_shape()
        kernel.launch(
            grid=shape.grid,
            block=shape.block,
            cluster=shape.cluster,
            smem=shape.smem,
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=self.ctas_per_sm,
            # Only to keep the compile off the GPU (the DSL asks the device for
            # its smem size otherwise); the runtime launches from the manifest.
            preferred_smem_carveout=100,
        )

    # -- device --------------------------------------------------------------------------

    @cute.jit
    def body(self, maps: Int64, w13_scale: Int64, w2_scale: Int64, s13_scale: Int64,
             s2_scale: Int64, x: Int64, logits: Int64, bias: Int64, rows1: Int64, rows2: Int64,
             out: Int64, shared_out: Int64, final: Int64, ids: Int64, weights: Int64,
             arrivals: Int64):  # fmt: skip
        """One cluster = one route or one token's shared expert
        (``mega_common.resolve``); both run the same code from the producer's
        first load on, and end in the finalize (``mega_common.finish_slice``)."""
        plan = self.plan
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(ptx.cluster_ctarank())
        route, token, k, is_shared, map1, map2, scale1, scale2, row = mgc.resolve(
            plan, cta // self.cluster, maps, w13_scale, w2_scale, s13_scale, s2_scale, out,
            shared_out,
        )  # fmt: skip

        base = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint()
        full = base + plan.offset("bar")
        empty = full + 8 * self.stages
        gate_in = full + 16 * self.stages
        hrecv = gate_in + 8
        pair = hrecv + 8  # the other K parts' row sums arrived (part 0; only used where split > 1)

        if tid == 0:
            self.init_barriers(full, empty, gate_in, hrecv, pair, rank)
        if warp == PRODUCER_WARP:
            if lane == 0:
                # No tensor-map proxy fence: the runtime never rewrites a maps
                # buffer (runtime/tensormap.py; the fence cost ~0.5 us a call).
                ptx.prefetch_tensormap(map1)
                ptx.prefetch_tensormap(map2)
        mgc.zero_b_tiles(plan, base + plan.offset("b1"), mp.B1_ROTATING, tid, THREADS, False)
        mgc.zero_b_tiles(plan, base + plan.offset("b2"), self.nk2, tid, THREADS, True)
        ptx.cluster_arrive_relaxed()
        cute.arch.sync_threads()

        # No launch_dependents: with it (at entry or after the last load)
        # M = 1, 2, 4 ran 2.7-5.6 us slower, likely from where the next call's
        # clusters land (docs/notes/mega-sm90.md, "Early launch of the next call").
        dsize = 2 if self.logits_bf16 else 4
        row_logits = logits + Int64(token) * (self.experts * dsize)
        pick = base + plan.offset("pick")
        picked_weights = base + plan.offset("route_weights")
        routed = True  # a route's cluster, not a token's shared expert
        record = rank == 0  # a route's rank 0 stores its ids and weights
        if cutlass.const_expr(plan.shared > 0):
            routed = not is_shared
            record = record & routed
        first = min(self.stages, plan.loads)  # loads that wait on nothing
        if warp == PRODUCER_WARP:
            # A route's first load waits on its expert (selection stopped at
            # round k); a shared route needs no routing and reads only
            # weights: its first stages stream before the previous grid ends.
            expert = Int32(0)
            if routed:
                ptx.griddepcontrol_wait()
                expert = route_pick(row_logits, bias, lane, k, self.experts, self.top_k,
                                    self.logits_bf16, self.routing)  # fmt: skip
            if lane == 0:
                ptx.st_shared_u32(pick, Uint32(expert))
            ptx.bar_arrive(PICK_BARRIER, THREADS)
            if lane == 0:
                self.produce(base, full, empty, map1, map2, expert, rank, 0, first)
            # The whole routing, while those stages stream: every lane's
            # weight for the finalize (a shared cluster's too: whichever of a
            # token's clusters arrives last sums its routes), and rank 0 of a
            # route's cluster records ids and weights. The wait again, on every
            # path (a route's is already satisfied): the logits' weak loads
            # stay after a wait that dominates them (a shared cluster's
            # producer has not waited yet).
            ptx.griddepcontrol_wait()
            _, weight = mgc.route_and_record(plan, row_logits, bias, lane, k, route, ids,
                                             weights, record, self.scale,
                                             self.logits_bf16, self.routing)  # fmt: skip
            if lane < self.top_k:
                ptx.st_shared_f32(picked_weights + lane * 4, weight)
            ptx.bar_arrive(WEIGHTS_BARRIER, THREADS)
            if lane == 0:
                self.produce(base, full, empty, map1, map2, expert, rank, first, plan.loads)
                if cutlass.const_expr(plan.loads <= self.stages):
                    ptx.cluster_wait_divergent()  # no load waited on a free stage
            else:
                ptx.cluster_wait_divergent()  # before any wait on a peer (module docstring)
        else:
            if cutlass.const_expr(plan.entry_cluster_wait):
                ptx.cluster_wait()  # else before GEMM1 ("Cluster waits")
            ptx.griddepcontrol_wait()
            self.consume(
                base, full, empty, gate_in, hrecv, pair, tid, lane, rank, token, pick,
                scale1, scale2, x, rows1, rows2, row,
            )  # fmt: skip
            ptx.bar_sync(WEIGHTS_BARRIER, THREADS)
            weight = ptx.ld_shared_f32(picked_weights + cutlass.min(lane, self.top_k - 1) * 4)
            mgc.finish_slice(plan, base, tid, token, rank, weight, out, shared_out, final,
                             arrivals, WG_BARRIER)  # fmt: skip

    @cute.jit
    def init_barriers(self, full, empty, gate_in, hrecv, pair, rank):
        """One thread: the ring's full/empty barriers, the gate, hidden and
        (K split) pair barriers with their expected bytes."""
        plan = self.plan
        for s in cutlass.range_constexpr(self.stages):
            ptx.mbarrier_init(full + 8 * s, 1)
            ptx.mbarrier_init(empty + 8 * s, MMA_THREADS // 32)
        ptx.mbarrier_init(gate_in, 1)
        ptx.mbarrier_init(hrecv, 1)
        if cutlass.const_expr(plan.split == 1):
            if rank < self.nk2:
                ptx.mbarrier_arrive_expect_tx(gate_in, TILE * 4)
        else:
            ptx.mbarrier_init(pair, 1)
            if rank % plan.split == 0:
                # The other K parts' row sums; an up tile's gate values.
                ptx.mbarrier_arrive_expect_tx(pair, (plan.split - 1) * TILE * 4)
                if rank // plan.split < self.nk2:
                    ptx.mbarrier_arrive_expect_tx(gate_in, TILE * 4)
        # Every up tile's FP8 hidden block and its scale.
        ptx.mbarrier_arrive_expect_tx(hrecv, self.nk2 * (TILE + 4))
        ptx.fence_mbarrier_init()

    @cute.jit
    def produce(self, base, full, empty, map1, map2, expert, rank,
                start: cutlass.Constexpr[int], stop: cutlass.Constexpr[int]):  # fmt: skip
        """TMA producer (one lane): the CTA's loads ``start .. stop - 1`` in
        its stream, the GEMM1 stages (its row tile, its K part's blocks in
        order), then the GEMM2 stages (row tile t, K block kb); the call
        whose range holds load ``stages`` waits on the cluster barrier
        before it, the first wait on a free stage (where no load waits on
        one, ``body`` waits after the last call)."""
        plan, stages = self.plan, self.stages
        policy = ptx.create_policy_evict_first()
        for n in cutlass.range_constexpr(start, stop):
            slot = n % stages
            if cutlass.const_expr(n == stages):
                ptx.cluster_wait_divergent()  # before any wait on the MMA warps
            if cutlass.const_expr(n >= stages):
                # Polling: a try_wait loop here hangs compute-sanitizer's racecheck
                # (docs/notes/mega-sm90.md).
                ptx.mbarrier_wait_polling(empty + 8 * slot, (n // stages - 1) % 2)
            ptx.mbarrier_arrive_expect_tx(full + 8 * slot, STAGE_BYTES)
            dst = base + slot * STAGE_BYTES
            if cutlass.const_expr(n < plan.blocks1):
                first, block = mp.gemm1_box(plan, rank, n, expert)
                ptx.tma_load_3d_hint(dst, map1, full + 8 * slot, 0, first, block, policy)
            else:
                first, block = mp.gemm2_box(plan, rank, n - plan.blocks1, expert, cutlass.min)
                ptx.tma_load_3d_hint(dst, map2, full + 8 * slot, 0, first, block, policy)

    @cute.jit
    def consume(self, base, full, empty, gate_in, hrecv, pair, tid, lane, rank, token, pick,
                w13_scale, w2_scale, x, rows1, rows2, out_row):  # fmt: skip
        """The MMA warpgroup: quantize the token's K part, GEMM1, the DSMEM
        exchange (K parts' row sums to part 0, gate values to the up CTA,
        hidden broadcast), GEMM2 and the output row at ``out_row`` (all
        global operands are byte addresses; the scales are the expert set's,
        indexed by the expert the producer warp leaves at shared ``pick``
        after ``PICK_BARRIER``: 0 for a shared route)."""
        plan = self.plan
        stages, nk1, nk2, tiles2 = self.stages, self.nk1, self.nk2, self.tiles2
        blocks1 = plan.blocks1  # this CTA's GEMM1 K blocks (its K part)
        if cutlass.const_expr(plan.split == 1):
            tile = rank
        else:
            tile = rank // plan.split  # GEMM1 row tile; K part rank % split
            first = (rank % plan.split) * blocks1  # the part's first K block
        b1 = base + plan.offset("b1")
        xscale = base + plan.offset("xscale")
        sets = -(-blocks1 // 8)  # accumulator column sets (the last may be partial)
        quad = lane % 4
        r0 = (tid // 32) * 16 + lane // 4  # fragment row of this thread (and r0 + 8)
        # The one row of 128 this thread owns after the quad reduction.
        row = (quad // 2) * 64 + r0 + (quad % 2) * 8

        # Thread t quantizes 16-value chunk t % 8 of the part's K blocks
        # t // 8 + 16 j (FP8 per 128) and keeps the codes for the B tile
        # refills. Past the part's last K block (blocks1 not a multiple of 16)
        # the 8 lanes of a block quantize the last one again (the amax is a
        # shuffle of all 8) and keep nothing.
        per = -(-blocks1 // 16)
        chunk = tid % 8
        codes = cute.make_rmem_tensor(cute.make_layout((4 * per,)), Uint32)
        x_row = x + Int64(token) * (self.hidden * 2)
        for j in cutlass.range_constexpr(per):
            kb = tid // 8 + 16 * j
            if cutlass.const_expr(blocks1 % 16 == 0):
                kx = kb
            else:
                kx = cutlass.min(kb, blocks1 - 1)
            if cutlass.const_expr(plan.split > 1):
                kx = first + kx
            words, sx = mgc.quantize_chunk(x_row, kx, chunk, self.ue8m0)
            for w in cutlass.range_constexpr(4):
                codes[4 * j + w] = words[w]
            if chunk == 0:
                if cutlass.const_expr(blocks1 % 16 == 0):
                    ptx.st_shared_f32(xscale + kb * 4, sx)
                else:
                    if kb < blocks1:
                        ptx.st_shared_f32(xscale + kb * 4, sx)
        # K blocks 0..7 into B tiles 0..7.
        if tid < 8 * mp.B1_ROTATING:
            self.fill_b1(b1, tid // 8, chunk, codes, 0)
        ptx.bar_sync(PICK_BARRIER, THREADS)
        expert = Int32(ptx.ld_shared_u32(pick))

        # Epilogue inputs, loaded while the first stages stream in. Column c of
        # accumulator set s is K block 8 s + c; this thread holds c = 2q, 2q+1.
        if cutlass.const_expr(plan.split == 1):
            s13 = w13_scale + (Int64(expert) * self.cluster + rank) * nk1 * 4
        else:
            s13 = w13_scale + ((Int64(expert) * plan.tiles1 + tile) * nk1 + first) * 4
        w1s = cute.make_rmem_tensor(cute.make_layout((2 * sets,)), Float32)
        for j in cutlass.range_constexpr(2 * sets):
            col = (j // 2) * 8 + 2 * quad + j % 2  # the part's K block of this column
            if cutlass.const_expr(blocks1 % 8 == 0):
                w1s[j] = ptx.ld_global_nc_f32(s13 + col * 4)
            else:
                w1s[j] = ptx.ld_global_nc_f32(s13 + cutlass.min(col, blocks1 - 1) * 4)
        local = logical_row(rows1, tile * TILE + row) - tile * TILE
        groups = plan.gemm2_groups
        # One group: its GEMM2 inputs load while the first stages stream in.
        if cutlass.const_expr(len(groups) == 1):
            w2s, out_rows = self.gemm2_inputs(w2_scale, rows2, expert, rank, quad, row, 0,
                                              tiles2)  # fmt: skip
        if cutlass.const_expr(not plan.entry_cluster_wait):
            ptx.cluster_wait()  # peers' barriers are initialized; "Cluster waits"
        ptx.fence_proxy_async_shared()
        ptx.bar_sync(WG_BARRIER, MMA_THREADS)

        # GEMM1: K blocks back to back; set kb // 8, column kb % 8.
        zero = Float32(0.0)
        acc1 = [[[zero] * 4 for _ in range(2)] for _ in range(sets)]  # [set][row half]
        for n in cutlass.range_constexpr(blocks1):
            slot = n % stages
            ptx.mbarrier_wait(full + 8 * slot, (n // stages) % 2)
            adesc = wgmma.smem_desc_sw128(base + slot * STAGE_BYTES)
            bdesc = wgmma.smem_desc_sw128(b1 + (n % mp.B1_ROTATING) * plan.b_bytes)
            wgmma.wgmma_fence()
            for h in cutlass.range_constexpr(2):
                for kk in cutlass.range_constexpr(4):
                    acc1[n // 8][h] = wgmma.wgmma_e4m3(
                        acc1[n // 8][h],
                        adesc + (h * 64 * TILE >> 4) + kk * wgmma.DESC_K32,
                        bdesc + kk * wgmma.DESC_K32,
                        not (n % 8 == 0 and kk == 0),
                    )  # fmt: skip
            wgmma.wgmma_commit()
            if cutlass.const_expr(n > 0):
                self.release(empty, (n - 1) % stages, lane, 1)
            if cutlass.const_expr(n % REFILL == 0 and n > 0
                                  and n - REFILL + mp.B1_ROTATING < blocks1):  # fmt: skip
                # MMAs up to n - 1 have retired: their B tiles take K blocks
                # n + 4 .. n + 7 (needed from iteration n + 4 on).
                refill = n - REFILL + mp.B1_ROTATING
                if tid // 8 >= refill % 16:
                    if tid // 8 < refill % 16 + min(REFILL, blocks1 - refill):
                        self.fill_b1(b1, refill + (tid // 8 - refill % 16), chunk, codes,
                                     refill // 16)  # fmt: skip
                ptx.fence_proxy_async_shared()
                ptx.bar_sync(WG_BARRIER, MMA_THREADS)
        self.release(empty, (blocks1 - 1) % stages, lane, 0)
        for s in cutlass.range_constexpr(sets):
            for h in cutlass.range_constexpr(2):
                acc1[s][h] = wgmma.fence_operands(acc1[s][h])

        # Scale and sum the columns of each row; quad lanes share a row.
        for j in cutlass.range_constexpr(2 * sets):
            col = (j // 2) * 8 + 2 * quad + j % 2
            if cutlass.const_expr(blocks1 % 8 == 0):
                w1s[j] = w1s[j] * ptx.ld_shared_f32(xscale + col * 4)
            else:
                # A column past the part's last K block holds zeros: weight it
                # 0 (its scale slot is never written).
                w1s[j] = w1s[j] * ptx.ld_shared_f32(xscale + cutlass.min(col, blocks1 - 1) * 4)
                if col >= blocks1:
                    w1s[j] = Float32(0.0)
        sums = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for h in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(2):
                v = Float32(0.0)
                for s in cutlass.range_constexpr(sets):
                    for c in cutlass.range_constexpr(2):
                        v = v + acc1[s][h][2 * r + c] * w1s[2 * s + c]
                sums[2 * h + r] = v
        acc = _quad_pick(sums, quad)

        part = None
        if cutlass.const_expr(plan.split > 1):
            part = rank % plan.split
        mgc.meet_k_parts(plan, base, acc, row, rank, part, pair,
                         lambda whole: self.gate_or_up(base, whole, local, tid, lane, tile,
                                                       gate_in, hrecv))  # fmt: skip

        # GEMM2: this CTA's rows; hidden block kb is B column kb.
        ptx.mbarrier_wait_cluster(hrecv, 0)
        ptx.fence_proxy_async_shared()
        hs = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
        for c in cutlass.range_constexpr(2):
            col = 2 * quad + c
            hs[c] = ptx.ld_shared_f32(base + plan.offset("hscale") + cutlass.min(col, nk2 - 1) * 4)
            if col >= nk2:
                hs[c] = Float32(0.0)
        for gi in cutlass.range_constexpr(len(groups)):
            g0, gn = groups[gi]
            if cutlass.const_expr(len(groups) > 1):
                w2s, out_rows = self.gemm2_inputs(w2_scale, rows2, expert, rank, quad, row, g0,
                                                  gn)  # fmt: skip
            self.gemm2_group(base, full, empty, lane, quad, rank, hs, w2s, out_rows, out_row,
                             g0, gn)  # fmt: skip

    @cute.jit
    def gate_or_up(self, base, acc, local, tid, lane, tile, gate_in, hrecv):
        """K part 0 of GEMM1 row tile ``tile`` with the tile's whole row sums
        ``acc`` (logical row ``local``): a gate tile hands them to part 0 of
        its up tile; an up tile waits for the gate values and builds hidden
        block ``tile`` (``mega_common.hidden_block``)."""
        plan, nk2 = self.plan, self.nk2
        if tile >= nk2:
            # Gate tile: hand the gate values to the matching up tile.
            if cutlass.const_expr(plan.split == 1):
                peer = tile - nk2
            else:
                peer = (tile - nk2) * plan.split
            ptx.st_async_b32(
                ptx.mapa(base + plan.offset("gate") + local * 4, peer), ptx.float_bits(acc),
                ptx.mapa(gate_in, peer),
            )  # fmt: skip
        else:
            ptx.mbarrier_wait_cluster(gate_in, 0)
            mgc.hidden_block(plan, base, acc, local, tid, lane, tile, hrecv, WG_BARRIER,
                             self.limit)  # fmt: skip

    @cute.jit
    def gemm2_inputs(self, w2_scale, rows2, expert, rank, quad, row,
                     g0: cutlass.Constexpr[int], gn: cutlass.Constexpr[int]):  # fmt: skip
        """The block scales (this thread's two columns) and logical output
        rows of GEMM2 tiles ``g0 .. g0 + gn - 1`` of this CTA
        (``mega_plan.gemm2_tile``)."""
        plan, nk2, tiles2 = self.plan, self.nk2, self.tiles2
        w2s = cute.make_rmem_tensor(cute.make_layout((2 * gn,)), Float32)
        out_rows = cute.make_rmem_tensor(cute.make_layout((gn,)), Int32)
        if cutlass.const_expr(plan.even2):
            s2 = w2_scale + (
                (Int64(expert) * (self.hidden // TILE) + rank * tiles2) * nk2) * 4  # fmt: skip
            for i in cutlass.range_constexpr(gn):
                for c in cutlass.range_constexpr(2):
                    col = cutlass.min(2 * quad + c, nk2 - 1)
                    w2s[2 * i + c] = ptx.ld_global_nc_f32(s2 + ((g0 + i) * nk2 + col) * 4)
            for i in cutlass.range_constexpr(gn):
                out_rows[i] = logical_row(rows2, rank * self.rows2 + (g0 + i) * TILE + row)
        else:
            for i in cutlass.range_constexpr(gn):
                tile = mp.gemm2_tile(plan, rank, g0 + i, cutlass.min)
                s2 = w2_scale + ((Int64(expert) * plan.tiles_out + tile) * nk2) * 4
                for c in cutlass.range_constexpr(2):
                    col = cutlass.min(2 * quad + c, nk2 - 1)
                    w2s[2 * i + c] = ptx.ld_global_nc_f32(s2 + col * 4)
                out_rows[i] = logical_row(rows2, tile * TILE + row)
        return w2s, out_rows

    @cute.jit
    def gemm2_group(self, base, full, empty, lane, quad, rank, hs, w2s, out_rows, out_row,
                    g0: cutlass.Constexpr[int], gn: cutlass.Constexpr[int]):  # fmt: skip
        """GEMM2 tiles ``g0 .. g0 + gn - 1`` of this CTA: their stages' MMAs
        (hidden block kb is B column kb), then, all retired, their rows
        scaled, quad-reduced and stored (a tile past the output's end, of an
        uneven split, is not stored)."""
        plan, stages, nk2 = self.plan, self.stages, self.nk2
        zero = Float32(0.0)
        acc2 = [[[zero] * 4 for _ in range(2)] for _ in range(gn)]  # [tile][half]
        for mm in cutlass.range_constexpr(gn * nk2):
            m = g0 * nk2 + mm
            n = plan.blocks1 + m  # this CTA's stage index
            slot = n % stages
            t, kb2 = mm // nk2, mm % nk2
            ptx.mbarrier_wait(full + 8 * slot, (n // stages) % 2)
            adesc = wgmma.smem_desc_sw128(base + slot * STAGE_BYTES)
            bdesc = wgmma.smem_desc_sw128(base + plan.offset("b2") + kb2 * plan.b_bytes)
            wgmma.wgmma_fence()
            for h in cutlass.range_constexpr(2):
                for kk in cutlass.range_constexpr(4):
                    acc2[t][h] = wgmma.wgmma_e4m3(
                        acc2[t][h],
                        adesc + (h * 64 * TILE >> 4) + kk * wgmma.DESC_K32,
                        bdesc + kk * wgmma.DESC_K32,
                        not (kb2 == 0 and kk == 0),
                    )  # fmt: skip
            wgmma.wgmma_commit()
            if cutlass.const_expr(m > 0):
                self.release(empty, (n - 1) % stages, lane, 1)
        wgmma.wgmma_wait(0)
        for t in cutlass.range_constexpr(gn):
            for h in cutlass.range_constexpr(2):
                acc2[t][h] = wgmma.fence_operands(acc2[t][h])
        # (the last stages need no release: nothing loads after them; a
        # group's last stage is released by the next group's first MMA)

        for t in cutlass.range_constexpr(gn):
            sums2 = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            for h in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    v = Float32(0.0)
                    for c in cutlass.range_constexpr(2):
                        v = v + acc2[t][h][2 * r + c] * (w2s[2 * t + c] * hs[c])
                    sums2[2 * h + r] = v
            value = _quad_pick(sums2, quad)
            if cutlass.const_expr(plan.even2):
                mgc.store_output(out_row, out_rows[t], value)
            else:
                if mp.stores_tile(plan, rank, g0 + t):
                    mgc.store_output(out_row, out_rows[t], value)

    @cute.jit
    def fill_b1(self, b1, kb, chunk, codes, j: cutlass.Constexpr[int]):
        """Writes 16-byte chunk ``chunk`` of the token's K block ``kb`` (codes
        ``4 j .. 4 j + 3`` of this thread) into row kb % 8 of rotating B tile
        kb % 8."""
        b = kb % mp.B1_ROTATING
        mgc.store_b_chunk(self.plan, b1, b, b, chunk, [codes[4 * j + w] for w in range(4)])

    @cute.jit
    def release(self, empty, slot: cutlass.Constexpr[int], lane, pending: cutlass.Constexpr[int]):
        """Waits until at most ``pending`` wgmma groups are in flight, then
        frees weight stage ``slot`` (one arrival per warp)."""
        wgmma.wgmma_wait(pending)
        if lane == 0:
            ptx.mbarrier_arrive(empty + 8 * slot)


@cute.jit
def _quad_pick(sums, quad):
    """Sums each of 4 values over the 4 lanes of a quad and returns value
    ``quad`` (lane q of a quad owns row q of the quad's 4 rows)."""
    for j in cutlass.range_constexpr(4):
        v = sums[j]
        v = v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1)
        v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1)
        sums[j] = v
    mine = sums[0]
    for j in cutlass.range_constexpr(1, 4):
        if quad == j:
            mine = sums[j]
    return mine


# -- build ------------------------------------------------------------------------------------


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one mega variant for sm_90a (no GPU needed); ``CUTE_DSL_ARCH``
    must have been sm_90a when cutlass was first imported. The ABI is
    ``mega_common.PARAMS`` / ``MAPS`` with the shared expert,
    ``ROUTED_PARAMS`` / ``ROUTED_MAPS`` without."""
    if spec.kernel != "mega" or spec.arch != ARCH:
        raise ValueError(f"{__name__} builds mega/{ARCH}, not {spec.kernel}/{spec.arch}")
    if os.environ.get("CUTE_DSL_ARCH") != ARCH:
        raise RuntimeError(f"compile mega/{ARCH} in a process started for {ARCH}")
    kernel = MegaMoeSm90(spec)
    plan = kernel.plan
    entry = kernel if plan.shared else kernel.routed_only
    cubin, ptx_text, name, params, maps = mgc.compile_mega(entry, plan, spec.logits_dtype, ENTRY)
    return CompiledKernel(
        cubin=cubin,
        entry=name,
        params=tuple(Param(p, "pointer") for p in params),
        launch=kernel.launch_shape(),
        tensor_maps=maps,
        workspace=tuple(Workspace(n, b, True) for n, b in mgc.workspace(plan).items()),
        ptx=ptx_text,
        notes=mgc.notes(plan, THREADS),
    )
