"""The sm_90a grouped kernel on the GPU, through the runtime, against
``runtime.reference``.

Artifacts under test: ``$MOE_GROUPED_ARTIFACTS`` (paths joined by ``os.pathsep``;
e.g. one built with ``ue8m0: false`` and one with ``ue8m0: true``), else
``$MOE_BUILD_ARTIFACT``; build them with
``moe-build compile CONFIG --arch sm_90a --kernel grouped -o DIR``.

Every grouped bucket, finalize off and on, both logits dtypes, random and
skewed routing (experts with more than 16 tokens run as several units; more
than 40 units split the lists into halves A and B), outputs NaN-poisoned
before every launch; calls back to back across buckets (the parity counters
are shared by every bucket); 1000 CUDA-graph replays with changing inputs.

Tolerance: relative L2 error 1e-2 (docs/semantics.md's bar) against the
float32 reference computed on the kernel's own expert choice (it agrees with
the float64 one to ~1e-7; ``moe-build bench`` reports the float64 error) (the reference quantizes both activations and
hidden values the same way; what remains is accumulation order and the
hidden FP8 rounding that follows from it, docs/semantics.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import seeding
from gpu_artifacts import CALL_TOL, TIE, artifact_paths, bind_fresh, pooled_rel_l2

from runtime.reference import rel_l2

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.gpu

TOL = 1e-2  # relative L2 error against the reference (docs/semantics.md's bar)
#: The shared expert's rows of one call are only M rows (8 at the smallest
#: bucket): one hidden FP8 code flipped by accumulation order moves them more
#: (1.18e-2 seen once on the H200 for an 8-row call). They are held to TOL
#: pooled over a test's calls and to CALL_TOL per call.
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=artifact_paths("MOE_GROUPED_ARTIFACTS") or [None],
                ids=lambda p: p.name if p else "none")  # fmt: skip
def bound(request):
    """(artifact, layer, (prepared, routed, shared)) of one artifact."""
    return bind_fresh(request.param, "MOE_GROUPED_ARTIFACTS", "grouped")


def _variants(artifact):
    return sorted(
        (v for v in artifact.variants if v.kernel == "grouped"),
        key=lambda v: (v.tokens, v.logits_dtype, v.finalize),
    )


def _inputs(shape, m, dtype, routing, gen):
    """x, logits, bias for ``routing``: "random" (bias N(0, 0.1)), "skewed"
    (bias N(0, 1): a few experts take most tokens) or "hot" (four experts
    far ahead: every token picks them, 4 units per expert at M = 64)."""
    import torch

    dev = gen.device
    x = torch.randn(m, shape.hidden, device=dev, generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, shape.experts, device=dev, generator=gen)
    spread = {"random": 0.1, "skewed": 1.0, "hot": 0.1}[routing]
    bias = torch.randn(shape.experts, device=dev, generator=gen) * spread
    if routing == "hot":
        bias[torch.randperm(shape.experts, device=dev, generator=gen)[:4]] += 5.0
    return x, logits.to(getattr(torch, dtype)), bias


def _reference(artifact, weights, x, logits, bias, ids=None):
    from runtime.reference import moe_reference

    return moe_reference(x, logits, bias, weights[1], weights[2], artifact.shape, ids=ids)


def _units(artifact, ids):
    """Units of a call with these expert ids (the kernel's own numbering)."""
    from kernels.grouped_plan import GroupedPlan, number_units

    s = artifact.shape
    plan = GroupedPlan(s.hidden, s.inter, s.experts, s.top_k, ids.shape[0], 1)
    return number_units(plan, ids.tolist())


def _check_call(artifact, layer, weights, v, routing, gen):
    """One call of variant ``v``: returns (errors, units)."""
    import torch

    from runtime.reference import tie_margin

    x, logits, bias = _inputs(artifact.shape, v.tokens, v.logits_dtype, routing, gen)
    ref = _reference(artifact, weights, x, logits, bias)
    if v.finalize:
        final = layer.grouped(x, logits, bias, finalize=True)
        torch.cuda.synchronize()
        assert not final.isnan().any(), v.name
        return {"final": rel_l2(final, ref.final)}, len(_units(artifact, ref.ids))
    out, ids, w, shared = layer.grouped(x, logits, bias)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not shared.isnan().any() and not w.isnan().any(), v.name
    close = tie_margin(logits, bias, artifact.shape.top_k) < TIE
    same = (ids == ref.ids).all(dim=1)
    assert bool((same | close).all()), f"{v.name}: routing differs on {(~same & ~close).nonzero()}"
    mine = _reference(artifact, weights, x, logits, bias, ids=ids)
    torch.testing.assert_close(w, mine.weights, rtol=1e-5, atol=1e-6)
    errors = {"out": rel_l2(out, mine.out), "shared": rel_l2(shared, mine.shared)}
    _check_call.shared.append((shared.float().cpu(), mine.shared.float().cpu()))
    return errors, len(_units(artifact, ids))


#: (kernel, reference) shared rows of the calls since the last reset.
_check_call.shared = []


@pytest.mark.parametrize("routing", ["random", "skewed", "hot"])
def test_every_bucket_matches_reference(bound, routing):

    artifact, layer, weights = bound
    gen = seeding.generator(device="cuda")
    failed, seen, units_seen = {}, {}, []
    _check_call.shared.clear()
    for v in _variants(artifact):
        errors, units = _check_call(artifact, layer, weights, v, routing, gen)
        seen[v.name] = {k: round(e, 5) for k, e in errors.items()} | {"units": units}
        units_seen.append(units)
        bars = {k: CALL_TOL if k == "shared" else TOL for k in errors}
        if any(e >= bars[k] for k, e in errors.items()):
            failed[v.name] = errors
    import torch

    got = torch.cat([g for g, _ in _check_call.shared])
    want = torch.cat([w for _, w in _check_call.shared])
    pooled = rel_l2(got, want)
    print(routing, seen, f"shared rows pooled over {len(_check_call.shared)} calls: {pooled:.5f}")
    assert not failed, failed
    assert pooled < TOL, pooled
    if routing == "random":
        assert max(units_seen) > 40, "no call split its lists into halves"


def test_experts_with_more_than_a_unit_of_tokens(bound):
    """The "hot" routing gives experts 17..64 tokens: several units each."""
    import torch

    artifact, layer, weights = bound
    gen = seeding.generator(device="cuda")
    big = max(_variants(artifact), key=lambda v: (v.tokens, not v.finalize))
    x, logits, bias = _inputs(artifact.shape, big.tokens, big.logits_dtype, "hot", gen)
    out, ids, w, shared = layer.grouped(x, logits, bias)
    counts = torch.bincount(ids.view(-1).long(), minlength=artifact.shape.experts)
    assert int(counts.max()) > 16 or big.tokens <= 16
    mine = _reference(artifact, weights, x, logits, bias, ids=ids)
    assert rel_l2(out, mine.out) < TOL and rel_l2(shared, mine.shared) < TOL


def test_back_to_back_calls_across_buckets(bound):
    """No synchronization between calls of different buckets and finalize
    settings: the parity counters they share stay right. Every input is
    drawn first, so the calls follow each other on the stream with no other
    kernel between them: each may launch while the one before still runs
    (``griddepcontrol.launch_dependents`` at entry, PDL) and must still see
    its counters, workspaces and outputs only once that one has completed.
    So the layer here does not poison (a fill between two calls would be the
    kernel before each launch); each call's inputs are fresh, so an output
    left from an earlier call cannot match its reference."""
    import torch

    artifact, _, weights = bound
    layer = artifact.bind(weights[0])
    gen = seeding.generator(device="cuda")
    variants = _variants(artifact)
    order = [variants[(7 * i) % len(variants)] for i in range(3 * len(variants))]
    drawn = [_inputs(artifact.shape, v.tokens, v.logits_dtype, "random", gen) for v in order]
    torch.cuda.synchronize()
    calls = []
    for v, (x, logits, bias) in zip(order, drawn, strict=True):
        got = layer.grouped(x, logits, bias, finalize=v.finalize)
        calls.append((v, x, logits, bias, got))
    torch.cuda.synchronize()
    # Per variant and output: the calls' error pooled within TOL, each call
    # within CALL_TOL (an M = 16 call's shared rows alone read 1.04e-2 once);
    # a parity counter gone wrong gives far worse, or NaN.
    pairs = {}
    for v, x, logits, bias, got in calls:
        if v.finalize:
            parts = {"final": (got, _reference(artifact, weights, x, logits, bias).final)}
        else:
            mine = _reference(artifact, weights, x, logits, bias, ids=got[1])
            parts = {"out": (got[0], mine.out), "shared": (got[3], mine.shared)}
        for part, (g, w) in parts.items():
            assert not g.isnan().any() and rel_l2(g, w) < CALL_TOL, (v.name, part)
            pairs.setdefault((v.name, part), []).append((g, w))
    for key, both in pairs.items():
        assert pooled_rel_l2(both) < TOL, key


@pytest.mark.parametrize("finalize", [False, True])
def test_graph_replays_with_changing_inputs(bound, finalize):
    """1000 replays of one captured call per bucket end (smallest and largest
    bucket), inputs rotated from a pool between replays, every output
    checked."""
    import torch

    artifact, layer, weights = bound
    gen = seeding.generator(device="cuda")
    variants = [v for v in _variants(artifact) if v.finalize == finalize]
    for v in (variants[0], variants[-1]):
        pool = []
        for i in range(6):
            x, logits, bias = _inputs(
                artifact.shape, v.tokens, v.logits_dtype, ("random", "skewed")[i % 2], gen
            )
            pool.append((x, logits, bias, _reference(artifact, weights, x, logits, bias)))
        x, logits, bias = (t.clone() for t in pool[0][:3])
        layer.grouped(x, logits, bias, finalize=finalize)  # workspaces before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = layer.grouped(x, logits, bias, finalize=finalize)
        worst, ties = 0.0, 0
        for i in range(1000):
            px, pl, pb, ref = pool[i % len(pool)]
            x.copy_(px)
            logits.copy_(pl)
            bias.copy_(pb)
            graph.replay()
            if finalize:
                err = rel_l2(got, ref.final)
            else:
                err = rel_l2(got[3], ref.shared)
                if bool((got[1] == ref.ids).all()):
                    err = max(err, rel_l2(got[0], ref.out))
                else:  # a near tie resolved the other way: routes not comparable
                    ties += 1
            worst = max(worst, err)
            assert err < TOL, (v.name, i, err)
        print(f"{v.name}: 1000 replays, worst rel_l2 {worst:.5f}, {ties} tie-affected")
        assert ties < 50
