"""Routed and shared experts of a few decode tokens as one kernel on Hopper
(sm_90a).

Every (token, expert) route of M tokens (M = 1..4) runs in one 8-CTA cluster in
one launch: routing, FP8 activation quantization, GEMM1 with block scales,
clamped SwiGLU, FP8 hidden quantization and GEMM2, writing one unweighted BF16
row per route (``out[token * top_k + k]``), the expert ``ids`` and the routing
``weights``. With a shared expert (``spec.shared_experts == 1``) M more
clusters (first or last in the grid: ``ORDER``) run it for each token with
the same per-route code (tensor maps s13/s2 = maps 2 and 3, expert 0, scales
``s13_scale`` / ``s2_scale``) and write the unweighted row
``shared_out[token]``; they need no
routing, so their producer streams weights before ``griddepcontrol.wait``
(only x waits). Without one the kernel has the routed-only ABI
(``ROUTED_PARAMS``, maps w13/w2). This is the seed's MegaExperts (``shared/seeds/mega_moe.clean.txt``)
ported from tcgen05/TMEM to warpgroup MMA with register accumulators, with a
different work split (below).

Work split (one cluster per route, CTA rank r of C = 2I/128 = 8):
  * GEMM1 (W31 rows: up tiles, then gate tiles): row tile r (128 rows) over
    the full K (H/128 = 32 K blocks). Gate CTA r >= C/2 hands its 128 gate
    values to up CTA r - C/2 over DSMEM; the up CTA computes the SwiGLU,
    quantizes the 128-value hidden block (FP8, scale amax / 448) and
    broadcasts it with its scale to all 8 CTAs (``st.async`` into each CTA's
    GEMM2 B tiles): two DSMEM hops.
  * GEMM2: rows ``r * H/8 .. + H/8`` (4 row tiles x I/128 = 4 K blocks).

Why 8 CTAs per route and not the seed's 16 (measured on the H200 with
``%smid`` stamps): a 16-CTA cluster occupies one CTA on each of 16 SMs of a
GPC, and only 7 such 16-SM sets exist, so a 1-token call's 8 routes put two
clusters on one set (those SMs then carry two CTAs and finish last: 18.0 us
against 14.5-16.4 us for the others), and 2 tokens (16 routes) already need
a second wave at 2 CTAs per SM (14 resident clusters): 37 us for M=2. 8-CTA
clusters fit 15 (1 CTA/SM), 30 (2/SM) or 45 (3/SM) at a time
(``cuOccupancyMaxActiveClusters`` of the built variants on the H200), and a
call needs M * (top_k + 1) = 9, 18, 27, 36 of them: ``STAGES`` picks per
bucket the deepest ring at the fewest CTAs per SM that still holds them all
(10 stages at 1/SM for M=1; 6 at 2/SM for M=2, 3; 3 at 3/SM for M=4, where 4/SM
would leave 2 stages and need <= 102 registers against 118).

Block scales (not powers of two) are applied in the epilogue with the
"column trick": K block kb's token (hidden block) is B column kb % 8 of a
``wgmma m64n8k32`` (the other columns zero), so each K block's unscaled
partial lands in its own accumulator column (4 sets of 8 columns for 32 K
blocks) and the MMAs of all K blocks run back to back. The GEMM1 B operand
is 8 rotating 1 KB tiles: tile b only ever holds a token block in row b, so
refilling it (one 16-byte store per thread of one warp, every 4 K blocks,
once the MMA that read it has retired) needs no zeroing.

Warps: 0-3 are the MMA warpgroup (activation quantization, wgmma, both
epilogues, the DSMEM exchange); warp 4 is the TMA producer. Weights stream
through a ring of 16 KB stages (one 128 x 128 TMA box each); a stage is
released one ``wgmma.wait_group`` after it was issued. The ring depth is
chosen per token bucket (``STAGES``) so that every route's cluster is
resident at once.

Cluster order (``ORDER``). ``%smid`` stamps of an M=1 call (9 clusters, 1
CTA/SM) put clusters 0-7 on 8 different GPCs and the 9th in the GPC of the
8th; those two finished last (18.3-18.9 us against 14.5-17 us). The shared
expert, which streams before ``griddepcontrol.wait``, is best as that 9th
cluster, with the routes in reverse order so that the route sharing its GPC
is route 0 (its routing ends first). Graphs of 8 calls, same run: M=1 20.39
us shared first, 19.52 shared last, 19.11 shared last with reversed routes;
M=2 31.5 / 33.5 / 33.0, M=3 43.3 / 43.6 / 43.7, M=4 54.5 / 55.1 / 53.5.

Start-up: the producer's pick k is ready after k + 1 rounds of selection,
each a ``redux.sync`` over the lanes' sorted candidate lists
(``moe_common._sort_candidates``): M=1 19.19 -> 18.90 us against a rescan
of every candidate per round. The tensor maps are prefetched without the
tensor-map proxy fence (the runtime pins and never rewrites them,
``runtime/tensormap.py``): M=1 18.82 -> 18.35 us in one A/B run.

Cluster waits, and the producer's polling (what compute-sanitizer racecheck
needs). The cluster barrier's arrive is at the start; each thread's wait
must come before its first DSMEM access. On the hardware a wait needs only
the arrives, but racecheck (2025.3.1) acts as if it needed every thread of
the cluster to be waiting, and it hung on a try_wait loop of the producer
while the MMA warps ran the DSMEM exchange. At hidden 4096 (not 2048) the
producer's last loads wait on GEMM2 stages, i.e. on the exchange, so with
the waits after GEMM1 (MMA warps) and after the last load (producer warp)
racecheck never finished (510 s at M=1; reduced hidden-4096 shapes of 2-3
clusters past 250 s; hidden-2048 shapes 6-10 s). Its deadlock detector
(``--racecheck-deadlock-timeout``) showed, in turn: the producer lane on
the free-stage wait of load 42 (the first GEMM2 stage); with only the
producer's cluster wait moved, that lane in its cluster wait (MMA warps on
load 10); with polling free-stage waits alone, load 42 again (M=1 and M=4).
With both changes, the MMA warps waiting before GEMM1, the producer lane
before its first free-stage wait (``mbarrier.test_wait`` polling), the
other producer lanes at once, racecheck of the M=1 bucket is clean in 8 s.
Cost, graphs of 8 calls in one run, M=1..4: 17.99 / 29.75 / 41.37 / 50.84
us before, 18.24 / 30.69 / 42.62 / 51.23 us after (polling alone: 17.81 /
29.43 / 41.36 / 50.78 in another run, against 18.00 / 29.65 / 41.43 /
50.85); the cluster wait before GEMM1 is the part that costs at M=2, 3.

``moe-build bench`` on the H200 (build of these defaults, PTX-identical;
CUDA graphs of 8 calls on fresh inputs over 4 bound weight copies, L2
defeated; 30 replays, median; MB = distinct routed experts plus the shared
expert, 6.29 MB each; % of the 4.19 TB/s device copy bandwidth measured in
the same run; ``benchmarks/results/h200-2026-11-29-59e5198.json``).
``layer`` is ``MoELayer.__call__``: the kernel plus ``runtime.moe.combine``
(4 torch kernels, ~13 us at every M):

  ====  =========  =========  =======  =======  =========  =================
  M     mega       layer      MB       TB/s     % of copy  stages, CTA/SM
  ====  =========  =========  =======  =======  =========  =================
  1     18.2 us    31.9 us    56.6     3.11     74 %       10, 1
  2     31.7 us    44.5 us    100.7    3.18     76 %       6, 2
  3     41.9 us    55.1 us    136.9    3.27     78 %       6, 2
  4     50.7 us    64.9 us    175.4    3.46     83 %       3, 3
  ====  =========  =========  =======  =======  =========  =================

Tried at M=1 and not kept (graphs of 8 calls): the shared expert split over
two clusters, one running GEMM1 and handing the FP8 hidden blocks to the
other through global memory, 23.1 us against 19.0; the shared cluster held
to 8, 6 or 4 loads in flight, 18.6 / 19.5 / 23.4 against 18.7; 12 or 13
stages, 19.1 against 18.9; barriers initialized by the producer so that it
starts before the B tiles are zeroed, 17.87 against 17.71.

Earlier measurements (before the cluster order, the sorted routing and the
fence removal; graphs of 8 calls, median of 15): with the shared expert
first, 19.60, 30.26, 42.81, 50.11 us (M = 1..4). The layer took 150-200 us
at M <= 4 before the shared expert moved into the kernel (shared expert in
torch on FP32 weights, top-k loop finalize). Shared routes waiting on
``griddepcontrol.wait`` like the others (``early_shared=False``), same run:
mega 19.76, 30.52, 42.00, 51.77 us (M = 1..4): streaming them early is worth
0.2-1.7 us except at M=3 (+0.8 us), so it is on by default.

The routed-only kernel (no shared routes; 2026-11-29, graphs of 40 calls):
M=1 16.45 us (50.3 MB, 3.06 TB/s, 72 %), M=2 28.6 us (97 MB, 80 %), M=3
41.1 us (140 MB, 80 %), M=4 51.2 us (177 MB, 82 %), at the same stages.

Alternatives measured the same way (routed-only kernel):
  * the seed's split (16-CTA clusters, 2 CTAs/SM, 5 stages): M=1 18.5-19.0 us,
    M=2 37.3, M=3 46.9, M=4 62.4 (see the cluster note above);
  * M=1 with 13 stages 16.60 us, with 6 stages at 2 CTAs/SM 16.74 us;
  * M=4 with 4 stages at 2 CTAs/SM: 59.9 us (30 resident 8-CTA clusters: the
    last 2 routes run as a second wave);
  * prefetching into L2 (``cp.async.bulk.prefetch``) the GEMM2 boxes the ring
    cannot hold when GEMM1 ends ("late"): M=1 17.67 us; all of them once the
    ring is full ("early", 16-CTA version): +2.4 us. Off by default.
  * one K-half partial exchange hop fewer (16-CTA version): -0.5 us at M=1.
Where the time goes at M=1 (routed-only; ``%globaltimer`` stamps, medians from the first
CTA's start): past ``griddepcontrol.wait`` 0.6 us, the producer's expert
known 1.8 us (logits load + top-k up to its round), first weight stage in
4.7 us, GEMM1 done 11.0 us, all hidden blocks in 12.2 us, last CTA done
14.7-15.2 us; DRAM is busy from ~2.3 us on.

Accuracy on the H200 (every bucket, both logits dtypes, UE8M0 off and on;
tests/test_mega_sm90_gpu.py on the build of these defaults, worst of 3
calls per variant): ids exact (no near-ties met), weights within 1e-5
relative, out 2.3-6.3e-3 relative L2 against the float64 reference (2.4e-2
for the worst single route), the shared rows 3.2-4.0e-3 pooled (1.9e-2 for
the worst row), the layer's output 2.6-8.3e-3 pooled per variant (1.4e-2
for the worst single call, one row at M=1). GEMM1 rows alone: 1.3e-4 (the
tensor cores' FP8 accumulation); the rest is hidden FP8 codes it flips.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import ptx
from kernels.moe_common import (
    TILE,
    fp8_code,
    hidden_scale,
    logical_row,
    quantize_activations,
    route_pick,
    route_token,
    swiglu,
)
from kernels.ptx import wgmma
from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param

STAGE_BYTES = TILE * TILE  # one 128 x 128 FP8 TMA box
B_BYTES = 8 * TILE  # one N=8 B tile: 8 rows of 128 K bytes (one swizzle atom)
B1_TILES = 8  # rotating GEMM1 B tiles (tile b holds its token block in row b)
REFILL = 4  # GEMM1 K blocks per B refill (one warp's 32 stores, one barrier)
MMA_THREADS = 128  # the MMA warpgroup (warps 0-3)
THREADS = MMA_THREADS + 32  # + the producer warp
PRODUCER_WARP = MMA_THREADS // 32
ENTRY = "moe_mega_sm90"
#: ABI with the shared expert (``spec.shared_experts == 1``) ...
PARAMS = ("maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "x", "logits", "bias",
          "rows1", "rows2", "out", "shared_out", "ids", "weights")  # fmt: skip
MAPS = ("w13", "w2", "s13", "s2")
#: ... and without (routed experts only).
ROUTED_PARAMS = ("maps", "w13_scale", "w2_scale", "x", "logits", "bias", "rows1", "rows2", "out",
                 "ids", "weights")  # fmt: skip
ROUTED_MAPS = ("w13", "w2")
WG_BARRIER = 1  # named barrier of the MMA warpgroup (0 is __syncthreads)

#: Which clusters run the shared experts: the first M ("shared_first": cluster
#: g < M is token g's shared expert, the routes follow), or the last M, after
#: the routes in order ("shared_last") or in reverse order
#: ("shared_last_reversed").
ORDERS = ("shared_first", "shared_last", "shared_last_reversed")

#: Ring depth and CTAs per SM per token bucket: M * (top_k + 1) clusters of 8
#: CTAs (9, 18, 27, 36 for top_k 8 with the shared expert) must all be
#: resident (H200: 15 at 1 CTA/SM, 30 at 2, 45 at 3), and with fewer CTAs per
#: SM each needs more bytes in flight.
STAGES = {1: (10, 1), 2: (6, 2), 3: (6, 2), 4: (3, 3)}

#: Cluster order per token bucket (measured: see the module docstring).
ORDER = {1: "shared_last_reversed", 2: "shared_first", 3: "shared_first",
         4: "shared_last_reversed"}  # fmt: skip


class MegaMoeSm90:
    """One variant (spec) of the Hopper mega kernel: shared-memory layout,
    host launch and device code."""

    def __init__(self, spec: KernelSpec, stages: int | None = None, ctas_per_sm: int | None = None,
                 prefetch: str = "none", early_shared: bool = True,
                 order: str | None = None):  # fmt: skip
        hidden, inter = spec.hidden, spec.inter
        self.hidden, self.inter, self.experts, self.top_k = hidden, inter, spec.experts, spec.top_k
        self.scale, self.limit, self.ue8m0 = spec.scale, spec.limit, spec.ue8m0
        self.logits_bf16 = spec.logits_dtype == "bfloat16"
        assert spec.shared_experts in (0, 1), spec.shared_experts
        # Clusters 0 .. shared - 1 run the shared expert (one per token), the
        # routes (token t, route k) follow at shared + t * top_k + k.
        self.shared = spec.tokens * spec.shared_experts
        self.routes = spec.tokens * spec.top_k
        self.groups = self.shared + self.routes
        self.early_shared = early_shared and self.shared > 0
        self.order = order or ORDER[min(spec.tokens, max(ORDER))]
        assert self.order in ORDERS, self.order
        default_stages, default_ctas = STAGES[min(spec.tokens, max(STAGES))]
        self.stages = stages or default_stages
        self.ctas_per_sm = ctas_per_sm or default_ctas
        assert prefetch in ("none", "late"), prefetch
        self.prefetch = prefetch
        self.nk1 = hidden // TILE  # GEMM1 K blocks
        self.nk2 = inter // TILE  # GEMM2 K blocks (= up tiles)
        self.cluster = 2 * inter // TILE  # one CTA per GEMM1 row tile
        assert self.cluster in (2, 4, 8, 16), "cluster of one CTA per GEMM1 row tile"
        # kernels/shapes.py states these rules for the config check.
        assert self.nk1 % 16 == 0 and 16 <= self.nk1 <= 64, "2-8 sets of 8 accumulator columns"
        assert self.nk2 <= 8, "GEMM2 K blocks are columns of an N=8 tile"
        assert spec.experts % 32 == 0
        self.rows2 = hidden // self.cluster  # GEMM2 rows per CTA
        self.tiles2 = self.rows2 // TILE
        assert self.tiles2 * TILE == self.rows2
        self.loads = self.nk1 + self.tiles2 * self.nk2
        # Shared memory (offsets from the 1024-aligned dynamic base).
        self.off_b1 = self.stages * STAGE_BYTES
        self.off_b2 = self.off_b1 + B1_TILES * B_BYTES
        self.off_gate = self.off_b2 + self.nk2 * B_BYTES
        self.off_stage = self.off_gate + TILE * 4
        self.off_amax = self.off_stage + TILE
        self.off_hscale = self.off_amax + 16
        self.off_xscale = self.off_hscale + 4 * self.nk2
        self.off_bar = -(-(self.off_xscale + 4 * self.nk1) // 8) * 8
        # full[stages], empty[stages], gate (gate values in), hrecv (hidden in)
        self.bars = 2 * self.stages + 2
        self.smem = self.off_bar + 8 * self.bars

    # -- host ----------------------------------------------------------------------------

    def launch_shape(self) -> LaunchShape:
        return LaunchShape(
            grid=(self.cluster * self.groups, 1, 1), block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1), smem=self.smem, pdl=True,
        )  # fmt: skip

    @cute.jit
    def __call__(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                 s13_scale: cute.Tensor, s2_scale: cute.Tensor, x: cute.Tensor,
                 logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor, rows2: cute.Tensor,
                 out: cute.Tensor, shared_out: cute.Tensor, ids: cute.Tensor,
                 weights: cute.Tensor, stream):  # fmt: skip
        """Launch with the shared expert (``PARAMS``)."""
        self.kernel.set_name_prefix(ENTRY, remove_cutlass_symbol=True, keep_mangled_name=False)
        self.launch(
            self.kernel(maps, w13_scale, w2_scale, s13_scale, s2_scale, x, logits, bias, rows1,
                        rows2, out, shared_out, ids, weights),
            stream,
        )  # fmt: skip

    @cute.jit
    def routed_only(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                    x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor,
                    rows2: cute.Tensor, out: cute.Tensor, ids: cute.Tensor,
                    weights: cute.Tensor, stream):  # fmt: skip
        """Launch without a shared expert (``ROUTED_PARAMS``)."""
        self.kernel_routed.set_name_prefix(ENTRY, remove_cutlass_symbol=True,
                                           keep_mangled_name=False)  # fmt: skip
        self.launch(
            self.kernel_routed(maps, w13_scale, w2_scale, x, logits, bias, rows1, rows2, out,
                               ids, weights),
            stream,
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

    @cute.kernel
    def kernel(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
               s13_scale: cute.Tensor, s2_scale: cute.Tensor, x: cute.Tensor,
               logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor, rows2: cute.Tensor,
               out: cute.Tensor, shared_out: cute.Tensor, ids: cute.Tensor,
               weights: cute.Tensor):  # fmt: skip
        self.body(
            maps.iterator.toint(), w13_scale.iterator.toint(), w2_scale.iterator.toint(),
            s13_scale.iterator.toint(), s2_scale.iterator.toint(), x.iterator.toint(),
            logits.iterator.toint(), bias.iterator.toint(), rows1.iterator.toint(),
            rows2.iterator.toint(), out.iterator.toint(), shared_out.iterator.toint(),
            ids.iterator.toint(), weights.iterator.toint(),
        )  # fmt: skip

    @cute.kernel
    def kernel_routed(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                      x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor,
                      rows1: cute.Tensor, rows2: cute.Tensor, out: cute.Tensor,
                      ids: cute.Tensor, weights: cute.Tensor):  # fmt: skip
        none = Int64(0)  # no shared routes: never read
        self.body(
            maps.iterator.toint(), w13_scale.iterator.toint(), w2_scale.iterator.toint(),
            none, none, x.iterator.toint(), logits.iterator.toint(), bias.iterator.toint(),
            rows1.iterator.toint(), rows2.iterator.toint(), out.iterator.toint(), none,
            ids.iterator.toint(), weights.iterator.toint(),
        )  # fmt: skip

    @cute.jit
    def body(self, maps: Int64, w13_scale: Int64, w2_scale: Int64, s13_scale: Int64,
             s2_scale: Int64, x: Int64, logits: Int64, bias: Int64, rows1: Int64, rows2: Int64,
             out: Int64, shared_out: Int64, ids: Int64, weights: Int64):  # fmt: skip
        """One cluster = one route (global addresses in bytes): either token
        t's shared expert (maps s13/s2, expert 0, its scales, row
        ``shared_out[t]``) or route r (token r // top_k, pick r % top_k: maps
        w13/w2, the routed expert, row ``out[r]``, ``ids[r]``,
        ``weights[r]``); which cluster is which: ``ORDERS``. Both run the same
        code from the producer's first load on."""
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(ptx.cluster_ctarank())
        group = cta // self.cluster
        # Cluster -> route or the shared expert of token ``shared_index``: ORDERS.
        route = group - self.shared
        shared_index = group
        is_shared = group < self.shared
        if cutlass.const_expr(self.order != "shared_first"):
            route = group
            shared_index = group - self.routes
            is_shared = group >= self.routes
        if cutlass.const_expr(self.order == "shared_last_reversed"):
            route = self.routes - 1 - group
        token = route // self.top_k
        k = route % self.top_k
        stages = self.stages

        map1 = maps
        scale1, scale2 = w13_scale, w2_scale
        row = out + Int64(route) * (self.hidden * 2)
        if cutlass.const_expr(self.shared > 0):
            if is_shared:
                token = shared_index
                map1 = maps + 2 * 128
                scale1 = s13_scale
                scale2 = s2_scale
                row = shared_out + Int64(token) * (self.hidden * 2)
        map2 = map1 + 128

        base = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint()
        bar = base + self.off_bar
        full = bar
        empty = bar + 8 * stages
        gate_in = bar + 16 * stages
        hrecv = gate_in + 8

        if tid == 0:
            self.init_barriers(full, empty, gate_in, hrecv, rank)
        if warp == PRODUCER_WARP:
            if lane == 0:
                # No tensor-map proxy fence: the runtime never rewrites a maps
                # buffer (runtime/tensormap.py; the fence cost ~0.5 us a call).
                ptx.prefetch_tensormap(map1)
                ptx.prefetch_tensormap(map2)
        self.zero_b_tiles(base, tid)
        ptx.cluster_arrive_relaxed()
        cute.arch.sync_threads()

        # No early launch_dependents: a dependent grid may read `weights`.
        dsize = 2 if self.logits_bf16 else 4
        row_logits = logits + Int64(token) * (self.experts * dsize)
        if warp == PRODUCER_WARP:
            expert = Int32(0)
            if cutlass.const_expr(self.shared > 0):
                # A shared route needs no routing and reads only weights: with
                # early_shared its stages stream before the previous grid ends.
                if cutlass.const_expr(not self.early_shared):
                    ptx.griddepcontrol_wait()
                if not is_shared:
                    if cutlass.const_expr(self.early_shared):
                        ptx.griddepcontrol_wait()
                    # The first load waits on this: stop selecting after round k.
                    expert = route_pick(row_logits, bias, lane, k, self.experts, self.top_k,
                                        self.logits_bf16)  # fmt: skip
            else:
                ptx.griddepcontrol_wait()
                expert = route_pick(row_logits, bias, lane, k, self.experts, self.top_k,
                                    self.logits_bf16)  # fmt: skip
            if lane == 0:
                self.produce(base, full, empty, map1, map2, expert, rank)
            else:
                ptx.cluster_wait_divergent()  # "Cluster waits" (module docstring)
        else:
            ptx.griddepcontrol_wait()
            expert = Int32(0)
            if cutlass.const_expr(self.shared > 0):
                if not is_shared:
                    expert = self.route(row_logits, bias, lane, warp, rank, k, route, ids, weights)
            else:
                expert = self.route(row_logits, bias, lane, warp, rank, k, route, ids, weights)
            self.consume(
                base, full, empty, gate_in, hrecv, tid, lane, rank, token, expert, scale1,
                scale2, x, rows1, rows2, row,
            )  # fmt: skip

    @cute.jit
    def init_barriers(self, full, empty, gate_in, hrecv, rank):
        """One thread: the ring's full/empty barriers, the gate and hidden
        barriers with their expected bytes."""
        for s in cutlass.range_constexpr(self.stages):
            ptx.mbarrier_init(full + 8 * s, 1)
            ptx.mbarrier_init(empty + 8 * s, MMA_THREADS // 32)
        ptx.mbarrier_init(gate_in, 1)
        ptx.mbarrier_init(hrecv, 1)
        if rank < self.nk2:
            ptx.mbarrier_arrive_expect_tx(gate_in, TILE * 4)
        # Every up tile's FP8 hidden block and its scale.
        ptx.mbarrier_arrive_expect_tx(hrecv, self.nk2 * (TILE + 4))
        ptx.fence_mbarrier_init()

    @cute.jit
    def zero_b_tiles(self, base, tid):
        """The B tiles are zeros but for one row each. GEMM2's token rows (row
        kb of tile kb) are written by other CTAs: left alone, so that no
        ordering against them is needed (a relaxed cluster arrive)."""
        zero = Uint32(0)
        chunks1 = B1_TILES * B_BYTES // 16
        for i in cutlass.range_constexpr(-(-chunks1 // THREADS)):
            c = i * THREADS + tid
            if c < chunks1:
                ptx.st_shared_v4_u32(base + self.off_b1 + c * 16, zero, zero, zero, zero)
        chunks2 = self.nk2 * B_BYTES // 16
        for i in cutlass.range_constexpr(-(-chunks2 // THREADS)):
            c = i * THREADS + tid
            if c < chunks2:
                if (c % 64) // 8 != c // 64:
                    ptx.st_shared_v4_u32(base + self.off_b2 + c * 16, zero, zero, zero, zero)

    @cute.jit
    def route(self, row_logits, bias, lane, warp, rank, k, route, ids, weights) -> Int32:
        """The MMA warps' routing of the token (every warp routes it: no
        exchange needed): returns the expert of pick ``k``; warp 0 of rank 0
        stores ``ids[route]`` and ``weights[route]``."""
        ident, weight = route_token(row_logits, bias, lane, self.experts, self.top_k, self.scale,
                                    self.logits_bf16)  # fmt: skip
        if rank == 0:
            if warp == 0:
                if lane == k:
                    ptx.st_global_u32(ids + Int64(route) * 4, Uint32(ident))
                    ptx.st_global_f32(weights + Int64(route) * 4, weight)
        return cute.arch.shuffle_sync(ident, k)

    @cute.jit
    def produce(self, base, full, empty, map1, map2, expert, rank):
        """TMA producer (one lane): the CTA's GEMM1 stages (its row tile, K
        blocks in order), then its GEMM2 stages (row tile t, K block kb)."""
        stages = self.stages
        policy = ptx.create_policy_evict_first()
        for n in cutlass.range_constexpr(self.loads):
            slot = n % stages
            if cutlass.const_expr(self.prefetch == "late" and n == self.nk1):
                # GEMM2 boxes the ring cannot hold when GEMM1 ends: into L2 now.
                for m in cutlass.range_constexpr(min(stages, self.loads - self.nk1),
                                                 self.loads - self.nk1):  # fmt: skip
                    ptx.tma_prefetch_3d(
                        map2, 0, rank * self.rows2 + (m // self.nk2) * TILE,
                        expert * self.nk2 + m % self.nk2,
                    )  # fmt: skip
            if cutlass.const_expr(n == stages):
                ptx.cluster_wait_divergent()  # before any wait on the MMA warps
            if cutlass.const_expr(n >= stages):
                # Polling: a try_wait loop here hangs racecheck (module docstring).
                ptx.mbarrier_wait_polling(empty + 8 * slot, (n // stages - 1) % 2)
            ptx.mbarrier_arrive_expect_tx(full + 8 * slot, STAGE_BYTES)
            dst = base + slot * STAGE_BYTES
            if cutlass.const_expr(n < self.nk1):
                ptx.tma_load_3d_hint(dst, map1, full + 8 * slot, 0, rank * TILE,
                                     expert * self.nk1 + n, policy)  # fmt: skip
            else:
                m = n - self.nk1
                ptx.tma_load_3d_hint(
                    dst, map2, full + 8 * slot, 0, rank * self.rows2 + (m // self.nk2) * TILE,
                    expert * self.nk2 + m % self.nk2, policy,
                )  # fmt: skip
        if cutlass.const_expr(self.loads <= stages):
            ptx.cluster_wait_divergent()

    @cute.jit
    def consume(self, base, full, empty, gate_in, hrecv, tid, lane, rank, token, expert,
                w13_scale, w2_scale, x, rows1, rows2, out_row):  # fmt: skip
        """The MMA warpgroup: quantize the token, GEMM1, the DSMEM exchange
        (gate values to the up CTA, hidden broadcast), GEMM2 and the output
        row at ``out_row`` (all global operands are byte addresses; the
        scales are the expert set's: ``expert`` indexes them)."""
        stages, nk1, nk2, tiles2 = self.stages, self.nk1, self.nk2, self.tiles2
        sets = nk1 // 8
        quad = lane % 4
        r0 = (tid // 32) * 16 + lane // 4  # fragment row of this thread (and r0 + 8)
        # The one row of 128 this thread owns after the quad reduction.
        row = (quad // 2) * 64 + r0 + (quad % 2) * 8

        # Thread t quantizes 16-value chunk t % 8 of K blocks t // 8 + 16 j (FP8
        # per 128) and keeps the codes for the B tile refills.
        per = nk1 // 16
        chunk = tid % 8
        codes = cute.make_rmem_tensor(cute.make_layout((4 * per,)), Uint32)
        for j in cutlass.range_constexpr(per):
            kb = tid // 8 + 16 * j
            values = cute.make_rmem_tensor(cute.make_layout((16,)), Float32)
            _load_bf16x16(x + (Int64(token) * self.hidden + kb * TILE
                                                + chunk * 16) * 2, values)  # fmt: skip
            words, sx = quantize_activations(values, 8, self.ue8m0)
            for w in cutlass.range_constexpr(4):
                codes[4 * j + w] = words[w]
            if chunk == 0:
                ptx.st_shared_f32(base + self.off_xscale + kb * 4, sx)
        # K blocks 0..7 into B tiles 0..7.
        if tid < 8 * B1_TILES:
            self.fill_b1(base, tid // 8, chunk, codes, 0)

        # Epilogue inputs, loaded while the first stages stream in. Column c of
        # accumulator set s is K block 8 s + c; this thread holds c = 2q, 2q+1.
        s13 = w13_scale + (Int64(expert) * self.cluster + rank) * nk1 * 4
        w1s = cute.make_rmem_tensor(cute.make_layout((2 * sets,)), Float32)
        for j in cutlass.range_constexpr(2 * sets):
            w1s[j] = ptx.ld_global_nc_f32(s13 + ((j // 2) * 8 + 2 * quad + j % 2) * 4)
        local = logical_row(rows1, rank * TILE + row) - rank * TILE
        s2 = w2_scale + (
            (Int64(expert) * (self.hidden // TILE) + rank * tiles2) * nk2) * 4  # fmt: skip
        w2s = cute.make_rmem_tensor(cute.make_layout((2 * tiles2,)), Float32)
        for t in cutlass.range_constexpr(tiles2):
            for c in cutlass.range_constexpr(2):
                col = cutlass.min(2 * quad + c, nk2 - 1)
                w2s[2 * t + c] = ptx.ld_global_nc_f32(s2 + (t * nk2 + col) * 4)
        out_rows = cute.make_rmem_tensor(cute.make_layout((tiles2,)), Int32)
        for t in cutlass.range_constexpr(tiles2):
            out_rows[t] = logical_row(rows2, rank * self.rows2 + t * TILE + row)
        ptx.cluster_wait()  # peers' barriers are initialized; "Cluster waits"
        ptx.fence_proxy_async_shared()
        ptx.bar_sync(WG_BARRIER, MMA_THREADS)

        # GEMM1: K blocks back to back; set kb // 8, column kb % 8.
        zero = Float32(0.0)
        acc1 = [[[zero] * 4 for _ in range(2)] for _ in range(sets)]  # [set][row half]
        for n in cutlass.range_constexpr(nk1):
            slot = n % stages
            ptx.mbarrier_wait(full + 8 * slot, (n // stages) % 2)
            adesc = wgmma.smem_desc_sw128(base + slot * STAGE_BYTES)
            bdesc = wgmma.smem_desc_sw128(base + self.off_b1 + (n % B1_TILES) * B_BYTES)
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
            if cutlass.const_expr(n % REFILL == 0 and n > 0 and n - REFILL + B1_TILES < nk1):
                # MMAs up to n - 1 have retired: their B tiles take K blocks
                # n + 4 .. n + 7 (needed from iteration n + 4 on).
                first = n - REFILL + B1_TILES
                if tid // 8 >= first % 16:
                    if tid // 8 < first % 16 + REFILL:
                        self.fill_b1(
                            base, first + (tid // 8 - first % 16), chunk, codes, first // 16
                        )
                ptx.fence_proxy_async_shared()
                ptx.bar_sync(WG_BARRIER, MMA_THREADS)
        self.release(empty, (nk1 - 1) % stages, lane, 0)
        for s in cutlass.range_constexpr(sets):
            for h in cutlass.range_constexpr(2):
                acc1[s][h] = wgmma.fence_operands(acc1[s][h])

        # Scale and sum the columns of each row; quad lanes share a row.
        for j in cutlass.range_constexpr(2 * sets):
            w1s[j] = w1s[j] * ptx.ld_shared_f32(
                base + self.off_xscale + ((j // 2) * 8 + 2 * quad + j % 2) * 4
            )
        sums = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for h in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(2):
                v = Float32(0.0)
                for s in cutlass.range_constexpr(sets):
                    for c in cutlass.range_constexpr(2):
                        v = v + acc1[s][h][2 * r + c] * w1s[2 * s + c]
                sums[2 * h + r] = v
        acc = _quad_pick(sums, quad)

        if rank >= nk2:
            # Gate tile: hand the gate values to the matching up tile.
            peer = rank - nk2
            ptx.st_async_b32(
                ptx.mapa(base + self.off_gate + local * 4, peer), ptx.float_bits(acc),
                ptx.mapa(gate_in, peer),
            )  # fmt: skip
        else:
            ptx.mbarrier_wait_cluster(gate_in, 0)
            self.hidden_block(base, acc, local, tid, lane, rank, hrecv)

        # GEMM2: this CTA's rows; hidden block kb is B column kb.
        ptx.mbarrier_wait_cluster(hrecv, 0)
        ptx.fence_proxy_async_shared()
        hs = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
        for c in cutlass.range_constexpr(2):
            col = 2 * quad + c
            hs[c] = ptx.ld_shared_f32(base + self.off_hscale + cutlass.min(col, nk2 - 1) * 4)
            if col >= nk2:
                hs[c] = Float32(0.0)
        acc2 = [[[zero] * 4 for _ in range(2)] for _ in range(tiles2)]  # [tile][half]
        for m in cutlass.range_constexpr(tiles2 * nk2):
            n = nk1 + m
            slot = n % stages
            t, kb2 = m // nk2, m % nk2
            ptx.mbarrier_wait(full + 8 * slot, (n // stages) % 2)
            adesc = wgmma.smem_desc_sw128(base + slot * STAGE_BYTES)
            bdesc = wgmma.smem_desc_sw128(base + self.off_b2 + kb2 * B_BYTES)
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
        for t in cutlass.range_constexpr(tiles2):
            for h in cutlass.range_constexpr(2):
                acc2[t][h] = wgmma.fence_operands(acc2[t][h])
        # (the last stages need no release: nothing loads after them)

        for t in cutlass.range_constexpr(tiles2):
            sums2 = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            for h in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    v = Float32(0.0)
                    for c in cutlass.range_constexpr(2):
                        v = v + acc2[t][h][2 * r + c] * (w2s[2 * t + c] * hs[c])
                    sums2[2 * h + r] = v
            value = _quad_pick(sums2, quad)
            ptx.st_global_u16(out_row + Int64(out_rows[t]) * 2, ptx.cvt_bf16(value))

    @cute.jit
    def fill_b1(self, base, kb, chunk, codes, j: cutlass.Constexpr[int]):
        """Writes 16-byte chunk ``chunk`` of the token's K block ``kb`` (codes
        ``4 j .. 4 j + 3`` of this thread) into row kb % 8 of B tile kb % 8
        (128B swizzle: chunk c of row r at c ^ r)."""
        b = kb % B1_TILES
        ptx.st_shared_v4_u32(
            base + self.off_b1 + b * B_BYTES + b * TILE + ((chunk ^ b) * 16),
            codes[4 * j], codes[4 * j + 1], codes[4 * j + 2], codes[4 * j + 3],
        )  # fmt: skip

    @cute.jit
    def release(self, empty, slot: cutlass.Constexpr[int], lane, pending: cutlass.Constexpr[int]):
        """Waits until at most ``pending`` wgmma groups are in flight, then
        frees weight stage ``slot`` (one arrival per warp)."""
        wgmma.wgmma_wait(pending)
        if lane == 0:
            ptx.mbarrier_arrive(empty + 8 * slot)

    @cute.jit
    def hidden_block(self, base, up, local, tid, lane, rank, hrecv):
        """Clamped SwiGLU of this up tile's 128 values (logical order), FP8 per
        128 (scale amax / 448), sent as hidden K block ``rank`` (row ``rank``
        of GEMM2 B tile ``rank``) with its scale to every CTA of the cluster."""
        gate = ptx.ld_shared_f32(base + self.off_gate + local * 4)
        act = swiglu(gate, up, self.limit)
        amax = ptx.fmax_abs(Float32(0.0), act)
        for i in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << i, mask=-1))
        if lane == 0:
            ptx.st_shared_f32(base + self.off_amax + (tid // 32) * 4, amax)
        ptx.bar_sync(WG_BARRIER, MMA_THREADS)
        amax = cute.arch.fmax(
            cute.arch.fmax(ptx.ld_shared_f32(base + self.off_amax),
                           ptx.ld_shared_f32(base + self.off_amax + 4)),
            cute.arch.fmax(ptx.ld_shared_f32(base + self.off_amax + 8),
                           ptx.ld_shared_f32(base + self.off_amax + 12)),
        )  # fmt: skip
        scale = hidden_scale(amax)
        ptx.st_shared_u8(base + self.off_stage + local, fp8_code(act, scale))
        ptx.bar_sync(WG_BARRIER, MMA_THREADS)
        # Thread e < 8 * cluster sends 16-byte chunk e % 8 to CTA e // 8.
        if tid < 8 * self.cluster:
            peer = tid // 8
            chunk = tid % 8
            w = ptx.ld_shared_v4_u32(base + self.off_stage + chunk * 16)
            dst = base + self.off_b2 + rank * B_BYTES + rank * TILE + ((chunk ^ rank) * 16)
            remote_bar = ptx.mapa(hrecv, peer)
            ptx.st_async_v4_b32(ptx.mapa(dst, peer), w[0], w[1], w[2], w[3], remote_bar)
            if chunk == 0:
                ptx.st_async_b32(
                    ptx.mapa(base + self.off_hscale + rank * 4, peer), ptx.float_bits(scale),
                    remote_bar,
                )  # fmt: skip


def _load_bf16x16(addr: Int64, values) -> None:
    """Sixteen BF16 at 32-byte aligned ``addr`` into ``values`` as FP32."""
    for half in range(2):
        words = ptx.ld_global_nc_v4_u32(addr + half * 16)
        for w in range(4):
            values[half * 8 + 2 * w] = ptx.bf16_low(words[w])
            values[half * 8 + 2 * w + 1] = ptx.bf16_high(words[w])


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


def compile_kernel(spec: KernelSpec, **options) -> CompiledKernel:
    """Compiles one mega variant for sm_90a (no GPU needed); ``CUTE_DSL_ARCH``
    must have been sm_90a when cutlass was first imported. ``options``
    (stages, ctas_per_sm, prefetch, early_shared, order) override the tuned
    defaults. ``spec.shared_experts`` picks the ABI: ``PARAMS`` / ``MAPS``
    with the shared expert, ``ROUTED_PARAMS`` / ``ROUTED_MAPS`` without."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    assert spec.kernel == "mega" and spec.arch == "sm_90a", spec
    assert os.environ.get("CUTE_DSL_ARCH") == "sm_90a", "compile in an sm_90a process"
    kernel = MegaMoeSm90(spec, **options)
    e, h, i, m, k = spec.experts, spec.hidden, spec.inter, spec.tokens, spec.top_k
    logits_dtype = cutlass.BFloat16 if spec.logits_dtype == "bfloat16" else Float32

    def fake(dtype, *shape, align=16):
        return make_fake_compact_tensor(dtype, shape, assumed_align=align)

    shared = kernel.shared > 0
    names, maps = (PARAMS, MAPS) if shared else (ROUTED_PARAMS, ROUTED_MAPS)
    tensors = {
        "maps": fake(cutlass.Uint8, len(maps) * 128, align=64),
        "w13_scale": fake(Float32, e, 2 * i // TILE, h // TILE),
        "w2_scale": fake(Float32, e, h // TILE, i // TILE),
        "s13_scale": fake(Float32, 1, 2 * i // TILE, h // TILE),
        "s2_scale": fake(Float32, 1, h // TILE, i // TILE),
        "x": fake(cutlass.BFloat16, m, h),
        "logits": fake(logits_dtype, m, e),
        "bias": fake(Float32, e),
        "rows1": fake(Int32, 2 * i),
        "rows2": fake(Int32, h),
        "out": fake(cutlass.BFloat16, m * k, h),
        "shared_out": fake(cutlass.BFloat16, m, h),
        "ids": fake(Int32, m * k),
        "weights": fake(Float32, m * k),
    }
    args = tuple(tensors[n] for n in names)
    entry = kernel if shared else kernel.routed_only
    compiled = cute.compile(entry, *args, make_fake_stream())
    cubin = compiled.artifacts.CUBIN
    if cubin is None:
        raise RuntimeError("no cubin: set CUTE_DSL_KEEP=ptx,cubin before importing cutlass")
    return CompiledKernel(
        cubin=bytes(cubin),
        entry=f"{ENTRY}_0",
        params=tuple(Param(name, "pointer") for name in names),
        launch=kernel.launch_shape(),
        tensor_maps=maps,
        ptx=compiled.artifacts.PTX,
        notes={
            "stages": kernel.stages,
            "stage_bytes": STAGE_BYTES,
            "ctas_per_sm": kernel.ctas_per_sm,
            "prefetch": kernel.prefetch,
            "shared_routes": kernel.shared,
            "early_shared": kernel.early_shared,
            "order": kernel.order,
            "threads": THREADS,
            "cluster": kernel.cluster,
            "smem_layout": {
                "b1": kernel.off_b1,
                "b2": kernel.off_b2,
                "gate": kernel.off_gate,
                "stage": kernel.off_stage,
                "bars": kernel.off_bar,
            },  # fmt: skip
        },
    )
