"""Grouped MoE kernel for sm_100a (B200/GB200): the persistent grouped kernel
with tcgen05 MMA and TMEM accumulators, with its architecture-independent
device code in ``kernels.grouped_common`` (shared with sm_90a) and its host
formulas in ``kernels.grouped_plan``.

Routed experts plus the shared expert of 8-64 decode tokens in one launch of
one CTA per SM. CTA t routes and quantizes token t into a global plan; every
CTA then cuts the routes into units of up to 16 tokens of one expert and
splits the weight stages (two 128 x 128 K blocks of one row tile) evenly over
the CTAs (FC1), then claims (unit, output row tile) jobs from a counter (FC2).

What is Blackwell's here: the MMA and its accumulators. Each stage's two K
blocks land in their own TMEM column groups (the unit's tokens on the UMMA N
side, N = 16), so the epilogue can apply the non-power-of-two block scales
(weight scale times token scale, from the gatherers' scale ring) and sum in
FP32. Accumulators rotate through ``slots`` TMEM slots of 32 columns, so the
MMA warp runs up to ``slots`` stages ahead of the epilogue.

Warp roles (256 threads): warp 0 the routing warp, then (lane 0) the weight
producer; warp 1 allocates TMEM and issues the UMMAs; warps 2-3 gather B tiles
and column scales; warps 4-7 quantize tokens, then read, scale and reduce the
accumulators and close FC1 pairs / store FC2 rows.
"""

from __future__ import annotations

import tempfile

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from kernels import grouped_plan as gp
from kernels import moe_common as mc
from kernels import ptx
from kernels.grouped_common import THREADS, GroupedCommon, RowFragment, Tables
from kernels.ptx import tcgen05 as tc
from kernels.spec import (
    CompiledKernel,
    KernelSpec,
    LaunchShape,
    Param,
    Workspace,
    entry_from_ptx,
)
from runtime.constants import SMEM_LIMIT, TILE

ARCH = "sm_100a"
ENTRY_PREFIX = "moe_grouped_sm100"

