"""Architecture-independent device code of the mega kernel (sm_90a and
sm_100a): what each cluster is (``mega_plan.cluster_role``), routing and the
ids/weights record, the token's FP8 quantization into B tiles, B-tile
zeroing, the K parts' meeting at part 0 (``meet_k_parts``), the hidden block
(clamped SwiGLU, FP8, broadcast to the cluster), DSMEM word stores, the output row and the finalize (``finish_slice``: the
last CTA to write a token's slice of rows sums them into ``final``); and the
compile step both kernels share (fake arguments from the ABI table, entry
name, PTX and cubin).

What differs per architecture is only the MMA and where its accumulators
live (``mega_moe_sm90``: warpgroup MMA into registers; ``mega_moe_sm100``:
UMMA into TMEM with separate producer, MMA and epilogue warps).

Conventions: global addresses are ``Int64`` bytes, shared addresses
``Int32`` (own CTA, or ``shared::cluster`` from ``mapa``); ``e`` is a
thread's index in the 128-thread group that quantizes the token and builds
the hidden block (the sm_90a MMA warpgroup, the sm_100a epilogue warps),
``lane`` its lane.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import mega_plan as mp
from kernels import moe_common as mc
from kernels import ptx
from kernels.abi import (
    MEGA_MAPS,
    MEGA_PARAMS,
    MEGA_ROUTED_MAPS,
    MEGA_ROUTED_PARAMS,
    fake_arguments,
)
from kernels.build_common import compile_entry, launch_named
from runtime.constants import TILE

#: The group that quantizes the token and builds the hidden block.
GROUP_THREADS = 128
#: ABI with the shared expert (``shared_experts == 1``) and without (kernels/abi.py).
PARAMS, MAPS = MEGA_PARAMS, MEGA_MAPS
ROUTED_PARAMS, ROUTED_MAPS = MEGA_ROUTED_PARAMS, MEGA_ROUTED_MAPS
MAP_BYTES = 128  # one CUtensorMap in the maps buffer


def abi(plan: mp.MegaPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(parameter names, tensor maps) of the variant: with the shared expert
    or routed only."""
    return (PARAMS, MAPS) if plan.shared else (ROUTED_PARAMS, ROUTED_MAPS)


@cute.jit
def resolve(plan: mp.MegaPlan, group, maps: Int64, w13_scale: Int64, w2_scale: Int64,
            s13_scale: Int64, s2_scale: Int64, out: Int64, shared_out: Int64):  # fmt: skip
    """What cluster ``group`` computes (``mega_plan.cluster_role``): returns
    ``(route, token, k, is_shared, map1, map2, scale1, scale2, row)``: the
    route (meaningless for a shared cluster), its token, the pick ``k``, the
    GEMM1/GEMM2 tensor maps and block scales of its expert set (routed:
    w13/w2; shared: s13/s2, whose expert is 0) and the address of its BF16
    output row (``out[route]`` or ``shared_out[token]``)."""
    route, shared_token, is_shared = mp.cluster_role(plan, group)
    token = route // plan.top_k
    k = route % plan.top_k
    map1 = maps
    scale1, scale2 = w13_scale, w2_scale
    row = out + Int64(route) * (plan.hidden * 2)
    if cutlass.const_expr(plan.shared > 0):
        if is_shared:
            token = shared_token
            map1 = maps + 2 * MAP_BYTES
            scale1 = s13_scale
            scale2 = s2_scale
            row = shared_out + Int64(shared_token) * (plan.hidden * 2)
    return route, token, k, is_shared, map1, map1 + MAP_BYTES, scale1, scale2, row


