"""Architecture-independent device functions of the MoE kernels: routing,
activation quantization, clamped SwiGLU, the hidden block's FP8 code and the
physical -> logical row map. Every kernel (both mega kernels, both grouped
kernels, sm_90a and sm_100a) calls these, so the H200 tests exercise the same
code the sm_100a cubins contain. The math is ``docs/semantics.md``'s.

Units: global addresses are ``Int64`` bytes; ``lane`` is the lane in the warp.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import ptx, routing
from kernels.routing import LANES, candidates
from runtime.constants import FP8_MAX

SCALE_FLOOR = 1e-10  # amax floor of every quantization scale
LOG2E = 1.4426950408889634


# -- float helpers -------------------------------------------------------------------------


def sigmoid(x: Float32) -> Float32:
    """1 / (1 + e^-x) with ``ex2.approx`` and ``rcp.approx`` (a few ulp; the
    reference's exact sigmoid can flip only near-tied routing picks)."""
    return ptx.rcp_approx(Float32(1.0) + ptx.ex2_approx(x * Float32(-LOG2E)))


def ue8m0_round(scale: Float32) -> Float32:
    """``2^ceil(log2(max(scale, 1e-10)))`` for a positive scale: the exponent
    field plus one when any mantissa bit is set."""
    bits = ptx.float_bits(cute.arch.fmax(scale, Float32(SCALE_FLOOR)))
    exponent = (bits >> 23) + Uint32((bits & Uint32(0x7FFFFF)) != Uint32(0))
    # NaN stays NaN (the rounded value is never below a finite scale).
    return ptx.fmax_nan(ptx.bits_float(exponent << 23), scale)


def hidden_scale(amax: Float32) -> Float32:
    """The hidden block's FP8 scale, ``max(amax, 1e-10) / 448`` (IEEE division,
    never UE8M0-rounded)."""
    return ptx.div_rn(ptx.fmax_nan(amax, Float32(SCALE_FLOOR)), Float32(FP8_MAX))


def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32) -> Uint32:
    """Four FP32 values as e4m3 bytes of one word (``a`` lowest), rounded to
    nearest even from FP32 exactly like torch's conversion (``round_e4m3``)
    and saturated at +-448 (= clamping first)."""
    return ptx.cvt_e4m3x4(ptx.round_e4m3(a), ptx.round_e4m3(b), ptx.round_e4m3(c),
                          ptx.round_e4m3(d))  # fmt: skip


def fp8_code(value: Float32, scale: Float32) -> Uint32:
    """The e4m3 byte of ``value / scale`` (IEEE division, round to nearest
    even, saturating) in the low byte of a word."""
    zero = Float32(0.0)
    return e4m3x4(ptx.div_rn(value, scale), zero, zero, zero) & Uint32(0xFF)


@cute.jit
def group_amax(value: Float32, lanes: cutlass.Constexpr[int]) -> Float32:
    """Max over groups of ``lanes`` consecutive lanes (a power of two <= 32,
    groups aligned) of ``value`` (butterfly shuffles; every lane gets it)."""
    result = value
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        result = ptx.fmax_nan(result, cute.arch.shuffle_sync_bfly(result, offset=1 << i, mask=-1))
    return result


# -- routing -------------------------------------------------------------------------------


@cute.jit
def group_sum(value: Float32, lanes: cutlass.Constexpr[int]) -> Float32:
    """Sum over groups of ``lanes`` consecutive lanes (as ``group_amax``;
    butterfly order, so every lane gets the same sum)."""
    result = value
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        result = result + cute.arch.shuffle_sync_bfly(result, offset=1 << i, mask=-1)
    return result


