"""Every routing family of docs/models.md in the torch reference
(runtime/reference.py): hand-computed cases per family, ties, group
selection, and random cases against a brute-force router written here
independently (plain Python, one token at a time, FP32 rounding by hand).

Hand cases use logits 0 (sigmoid 0.5 exactly) or softmax of logarithms, and
biases that are multiples of 1/8, so every key, group score and weight below
is exact and worked out in the comments."""

from __future__ import annotations

import math
import random
import struct

import pytest
import seeding
import torch

from runtime.model import MoEShape
from runtime.reference import (
    group_scores,
    route,
    route_for,
    routing_scores,
    selection_keys,
    tie_margin,
    weights_for,
)


def _keys_to_bias(keys: list[float], score: float = 0.5) -> torch.Tensor:
    """The bias that makes ``score + bias`` equal ``keys`` (all dyadic: exact)."""
    return torch.tensor([k - score for k in keys])


def _sig(v: float) -> float:
    return 1 / (1 + math.exp(-v))


# Sigmoid + bias, one group (GLM, Kimi-K2, the kernels' family) -------------------------


def test_sigmoid_bias_selects_by_biased_keys_and_weighs_unbiased_scores():
    # Logits 0 except expert 6 (logit 2): s = 0.5, and s[6] = sigmoid(2) = 0.881.
    # Bias: keys c = s + bias = [0.5, 0.75, 0.25, 1.0, 0.5, 0.625, 0.881 - 0.5, 0.5].
    # Top 3 keys: e3 (1.0), e1 (0.75), e5 (0.625); e6's high score does not
    # count (its key is 0.381). Weights from the unbiased scores: 0.5 each,
    # renormalized to 1/3, times 2.5.
    logits = torch.zeros(1, 8)
    logits[0, 6] = 2.0
    bias = torch.tensor([0.0, 0.25, -0.25, 0.5, 0.0, 0.125, -1.0, 0.0])
    ids, w = route(logits, bias, top_k=3, scale=2.5)
    assert ids.tolist() == [[3, 1, 5]]
    assert torch.allclose(w, torch.full((1, 3), 2.5 / 3), rtol=1e-6)
    # Without renormalization: s * 2.5 = 1.25 each (exact).
    _, w = route(logits, bias, top_k=3, scale=2.5, renormalize=False)
    assert w.tolist() == [[1.25, 1.25, 1.25]]


def test_sigmoid_without_bias_selects_by_scores():
    # s = sigmoid([0, 1, -1, 2, 0.5, -2, 3, -3]); the 3 best: e6 (3), e3 (2), e1 (1).
    # Weights s / (s6 + s3 + s1) * 1.0.
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, -2.0, 3.0, -3.0]])
    ids, w = route(logits, None, top_k=3, scale=1.0)
    assert ids.tolist() == [[6, 3, 1]]
    s = [_sig(3), _sig(2), _sig(1)]
    assert torch.allclose(w, torch.tensor([[v / sum(s) for v in s]]), rtol=1e-6)


# Softmax (Qwen3) ------------------------------------------------------------------------


def test_softmax_top_k_renormalized_or_not():
    # Logits ln([4, 2, 1, 1, 8, 0.5, 0.5, 1]): p = those / 18.
    # Top 2: e4 (8/18), e0 (4/18). Renormalized: 8/12 = 2/3 and 4/12 = 1/3;
    # not renormalized: 8/18 = 0.444 and 4/18 = 0.222.
    raw = [4.0, 2.0, 1.0, 1.0, 8.0, 0.5, 0.5, 1.0]
    logits = torch.tensor([[math.log(v) for v in raw]])
    ids, w = route(logits, None, top_k=2, scale=1.0, score="softmax")
    assert ids.tolist() == [[4, 0]]
    assert torch.allclose(w, torch.tensor([[2 / 3, 1 / 3]]), rtol=1e-6)
    ids, w = route(logits, None, top_k=2, scale=1.0, score="softmax", renormalize=False)
    assert ids.tolist() == [[4, 0]]
    assert torch.allclose(w, torch.tensor([[8 / 18, 4 / 18]]), rtol=1e-6)