class MegaEntries:
    """The mega kernels' entry points, one set for both archs: ``__call__`` /
    ``routed_only`` (the launches with and without the shared expert's
    routes: ``PARAMS`` / ``ROUTED_PARAMS``) and ``kernel`` / ``kernel_routed``
    (their kernels, which pass every operand's address to the arch's
    ``body``; the shared expert's are 0 without one). An arch's kernel class
    provides ``ENTRY`` (the entry name's prefix), ``launch(kernel, stream)``
    and ``body``."""

    ENTRY = "moe_mega"

    @cute.jit
    def __call__(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                 s13_scale: cute.Tensor, s2_scale: cute.Tensor, x: cute.Tensor,
                 logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor, rows2: cute.Tensor,
                 out: cute.Tensor, shared_out: cute.Tensor, final: cute.Tensor,
                 ids: cute.Tensor, weights: cute.Tensor, arrivals: cute.Tensor,
                 stream):  # fmt: skip
        """Launch with the shared expert (``mega_common.PARAMS``)."""
        launch_named(self, self.kernel,
                     (maps, w13_scale, w2_scale, s13_scale, s2_scale, x, logits, bias, rows1,
                      rows2, out, shared_out, final, ids, weights, arrivals), stream)  # fmt: skip

    @cute.jit
    def routed_only(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                    x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor,
                    rows2: cute.Tensor, out: cute.Tensor, final: cute.Tensor,
                    ids: cute.Tensor, weights: cute.Tensor, arrivals: cute.Tensor,
                    stream):  # fmt: skip
        """Launch without a shared expert (``mega_common.ROUTED_PARAMS``)."""
        launch_named(self, self.kernel_routed,
                     (maps, w13_scale, w2_scale, x, logits, bias, rows1, rows2, out, final, ids,
                      weights, arrivals), stream)  # fmt: skip

    @cute.kernel
    def kernel(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
               s13_scale: cute.Tensor, s2_scale: cute.Tensor, x: cute.Tensor,
               logits: cute.Tensor, bias: cute.Tensor, rows1: cute.Tensor, rows2: cute.Tensor,
               out: cute.Tensor, shared_out: cute.Tensor, final: cute.Tensor,
               ids: cute.Tensor, weights: cute.Tensor, arrivals: cute.Tensor):  # fmt: skip
        self.body(
            maps.iterator.toint(), w13_scale.iterator.toint(), w2_scale.iterator.toint(),
            s13_scale.iterator.toint(), s2_scale.iterator.toint(), x.iterator.toint(),
            logits.iterator.toint(), bias.iterator.toint(), rows1.iterator.toint(),
            rows2.iterator.toint(), out.iterator.toint(), shared_out.iterator.toint(),
            final.iterator.toint(), ids.iterator.toint(), weights.iterator.toint(),
            arrivals.iterator.toint(),
        )  # fmt: skip

    @cute.kernel
    def kernel_routed(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                      x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor,
                      rows1: cute.Tensor, rows2: cute.Tensor, out: cute.Tensor,
                      final: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
                      arrivals: cute.Tensor):  # fmt: skip
        none = Int64(0)  # no shared routes: never read
        self.body(
            maps.iterator.toint(), w13_scale.iterator.toint(), w2_scale.iterator.toint(),
            none, none, x.iterator.toint(), logits.iterator.toint(), bias.iterator.toint(),
            rows1.iterator.toint(), rows2.iterator.toint(), out.iterator.toint(), none,
            final.iterator.toint(), ids.iterator.toint(), weights.iterator.toint(),
            arrivals.iterator.toint(),
        )  # fmt: skip


# -- routing ----------------------------------------------------------------------------------


@cute.jit
def route_and_record(plan: mp.MegaPlan, row_logits: Int64, bias: Int64, lane, k, route,
                     ids: Int64, weights: Int64, record, scale: cutlass.Constexpr[float],
                     logits_bf16: cutlass.Constexpr[bool], routing: cutlass.Constexpr):  # fmt: skip
    """Routes the token with this warp (``moe_common.route_token``): returns
    ``(expert, weight)``, pick ``k``'s expert (warp-uniform) and this lane's
    routing weight (lane j < top_k holds route j's, for ``finish_slice``);
    when ``record``, lane ``k`` stores ``ids[route]`` and ``weights[route]``."""
    ident, weight = mc.route_token(row_logits, bias, lane, plan.experts, plan.top_k, scale,
                                   logits_bf16, routing)  # fmt: skip
    if record:
        if lane == k:
            ptx.st_global_u32(ids + Int64(route) * 4, Uint32(ident))
            ptx.st_global_f32(weights + Int64(route) * 4, weight)
    return cute.arch.shuffle_sync(ident, k), weight