@cute.jit
def _route_keys(logits, bias, lane, experts: cutlass.Constexpr[int],
                logits_bf16: cutlass.Constexpr[bool], routing: cutlass.Constexpr):  # fmt: skip
    """Scores and order keys (of score + bias) of the experts lane l holds
    (l + 32 j), as two register tensors. ``routing`` (``kernels.spec.Routing``,
    fixed at compile time): scores are the sigmoid of each logit, or the
    softmax over the token's experts (``e^(l - max) / sum``: the max and the
    sum over the warp, butterflies, so every lane gets the same values;
    ``ex2.approx.ftz`` makes a score below ~1e-38 of the best 0); the bias
    is added only when ``routing.bias``; with
    ``routing.limits_groups`` the keys outside the token's kept groups are
    ``routing.MASKED_KEY`` (``_keep_groups``). When 32 does not divide
    ``experts``, lanes past the end of the last row load expert E - 1 (an
    address inside the row) and their candidate is dropped: score -inf
    before a softmax (so e^ gives 0), key 0 ("no candidate")."""
    per = candidates(experts)
    tail = experts % LANES  # lanes with a candidate in the last row (0: all)
    scores = cute.make_rmem_tensor(cute.make_layout((per,)), Float32)
    offsets = cute.make_rmem_tensor(cute.make_layout((per,)), Float32)
    keys = cute.make_rmem_tensor(cute.make_layout((per,)), Uint32)
    # Every load first: interleaved with the sigmoids they would serialize.
    for j in cutlass.range_constexpr(per):
        expert = Int64(j * 32 + lane)
        if cutlass.const_expr(tail and j == per - 1):
            expert = Int64(cutlass.min(j * 32 + lane, experts - 1))
        if cutlass.const_expr(logits_bf16):
            scores[j] = ptx.bf16_low(ptx.ld_global_u16(logits + expert * 2))
        else:
            scores[j] = ptx.ld_global_f32(logits + expert * 4)
        if cutlass.const_expr(routing.bias):
            offsets[j] = ptx.ld_global_f32(bias + expert * 4)
    if cutlass.const_expr(tail):
        present = lane < tail
    if cutlass.const_expr(routing.score == "softmax"):
        if cutlass.const_expr(tail):
            scores[per - 1] = scores[per - 1] if present else Float32(-math.inf)
        top = scores[0]
        for j in cutlass.range_constexpr(1, per):
            top = ptx.fmax_nan(top, scores[j])
        top = group_amax(top, 32)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(per):
            scores[j] = ptx.ex2_approx((scores[j] - top) * Float32(LOG2E))
            total = total + scores[j]
        total = group_sum(total, 32)
        for j in cutlass.range_constexpr(per):
            scores[j] = ptx.div_rn(scores[j], total)
    for j in cutlass.range_constexpr(per):
        if cutlass.const_expr(routing.score == "sigmoid"):
            scores[j] = sigmoid(scores[j])
        if cutlass.const_expr(routing.bias):
            keys[j] = ptx.float_order_key(scores[j] + offsets[j])
        else:
            keys[j] = ptx.float_order_key(scores[j])
    if cutlass.const_expr(routing.limits_groups):
        _keep_groups(keys, lane, experts, routing.groups, routing.groups_kept)
    # After the group stage, which counts no lane past E in any group but
    # masks it as a dropped group's expert.
    if cutlass.const_expr(tail):
        keys[per - 1] = keys[per - 1] if present else Uint32(0)
    return scores, keys


class _WarpOps:
    """``kernels.routing``'s operations on the device: DSL registers of each
    lane, ``redux.sync`` reductions over the warp."""

    int32, uint32 = Int32, Uint32
    redux_max = staticmethod(ptx.redux_max_u32)
    redux_min = staticmethod(ptx.redux_min_u32)
    key_value = staticmethod(ptx.order_key_float)

    @staticmethod
    def select(cond, a, b):
        return type(a)(cutlass.select_(cond, a, type(a)(b)))


def _keep_groups(keys, lane, experts: int, groups: int, kept: int) -> None:
    """Sets the keys (a register tensor) of the experts outside the token's
    ``kept`` best groups to ``routing.MASKED_KEY`` (``kernels.routing.keep_groups``)."""
    per = cute.size(keys)
    kept_keys = routing.keep_groups([keys[j] for j in range(per)], lane, experts, groups, kept,
                                    routing.MASKED_KEY, _WarpOps)  # fmt: skip
    for j in range(per):
        keys[j] = kept_keys[j]