def test_softmax_ties_go_to_the_lower_expert():
    # Logits ln([1, 2, 2, 1, 2, 1, 1, 1]): experts 1, 2 and 4 tie at p = 2/11
    # (equal logits give bit-equal probabilities); the top 2 are e1 then e2.
    raw = [1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    logits = torch.tensor([[math.log(v) for v in raw]])
    ids, w = route(logits, None, top_k=2, scale=1.0, score="softmax")
    assert ids.tolist() == [[1, 2]]
    assert w.tolist() == [[0.5, 0.5]]


def test_softmax_with_bias_selects_by_biased_keys():
    # Logits 0: p = 1/8 each. Keys p + bias: e5 0.625, e2 0.375, the rest
    # 0.125 (ties: lowest index, e0). Weights from p: 1/3 each renormalized,
    # p * 2 = 0.25 each without.
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.0])
    ids, w = route(logits, bias, top_k=3, scale=2.0, score="softmax")
    assert ids.tolist() == [[5, 2, 0]]
    assert torch.allclose(w, torch.full((1, 3), 2 / 3), rtol=1e-6)
    _, w = route(logits, bias, top_k=3, scale=2.0, score="softmax", renormalize=False)
    assert w.tolist() == [[0.25, 0.25, 0.25]]


# Group-limited selection (DeepSeek-V3) -------------------------------------------------

# 16 experts in 4 groups of 4; logits 0, so s = 0.5 and the keys are set by the bias.
#   g0 = e0..3:   [1.5, 0.25, 0.25, 0.25]  top-2 sum 1.75 (holds the single best key)
#   g1 = e4..7:   [1.25, 1.25, 0.5, 0.5]   top-2 sum 2.5
#   g2 = e8..11:  [1.0, 1.0, 1.0, 0.5]     top-2 sum 2.0
#   g3 = e12..15: [0.75, 0.75, 0.75, 0.75] top-2 sum 1.5
GROUP_KEYS = [1.5, 0.25, 0.25, 0.25, 1.25, 1.25, 0.5, 0.5, 1.0, 1.0, 1.0, 0.5] + [0.75] * 4


def test_groups_keep_the_best_top2_sums_not_the_best_expert():
    logits, bias = torch.zeros(1, 16), _keys_to_bias(GROUP_KEYS)
    assert group_scores(logits + 0.5 + bias, 4).tolist() == [[1.75, 2.5, 2.0, 1.5]]
    # Keep 2 groups: g1 (2.5) and g2 (2.0). Top 3 of their experts: e4, e5
    # (1.25), then e8 of the three tied at 1.0. Expert 0 (1.5) is out: its
    # group's sum (1.75) is third. Weights: 0.5 each -> 1/3 * 2.5.
    ids, w = route(logits, bias, 3, 2.5, groups=4, groups_kept=2)
    assert ids.tolist() == [[4, 5, 8]]
    assert torch.allclose(w, torch.full((1, 3), 2.5 / 3), rtol=1e-6)
    # Without the group stage (or keeping all 4 groups): e0, e4, e5.
    assert route(logits, bias, 3, 2.5)[0].tolist() == [[0, 4, 5]]
    assert route(logits, bias, 3, 2.5, groups=4, groups_kept=4)[0].tolist() == [[0, 4, 5]]
    # Keep 3 groups: g1, g2, g0 -> e0 (1.5) is back, first.
    assert route(logits, bias, 3, 2.5, groups=4, groups_kept=3)[0].tolist() == [[0, 4, 5]]
    # Keep 1 group: only g1 -> e4, e5, then e6 (0.5, before e7).
    assert route(logits, bias, 3, 2.5, groups=4, groups_kept=1)[0].tolist() == [[4, 5, 6]]
    keys = selection_keys(logits + 0.5, bias, groups=4, groups_kept=2)
    assert torch.isinf(keys[0, :4]).all() and torch.isinf(keys[0, 12:]).all()
    assert keys[0, 4:12].tolist() == GROUP_KEYS[4:12]


def test_equal_group_scores_go_to_the_lower_group():
    # 8 experts, 2 groups: g0 = [0.5, 1.0, 0.75, 0.25] and g1 = [1.0, 0.75,
    # 0.5, 0.5] both sum their top 2 to 1.75; keeping 1, g0 wins: e1, e2.
    keys = [0.5, 1.0, 0.75, 0.25, 1.0, 0.75, 0.5, 0.5]
    ids, _ = route(torch.zeros(1, 8), _keys_to_bias(keys), 2, 1.0, groups=2, groups_kept=1)
    assert ids.tolist() == [[1, 2]]


