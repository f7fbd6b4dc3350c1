"""Grouped MoE kernel for sm_100a (B200/GB200): routed experts plus the
shared expert of 8-512 decode tokens in one persistent kernel, one CTA per SM,
with tcgen05 MMA and TMEM accumulators.

The plan (``grouped_plan``), the phases of a call and the rings shared with
sm_90a (``grouped_common``'s docstring: shared-memory map, full / posted
rings, counters, what each phase waits on) are the same on both
architectures; this module is Blackwell's MMA and its epilogue.

Warp roles (256 threads):

* at the start of a call (``grouped_common.start_call``): warp 0 routes
  token ``cta`` and warps 4-7 quantize it (CTAs below M); with
  ``plan.local_routing`` warps 4-7 of CTA c < M quantize token c first and
  warp w < M of every CTA routes token w;
* warp 0: lane 0 is the weight producer (``produce``);
* warp 1: allocates all ``TMEM_COLUMNS`` of TMEM (its address in the
  ``tmem`` region) and issues the UMMAs (``issue``);
* warps 2-3: the B-tile gatherers (``gather``: stages g, g + 2, ...; with
  local routing they first wait for every token, ``await_tokens``);
* warps 4-7: the epilogue (``epilogue``): thread e owns TMEM lane (weight
  row) e of every slot (warp % 4 is its lane quadrant).

Rings: full[stages] (``grouped_common.FULL_ARRIVALS`` arrivals and the
weights' transaction bytes), posted[posts] (1), empty[stages] with 1 arrival
(the UMMA commit of the stage), and ``grouped_plan.accumulator_slots``
accumulator slots of ``grouped_plan.tmem_stage_columns`` TMEM columns: acc_full[slots] with 1 arrival (the UMMA commit of
the slot; on END, lane 0 of warp 1) and acc_empty[slots] with 4 (lane 0 of
each epilogue warp, once its warp's TMEM loads are fenced).

The MMA warp, stage n: waits full[n % stages] (parity (n // stages) % 2),
reads the stage word, and for n >= slots waits acc_empty[n % slots] (parity
(n // slots - 1) % 2); then ``fence.proxy.async`` (the B rows are cp.async
writes), one elected lane issues the stage's ``depth`` K blocks, each a K = 128 FP8 UMMA
(M = 128 weight rows, N = the plan's ``group`` tokens) into columns ``d * group`` of the
slot, and commits the weight stage to empty[n % stages] and the slot to
acc_full[n % slots]. So the MMA runs up to ``slots`` stages ahead of the
epilogue, which is why the scale ring and the stage words outlive the
weight stage by ``slots`` stages.

The epilogue, stage n: waits acc_full[n % slots] (parity (n // slots) % 2),
reads the stage word, loads the slot's 32 columns, scales each K block's
column by the ring's column scale and sums into the up or gate (FC1) or
output (FC2) values of the current piece, fences and arrives on
acc_empty; a closing stage ends an FC1 pair piece (``close_pair``) or an
FC2 job (``store_rows``).

Measurements behind the choices: docs/notes/grouped-sm100.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from kernels import grouped_plan as gp
from kernels import moe_common as mc
from kernels import ptx
from kernels.grouped_common import PARAMS as PARAMS
from kernels.grouped_common import TENSOR_MAPS as TENSOR_MAPS
from kernels.grouped_common import (
    THREADS,
    GroupedCommon,
    RowFragment,
    Tables,
    check_spec,
    compile_grouped,
    unpack,
)
from kernels.grouped_common import workspaces as workspaces
from kernels.ptx import tcgen05 as tc
from kernels.spec import CompiledKernel, KernelSpec
from runtime.constants import TILE

ARCH = "sm_100a"
ENTRY_PREFIX = "moe_grouped_sm100"

GATHERERS = gp.GATHERERS[ARCH]  # B-tile gatherer warps (2, 3)
EPILOGUE = 4  # first epilogue warp (4..7; warp % 4 = its TMEM lane quadrant)
MMA_WARP = 1
#: All 512 TMEM columns: one CTA per SM, so no other CTA waits for them.
TMEM_COLUMNS = gp.TMEM_COLUMNS


def idesc_of(plan: gp.GroupedPlan) -> int:
    """UMMA instruction descriptor: E4M3 x E4M3 -> F32, M = 128 weight rows, N
    = the plan's ``group`` tokens."""
    return tc.instruction_desc_e4m3(TILE, plan.group)


