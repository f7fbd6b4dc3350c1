"""The torch reference of docs/semantics.md, on CPU or GPU.

Every step the kernels take, written plainly: routing (every family of
docs/models.md, of which the kernels serve sigmoid + bias without groups),
FP8 activation quantization, GEMM1 with block scales, clamped (or, for a
model without a clamp, plain) SwiGLU, FP8 hidden
quantization, GEMM2, the shared expert and finalize. ``dtype`` selects the
accumulation precision (``torch.float32`` or ``torch.float64``).

Both FP8 quantizations reproduce the kernels' values bit for bit: the scale is
``amax / 448`` (IEEE division), activations are multiplied by the correctly
rounded reciprocal of their scale (as the kernels do:
``kernels.moe_common.quantize_activations``), hidden values are divided by
theirs, both are clamped to +-448 and cast with round-to-nearest-even (the
PTX ``cvt.rn.satfinite.e4m3x2.f32`` of the kernels). So the activation FP8
values are exact, and kernel-vs-reference differences come from accumulation
order (and, through it, from the hidden values' rounding).

Imports neither cutlass nor anything outside torch and this package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.constants import FP8_MAX, TILE
from runtime.layout import CheckpointWeights, ExpertWeights, logical_rows, swap_halves
from runtime.model import SCORES, MoEShape

FP8 = torch.float8_e4m3fn
SCALE_FLOOR = 1e-10  # amax floor of both quantizations


# Routing ----------------------------------------------------------------------
#
# Every family of docs/models.md, per token, in FP32 (in both accumulation
# modes): scores over all experts (sigmoid or softmax); selection keys = scores
# plus the score-correction bias when the model has one; with expert groups,
# only the experts of the best ``groups_kept`` groups can be chosen; the
# ``top_k`` largest keys win; weights come from the unbiased scores, divided by
# their sum when the model renormalizes, times the routed scale. Equal keys go
# to the lower expert index, equal group scores to the lower group index (as
# the kernels order their candidates: a stable descending sort).


def routing_scores(logits: torch.Tensor, score: str = "sigmoid") -> torch.Tensor:
    """FP32 [M, E] router scores of [M, E] logits (BF16 logits are widened to
    FP32 exactly first): ``sigmoid`` elementwise, or ``softmax`` over each
    token's experts."""
    z = logits.float()
    if score == "sigmoid":
        return torch.sigmoid(z)
    if score == "softmax":
        return torch.softmax(z, dim=-1)
    raise ValueError(f"score {score!r}: must be one of {', '.join(SCORES)}")