def test_dropped_groups_are_minus_infinity_not_zero():
    # All keys negative: g0 = [-0.25, -0.5, -0.75, -1.0] (sum -0.75) beats g1
    # = [-1] * 4 (sum -2). Keep g0: e0, e1. Zeroing g1's keys instead of
    # excluding them would pick e4, e5 (0 > -0.25).
    keys = [-0.25, -0.5, -0.75, -1.0] + [-1.0] * 4
    ids, w = route(torch.zeros(1, 8), _keys_to_bias(keys), 2, 1.0, groups=2, groups_kept=1)
    assert ids.tolist() == [[0, 1]]
    assert w.tolist() == [[0.5, 0.5]]  # the unbiased scores (0.5, 0.5), renormalized


def test_group_rules_are_refused():
    logits, bias = torch.zeros(1, 16), torch.zeros(16)
    with pytest.raises(ValueError, match="groups_kept"):
        route(logits, bias, 2, 1.0, groups=4, groups_kept=5)
    with pytest.raises(ValueError, match="groups of at least 2"):
        route(logits, bias, 2, 1.0, groups=5, groups_kept=1)
    with pytest.raises(ValueError, match="top_k 5"):
        route(logits, bias, 5, 1.0, groups=4, groups_kept=1)  # 1 group of 4 experts
    with pytest.raises(ValueError, match="score"):
        routing_scores(logits, "tanh")


def test_tie_margin_sees_near_ties_between_groups():
    # GROUP_KEYS has exact ties among the experts (e4/e5, e8/e9/e10): margin 0.
    logits, bias = torch.zeros(1, 16), _keys_to_bias(GROUP_KEYS)
    assert tie_margin(logits, bias, 3, groups=4, groups_kept=2).item() == 0
    # Distinct expert keys; group sums 1.125, 1.125, 1.0 and 1.0 - 1/64.
    keys = [1.0, 0.125, 0.0, 0.0, 0.875, 0.25, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]
    keys += [0.5, 0.5 - 1 / 64, 0.0, 0.0]
    bias = _keys_to_bias(keys)
    # Keep 2: g0 and g1 (tied with each other: that changes nothing). The
    # kept/dropped boundary gap is 1.125 - 1.0; the best two allowed keys are
    # 1.0 and 0.875: margin 0.125.
    assert tie_margin(logits, bias, 1, groups=4, groups_kept=2).item() == 0.125
    # Keep 3: the boundary lies between 1.0 and 1.0 - 1/64.
    assert tie_margin(logits, bias, 1, groups=4, groups_kept=3).item() == 1 / 64
    # No group stage: the two best keys, 1.0 and 0.875.
    assert tie_margin(logits, bias, 1).item() == 0.125


# The shape's routing --------------------------------------------------------------------


def _shape(**routing) -> MoEShape:
    base = dict(hidden=256, inter=128, experts=16, top_k=3, routed_scale=2.5,
                swiglu_limit=None, ue8m0=False, shared_experts=0)  # fmt: skip
    return MoEShape(**{**base, **routing})


def test_route_for_reads_the_shape():
    logits, bias = torch.zeros(1, 16), _keys_to_bias(GROUP_KEYS)
    ids, w = route_for(logits, bias, _shape(groups=4, groups_kept=2))
    assert ids.tolist() == [[4, 5, 8]]
    assert torch.equal(w, weights_for(logits, ids, _shape(groups=4, groups_kept=2)))
    # A shape without bias ignores the bias it is handed; one with bias needs it.
    plain = route_for(logits, bias, _shape(bias=False))[0]
    assert torch.equal(plain, route_for(logits, None, _shape(bias=False))[0])
    assert plain.tolist() == [[0, 1, 2]]  # all scores 0.5: ties, lowest first
    with pytest.raises(ValueError, match="bias"):
        route_for(logits, None, _shape())
    # groups_kept defaults to groups: the group stage keeps everything.
    assert _shape(groups=4).groups_kept == 4


# Against a brute-force router ----------------------------------------------------------