@cute.jit
def _sort_candidates(keys, lane):
    """Sorts the lane's candidates best first: returns ``(keys, experts)``,
    register tensors ordered by key descending, ties to the lower expert
    (odd-even transposition network: ``per`` rounds of compare-exchanges, no
    data-dependent branches). A selection round then only reads each lane's
    head and shifts the winner's list (H200, 288 experts: the M=1 mega call
    19.19 -> 18.90 us against a rescan of every candidate per round)."""
    per = cute.size(keys)
    ks = cute.make_rmem_tensor(cute.make_layout((per,)), Uint32)
    es = cute.make_rmem_tensor(cute.make_layout((per,)), Uint32)
    for j in cutlass.range_constexpr(per):
        ks[j] = keys[j]
        es[j] = Uint32(j * 32) + Uint32(lane)
    for r in cutlass.range_constexpr(per):
        for a in cutlass.range_constexpr(r % 2, per - 1, 2):
            ka, kb, ea, eb = ks[a], ks[a + 1], es[a], es[a + 1]
            swap = (kb > ka) | ((kb == ka) & (eb < ea))
            ks[a] = kb if swap else ka
            ks[a + 1] = ka if swap else kb
            es[a] = eb if swap else ea
            es[a + 1] = ea if swap else eb
    return ks, es


@cute.jit
def _take_head(ks, es):
    """One selection round over sorted lists (``_sort_candidates``): the
    expert with the largest key (ties: lower expert), warp-uniform; the
    winning lane drops its head (a taken list ends in key 0)."""
    per = cute.size(ks)
    top = ptx.redux_max_u32(ks[0])
    candidate = Uint32(0xFFFFFFFF)
    if ks[0] == top:
        candidate = es[0]
    winner = ptx.redux_min_u32(candidate)
    mine = es[0] == winner
    for j in cutlass.range_constexpr(per - 1):
        ks[j] = ks[j + 1] if mine else ks[j]
        es[j] = es[j + 1] if mine else es[j]
    if mine:
        ks[per - 1] = Uint32(0)
    return Int32(winner)


@cute.jit
def _score_of(scores, expert, lane):
    """The score of ``expert`` (warp-uniform), held by lane ``expert % 32``."""
    per = cute.size(scores)
    score = Float32(0.0)
    for j in cutlass.range_constexpr(per):
        if expert == j * 32 + lane:
            score = scores[j]
    return cute.arch.shuffle_sync(score, expert % 32)


@cute.jit
def route_pick(
    logits: Int64,
    bias: Int64,
    lane: Int32,
    k: Int32,
    experts: cutlass.Constexpr[int],
    top_k: cutlass.Constexpr[int],
    logits_bf16: cutlass.Constexpr[bool],
    routing: cutlass.Constexpr,
) -> Int32:
    """Expert of route ``k`` (0-based, selection order) of one token, with one
    warp (warp-uniform result): ``route_token``'s selection, stopped after
    round ``k`` (no weight), for a caller whose next step waits on it; the
    same rule on ``griddepcontrol.wait`` as ``route_token``."""
    _, keys = _route_keys(logits, bias, lane, experts, logits_bf16, routing)
    ks, es = _sort_candidates(keys, lane)
    pick = Int32(0)
    for r in cutlass.range_constexpr(top_k):
        if r <= k:
            pick = _take_head(ks, es)
    return pick


@cute.jit
def route_token(
    logits: Int64,
    bias: Int64,
    lane: Int32,
    experts: cutlass.Constexpr[int],
    top_k: cutlass.Constexpr[int],
    scale: cutlass.Constexpr[float],
    logits_bf16: cutlass.Constexpr[bool],
    routing: cutlass.Constexpr,
):
    """Routes one token with one warp: returns ``(expert, weight)`` where lane
    k < top_k holds route k (selection order, best first); other lanes hold
    junk.

    ``logits``: address of the token's row of ``experts`` router logits (FP32,
    or BF16 when ``logits_bf16``); ``bias``: address of the FP32 [experts]
    score-correction bias (not read without ``routing.bias``). Scores ``s``
    (FP32) by ``routing`` (``_route_keys``: sigmoid or softmax); the top_k
    largest ``s + bias`` win (only the kept groups' experts when groups are
    dropped), ties to the lower expert (a uint32 order key; each lane's
    candidates sorted once, then per round ``redux.sync`` max of the lanes'
    heads and min expert among the lanes holding it); ``weight_k = s_k /
    sum_j s_j * scale`` (sum in selection order), or ``s_k * scale`` without
    ``routing.renormalize``. Lane l holds experts l + 32 j (any ``experts``
    in ``routing.experts_problems``: the last row may be partial). Issue it after a ``griddepcontrol.wait`` that
    no branch goes around: the logits and the bias are read with weak
    loads, which ptxas keeps after such a wait (``ld.global.nc`` it moved
    across one, even an unconditional one; ``kernels/ptx/memory.py``), but
    a wait in a branch does not dominate the loads where the branches meet
    (the compile tests walk each build's SASS control flow for that,
    ``tests/sass_tools.py``)."""
    scores, keys = _route_keys(logits, bias, lane, experts, logits_bf16, routing)
    ks, es = _sort_candidates(keys, lane)
    total = Float32(0.0)
    mine = Int32(0)
    picked = Float32(0.0)
    for r in cutlass.range_constexpr(top_k):
        winner = _take_head(ks, es)
        score = _score_of(scores, winner, lane)
        if cutlass.const_expr(routing.renormalize):
            total = total + score
        if lane == r:
            mine = winner
            picked = score
    if cutlass.const_expr(routing.renormalize):
        return mine, ptx.div_rn(picked, total) * Float32(scale)
    return mine, picked * Float32(scale)