def group_scores(keys: torch.Tensor, groups: int) -> torch.Tensor:
    """FP32 [M, groups]: each group's score, the sum of the two largest keys
    among its ``E / groups`` consecutive experts (DeepSeek-V3's ``noaux_tc``)."""
    m, e = keys.shape
    if groups < 1 or e % groups or e // groups < 2:
        raise ValueError(f"{e} experts do not form {groups} groups of at least 2")
    best = torch.sort(keys.view(m, groups, e // groups), dim=-1, descending=True).values
    return best[..., 0] + best[..., 1]


def selection_keys(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    groups: int = 1,
    groups_kept: int | None = None,
) -> torch.Tensor:
    """FP32 [M, E]: the keys experts are selected by. ``scores + bias`` (the
    scores alone when ``bias`` is None); when ``groups_kept`` (default: all)
    is below ``groups``, the keys of experts outside a token's kept groups are
    -inf (a biased key can be negative, so they are not zeroed). The kept
    groups are the ``groups_kept`` best by ``group_scores``, ties to the lower
    group."""
    keys = scores if bias is None else scores + bias.float()[None, :]
    kept = groups if groups_kept is None else groups_kept
    if not 1 <= kept <= groups:
        raise ValueError(f"groups_kept {kept}: must be in 1..groups ({groups})")
    if kept == groups:
        return keys
    m, e = keys.shape
    best = torch.sort(group_scores(keys, groups), dim=-1, descending=True, stable=True)
    allowed = torch.zeros(m, groups, dtype=torch.bool, device=keys.device)
    allowed.scatter_(1, best.indices[:, :kept], True)
    allowed = allowed.repeat_interleave(e // groups, dim=1)
    return keys.masked_fill(~allowed, float("-inf"))


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scale: float,
    *,
    score: str = "sigmoid",
    groups: int = 1,
    groups_kept: int | None = None,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [M, top_k] expert ids (best first) and FP32 [M, top_k] weights.

    Scores ``s = routing_scores(logits, score)`` select by
    ``selection_keys(s, bias, groups, groups_kept)``, ties going to the lower
    expert; weights are ``s[id] / sum(s[ids]) * scale`` with the sum taken in
    selection order (as the kernels do), or ``s[id] * scale`` without
    ``renormalize``. The defaults are the kernels' routing (sigmoid + bias,
    no groups). ValueError when the kept groups hold fewer than ``top_k``
    experts."""
    s = routing_scores(logits, score)
    keys = selection_keys(s, bias, groups, groups_kept)
    kept = groups if groups_kept is None else groups_kept
    if top_k > kept * (keys.shape[1] // groups):
        raise ValueError(f"top_k {top_k}: the {kept} kept groups hold fewer experts")
    # A stable descending sort keeps equal keys in index order: ties -> lower id.
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return order.to(torch.int32), _weights(s, order, scale, renormalize)


def route_for(
    logits: torch.Tensor, bias: torch.Tensor | None, shape: MoEShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` with ``shape``'s routing. ``bias`` is required when
    ``shape.bias`` and ignored otherwise."""
    return route(logits, _bias_of(bias, shape), shape.top_k, shape.routed_scale,
                 **_family(shape))  # fmt: skip


def weights_for(logits: torch.Tensor, ids: torch.Tensor, shape: MoEShape) -> torch.Tensor:
    """FP32 [M, top_k]: ``shape``'s routing weights for the given expert ids
    (int [M, top_k], in their order), whoever chose them."""
    s = routing_scores(logits, shape.score)
    return _weights(s, ids.long(), shape.routed_scale, shape.renormalize)


def _weights(s: torch.Tensor, ids: torch.Tensor, scale: float, renormalize: bool):
    picked = s.gather(1, ids)
    factor = torch.tensor(scale, dtype=torch.float32, device=s.device)
    if not renormalize:
        return picked * factor
    total = torch.zeros_like(picked[:, 0])
    for k in range(ids.shape[1]):
        total = total + picked[:, k]
    return picked / total[:, None] * factor


def _family(shape: MoEShape) -> dict:
    return {"score": shape.score, "groups": shape.groups, "groups_kept": shape.groups_kept,
            "renormalize": shape.renormalize}  # fmt: skip


def _bias_of(bias: torch.Tensor | None, shape: MoEShape) -> torch.Tensor | None:
    if not shape.bias:
        return None
    if bias is None:
        raise ValueError("this shape routes with a score-correction bias: pass it")
    return bias


def tie_margin(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    score: str = "sigmoid",
    groups: int = 1,
    groups_kept: int | None = None,
    order: bool = True,
) -> torch.Tensor:
    """FP32 [M]: the smallest gap between consecutive keys among each token's
    ``top_k + 1`` best (experts of dropped groups excluded) and, when groups
    are dropped, the gap between the last kept and the first dropped group
    score (the order among kept groups changes nothing). A kernel whose score
    function is a few ulp off may order (or pick) experts differently where
    this is tiny: tests count such tokens apart instead of calling them
    wrong. With ``order`` False, of the keys only the gap at the selection's
    edge (the ``top_k``-th best against the next): what can change the set
    of experts picked, and so an output that depends on the set alone (the
    weighted sum ``final``), where ``order`` True also counts the order of
    the picks (``ids``)."""
    s = routing_scores(logits, score)
    keys = selection_keys(s, bias, groups, groups_kept)
    gaps = _gaps(keys, top_k + 1)
    if order:
        margin = gaps.amin(dim=-1)
    elif keys.shape[-1] > top_k:
        margin = gaps[:, top_k - 1]
    else:  # every expert picked: no edge
        margin = torch.full(keys.shape[:-1], float("inf"), device=keys.device)
    kept = groups if groups_kept is None else groups_kept
    if kept < groups:
        plain = s if bias is None else s + bias.float()[None, :]
        best = torch.sort(group_scores(plain, groups), dim=-1, descending=True).values
        margin = torch.minimum(margin, best[:, kept - 1] - best[:, kept])
    return margin


def tie_margin_for(logits: torch.Tensor, bias: torch.Tensor | None,
                   shape: MoEShape, order: bool = True) -> torch.Tensor:  # fmt: skip
    """``tie_margin`` under ``shape``'s routing (score function, groups; the
    bias only where ``shape.bias``, as ``route_for`` reads it)."""
    return tie_margin(logits, bias if shape.bias else None, shape.top_k, score=shape.score,
                      groups=shape.groups, groups_kept=shape.groups_kept, order=order)  # fmt: skip


def _gaps(values: torch.Tensor, count: int) -> torch.Tensor:
    """[M, min(count, E) - 1]: the gaps between consecutive values among each
    row's ``count`` largest, in order."""
    best = torch.sort(values, dim=-1, descending=True).values[:, :count]
    # -inf - -inf (two excluded experts) is NaN: not a near tie.
    return (best[:, :-1] - best[:, 1:]).nan_to_num(nan=float("inf"))


# Quantization -----------------------------------------------------------------


def ue8m0_round(scale: torch.Tensor) -> torch.Tensor:
    """Rounds positive FP32 scales up to powers of two (bit-exact: exponent
    plus one when the mantissa is non-zero), after a floor of 1e-10."""
    bits = scale.float().clamp_min(SCALE_FLOOR).view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


def quantize_activations(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 [M, H] tokens and FP32 [M, H/128] scales, per 128-column group
    (vLLM's per_token_group_quant_fp8)."""
    m, h = x.shape
    groups = x.float().view(m, h // TILE, TILE)
    amax = groups.abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    # Divide by a tensor: on CUDA, torch turns division by a Python scalar into
    # a multiply by its reciprocal (one ulp off IEEE; measured on the H200: 61%
    # of scales differ and 0.2% of FP8 codes flip at exact ties).
    sx = amax / _full(amax, FP8_MAX)
    if ue8m0:
        sx = ue8m0_round(sx)
    inverse = 1.0 / sx
    q = (groups * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, h), sx


def quantize_hidden(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 [T, I] hidden values and [T, I/128] scales (``a``'s dtype), per
    128-column block: scale ``max(amax, 1e-10) / 448`` (never UE8M0)."""
    t, i = a.shape
    blocks = a.view(t, i // TILE, TILE)
    amax = blocks.abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    sh = amax / _full(amax, FP8_MAX)  # IEEE division on CUDA too (see above)
    q = (blocks / sh[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(t, i), sh


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU: ``min(gate, limit) * sigmoid(.) * clamp(up, +-limit)``;
    ``silu(gate) * up`` when ``limit`` is None (a model without a clamp)."""
    if limit is None:
        return gate * torch.sigmoid(gate) * up
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return g * torch.sigmoid(g) * u


# GEMMs with block scales ----------------------------------------------------------


def block_scaled_gemm(
    q: torch.Tensor, sq: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, dtype
) -> torch.Tensor:
    """[T, N] = sum over K blocks kb of ``w_scale[n/128, kb] * sq[t, kb] *
    (w[n, kb-block] . q[t, kb-block])``, accumulated in ``dtype``.

    q: FP8 [T, K]; sq: [T, K/128]; w: FP8 [N, K] (logical rows);
    w_scale: FP32 [N/128, K/128]."""
    t, k = q.shape
    n = w.shape[0]
    nb = k // TILE
    partial = torch.einsum(
        "nbk,tbk->tnb", w.to(dtype).view(n, nb, TILE), q.to(dtype).view(t, nb, TILE)
    )
    scale = w_scale.to(dtype).repeat_interleave(TILE, dim=0)  # [N, K/128]
    return (partial * (scale[None] * sq.to(dtype)[:, None, :])).sum(dim=-1)


def _logical_w13(weights: CheckpointWeights | ExpertWeights, e: int):
    """Expert e's GEMM1 weight [2I, H] in checkpoint row order ([gate; up])
    and its scale [2I/128, H/128]."""
    if isinstance(weights, CheckpointWeights):
        return weights.w13[e], weights.w13_scale[e]
    # Kernel layout: un-block-major, then scatter physical rows to logical
    # rows with the table the kernels' epilogues use, then undo the W31 swap.
    w31 = _physical_to_logical(weights.w13[e])
    w = swap_halves(w31.view(torch.uint8), dim=0).view(FP8)
    return w, swap_halves(weights.w13_scale[e], dim=0)


def _logical_w2(weights: CheckpointWeights | ExpertWeights, e: int):
    if isinstance(weights, CheckpointWeights):
        return weights.w2[e], weights.w2_scale[e]
    return _physical_to_logical(weights.w2[e]), weights.w2_scale[e]


def _physical_to_logical(w: torch.Tensor) -> torch.Tensor:
    """[K/128, N, 128] BlockMajorK (shuffled rows) -> [N, K] logical rows."""
    kb, n, _ = w.shape
    flat = w.view(torch.uint8).permute(1, 0, 2).reshape(n, kb * TILE)
    out = torch.empty_like(flat)
    out[logical_rows(n, w.device).long()] = flat
    return out.view(FP8)


@dataclass(frozen=True)
class ExpertTrace:
    """One expert applied to T tokens: output [T, H] (unrounded, ``dtype``)
    and the intermediate FP8 hidden values and scales."""

    y: torch.Tensor
    hidden_q: torch.Tensor
    hidden_scale: torch.Tensor


def expert_forward(
    xq: torch.Tensor,
    sx: torch.Tensor,
    weights: CheckpointWeights | ExpertWeights,
    e: int,
    limit: float | None,
    dtype=torch.float32,
) -> ExpertTrace:
    """Expert ``e`` of ``weights`` (either layout) on quantized tokens."""
    w13, s13 = _logical_w13(weights, e)
    w2, s2 = _logical_w2(weights, e)
    inter = w13.shape[0] // 2
    h1 = block_scaled_gemm(xq, sx, w13, s13, dtype)
    a = swiglu(gate=h1[:, :inter], up=h1[:, inter:], limit=limit)
    aq, sh = quantize_hidden(a)
    y = block_scaled_gemm(aq, sh, w2, s2, dtype)
    return ExpertTrace(y=y, hidden_q=aq, hidden_scale=sh)


# The layer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEReference:
    """Reference outputs of one call (``dtype`` unless stated).

    out [M*top_k, H]: route (t, k) at row t*top_k + k, unweighted, unrounded;
    ids int32 [M, top_k]; weights FP32 [M, top_k]; shared [M, H] (None without
    a shared expert); final [M, H] = sum_k weights * out + shared, summed in
    top-k order from the BF16-rounded route and shared rows in float32 mode
    (as the kernels finalize), from the unrounded ones in float64 mode."""

    out: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor | None
    final: torch.Tensor


def moe_reference(
    x: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    routed: CheckpointWeights | ExpertWeights,
    shared: CheckpointWeights | ExpertWeights | None,
    shape: MoEShape,
    dtype=torch.float32,
    ids: torch.Tensor | None = None,
) -> MoEReference:
    """The MoE layer of ``shape`` on BF16 tokens ``x`` [M, H], routed by
    ``route_for`` (``bias``, FP32 [E], is required when ``shape.bias`` and
    ignored otherwise).

    ``ids`` (int32 [M, top_k]) overrides the routing's expert choice (weights
    are then recomputed for those ids), so a kernel that resolved a near-tie
    differently can still be compared route by route."""
    m, hidden = x.shape
    top_k = shape.top_k
    ref_ids, weights = route_for(logits, bias, shape)
    if ids is not None:
        ids = ids.to(device=x.device, dtype=torch.int32).view(m, top_k)
        weights = weights_for(logits, ids, shape)
    else:
        ids = ref_ids
    xq, sx = quantize_activations(x, shape.ue8m0)
    out = torch.empty(m * top_k, hidden, dtype=dtype, device=x.device)
    flat = ids.view(-1).long()
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().view(-1)
        tokens = rows // top_k
        trace = expert_forward(xq[tokens], sx[tokens], routed, e, shape.swiglu_limit, dtype)
        out[rows] = trace.y
    shared_out = None
    if shared is not None:
        shared_out = expert_forward(xq, sx, shared, 0, shape.swiglu_limit, dtype).y
    final = finalize(out, weights, shared_out, top_k, rounded=(dtype == torch.float32))
    return MoEReference(out=out, ids=ids, weights=weights, shared=shared_out, final=final)


def finalize(
    out: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    top_k: int,
    rounded: bool = True,
) -> torch.Tensor:
    """[M, H] = sum_k weights[t, k] * out[t*top_k + k] (+ shared[t]), summed in
    top-k order in FP32 (float64 inputs: float64). With ``rounded`` the route
    and shared rows are first rounded to BF16 (what the kernels store) and the
    result is returned in FP32 (round it to BF16 to get the kernels' output)."""
    acc = torch.float64 if out.dtype == torch.float64 and not rounded else torch.float32
    m = weights.shape[0]
    rows = out.view(m, top_k, -1)
    if rounded:
        rows = rows.to(torch.bfloat16)
        shared = None if shared is None else shared.to(torch.bfloat16)
    total = torch.zeros(m, rows.shape[-1], dtype=acc, device=out.device)
    for k in range(top_k):
        total = total + weights[:, k : k + 1].to(acc) * rows[:, k].to(acc)
    if shared is not None:
        total = total + shared.to(acc)
    return total


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error ``|got - want| / |want|`` in float64: the one error
    measure every kernel-vs-reference comparison reports."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