def _f32(v: float) -> float:
    """``v`` rounded to FP32. A float64 sum, product or quotient of two FP32
    values rounded once to FP32 is the correctly rounded FP32 result."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def brute_force_route(scores, bias, top_k, scale, groups, kept, renormalize):
    """One token at a time from FP32 scores (lists of Python floats): the
    rules of docs/models.md, written as plainly as possible."""
    ids_out, w_out = [], []
    for s in scores:
        experts = len(s)
        key = [_f32(s[e] + bias[e]) if bias is not None else s[e] for e in range(experts)]
        size = experts // groups
        group_score = []
        for g in range(groups):
            top = sorted(key[g * size : (g + 1) * size], reverse=True)
            group_score.append(_f32(top[0] + top[1]) if size >= 2 else top[0])
        best_groups = sorted(range(groups), key=lambda g: (-group_score[g], g))[:kept]
        candidates = [e for e in range(experts) if e // size in best_groups]
        chosen = sorted(candidates, key=lambda e: (-key[e], e))[:top_k]
        picked = [s[e] for e in chosen]
        factor = _f32(scale)
        if renormalize:
            total = 0.0
            for v in picked:
                total = _f32(total + v)
            weights = [_f32(_f32(v / total) * factor) for v in picked]
        else:
            weights = [_f32(v * factor) for v in picked]
        ids_out.append(chosen)
        w_out.append(weights)
    return ids_out, w_out


def _random_family(rng: random.Random) -> dict:
    experts = rng.choice([8, 16, 32, 40, 60, 64, 72])
    score = rng.choice(["sigmoid", "softmax"])
    bias = rng.random() < 0.7
    divisors = [g for g in (1, 2, 4, 8) if experts % g == 0 and experts // g >= 2]
    groups = rng.choice(divisors) if bias else 1
    kept = rng.randint(1, groups)
    top_k = rng.randint(1, min(8, kept * (experts // groups)))
    return dict(experts=experts, score=score, bias=bias, groups=groups, kept=kept,
                top_k=top_k, renormalize=rng.random() < 0.7,
                scale=rng.choice([1.0, 2.5, 2.827]))  # fmt: skip


@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "coarse"])
def test_route_matches_brute_force(ties):
    """Random families and inputs; with ``ties`` the logits and biases come
    from coarse grids, so equal keys and equal group scores are common. Ids
    and weights must match exactly (both compute in FP32, in the same
    order)."""
    rng = random.Random(seeding.seed())
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    for trial in range(150):
        f = _random_family(rng)
        m, e = 4, f["experts"]
        if ties:
            logits = torch.randint(-4, 5, (m, e), generator=g) / 4.0
            bias = torch.randint(-2, 3, (e,), generator=g) / 8.0
        else:
            logits = torch.randn(m, e, generator=g) * 2
            bias = torch.randn(e, generator=g) * 0.1
        if not f["bias"]:
            bias = None
        if trial % 2:
            logits = logits.bfloat16()  # widened to FP32 exactly
        ids, w = route(logits, bias, f["top_k"], f["scale"], score=f["score"],
                       groups=f["groups"], groups_kept=f["kept"],
                       renormalize=f["renormalize"])  # fmt: skip
        scores = routing_scores(logits, f["score"]).tolist()
        b = None if bias is None else bias.tolist()
        want_ids, want_w = brute_force_route(scores, b, f["top_k"], f["scale"], f["groups"],
                                             f["kept"], f["renormalize"])  # fmt: skip
        where = f"trial {trial}: {f}; {seeding.rerun_hint()}"
        assert ids.tolist() == want_ids, where
        assert w.tolist() == want_w, where
        assert ids.dtype == torch.int32 and w.dtype == torch.float32


def test_scores_match_float64_math():
    """The score functions themselves, against float64 formulas: sigmoid
    elementwise, softmax over each row (which sums to 1)."""
    g = seeding.generator()
    logits = torch.randn(6, 40, generator=g) * 3
    z = logits.double()
    sig = routing_scores(logits, "sigmoid")
    assert sig.dtype == torch.float32
    assert torch.allclose(sig.double(), 1 / (1 + torch.exp(-z)), rtol=1e-6, atol=0)
    soft = routing_scores(logits, "softmax")
    want = torch.exp(z - z.amax(-1, keepdim=True))
    want = want / want.sum(-1, keepdim=True)
    assert torch.allclose(soft.double(), want, rtol=1e-5, atol=1e-9), seeding.rerun_hint()
    assert torch.allclose(soft.double().sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-6)
