"""Grouped MoE kernel for Hopper (sm_90a): routed experts plus the shared
expert of 8-512 decode tokens in one persistent kernel, one CTA per SM.

The plan (``grouped_plan``), the phases of a call and the rings shared with
sm_100a (``grouped_common``'s docstring: shared-memory map, full / posted
rings, counters, what each phase waits on) are the same on both
architectures; this module is Hopper's MMA and its epilogue.

Warp roles (256 threads):

* at the start of a call (``grouped_common.start_call``): warp 0 routes
  token ``cta`` and warps 4-7 quantize it (CTAs below M); with
  ``plan.local_routing`` warps 4-7 of CTA c < M quantize token c first and
  warp w < M of every CTA routes token w;
* warp 0: lane 0 is the weight producer (``produce``: TMA of each stage's
  ``depth`` weight boxes, the FC2 job claims);
* warps 1-3: the B-tile gatherers (``gather``: stages g, g + 3, ...; cp.async
  of quantized tokens / hidden rows, column scales into the scale ring;
  with local routing they first wait for every token, ``await_tokens``);
* warps 4-7: the MMA warpgroup, which is also the epilogue (``consume``: the
  accumulators live in its registers).

Rings: full[stages] (``grouped_common.FULL_ARRIVALS`` = 1 + 32 + 32 arrivals
and the weights' transaction bytes), posted[posts] (1), and empty[stages]
with ``EPILOGUE_THREADS`` = 128 arrivals: every MMA thread arrives once it has
waited for its stage's wgmma chain and read the stage's column scales. No
accumulator slots (``SmemLayout.slots`` = 0: no acc_full / acc_empty).

The consumer, stage n: waits full[n % stages] (parity (n // stages) % 2),
reads the stage word, ``fence.proxy.async`` (the B rows are cp.async
writes), issues ``wgmma.mma_async m64nNk32`` FP8 (weights = A, 128 rows as
two m64 halves; the unit's ``group`` tokens = B, N = group: 16, or 32 above
16 tokens, ``grouped_plan.UNIT_TOKENS``), four k32 steps per K block, each K
block into its own accumulator set (depth K blocks x 2 halves x N / 2
registers), ``wgmma.commit_group`` + ``wait_group 0``; reads the column
scales, arrives on empty[n % stages], then applies the non-power-of-two
block scales (weight block scale x the token's activation or hidden scale)
once per K block in FP32 into the running up / gate (FC1) or output (FC2)
values. A closing stage ends an FC1 pair piece (``close_pair``) or an FC2
job (``store_rows``).

Accumulator fragment (``wgmma`` ``m64nNk32``): thread e (warp w = e // 32,
lane l) holds, per 64-row half h, physical rows 16 w + l // 4 and + 8, tokens
2 (l % 4) + {0, 1} + 8 j for j < N / 8 (``Sm90Fragment``). Under the 16-row
shuffle of the weight layout those two physical rows are the logical
neighbours 2 (l // 4) and + 1, so a
thread stores two adjacent output elements per token (one BF16x2 word, one
FP8 pair); the ``rows`` table is not read (the shuffle is the layout's
contract, docs/semantics.md, "Weight layout").

Measurements behind the choices (ring depth, gatherer count, L2 policy,
timings, accuracy): docs/notes/grouped-sm90.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import grouped_plan as gp
from kernels import ptx
from kernels.grouped_common import (
    EPILOGUE_THREADS,
    THREADS,
    Fragment,
    GroupedCommon,
    Tables,
    check_spec,
    compile_grouped,
    unpack,
)
from kernels.grouped_common import PARAMS as PARAMS
from kernels.grouped_common import TENSOR_MAPS as TENSOR_MAPS
from kernels.grouped_common import workspaces as workspaces
from kernels.grouped_plan import END, STAGE_BYTES, GroupedPlan
from kernels.ptx import wgmma
from kernels.spec import CompiledKernel, KernelSpec
from runtime.constants import TILE

ENTRY = "moe_grouped_sm90"
ARCH = "sm_90a"
GATHERERS = gp.GATHERERS[ARCH]  # warps 1-3
MMA_WARP = 4  # first warp of the MMA warpgroup (a multiple of 4)
HALVES = TILE // 64  # m64 instructions per 128-row tile
K32 = TILE // 32  # k32 steps of one K block


@dataclass(frozen=True)
class Sm90Fragment(Fragment):
    """The ``m64nNk32`` accumulator fragment over a 128-row tile (N = 4 *
    ``slots`` tokens, N / 2 registers per m64 half): token slot s = (j, c)
    holds token 8 j + 2 (l % 4) + c; row slot r = (h, p) holds logical row
    64 h + 16 w + 2 (l // 4) + p; register ``(N / 2) h + 4 j + 2 p + c``."""

    e: object  # Int32: thread in the MMA warpgroup
    slots: int  # N / 4: the unit's tokens over the four lanes of a row
    rows = HALVES * 2
    paired = True
    shuffles = (4, 8, 16)

    warp = property(lambda f: f.e // 32)
    amax_writer = property(lambda f: f.e % 32 < 4)
    scale_writer = property(lambda f: f.e < 4)

    def index(self, s, r):
        return (r // 2) * (2 * self.slots) + (s // 2) * 4 + (r % 2) * 2 + (s % 2)

    def token(self, s):
        return 8 * (s // 2) + 2 * (self.e % 4) + (s % 2)

    def row(self, s, r):
        return 64 * (r // 2) + 16 * (self.e // 32) + 2 * ((self.e % 32) // 4) + (r % 2)


class GroupedMoeSm90(GroupedCommon):
    GATHERERS = GATHERERS
    EPILOGUE_WARP = MMA_WARP
    ENTRY = ENTRY

    def __init__(self, spec: KernelSpec):
        plan = GroupedPlan.from_spec(spec)
        layout = gp.arch_layout(plan, ARCH)
        super().__init__(spec, layout)

    # -- host ----------------------------------------------------------------------------

    def launch(self, kernel, stream):
        kernel.launch(
            grid=(self.grid, 1, 1),
            block=(THREADS, 1, 1),
            smem=self.layout.total,
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=1,
            # Only to keep the compile off the GPU (the DSL asks the device for
            # its smem size otherwise); the runtime launches from the manifest.
            preferred_smem_carveout=100,
        )  # fmt: skip

    # -- device --------------------------------------------------------------------------

    @cute.jit
    def body(self, maps, w13_scale, w2_scale, s13_scale, s2_scale, s13, s2, x, logits, bias,
             rows, out, shared_out, final, ids, weights, plan_x, plan_s, hidden, hscale,
             partial, counters, valid):  # fmt: skip
        """The kernel: every parameter a ``cute.Tensor`` but the shared
        expert's (``s13_scale``, ``s2_scale``, ``s13``, ``s2``, ``shared_out``),
        addresses (``Int64``; 0 in a variant without it, never read), and
        ``valid`` (``Int32``: the rows of x and logits, ``start_call``)."""
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        base = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint()
        t = Tables(base, self.layout, self.plan, self.stamp_base(partial.iterator.toint(), cta))
        a_maps = maps.iterator.toint()
        a_counters = counters.iterator.toint()
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("entry"))

        if tid == 0:
            # The next grid may launch once every CTA is here; it reads
            # nothing of this call before its own griddepcontrol.wait
            # (grouped_common's docstring, phase 1).
            ptx.griddepcontrol_launch_dependents()
            # Every MMA thread's arrival frees a weight stage.
            self.init_barriers(t, EPILOGUE_THREADS)
            # No tensor-map proxy fence: the runtime never rewrites a maps
            # buffer (runtime/tensormap.py).
            for m in cutlass.range_constexpr(len(self.maps)):
                ptx.prefetch_tensormap(a_maps + 128 * m)
        if cutlass.const_expr(self.shared_experts):
            if tid == 64:
                self.prefetch_static(
                    s13, s2, w13_scale.iterator.toint(),
                    w2_scale.iterator.toint(), cta, 0,
                )  # fmt: skip
        if tid == 96:
            self.prefetch_static(
                s13, s2, w13_scale.iterator.toint(),
                w2_scale.iterator.toint(), cta, 1,
            )  # fmt: skip
        cute.arch.sync_threads()

        ptx.griddepcontrol_wait()
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("pdl_wait"))
        mine = self.start_call(
            t, a_counters, logits.iterator.toint(), bias.iterator.toint(), ids.iterator.toint(),
            weights.iterator.toint(), x.iterator.toint(), plan_x.iterator.toint(),
            plan_s.iterator.toint(), cta, tid, warp, lane, valid,
        )  # fmt: skip
        self.number_units(t, ids.iterator.toint(), tid, warp, lane, cta)

        if warp == 0:
            if lane == 0:
                self.produce(t, a_maps, mine + self.counters.jobs * 4)
        elif warp < MMA_WARP:
            self.await_tokens(t, mine, lane, warp - 1)
            self.gather(
                t, plan_x.iterator.toint(), plan_s.iterator.toint(), hidden.iterator.toint(),
                hscale.iterator.toint(), mine + self.counters.unit_ready * 4, lane,
                w13_scale.iterator.toint(), w2_scale.iterator.toint(),
                s13_scale, s2_scale, warp - 1,
            )  # fmt: skip
        else:
            self.consume(
                t, tid - MMA_WARP * 32, cta, out.iterator.toint(), shared_out,
                hidden.iterator.toint(), hscale.iterator.toint(), partial.iterator.toint(), mine,
            )  # fmt: skip
        cute.arch.sync_threads()
        self.end_call(
            t, a_counters, mine, out.iterator.toint(), shared_out,
            final.iterator.toint(), weights.iterator.toint(), cta, tid, valid,
        )  # fmt: skip
        self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("exit"))

    @cute.jit
    def consume(self, t: Tables, e: Int32, cta: Int32, out: Int64, shared_out: Int64,
                hidden: Int64, hscale: Int64, partial: Int64, mine: Int64):  # fmt: skip
        """The MMA warpgroup: every stage's wgmma chain, its scaled sum into
        the running up / gate (FC1) or output (FC2) values, and the closes."""
        frag = Sm90Fragment(e, self.group // 4)
        v = frag.values
        up = cute.make_rmem_tensor(cute.make_layout((v,)), Float32)
        gate = cute.make_rmem_tensor(cute.make_layout((v,)), Float32)
        # parts[d * v + i]: K block d's unscaled partial of register i.
        parts = cute.make_rmem_tensor(cute.make_layout((self.depth * v,)), Float32)
        for i in cutlass.range_constexpr(v):
            up[i] = Float32(0.0)
            gate[i] = Float32(0.0)
        for i in cutlass.range_constexpr(self.depth * v):
            parts[i] = Float32(0.0)
        a_desc = wgmma.smem_desc_sw128(t.weights)
        b_desc = wgmma.smem_desc_sw128(t.tokens)
        opened = Int32(0)
        n = Int32(0)
        word = Uint32(0)
        if cutlass.const_expr(self.stamps):
            # ns waiting for full stages, ns in the closes (STAMP_SUMS)
            sums = cute.make_rmem_tensor(cute.make_layout((2,)), Int64)
            sums[0] = Int64(0)
            sums[1] = Int64(0)
        while word != Uint32(END):
            slot = n % self.stages
            if cutlass.const_expr(self.stamps):
                waited = ptx.globaltimer()
            ptx.mbarrier_wait(t.full(slot), (n // self.stages) % 2)
            if cutlass.const_expr(self.stamps):
                sums[0] = sums[0] + (ptx.globaltimer() - waited)
            word = Uint32(t.desc[n % self.posts])
            if cutlass.const_expr(self.stamps):
                if e == 0:
                    if n == 0:
                        self.stamp(t, "first_full")
                    if n == t.scal[gp.S_N1A] + t.scal[gp.S_N1B]:
                        if word != Uint32(END):
                            self.stamp(t, "first_fc2")
            if word != Uint32(END):
                # The gathered B rows are generic-proxy (cp.async) writes.
                ptx.fence_proxy_async_shared()
                self.mma_stage(parts, a_desc, b_desc, slot)
                scales = cute.make_rmem_tensor(
                    cute.make_layout((self.depth * frag.slots,)), Float32
                )
                for d in cutlass.range_constexpr(self.depth):
                    for s in cutlass.range_constexpr(frag.slots):
                        scales[d * frag.slots + s] = self.ring_scale(t, n, d, frag.token(s))
                # The stage (weights, B tile, word, scales) is read: each
                # thread frees it for itself (see FULL_ARRIVALS).
                ptx.mbarrier_arrive(t.empty(slot))
                fc2, half, unit, tile, kb, opens, closes = unpack(word)
                if opens:
                    opened = n
                    for i in cutlass.range_constexpr(v):
                        up[i] = Float32(0.0)
                        gate[i] = Float32(0.0)
                # FC1 gate row tiles (pairs..2 * pairs - 1) sum into ``gate``; FC1 up
                # tiles and every FC2 stage (its tile an output row tile) into ``up``.
                into_gate = not fc2 and tile >= self.pairs
                if into_gate:
                    self.add_scaled(frag, gate, parts, scales)
                else:
                    self.add_scaled(frag, up, parts, scales)
                if closes:
                    if cutlass.const_expr(self.stamps):
                        closing = ptx.globaltimer()
                    count = t.ucnt[unit]
                    if fc2:
                        self.store_rows(t, frag, up, unit, tile, count, out, shared_out)
                    else:
                        self.close_pair(
                            t, frag, up, gate, n, opened, count, unit, half, cta, e, hidden,
                            hscale, partial, mine,
                        )  # fmt: skip
                    if cutlass.const_expr(self.stamps):
                        sums[1] = sums[1] + (ptx.globaltimer() - closing)
                if cutlass.const_expr(self.stamps):
                    if e == 0:
                        if not fc2:
                            self.stamp(t, "fc1_done")
            n = n + 1
        if cutlass.const_expr(self.stamps):
            if e == 0:
                self.stamp(t, "consumer_end")
                self.stamp(t, "wait_full", sums[0])
                self.stamp(t, "closing", sums[1])

    @cute.jit
    def mma_stage(self, parts, a_desc: Int64, b_desc: Int64, slot: Int32):
        """One stage's wgmma chain: K block d of the weights (A, two m64
        halves) times the unit's B tile of K block d into accumulator set d,
        then commit and wait (the stage's shared memory is free after it)."""
        acc_regs = self.group // 2  # FP32 accumulators of one m64nNk32 instruction
        v = HALVES * acc_regs
        a_stage = a_desc + Int64((slot * self.layout.a_bytes) >> 4)
        b_stage = b_desc + Int64((slot * self.layout.b_bytes) >> 4)
        wgmma.wgmma_fence()
        for d in cutlass.range_constexpr(self.depth):
            for h in cutlass.range_constexpr(HALVES):
                acc = [parts[d * v + h * acc_regs + i] for i in range(acc_regs)]
                a = a_stage + (d * STAGE_BYTES + h * 64 * TILE) // 16
                b = b_stage + (d * self.group * TILE) // 16
                for k in cutlass.range_constexpr(K32):
                    acc = wgmma.wgmma_e4m3(
                        acc, a + k * wgmma.DESC_K32, b + k * wgmma.DESC_K32, k > 0
                    )
                for i in cutlass.range_constexpr(acc_regs):
                    parts[d * v + h * acc_regs + i] = acc[i]
        wgmma.wgmma_commit()
        wgmma.wgmma_wait(0)
        done = wgmma.fence_operands([parts[i] for i in range(self.depth * v)])
        for i in cutlass.range_constexpr(self.depth * v):
            parts[i] = done[i]

    def add_scaled(self, frag: Fragment, into, parts, scales):
        """into[i] += sum_d parts[d][i] * scale(d, token of i)."""
        v = frag.values
        for s in range(frag.slots):
            for r in range(frag.rows):
                i = frag.index(s, r)
                total = into[i]
                for d in range(self.depth):
                    total = total + parts[d * v + i] * scales[d * frag.slots + s]
                into[i] = total


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one grouped variant for sm_90a (no GPU needed; the process
    must have been started for sm_90a, see ``kernels.registry``)."""
    check_spec(spec, ARCH, __name__)
    if os.environ.get("CUTE_DSL_ARCH") != ARCH:
        raise RuntimeError(f"compile {__name__} in a process started for {ARCH}")
    return compile_grouped(GroupedMoeSm90(spec), ENTRY)