class GroupedKernel(GroupedCommon):
    """BF16 [M * top_k, H] routed outputs (one row per route), int32 ids, FP32
    routing weights and the shared expert's BF16 [M, H]; with ``finalize``
    also the BF16 [M, H] MoE output."""

    GATHERERS = GATHERERS
    EPILOGUE_WARP = EPILOGUE
    ENTRY = ENTRY_PREFIX

    def __init__(self, spec: KernelSpec):
        plan = gp.GroupedPlan.from_spec(spec)
        super().__init__(spec, gp.arch_layout(plan, ARCH))
        self.columns = gp.tmem_stage_columns(plan)
        self.slots = self.layout.slots

    def launch(self, kernel, stream):
        kernel.launch(
            grid=(self.grid, 1, 1),
            block=(THREADS, 1, 1),
            smem=self.layout.total,
            stream=stream,
            use_pdl=True,
        )  # fmt: skip

    @cute.jit
    def body(
        self, maps, w13_scale, w2_scale, s13_scale, s2_scale, s13, s2, x, logits, bias, rows,
        out, shared_out, final, ids, weights, plan_x, plan_s, hidden, hscale, partial, counters,
        valid,
    ):  # fmt: skip
        """The kernel: every parameter a ``cute.Tensor`` but the shared
        expert's (``s13_scale``, ``s2_scale``, ``s13``, ``s2``, ``shared_out``),
        addresses (``Int64``; 0 in a variant without it, never read), and
        ``valid`` (``Int32``: the rows of x and logits, ``start_call``)."""
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate_tensor(
            Uint8, cute.make_layout(self.layout.total), byte_alignment=1024
        )
        t = Tables(storage.iterator.toint(), self.layout, self.plan,
                   self.stamp_base(partial.iterator.toint(), cta))  # fmt: skip
        tmem_at = t.base + self.layout.off_tmem
        maps_at = maps.iterator.toint()
        w13s, w2s = w13_scale.iterator.toint(), w2_scale.iterator.toint()
        s13s, s2s = s13_scale, s2_scale
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("entry"))

        if tid == 0:
            # Empty stages are released by one UMMA commit each.
            self.init_barriers(t, 1)
            for m in cutlass.range_constexpr(len(self.maps)):
                ptx.tensormap_fence_acquire(maps_at + 128 * m)
        if cutlass.const_expr(self.shared_experts):
            if tid == 64:
                # The shared expert's weights do not depend on the routing: pull
                # this CTA's slice into L2 while the router runs.
                self.prefetch_static(s13, s2, w13s, w2s, cta, 0)
        if tid == 96:
            # And the routed experts' block scales, which the B gatherers load
            # on their critical path.
            self.prefetch_static(s13, s2, w13s, w2s, cta, 1)
        if warp == MMA_WARP:
            tc.tcgen05_alloc(tmem_at, TMEM_COLUMNS)
            tc.tcgen05_relinquish_alloc_permit()
        tc.tcgen05_fence_before_thread_sync()
        cute.arch.sync_threads()
        tc.tcgen05_fence_after_thread_sync()
        tmem = Int32(ptx.ld_shared_u32(tmem_at))

        # No launch_dependents here (sm_90a issues it at entry): its effect
        # was measured on the H200 only (docs/notes/grouped-sm90.md).
        ptx.griddepcontrol_wait()
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("pdl_wait"))
        mine = self.start_call(
            t, counters.iterator.toint(), logits.iterator.toint(), bias.iterator.toint(),
            ids.iterator.toint(), weights.iterator.toint(), x.iterator.toint(),
            plan_x.iterator.toint(), plan_s.iterator.toint(), cta, tid, warp, lane, valid,
        )  # fmt: skip
        self.number_units(t, ids.iterator.toint(), tid, warp, lane, cta)
        unit_ready = mine + self.counters.unit_ready * 4
        jobs = mine + self.counters.jobs * 4  # next FC2 job of halves A and B

        if warp == 0:
            if lane == 0:
                self.produce(t, maps_at, jobs)
        elif warp == MMA_WARP:
            self.issue(t, tmem, lane)
        elif warp < EPILOGUE:
            self.await_tokens(t, mine, lane, warp - (MMA_WARP + 1))
            self.gather(
                t, plan_x.iterator.toint(), plan_s.iterator.toint(), hidden.iterator.toint(),
                hscale.iterator.toint(), unit_ready, lane, w13s, w2s, s13s, s2s,
                warp - (MMA_WARP + 1),
            )  # fmt: skip
        else:
            self.epilogue(
                t, tmem, warp, lane, cta, tid - EPILOGUE * 32, rows.iterator.toint(),
                out.iterator.toint(), shared_out, hidden.iterator.toint(),
                hscale.iterator.toint(), partial.iterator.toint(), mine,
            )  # fmt: skip
        tc.release_tmem(tmem, TMEM_COLUMNS, warp, MMA_WARP)
        self.end_call(
            t, counters.iterator.toint(), mine, out.iterator.toint(), shared_out,
            final.iterator.toint(), weights.iterator.toint(), cta, tid, valid,
        )  # fmt: skip
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("exit"))

    @cute.jit
    def issue(self, t: Tables, tmem: Int32, lane: Int32):
        """Warp 1: stage n's ``depth`` K blocks into accumulator slot n % slots
        (K block d in columns ``d * group`` of the slot, each overwritten by
        its first UMMA), the weight stage committed to its empty barrier and
        the slot to ``acc_full``; END is passed on to the epilogue."""
        lay = self.layout
        w = self.group
        idesc = idesc_of(self.plan)
        adesc = tc.smem_desc_sw128(t.weights)
        bdesc = tc.smem_desc_sw128(t.tokens)
        n = Int32(0)
        word = Uint32(0)
        while word != Uint32(gp.END):
            slot = n % self.stages
            acc = n % self.slots
            tc.wait_tmem(t.full(slot), (n // self.stages) % 2)
            word = Uint32(t.desc[n % self.posts])
            if n >= self.slots:
                tc.wait_tmem(t.acc_empty(acc), ((n // self.slots) - 1) % 2)
            if word == Uint32(gp.END):
                if lane == 0:
                    ptx.mbarrier_arrive(t.acc_full(acc))
            else:
                # The gathered B rows are generic-proxy writes.
                ptx.fence_proxy_async_shared()
                for d in cutlass.range_constexpr(self.depth):
                    a_off = slot * lay.a_bytes + d * gp.STAGE_BYTES
                    b_off = slot * lay.b_bytes + d * w * TILE
                    with cute.arch.elect_one():
                        tc.umma_k128(
                            tmem + acc * self.columns + d * w, adesc + Int64(a_off >> 4),
                            bdesc + Int64(b_off >> 4), Int32(idesc), Int32(0),
                        )  # fmt: skip
                tc.commit_elected(t.empty(slot))
                cute.arch.sync_warp()
                tc.commit_elected(t.acc_full(acc))
            n = n + 1

    @cute.jit
    def epilogue(
        self, t: Tables, tmem: Int32, warp: Int32, lane: Int32, cta: Int32, e: Int32,
        rows: Int64, out: Int64, shared_out: Int64, hidden: Int64, hscale: Int64,
        partial: Int64, mine: Int64,
    ):  # fmt: skip
        """Warps 4-7: thread e owns TMEM lane (weight row) e of every slot, so
        every token of the unit (``RowFragment``). Each stage's 32 columns are
        scaled by the ring's column scales and summed into the up or gate
        accumulators of the current piece; a piece's last stage closes an FC1
        pair or stores an FC2 job's rows."""
        w = self.group
        quadrant = warp % 4
        logical = mc.logical_row(rows, e)  # this thread's output row of every row tile
        frag = RowFragment(e, logical, w)
        lanes = tmem + (Int32(quadrant * 32) << 16)
        up = cute.make_rmem_tensor(cute.make_layout((w,)), Float32)
        gate = cute.make_rmem_tensor(cute.make_layout((w,)), Float32)
        for j in cutlass.range_constexpr(w):
            up[j] = Float32(0.0)
            gate[j] = Float32(0.0)
        start = Int32(0)  # first FC1 stage of the current piece
        n = Int32(0)
        word = Uint32(0)
        while word != Uint32(gp.END):
            acc = n % self.slots
            tc.wait_tmem(t.acc_full(acc), (n // self.slots) % 2)
            word = Uint32(t.desc[n % self.posts])
            if word != Uint32(gp.END):
                fc2, half, unit, tile, _, opens, closes = unpack(word)
                count = t.ucnt[unit]
                # FC1 gate row tiles (pairs..2 * pairs - 1) sum into ``gate``; FC1 up
                # tiles and every FC2 stage (its tile an output row tile) into ``up``.
                into_gate = not fc2 and tile >= self.pairs
                if opens:
                    start = n
                    for j in cutlass.range_constexpr(w):
                        up[j] = Float32(0.0)
                        gate[j] = Float32(0.0)
                parts = tc.load_tmem(lanes + acc * self.columns, self.columns)
                if into_gate:
                    for c in cutlass.range_constexpr(self.columns):
                        gate[c % w] = gate[c % w] + parts[c] * self.ring_scale(t, n, c // w, c % w)
                else:
                    for c in cutlass.range_constexpr(self.columns):
                        up[c % w] = up[c % w] + parts[c] * self.ring_scale(t, n, c // w, c % w)
                tc.tcgen05_fence_before_thread_sync()
                cute.arch.sync_warp()
                if lane == 0:
                    ptx.mbarrier_arrive(t.acc_empty(acc))
                if closes:
                    if fc2:
                        self.store_rows(t, frag, up, unit, tile, count, out, shared_out)
                    else:
                        self.close_pair(
                            t, frag, up, gate, n, start, count, unit, half, cta, e, hidden,
                            hscale, partial, mine,
                        )  # fmt: skip
            n = n + 1


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one grouped variant for sm_100a (no GPU needed; the process
    must have been started for sm_100a, see ``kernels.registry``)."""
    check_spec(spec, ARCH, __name__)
    kernel = GroupedKernel(spec)
    return compile_grouped(kernel, ENTRY_PREFIX, tmem_columns=TMEM_COLUMNS,
                           idesc=f"{idesc_of(kernel.plan):#010x}")  # fmt: skip