GATHERERS = 2  # B-tile gatherer warps (2, 3)
EPILOGUE = 4  # first epilogue warp (4..7; warp % 4 = its TMEM lane quadrant)
MMA_WARP = 1
#: All 512 TMEM columns: one CTA per SM, so no other CTA waits for them.
TMEM_COLUMNS = 512
COLUMNS = gp.DEPTH * gp.GROUP  # TMEM columns of one stage's accumulators
#: Accumulator slots between the MMA warp and the epilogue (at most 32; with
#: 512 TMEM columns of COLUMNS each, 16 here).
SLOTS = min(32, TMEM_COLUMNS // COLUMNS)
#: UMMA instruction descriptor: E4M3 x E4M3 -> F32, M = 128 weight rows, N =
#: GROUP tokens.
IDESC = tc.instruction_desc_e4m3(TILE, gp.GROUP)

#: ABI order (kernels/spec.py PARAMETER_NAMES); every parameter a pointer.
PARAMS = (
    "maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "s13", "s2", "x", "logits",
    "bias", "rows", "out", "shared_out", "final", "ids", "weights", "plan_x", "plan_s",
    "hidden", "hscale", "partial", "counters",
)  # fmt: skip
TENSOR_MAPS = ("w13", "w2", "s13", "s2")


def layout_of(plan: gp.GroupedPlan) -> gp.SmemLayout:
    """The deepest shared-memory layout that fits sm_100a's limit."""
    return gp.fit_layout(plan, ARCH, GATHERERS, SLOTS)


class GroupedKernel(GroupedCommon):
    """BF16 [M * top_k, H] routed outputs (one row per route), int32 ids, FP32
    routing weights and the shared expert's BF16 [M, H]; with ``finalize``
    also the BF16 [M, H] MoE output."""

    GATHERERS = GATHERERS
    EPILOGUE_WARP = EPILOGUE

    def __init__(self, spec: KernelSpec):
        plan = gp.GroupedPlan.from_spec(spec)
        super().__init__(spec, layout_of(plan))
        self.slots = self.layout.slots

    @cute.jit
    def __call__(
        self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
        s13_scale: cute.Tensor, s2_scale: cute.Tensor, s13: cute.Tensor, s2: cute.Tensor,
        x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows: cute.Tensor,
        out: cute.Tensor, shared_out: cute.Tensor, final: cute.Tensor, ids: cute.Tensor,
        weights: cute.Tensor, plan_x: cute.Tensor, plan_s: cute.Tensor, hidden: cute.Tensor,
        hscale: cute.Tensor, partial: cute.Tensor, counters: cute.Tensor, stream,
    ):  # fmt: skip
        self.kernel(
            maps, w13_scale, w2_scale, s13_scale, s2_scale, s13, s2, x, logits, bias, rows,
            out, shared_out, final, ids, weights, plan_x, plan_s, hidden, hscale, partial,
            counters,
        ).launch(
            grid=(self.grid, 1, 1),
            block=(THREADS, 1, 1),
            smem=self.layout.total,
            stream=stream,
            use_pdl=True,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
        s13_scale: cute.Tensor, s2_scale: cute.Tensor, s13: cute.Tensor, s2: cute.Tensor,
        x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows: cute.Tensor,
        out: cute.Tensor, shared_out: cute.Tensor, final: cute.Tensor, ids: cute.Tensor,
        weights: cute.Tensor, plan_x: cute.Tensor, plan_s: cute.Tensor, hidden: cute.Tensor,
        hscale: cute.Tensor, partial: cute.Tensor, counters: cute.Tensor,
    ):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate_tensor(
            Uint8, cute.make_layout(self.layout.total), byte_alignment=1024
        )
        t = Tables(storage.iterator.toint(), self.layout, self.plan)
        tmem_at = t.base + self.layout.off_tmem
        maps_at = maps.iterator.toint()
        w13s, w2s = w13_scale.iterator.toint(), w2_scale.iterator.toint()
        s13s, s2s = s13_scale.iterator.toint(), s2_scale.iterator.toint()

        if tid == 0:
            # Empty stages are released by one UMMA commit each.
            self.init_barriers(t, 1)
            for m in cutlass.range_constexpr(len(TENSOR_MAPS)):
                ptx.tensormap_fence_acquire(maps_at + 128 * m)
        if tid == 64:
            # The shared expert's weights do not depend on the routing: pull this
            # CTA's slice into L2 while the router runs.
            self.prefetch_static(s13.iterator.toint(), s2.iterator.toint(), w13s, w2s, cta, 0)
        if tid == 96:
            # And the routed experts' block scales, which the B gatherers load
            # on their critical path.
            self.prefetch_static(s13.iterator.toint(), s2.iterator.toint(), w13s, w2s, cta, 1)
        if warp == MMA_WARP:
            tc.tcgen05_alloc(tmem_at, TMEM_COLUMNS)
            tc.tcgen05_relinquish_alloc_permit()
        tc.tcgen05_fence_before_thread_sync()
        cute.arch.sync_threads()
        tc.tcgen05_fence_after_thread_sync()
        tmem = Int32(ptx.ld_shared_u32(tmem_at))

        # No early launch_dependents: the finalize publish reads the routing
        # weights this kernel writes before its own PDL wait.
        ptx.griddepcontrol_wait()
        mine = self.start_call(
            t, counters.iterator.toint(), logits.iterator.toint(), bias.iterator.toint(),
            ids.iterator.toint(), weights.iterator.toint(), x.iterator.toint(),
            plan_x.iterator.toint(), plan_s.iterator.toint(), cta, tid, warp, lane,
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
            self.gather(
                t, plan_x.iterator.toint(), plan_s.iterator.toint(), hidden.iterator.toint(),
                hscale.iterator.toint(), unit_ready, lane, w13s, w2s, s13s, s2s,
                warp - (MMA_WARP + 1),
            )  # fmt: skip
        else:
            self.epilogue(
                t, tmem, warp, lane, cta, tid - EPILOGUE * 32, rows.iterator.toint(),
                out.iterator.toint(), shared_out.iterator.toint(), hidden.iterator.toint(),
                hscale.iterator.toint(), partial.iterator.toint(), mine,
            )  # fmt: skip
        tc.release_tmem(tmem, TMEM_COLUMNS, warp, MMA_WARP)
        self.end_call(
            counters.iterator.toint(), mine, out.iterator.toint(), shared_out.iterator.toint(),
            final.iterator.toint(), weights.iterator.toint(), cta, tid,
        )  # fmt: skip

    @cute.jit
    def issue(self, t: Tables, tmem: Int32, lane: Int32):
        """Warp 1: stage n's DEPTH K blocks into accumulator slot n % slots
        (K block d in columns ``d * GROUP`` of the slot, each overwritten by
        its first UMMA), the weight stage committed to its empty barrier and
        the slot to ``acc_full``; END is passed on to the epilogue."""
        lay = self.layout
        w = gp.GROUP
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
                for d in cutlass.range_constexpr(gp.DEPTH):
                    a_off = slot * lay.a_bytes + d * gp.STAGE_BYTES
                    b_off = slot * lay.b_bytes + d * w * TILE
                    with cute.arch.elect_one():
                        tc.umma_k128(
                            tmem + acc * COLUMNS + d * w, adesc + Int64(a_off >> 4),
                            bdesc + Int64(b_off >> 4), Int32(IDESC), Int32(0),
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
        w = gp.GROUP
        quadrant = warp % 4
        logical = mc.logical_row(rows, e)  # this thread's output row of every row tile
        frag = RowFragment(e, logical)
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
                fc2, half, unit, tile, _, opens, closes = self.unpack(word)
                count = t.ucnt[unit]
                # FC1 gate row tiles (pairs..2 * pairs - 1) sum into ``gate``; FC1 up
                # tiles and every FC2 stage (its tile an output row tile) into ``up``.
                into_gate = not fc2 and tile >= self.pairs
                if opens:
                    start = n
                    for j in cutlass.range_constexpr(w):
                        up[j] = Float32(0.0)
                        gate[j] = Float32(0.0)
                parts = tc.load_tmem(lanes + acc * COLUMNS, COLUMNS)
                if into_gate:
                    for c in cutlass.range_constexpr(COLUMNS):
                        gate[c % w] = gate[c % w] + parts[c] * self.ring_scale(t, n, c // w, c % w)
                else:
                    for c in cutlass.range_constexpr(COLUMNS):
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


GroupedKernel.kernel.set_name_prefix(
    ENTRY_PREFIX, remove_cutlass_symbol=True, keep_mangled_name=False
)


def workspaces(plan: gp.GroupedPlan) -> tuple[Workspace, ...]:
    return gp.workspaces(plan.hidden, plan.inter, plan.experts, plan.top_k, plan.grid)


def fake_arguments(plan: gp.GroupedPlan, logits_bf16: bool) -> list:
    """Static-shaped stand-ins of the kernel's parameters (ABI order);
    workspaces as flat arrays of their element type."""
    e, h, i, m = plan.experts, plan.hidden, plan.inter, plan.tokens
    ws = {w.name: w.bytes for w in workspaces(plan)}
    shapes = {
        "maps": (Uint8, (len(TENSOR_MAPS) * 128,)),
        "w13_scale": (Float32, (e, 2 * i // TILE, h // TILE)),
        "w2_scale": (Float32, (e, h // TILE, i // TILE)),
        "s13_scale": (Float32, (1, 2 * i // TILE, h // TILE)),
        "s2_scale": (Float32, (1, h // TILE, i // TILE)),
        "s13": (Uint8, (h // TILE * 2 * i * TILE,)),
        "s2": (Uint8, (i // TILE * h * TILE,)),
        "x": (BFloat16, (m, h)),
        "logits": (BFloat16 if logits_bf16 else Float32, (m, e)),
        "bias": (Float32, (e,)),
        "rows": (Int32, (TILE,)),
        "out": (BFloat16, (plan.routes, h)),
        "shared_out": (BFloat16, (m, h)),
        "final": (BFloat16, (m, h)),
        "ids": (Int32, (plan.routes,)),
        "weights": (Float32, (plan.routes,)),
        "plan_x": (Uint8, (ws["plan_x"],)),
        "plan_s": (Float32, (ws["plan_s"] // 4,)),
        "hidden": (Uint8, (ws["hidden"],)),
        "hscale": (Float32, (ws["hscale"] // 4,)),
        "partial": (Float32, (ws["partial"] // 4,)),
        "counters": (Int32, (ws["counters"] // 4,)),
    }
    return [make_fake_compact_tensor(*shapes[name], assumed_align=16) for name in PARAMS]


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    """Compiles one grouped variant for sm_100a (no GPU needed; the process
    must have been started for sm_100a, see ``kernels.registry``)."""
    if spec.kernel != "grouped" or spec.arch != ARCH:
        raise ValueError(f"{__name__} builds grouped/{ARCH}, not {spec.kernel}/{spec.arch}")
    kernel = GroupedKernel(spec)
    plan, layout = kernel.plan, kernel.layout
    with tempfile.TemporaryDirectory(prefix="moe-grouped-sm100-") as dump:
        compiled = cute.compile(
            kernel, *fake_arguments(plan, spec.logits_dtype == "bfloat16"), make_fake_stream(),
            options=f"--keep-ptx --keep-cubin --dump-dir={dump}",
        )  # fmt: skip
        cubin, ptx_text = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    if not cubin or not ptx_text:
        raise RuntimeError("the DSL kept no cubin/PTX for the grouped kernel")
    notes = {
        "stages": layout.stages,
        "stage_bytes": layout.a_bytes,
        "b_tile_bytes": layout.b_bytes,
        "threads": THREADS,
        "gatherers": GATHERERS,
        "tmem_columns": TMEM_COLUMNS,
        "accumulator_slots": layout.slots,
        "idesc": f"{IDESC:#010x}",
        "max_units": plan.max_units,
        "fc2_jobs_per_claim": plan.chunk,
        "smem_layout": {name: [off, size] for name, off, size in layout.regions()},
        "smem_limit": SMEM_LIMIT[ARCH],
        "resident_ctas_required": plan.grid,
    }
    return CompiledKernel(
        cubin=bytes(cubin),
        entry=entry_from_ptx(ptx_text, ENTRY_PREFIX),
        params=tuple(Param(name, "pointer") for name in PARAMS),
        launch=LaunchShape(
            grid=(plan.grid, 1, 1),
            block=(THREADS, 1, 1),
            cluster=None,
            smem=layout.total,
            pdl=True,
        ),
        tensor_maps=TENSOR_MAPS,
        workspace=workspaces(plan),
        ptx=ptx_text,
        notes=notes,
    )