# -- quantization --------------------------------------------------------------------------


@cute.jit
def quantize_activations(values, lanes: cutlass.Constexpr[int], ue8m0: cutlass.Constexpr[bool]):
    """FP8 quantization of one 128-column group of a token spread over
    ``lanes`` consecutive lanes (aligned), each holding ``len(values)`` FP32
    values (a register tensor; 128 = lanes * len(values)).

    ``amax = max(1e-10, max|x|)``, ``sx = amax / 448`` (IEEE), rounded up to a
    power of two with ``ue8m0``; codes ``e4m3(x * (1 / sx))`` (the correctly
    rounded reciprocal, as ``runtime.reference`` does; round to
    nearest even, saturating: ``e4m3x4``). Returns ``(words, sx)``: a register tensor of
    len(values) / 4 words, four codes each, the first value in the lowest
    byte."""
    n = cute.size(values)
    amax = Float32(SCALE_FLOOR)
    for v in cutlass.range_constexpr(n):
        amax = ptx.fmax_abs(amax, values[v])
    amax = group_amax(amax, lanes)
    sx = ptx.div_rn(amax, Float32(FP8_MAX))
    if cutlass.const_expr(ue8m0):
        sx = ue8m0_round(sx)
    inverse = ptx.div_rn(Float32(1.0), sx)
    words = cute.make_rmem_tensor(cute.make_layout((n // 4,)), Uint32)
    for w in cutlass.range_constexpr(n // 4):
        words[w] = e4m3x4(
            ptx.mul_rn(values[4 * w], inverse),
            ptx.mul_rn(values[4 * w + 1], inverse),
            ptx.mul_rn(values[4 * w + 2], inverse),
            ptx.mul_rn(values[4 * w + 3], inverse),
        )
    return words, sx


def load_bf16x8(addr: Int64, values, first: int) -> None:
    """Eight BF16 at 16-byte aligned ``addr`` into ``values[first:first + 8]``
    as FP32 (one weak ``ld.global.v4``: x may come from the previous grid)."""
    words = ptx.ld_global_v4_u32(addr)
    for w in range(4):
        values[first + 2 * w] = ptx.bf16_low(words[w])
        values[first + 2 * w + 1] = ptx.bf16_high(words[w])


# -- expert math ---------------------------------------------------------------------------


def swiglu(gate: Float32, up: Float32, limit: float | None) -> Float32:
    """Clamped SwiGLU: ``g = min(gate, limit)``, ``u = clamp(up, -limit,
    limit)``, ``g * sigmoid(g) * u`` (no alpha, no +1); ``limit`` None (fixed
    at compile time): plain SwiGLU, ``gate * sigmoid(gate) * up``. The clamps keep NaN
    (``min.NaN`` / ``max.NaN``, as torch's clamp does), so a token whose
    input holds a NaN or Inf (its FP8 codes or scale are then NaN) keeps a
    non-finite output instead of a clamped finite one."""
    if limit is None:
        return gate * sigmoid(gate) * up
    lim = Float32(limit)
    g = ptx.fmin_nan(gate, lim)
    u = ptx.fmax_nan(ptx.fmin_nan(up, lim), -lim)
    return g * sigmoid(g) * u


def logical_row(rows: Int64, physical) -> Int32:
    """The logical row of ``physical`` through the int32 row table at ``rows``
    (``runtime.layout.logical_rows``: rows are shuffled within 16-row groups)."""
    return Int32(ptx.ld_global_nc_u32(rows + Int64(physical) * 4))