# -- the token into B tiles -------------------------------------------------------------------


@cute.jit
def quantize_chunk(x_row: Int64, kb, chunk, ue8m0: cutlass.Constexpr[bool]):
    """16-value chunk ``chunk`` (0..7) of the token's K block ``kb`` (BF16 row
    at ``x_row``), FP8 per 128 over the 8 lanes holding the block
    (``moe_common.quantize_activations``): ``(words, scale)``, four words of
    four codes."""
    values = cute.make_rmem_tensor(cute.make_layout((16,)), Float32)
    source = x_row + (Int64(kb) * TILE + chunk * 16) * 2
    mc.load_bf16x8(source, values, 0)
    mc.load_bf16x8(source + 16, values, 8)
    return mc.quantize_activations(values, 8, ue8m0)


def store_b_chunk(plan: mp.MegaPlan, b_tiles: Int32, tile, row, chunk, words) -> None:
    """Four words into chunk ``chunk`` of token row ``row`` of B tile ``tile``
    (``mega_plan.b_chunk``: 128-byte swizzle)."""
    ptx.st_shared_v4_u32(b_tiles + mp.b_chunk(plan, tile, row, chunk), words[0], words[1],
                         words[2], words[3])  # fmt: skip


@cute.jit
def zero_b_tiles(plan: mp.MegaPlan, b_tiles: Int32, tiles: cutlass.Constexpr[int], tid,
                 threads: cutlass.Constexpr[int], keep_diagonal: cutlass.Constexpr[bool]):  # fmt: skip
    """Zeroes ``tiles`` B tiles from ``b_tiles`` with ``threads`` threads
    (``tid`` < threads), 16 bytes a store. With ``keep_diagonal``, row t of
    tile t is left alone: other CTAs write it (GEMM2's hidden rows), so no
    ordering against their stores is needed."""
    per_tile = plan.b_bytes // 16
    chunks = tiles * per_tile
    zero = Uint32(0)
    for i in cutlass.range_constexpr(-(-chunks // threads)):
        c = i * threads + tid
        if c < chunks:
            if cutlass.const_expr(keep_diagonal):
                if (c % per_tile) // 8 != c // per_tile:
                    ptx.st_shared_v4_u32(b_tiles + c * 16, zero, zero, zero, zero)
            else:
                ptx.st_shared_v4_u32(b_tiles + c * 16, zero, zero, zero, zero)


# -- the hidden block -------------------------------------------------------------------------


@cute.jit
def hidden_block(plan: mp.MegaPlan, base: Int32, up: Float32, local, e, lane, block, hrecv,
                 barrier: cutlass.Constexpr[int], limit: cutlass.Constexpr):  # fmt: skip
    """The group of ``GROUP_THREADS`` (thread ``e`` holds logical row ``local``
    of this up tile: its ``up`` value; the gate values are in the ``gate``
    region): clamped SwiGLU, FP8 per 128 (scale ``max(amax, 1e-10) / 448``),
    sent as hidden K block ``block`` (token row ``block`` of GEMM2 B tile
    ``block``) with its scale to every CTA of the cluster, each completing
    ``TILE + 4`` bytes on that CTA's ``hrecv``. Named barrier ``barrier``
    orders the group's shared-memory steps."""
    gate = ptx.ld_shared_f32(base + plan.offset("gate") + local * 4)
    act = mc.swiglu(gate, up, limit)
    amax = mc.group_amax(ptx.fmax_abs(Float32(0.0), act), 32)
    amax_at = base + plan.offset("amax")
    if lane == 0:
        ptx.st_shared_f32(amax_at + (e // 32) * 4, amax)
    ptx.bar_sync(barrier, GROUP_THREADS)
    amax = ptx.fmax_nan(
        ptx.fmax_nan(ptx.ld_shared_f32(amax_at), ptx.ld_shared_f32(amax_at + 4)),
        ptx.fmax_nan(ptx.ld_shared_f32(amax_at + 8), ptx.ld_shared_f32(amax_at + 12)),
    )
    scale = mc.hidden_scale(amax)
    stage = base + plan.offset("stage")
    ptx.st_shared_u8(stage + local, mc.fp8_code(act, scale))
    ptx.bar_sync(barrier, GROUP_THREADS)
    # Thread e < 8 * cluster sends 16-byte chunk e % 8 to CTA e // 8.
    if e < 8 * plan.cluster:
        peer = e // 8
        chunk = e % 8
        w = ptx.ld_shared_v4_u32(stage + chunk * 16)
        dst = base + plan.offset("b2") + mp.b_chunk(plan, block, block, chunk)
        remote_bar = ptx.mapa(hrecv, peer)
        ptx.st_async_v4_b32(ptx.mapa(dst, peer), w[0], w[1], w[2], w[3], remote_bar)
        if chunk == 0:
            send_word(base + plan.offset("hscale") + block * 4, ptx.float_bits(scale), hrecv, peer)


@cute.jit
def finish_slice(plan: mp.MegaPlan, base: Int32, e, token, rank, weight, out: Int64,
                 shared_out: Int64, final: Int64, arrivals: Int64,
                 barrier: cutlass.Constexpr[int]):  # fmt: skip
    """The finalize, run by the group of ``GROUP_THREADS`` of every CTA once
    it has stored its slice of the output row (columns ``rank * rows2 ..``,
    ``mega_plan.slice_rows`` of them, of a route's ``out`` row or of
    ``shared_out[token]``).

    Protocol (no CTA waits on another): after a named barrier, thread 0
    releases the slice (``fence.acq_rel.gpu`` + ``atom.release.gpu.add`` on
    ``arrivals[token, rank]``); the CTA that sees ``plan.arrivals - 1`` there
    is the last of the token's clusters to write that slice. It zeroes the
    word for the next call (ordered after this grid by the kernel boundary:
    a dependent launch waits on ``griddepcontrol.wait`` before any access),
    acquires (``fence.acq_rel.gpu``) and writes ``final[token, slice]`` = the
    routes' BF16 rows weighted in top-k order in FP32, plus the shared row,
    rounded once to BF16: ``runtime.reference.finalize``. ``weight``: this
    lane's routing weight of the token (lane j holds route j's)."""
    ptx.bar_sync(barrier, GROUP_THREADS)
    flag = base + plan.offset("flag")
    counter = arrivals + Int64(token * plan.cluster + rank) * 4
    if e == 0:
        ptx.fence_acq_rel_gpu()  # cumulative: the stores the barrier ordered first
        ptx.st_shared_u32(flag, ptx.atom_add_release_gpu_u32(counter, Uint32(1)))
    ptx.bar_sync(barrier, GROUP_THREADS)
    if ptx.ld_shared_u32(flag) == Uint32(plan.arrivals - 1):
        ptx.fence_acq_rel_gpu()
        if e == 0:
            ptx.st_global_u32(counter, Uint32(0))
        picks = cute.make_rmem_tensor(cute.make_layout((plan.top_k,)), Float32)
        for k in cutlass.range_constexpr(plan.top_k):
            picks[k] = cute.arch.shuffle_sync(weight, k)
        per_row = plan.rows2 // 8
        if cutlass.const_expr(not plan.even2):
            per_row = mp.slice_rows(plan, rank, cutlass.min) // 8  # the last ranks' end at H
        for v in cutlass.range(e, per_row, GROUP_THREADS, unroll=1):
            column = Int64(rank * plan.rows2 + v * 8)
            total = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            for c in cutlass.range_constexpr(8):
                total[c] = Float32(0.0)
            for k in cutlass.range_constexpr(plan.top_k):
                route = Int64(token * plan.top_k + k)
                got = ptx.ld_global_cg_v4_u32(out + (route * plan.hidden + column) * 2)
                for c in cutlass.range_constexpr(4):
                    total[2 * c] = total[2 * c] + picks[k] * ptx.bf16_low(got[c])
                    total[2 * c + 1] = total[2 * c + 1] + picks[k] * ptx.bf16_high(got[c])
            row = (Int64(token) * plan.hidden + column) * 2
            if cutlass.const_expr(plan.shared > 0):
                got = ptx.ld_global_cg_v4_u32(shared_out + row)
                for c in cutlass.range_constexpr(4):
                    total[2 * c] = total[2 * c] + ptx.bf16_low(got[c])
                    total[2 * c + 1] = total[2 * c + 1] + ptx.bf16_high(got[c])
            ptx.st_global_v4_u32(
                final + row,
                *(ptx.cvt_bf16x2(total[2 * c], total[2 * c + 1]) for c in range(4)),
            )


@cute.jit
def meet_k_parts(plan: mp.MegaPlan, base: Int32, acc: Float32, row, rank, part, pair: Int32,
                 then):  # fmt: skip
    """The K parts of a GEMM1 row tile meet at part 0 (``plan.split`` > 1;
    thread ``row`` of the group holding physical row ``row``'s sum ``acc``
    of this CTA's K part ``part``): part p > 0 sends its sums into part 0's
    ``partial`` region (slot p - 1, 512 bytes completing on part 0's ``pair``
    barrier, which expects (split - 1) x 512), part 0 waits on ``pair``, adds
    the other parts' sums and calls ``then(acc)`` with the row tile's whole
    sum. Without a split (``part`` unused) ``then(acc)`` runs directly."""
    if cutlass.const_expr(plan.split == 1):
        then(acc)
    else:
        if part > 0:
            # K part ``part`` hands its row sums to part 0 of its row tile.
            send_word(base + plan.offset("partial") + ((part - 1) * TILE + row) * 4,
                      ptx.float_bits(acc), pair, rank - part)  # fmt: skip
        else:
            ptx.mbarrier_wait_cluster(pair, 0)
            for q in cutlass.range_constexpr(plan.split - 1):
                acc = acc + ptx.ld_shared_f32(base + plan.offset("partial") + (q * TILE + row) * 4)
            then(acc)


def send_word(local_addr: Int32, value, local_bar: Int32, peer) -> None:
    """``st.async`` of one word to the same shared offset in CTA ``peer``,
    completing 4 bytes on that CTA's barrier at ``local_bar``'s offset."""
    ptx.st_async_b32(ptx.mapa(local_addr, peer), value, ptx.mapa(local_bar, peer))


def store_output(row: Int64, logical, value: Float32) -> None:
    """``value`` as BF16 (round to nearest even) at logical column ``logical``
    of the output row at ``row``."""
    ptx.st_global_u16(row + Int64(logical) * 2, ptx.cvt_bf16(value))


# -- build ------------------------------------------------------------------------------------


def workspace(plan: mp.MegaPlan) -> dict[str, int]:
    """The variant's workspaces, name -> bytes: the finalize's arrival
    counts (zeroed once at allocation)."""
    return {"arrivals": plan.arrival_bytes}


def compile_mega(entry, plan: mp.MegaPlan, logits_dtype: str, prefix: str):
    """Compiles the jit function ``entry`` (the kernel object's launch) over
    fake arguments of the variant's ABI (``kernels.build_common``); returns
    ``(cubin, ptx, entry name, params, maps)``."""
    names, maps = abi(plan)
    args = fake_arguments(names, plan.hidden, plan.inter, plan.experts, plan.top_k, plan.tokens,
                          len(maps), logits_dtype, workspace(plan))  # fmt: skip
    cubin, ptx_text, name = compile_entry(entry, args, prefix)
    return cubin, ptx_text, name, names, maps


def notes(plan: mp.MegaPlan, threads: int, **extra) -> dict:
    """The compile notes of a mega variant (one schema for both archs; an
    arch adds its own keys through ``extra``)."""
    from runtime.constants import SMEM_LIMIT

    return {
        "stages": plan.stages,
        "stage_bytes": mp.STAGE_BYTES,
        "ctas_per_sm": plan.ctas_per_sm,
        "threads": threads,
        "cluster": plan.cluster,
        "order": plan.order,
        "shared_routes": plan.shared,
        "loads_per_cta": plan.loads,
        "smem_layout": plan.regions.table(),
        "smem_limit": SMEM_LIMIT[plan.arch],
        **extra,
    }
