"""The benchmark's bookkeeping (the timing itself needs a GPU: `moe-build bench`)."""

import dataclasses
import gc
import os
import statistics
import time
from types import SimpleNamespace

import pytest
import seeding
import torch
from click.testing import CliRunner
from layer_fakes import ReferenceLayer

from benchmarks import bench as bench_module
from benchmarks.bench import (
    CHECK_CALLS,
    CHECK_ROWS,
    LOGIT_SKEW,
    ROUTINGS,
    TOLERANCE,
    Bench,
    Check,
    Row,
    _speedups,
    check_calls,
    crossover,
    distinct_experts,
    pool_errors,
    route_ids,
    routing_inputs,
    routing_rule,
    tie_margins,
    time_host,
)
from benchmarks.command import summary, table
from pipeline.cli import main
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.reference import moe_reference, rel_l2, route_for, tie_margin

SHAPE = MoEShape(256, 128, 64, 4, 2.5, 10.0, False, 1)
#: Qwen3's family: softmax scores, no bias, no shared expert, no clamp.
SOFTMAX = MoEShape(256, 128, 64, 4, 1.0, None, False, 0, score="softmax", bias=False)
#: DeepSeek-V3's family: sigmoid + bias, 8 groups of which 4 are kept.
GROUPED_ROUTING = MoEShape(256, 128, 64, 4, 2.5, None, False, 1, groups=8, groups_kept=4)


def _row(kernel, m, t, finalize=None, host_us=None):
    return Row(kernel=kernel, arch="sm_90a", tokens=m, routing="random", distinct_experts=4.0,
               weight_bytes=10**6, time_us=t, time_us_min=t, time_us_max=t, reps=5, tb_s=1.0,
               floor_fraction=0.25, correct=True, rel_l2=1e-3, max_abs=1e-2, near_ties=0,
               finalize=finalize, host_us=host_us)  # fmt: skip


@pytest.mark.parametrize("shape", [SHAPE, SOFTMAX, GROUPED_ROUTING],
                         ids=["sigmoid-bias", "softmax-no-bias", "groups"])  # fmt: skip
def test_routing_spread_sets_distinct_experts(shape):
    """Every routing kind skews every family: skewed routing concentrates
    tokens on fewer experts than uniform routing, through the bias or (a
    model without one) the logits."""
    g = torch.Generator().manual_seed(0)
    counts = {}
    for kind in ROUTINGS:
        x, logits, bias = routing_inputs(kind, 16, shape, 8, g, "cpu")
        assert x.shape == (8, 16, 256) and logits.shape == (8, 16, 64)
        assert (bias.shape == (64,)) if shape.bias else bias is None
        counts[kind] = distinct_experts(logits, bias, shape)
    assert counts["skewed"] < counts["random"] <= counts["uniform"] + 2, counts
    assert 1 <= counts["skewed"] and counts["uniform"] <= 64


def test_glm5_family_inputs_and_distinct_experts_are_unchanged():
    """For sigmoid + bias without groups (GLM-5, the committed results) the
    draws are tokens, logits, then bias N(0, std), and distinct experts the
    plain top-k of sigmoid(logits) + bias, as before the routing families."""
    for kind, std in ROUTINGS.items():
        x, logits, bias = routing_inputs(kind, 4, SHAPE, 3, torch.Generator().manual_seed(3), "cpu")
        g = torch.Generator().manual_seed(3)
        assert torch.equal(x, torch.randn(3, 4, 256, generator=g).bfloat16())
        assert torch.equal(logits, torch.randn(3, 4, 64, generator=g))
        assert torch.equal(bias, torch.randn(64, generator=g) * std)
        ids = (torch.sigmoid(logits) + bias).topk(SHAPE.top_k, dim=-1).indices
        plain = statistics.mean(len(torch.unique(ids[p])) for p in range(3))
        assert distinct_experts(logits, bias, SHAPE) == plain


def test_routing_rule_skews_the_bias_or_the_logits():
    """A model with a bias gets it N(0, std) over plain N(0, 1) logits; one
    without gets the same draw, times LOGIT_SKEW, added to every token's
    logits (a per-expert offset, the same for the pool's calls)."""
    assert routing_rule(SHAPE)["skews"] == "bias" and routing_rule(SHAPE)["std"] == ROUTINGS
    rule = routing_rule(SOFTMAX)
    assert rule["skews"] == "logits" and "no bias" in rule["rule"]
    assert rule["std"] == {k: LOGIT_SKEW * v for k, v in ROUTINGS.items()}
    for kind in ROUTINGS:
        _, biased, bias = routing_inputs(kind, 3, SHAPE, 5, torch.Generator().manual_seed(7), "cpu")
        _, skewed, none = routing_inputs(kind, 3, SOFTMAX, 5, torch.Generator().manual_seed(7),
                                         "cpu")  # fmt: skip
        assert none is None
        # Same draws: the offset is LOGIT_SKEW x the bias, on every token of every call.
        torch.testing.assert_close(skewed - biased, (LOGIT_SKEW * bias).expand(5, 3, -1))


@pytest.mark.parametrize("shape", [SHAPE, SOFTMAX, GROUPED_ROUTING],
                         ids=["sigmoid-bias", "softmax-no-bias", "groups"])  # fmt: skip
def test_distinct_experts_and_ties_follow_the_model_routing(shape):
    """Expert choice and near-tie margins are the reference's routing of the
    model (route_for, tie_margin with its score function and groups), per
    call of a pool."""
    g = seeding.generator()
    _, logits, bias = routing_inputs("random", 6, shape, 4, g, "cpu")
    ids = route_ids(logits, bias, shape)
    assert ids.shape == (4, 6, shape.top_k)
    counts = []
    for p in range(4):
        want, _ = route_for(logits[p], bias, shape)
        assert torch.equal(ids[p], want)
        counts.append(len(set(want.view(-1).tolist())))
        margin = tie_margin(logits[p], bias, shape.top_k, score=shape.score,
                            groups=shape.groups, groups_kept=shape.groups_kept)  # fmt: skip
        assert torch.equal(tie_margins(logits[p], bias, shape), margin)
    assert distinct_experts(logits, bias, shape) == statistics.mean(counts)
    if shape.groups_kept < shape.groups:  # no token's experts lie outside its kept groups
        per_group = shape.experts // shape.groups
        for token in ids.view(-1, shape.top_k).tolist():
            assert len({e // per_group for e in token}) <= shape.groups_kept


def test_distinct_experts_of_a_group_limited_model_differ_from_plain_top_k():
    """With groups dropped, expert choice is not the plain top-k of the keys
    (the bench must route as the model does)."""
    g = seeding.generator()
    _, logits, bias = routing_inputs("uniform", 64, GROUPED_ROUTING, 2, g, "cpu")
    plain = dataclasses.replace(GROUPED_ROUTING, groups=1, groups_kept=1)
    assert not torch.equal(route_ids(logits, bias, GROUPED_ROUTING), route_ids(logits, bias, plain))


def test_speedups_and_crossover():
    rows = [_row("baseline", 4, 100.0), _row("mega", 4, 20.0), _row("grouped", 4, 25.0, False),
            _row("grouped", 4, 30.0, True), _row("layer", 4, 22.0)]  # fmt: skip
    _speedups(rows)
    assert rows[1].speedup_vs_baseline == 5.0 and rows[0].speedup_vs_baseline is None
    assert crossover(rows) == [
        {"routing": "random", "tokens": 4, "mega": 20.0, "grouped": 25.0, "faster": "mega"}
    ]


def _result(rows):
    return {"device": "GPU", "driver": "1", "sms": 1, "copy_tb_s": 4.0, "commit": "abc",
            "date": "2026-01-01", "rows": [dataclasses.asdict(r) for r in rows]}  # fmt: skip


def test_table_lists_every_row():
    rows = [_row("layer", 1, 15.0, host_us=21.3), _row("baseline", 1, 900.0)]
    _speedups(rows)
    text = table(_result(rows))
    assert text.count("\n| random |") == 2 and "60.0x" in text
    header, _, layer, base = (line.split("|") for line in text.splitlines()[2:6])
    column = header.index(" host (us) ")
    assert layer[column] == " 21.3 " and base[column] == "  "  # the baseline has none


def test_table_and_summary_read_results_without_host_time():
    rows = [_row("layer", 2, 30.0), _row("baseline", 2, 900.0), _row("mega", 2, 20.0)]
    _speedups(rows)
    old = _result(rows)
    for r in old["rows"]:
        del r["host_us"], r["rel_l2_worst_call"]  # a result JSON that predates the fields
    assert "| 2 | layer | 4.0 | 1.0 | 30.0 |  | 1.00 |" in table(old)
    text = summary(old)
    assert "host" not in text
    assert "| random | 2 | 30.0 | 25% | mega | 20.0 | 25% | 900 | 30x |" in text
    # Each host field adds its column once every layer row has it.
    for field, value, header_part, cells in (
        ("host_us", 12.5, "| layer % of copy | layer host (us) | fastest kernel |", "12.5 |"),
        ("host_pinned_us", 9.5, "| layer host (us) | pinned (us) | fastest kernel |", "12.5 | 9.5 |"),
    ):  # fmt: skip
        for r in rows:
            setattr(r, field, value if r.kernel != "baseline" else None)
        text = summary(_result(rows))
        assert header_part in text
        assert f"| random | 2 | 30.0 | 25% | {cells} mega | 20.0 | 25% | 900 | 30x |" in text
        header, rule, line = text.splitlines()[2:5]
        assert header.count("|") == rule.count("|") == line.count("|")


def test_bench_refuses_bad_tokens_and_needs_a_gpu(tmp_path):
    for bad in ("0,65", "8193"):
        r = CliRunner().invoke(main, ["bench", str(tmp_path), "--tokens", bad])
        assert r.exit_code == 2 and "1..8192" in r.output, r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["bench", str(tmp_path)])
        assert r.exit_code == 2 and "needs a CUDA GPU" in r.output


@pytest.mark.parametrize(
    "shape",
    [MoEShape(512, 256, 64, 4, 2.5, 10.0, False, 1),
     dataclasses.replace(SOFTMAX, hidden=512, inter=256),
     dataclasses.replace(GROUPED_ROUTING, hidden=512, inter=256)],
    ids=["glm5-family", "softmax-no-bias-no-shared", "groups"],
)  # fmt: skip
def test_torch_baseline_matches_the_reference(shape):
    from benchmarks.baseline import TorchMoE

    g = seeding.generator()
    prepared, routed, shared = random_moe_weights(shape, g)
    assert (prepared.shared is None) == (shape.shared_experts == 0)
    x, logits, bias = (t if t is None or t.dim() == 1 else t[0]
                       for t in routing_inputs("random", 5, shape, 1, g, "cpu"))  # fmt: skip
    want = moe_reference(x, logits, bias, routed, shared, shape, torch.float64).final
    # BF16 weights: ~1.6e-2 here; a layout or gate/up mix-up lands near 1,
    # and so would routing by another family's rule.
    assert rel_l2(TorchMoE(prepared, shape)(x, logits, bias), want) < TOLERANCE["baseline"]


class _Skewed(ReferenceLayer):
    """A reference layer whose call c's outputs are scaled by 1 + errors[c]
    (every output part), recording each call's inputs and outputs."""

    def __init__(self, routed, shared, shape, errors):
        super().__init__(routed, shared, shape)
        self.errors = errors
        self.seen = []  # (x, logits, bias, outputs) per call

    def _ref(self, x, logits, bias):
        r = super()._ref(x, logits, bias)
        s = 1 + self.errors[len(self.seen) % len(self.errors)]
        shared = None if r.shared is None else r.shared * s
        return dataclasses.replace(r, out=r.out * s, shared=shared, final=r.final * s)

    def mega(self, x, logits, bias, shared=False):
        got = super().mega(x, logits, bias, shared)
        self.seen.append((x, logits, bias, got))
        return got

    def __call__(self, x, logits, bias):
        got = super().__call__(x, logits, bias)
        self.seen.append((x, logits, bias, got))
        return got


def _bench(shape, g, layer=None):
    """A Bench with only what check() and _row() read (no GPU)."""
    prepared, routed, shared = random_moe_weights(shape, g)
    bench = Bench.__new__(Bench)
    bench.shape, bench.g, bench.device = shape, g, torch.device("cpu")
    bench.checkpoints = (routed, shared)
    bench.checker = layer or ReferenceLayer(routed, shared, shape)
    bench.baseline = bench.checker
    bench.artifact = SimpleNamespace(arch="sm_90a")
    bench.copy_tb_s = 4.0
    bench.gpu_start = {}
    bench.host_cpu = None
    return bench


CHECK_SHAPE = MoEShape(256, 128, 32, 4, 2.5, 10.0, False, 1)


def test_check_compares_every_kind_with_the_reference():
    g = seeding.generator()
    bench = _bench(CHECK_SHAPE, g)
    for kind, fin in (("mega", False), ("grouped", False), ("grouped", True), ("layer", False),
                      ("baseline", False)):  # fmt: skip
        c = bench.check(kind, 3, "random", fin)
        # BF16 rounding of the outputs only (and of the rows the final sums):
        # a few roundings, each at most 2**-9 of the largest magnitude.
        assert c.rel_l2 < 1e-2 and c.max_abs < 2**-6 * c.ref_max_abs, (kind, fin, c)
        assert c.near_ties >= 0 and c.ref_max_abs > 0
        assert c.calls == check_calls(3) and c.rel_l2 <= c.rel_l2_worst_call
    routed, shared = random_moe_weights(CHECK_SHAPE, g)[1:]
    bench.checker = ReferenceLayer(routed, bench.checkpoints[1], CHECK_SHAPE)
    assert bench.check("mega", 3, "random").rel_l2 > 0.5  # other weights: caught


@pytest.mark.parametrize("shape", [dataclasses.replace(SOFTMAX, experts=32),
                                   dataclasses.replace(GROUPED_ROUTING, experts=32)],
                         ids=["softmax-no-bias-no-shared", "groups"])  # fmt: skip
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_check_of_other_families(shape, routing, monkeypatch):
    """The check of a model without a bias passes None as the bias (the
    stand-in layer asserts it); without a shared expert it compares no shared
    rows (the grouped kernel's are unwritten, NaN here), so every kind
    passes. (4 calls a check, for time.)"""
    monkeypatch.setattr(bench_module, "CHECK_CALLS", 4)
    monkeypatch.setattr(bench_module, "CHECK_ROWS", 1)
    g = seeding.generator()
    bench = _bench(shape, g)
    for kind, fin in (("mega", False), ("grouped", False), ("grouped", True), ("layer", False)):
        c = bench.check(kind, 3, routing, fin)
        assert c.rel_l2 < 1e-2 and c.max_abs < 2**-6 * c.ref_max_abs, (kind, fin, c)
        assert c.near_ties >= 0 and c.ref_max_abs > 0
    routed, shared = random_moe_weights(shape, g)[1:]
    bench.checker = ReferenceLayer(routed, shared, shape)  # other weights: caught
    assert bench.check("grouped", 3, routing).rel_l2 > 0.5


def test_check_counts_near_ties_with_the_model_routing(monkeypatch):
    """A near tie is ``tie_margins`` below NEAR_TIE: with groups dropped, the
    margin includes the gap between the last kept and first dropped group."""
    g = seeding.generator()
    shape = dataclasses.replace(GROUPED_ROUTING, experts=32)
    monkeypatch.setattr(bench_module, "CHECK_CALLS", 4)
    monkeypatch.setattr(bench_module, "CHECK_ROWS", 1)
    monkeypatch.setattr(bench_module, "NEAR_TIE", float("inf"))
    assert _bench(shape, g).check("layer", 2, "random").near_ties == 2 * 4
    monkeypatch.setattr(bench_module, "NEAR_TIE", 0.0)
    assert _bench(shape, g).check("layer", 2, "random").near_ties == 0


def test_check_pools_at_least_check_rows_tokens():
    """CHECK_CALLS calls a case, more where M is small: the fewest calls
    holding CHECK_ROWS tokens."""
    for m in range(1, 1025):
        n = check_calls(m)
        assert n >= CHECK_CALLS and n * m >= CHECK_ROWS, m
        assert n == CHECK_CALLS or (n - 1) * m < CHECK_ROWS, m
    assert check_calls(1) == CHECK_ROWS and check_calls(1, least=2) == CHECK_ROWS
    assert check_calls(128, least=2) == 2


def test_pool_errors_is_the_error_of_the_rows_concatenated():
    # [calls=2, parts=2, (err2, ref2, max_abs, ref_max)]: part 0 is 1/4 then 0/96.
    sums = torch.tensor([[[1.0, 4.0, 0.5, 2.0], [0.0, 1.0, 0.0, 1.0]],
                         [[0.0, 96.0, 0.0, 9.0], [0.01, 1.0, 0.1, 1.0]]],
                        dtype=torch.float64)  # fmt: skip
    pooled, worst, max_abs, ref_max = pool_errors(sums)
    # part 0 pooled sqrt(1/100); part 1 sqrt(0.01/2); worst call: part 0 of call 0.
    assert pooled == pytest.approx(0.1) and worst == pytest.approx(0.5) and max_abs == 0.5
    assert ref_max == 9.0
    sums[1, 1, 0] = float("nan")  # an unwritten (poisoned) output in one call
    assert all(v != v for v in pool_errors(sums)[:2])


@pytest.mark.parametrize("kind", ["layer", "mega"])
def test_check_pools_the_calls(kind, monkeypatch):
    """The verdict is the relative L2 of all check_calls(M) calls' rows
    concatenated (per part: routed and shared rows), not any one call's."""
    monkeypatch.setattr(bench_module, "NEAR_TIE", 2.0)  # every token counts as a near tie
    g = seeding.generator()
    shape = CHECK_SHAPE
    routed, shared = random_moe_weights(shape, g)[1:]
    n = check_calls(2)
    layer = _Skewed(routed, shared, shape, errors=[0.03, 0.01] + [0.0] * (n - 2))
    bench = _bench(shape, g, layer)
    bench.checkpoints = (routed, shared)
    c = bench.check(kind, 2, "random")
    assert len(layer.seen) == c.calls == n
    assert c.near_ties == 2 * n  # summed over the calls
    parts = {}  # part -> (got, want) per call
    for x, logits, bias, got in layer.seen:
        ref = moe_reference(x, logits, bias, routed, shared, shape, torch.float64)
        pairs = [(got, ref.final)] if kind == "layer" else [(got[0], ref.out), (got[3], ref.shared)]
        for p, pair in enumerate(pairs):
            parts.setdefault(p, []).append(pair)
    pooled = max(rel_l2(torch.cat([g for g, _ in ps]), torch.cat([w for _, w in ps]))
                 for ps in parts.values())  # fmt: skip
    worst = max(rel_l2(g, w) for ps in parts.values() for g, w in ps)
    max_abs = max((g.double() - w).abs().max().item() for ps in parts.values() for g, w in ps)
    ref_max = max(w.abs().max().item() for ps in parts.values() for _, w in ps)
    assert c.ref_max_abs == pytest.approx(ref_max, rel=1e-9)
    assert c.rel_l2 == pytest.approx(pooled, rel=1e-9)
    assert c.rel_l2_worst_call == pytest.approx(worst, rel=1e-9)
    assert c.max_abs == pytest.approx(max_abs, rel=1e-9)
    assert 0.025 < c.rel_l2_worst_call < 0.035 and c.rel_l2 < 0.02  # call 0 dominates


def test_one_bad_call_does_not_fail_a_case_but_a_bad_case_does():
    """A single call past the bar (one token's FP8 rounding flip) passes when
    the pooled error is within it; an error in every call fails."""
    g = seeding.generator()
    routed, shared = random_moe_weights(CHECK_SHAPE, g)[1:]
    n = check_calls(2)
    one_bad = [0.025] + [0.0] * (n - 1)  # one call's rows 2.5e-2 off
    for errors, correct in ((one_bad, True), ([0.012] * n, False)):
        bench = _bench(CHECK_SHAPE, g, _Skewed(routed, shared, CHECK_SHAPE, errors))
        bench.checkpoints = (routed, shared)
        c = bench.check("layer", 2, "random")
        assert c.rel_l2_worst_call > TOLERANCE["layer"]
        row = bench._row("layer", 2, "random", 4.0, True, [10.0], c)
        assert row.correct is correct and row.rel_l2 == c.rel_l2, (errors, c)
        assert row.rel_l2_worst_call == c.rel_l2_worst_call and row.max_abs == c.max_abs
        assert row.check_calls == c.calls == n and row.ref_max_abs == c.ref_max_abs


def test_row_takes_the_pooled_verdict_and_the_median_host_time():
    bench = _bench(CHECK_SHAPE, seeding.generator())
    check = Check(
        rel_l2=5e-3, rel_l2_worst_call=1.3e-2, max_abs=0.2, near_ties=1, calls=4, ref_max_abs=30.0
    )
    row = bench._row("grouped", 1, "skewed", 4.0, True, [10.0, 12.0, 11.0], check,
                     [30.0, 20.0, 25.0, 90.0], [15.0, 40.0, 16.0], bucket=1,
                     finalize=False)  # fmt: skip
    assert row.correct and row.rel_l2 == 5e-3 and row.rel_l2_worst_call == 1.3e-2
    assert row.host_us == 27.5 and row.time_us == 11.0 and row.near_ties == 1
    assert row.host_pinned_us == 16.0
    bad = dataclasses.replace(check, rel_l2=1.1e-2)
    row = bench._row("baseline", 1, "skewed", 4.0, True, [10.0], bad)
    assert row.host_us is None and row.host_pinned_us is None and row.correct  # bar 3e-2
    assert not bench._row("mega", 1, "skewed", 4.0, True, [10.0], bad).correct


def test_commit_id_names_the_tree_that_runs(monkeypatch):
    """$MOE_BUILD_COMMIT first; else git's HEAD, marked ``-dirty`` where
    tracked files differ from it; "unknown" without git."""
    answers = {}
    monkeypatch.setattr(bench_module, "_env_fact",
                        lambda cmd, fallback="unknown": answers.get(cmd[1], fallback))  # fmt: skip
    monkeypatch.delenv("MOE_BUILD_COMMIT", raising=False)
    assert bench_module.commit_id() == "unknown"
    answers.update({"rev-parse": "abc123", "status": ""})
    assert bench_module.commit_id() == "abc123"
    answers["status"] = " M kernels/mega_plan.py"
    assert bench_module.commit_id() == "abc123-dirty"
    monkeypatch.setenv("MOE_BUILD_COMMIT", "d567cf4")
    assert bench_module.commit_id() == "d567cf4"


@pytest.mark.parametrize("shape", [CHECK_SHAPE, SOFTMAX], ids=["glm5-family", "softmax"])
def test_result_records_the_check_calls_model_and_routing_rule(shape, monkeypatch):
    monkeypatch.setattr(bench_module, "device_facts", lambda d: {"device": "GPU"})
    monkeypatch.setattr(bench_module, "commit_id", lambda: "abc")
    bench = _bench(shape, seeding.generator())
    bench.artifact.manifest = {"config": {"name": "c"}, "config_hash": "h", "toolchain": None}
    bench.config, bench.reps = bench.artifact.manifest["config"], 5
    rows = [_row("layer", 1, 15.0, host_us=20.0), _row("baseline", 1, 900.0)]
    result = bench.result(rows)
    assert result["method"]["check_calls"] == CHECK_CALLS
    assert result["method"]["check_rows"] == CHECK_ROWS
    assert result["rows"][0]["host_us"] == 20.0 and result["rows"][1]["host_us"] is None
    assert "rel_l2_worst_call" in result["rows"][0]
    assert result["artifact"]["model"] == shape.to_dict()
    assert result["method"]["routing"] == routing_rule(shape)
    assert result["method"]["routing"]["skews"] == ("bias" if shape.bias else "logits")


def _variant(kernel, tokens, finalize=False, shared=True):
    from kernels import abi

    names = {("mega", True): abi.MEGA_PARAMS, ("mega", False): abi.MEGA_ROUTED_PARAMS,
             ("grouped", True): abi.GROUPED_PARAMS, ("grouped", False): abi.GROUPED_ROUTED_PARAMS}  # fmt: skip
    params = tuple((n, abi.param_kind(n)) for n in names[(kernel, shared)])
    return SimpleNamespace(kernel=kernel, tokens=tokens, finalize=finalize, params=params)


@pytest.mark.parametrize("shape", [CHECK_SHAPE, dataclasses.replace(SOFTMAX, experts=32)],
                         ids=["shared-expert", "no-shared-expert"])  # fmt: skip
def test_run_counts_the_shared_expert_only_where_the_model_has_one(shape, monkeypatch):
    """A whole run without a GPU (timers stubbed: each call runs once, 10 us
    a call; the check on 12 calls; the torch baseline real): every case of
    every M, bias None throughout for a model without one, and weight_bytes
    of every row distinct experts x expert_bytes, plus one expert's bytes for
    the shared expert where the model has one (on every kind: its mega
    variants compute it), on none where it has none; the result's tables."""
    from benchmarks.baseline import TorchMoE

    # 12 calls, not fewer: the torch baseline's own BF16 numerics read ~1.6e-2
    # pooled against float64 (as in the H200 runs), and pooled over 2 calls of
    # 2 tokens their spread once reached past its 3e-2 bar (3.2e-2).
    monkeypatch.setattr(bench_module, "CHECK_CALLS", 12)
    monkeypatch.setattr(bench_module, "CHECK_ROWS", 1)

    def timed(calls, *args, **kwargs):
        for call in calls if isinstance(calls, list) else [calls]:
            call()
        return [10.0]

    monkeypatch.setattr(bench_module, "time_graph", timed)
    monkeypatch.setattr(bench_module, "time_eager", timed)
    monkeypatch.setattr(bench_module, "time_host", lambda calls, cpu=None: [3.0 if cpu else 4.0])
    monkeypatch.setattr(bench_module, "cpu_probe", lambda: 7.0)
    monkeypatch.setattr(bench_module, "device_facts", lambda d: {"device": "CPU", "driver": "-",
                                                                 "sms": 0})  # fmt: skip
    monkeypatch.setattr(bench_module, "commit_id", lambda: "abc")
    shared = bool(shape.shared_experts)
    g = seeding.generator()
    prepared, routed, shared_ckpt = random_moe_weights(shape, g)
    bench = _bench(shape, g)
    bench.checkpoints = (routed, shared_ckpt)
    bench.checker = ReferenceLayer(routed, shared_ckpt, shape)
    bench.copies = [(prepared, bench.checker)] * bench_module.COPIES
    bench.baseline = TorchMoE(prepared, shape)
    bench.reps, logged = 5, []
    bench.log = logged.append
    bench.host_cpu = 1
    bench.artifact.variants = [_variant("mega", 2, shared=shared),
                               _variant("grouped", 8, shared=shared),
                               _variant("grouped", 8, True, shared=shared)]  # fmt: skip
    bench.artifact.manifest = {"config": {"name": "c"}, "config_hash": "h", "toolchain": None}
    bench.config = bench.artifact.manifest["config"]
    seen = []
    rows = bench.run([2, 8], ["random", "skewed"], done=lambda so_far: seen.append(
        [(r.routing, r.tokens, r.kernel, r.speedup_vs_baseline) for r in so_far]))  # fmt: skip
    # After each (routing, M): the rows so far, in order, speedups already set.
    assert [len(s) for s in seen] == [4, 8, 12, 16]
    assert seen[-1] == [(r.routing, r.tokens, r.kernel, r.speedup_vs_baseline) for r in rows]
    assert {(r, m) for r, m, _, _ in seen[0]} == {("random", 2)}
    assert all(sp is not None for *_, kind, sp in seen[0] if kind != "baseline")
    kinds = sorted((r.tokens, r.kernel, r.bucket, bool(r.finalize)) for r in rows
                   if r.routing == "random")  # fmt: skip
    # M = 2: the grouped kernel padded to its bucket 8; M = 8: both finalize settings.
    assert kinds == [(2, "baseline", None, False), (2, "grouped", 8, False),
                     (2, "layer", None, False), (2, "mega", 2, False),
                     (8, "baseline", None, False), (8, "grouped", 8, False),
                     (8, "grouped", 8, True), (8, "layer", None, False)]  # fmt: skip
    per = shape.expert_bytes
    for r in rows:
        assert r.correct and r.time_us == 10.0, r
        routed_bytes = r.weight_bytes - (per if shared else 0)
        assert abs(routed_bytes - r.distinct_experts * per) <= 0.005 * per + 1, r
        assert 1 <= r.distinct_experts <= min(shape.experts, r.tokens * shape.top_k)
        assert r.tb_s == round(r.weight_bytes / 10e-6 / 1e12, 3)
        timed_host = r.kernel != "baseline"
        hosts = (r.host_us, r.host_pinned_us, r.cpu_probe_us)
        assert hosts == ((4.0, 3.0, 7.0) if timed_host else (None, None, None))
    assert len(logged) == len(rows) == 16
    bench.host_cpu = None  # where the OS cannot pin: no pinned figure, not a free one
    assert {r.host_pinned_us for r in bench.run([8], ["random"])} == {None}
    result = bench.result(rows)
    assert "partial" not in result and bench.result(rows[:4], partial=True)["partial"] is True
    assert result["method"]["routing"]["skews"] == ("bias" if shape.bias else "logits")
    assert table(result).count("\n| skewed |") == 8 and "| random | 8 |" in summary(result)


def test_time_host_times_each_call_without_waiting(monkeypatch):
    """Each call's own wall time, calls back to back in batches, the device
    synchronized (untimed) only before and between batches, no garbage
    collection during the timed calls."""
    events, collecting = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))

    def call(i, seconds):
        def run():
            events.append(i)
            collecting.append(gc.isenabled())
            time.sleep(seconds)

        return run

    us = time_host([call(0, 0.003), call(1, 0.0)], n=10, batch=4)
    assert len(us) == 10
    assert events == [0, 1, "sync", 0, 1, 0, 1, "sync", 0, 1, 0, 1, "sync", 0, 1, "sync"]
    assert min(us[0::2]) >= 3000 > statistics.median(us[1::2])  # microseconds
    assert collecting == [True] * 2 + [False] * 10 and gc.isenabled()


def test_time_host_pins_the_calling_thread_and_restores_it(monkeypatch):
    """With ``cpu``, every call (the warm-up too) runs with the thread's CPU
    set {cpu}; the former set is back after, also when a call raises."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    state = {"cpus": {0, 1, 2, 3}}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(state["cpus"]))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: state.update(cpus=set(cpus)))
    seen = []
    assert bench_module.host_cpu() == 3
    time_host([lambda: seen.append(set(state["cpus"]))], n=3, batch=2, cpu=3)
    assert seen == [{3}] * 4 and state["cpus"] == {0, 1, 2, 3}
    time_host([lambda: seen.append(set(state["cpus"]))], n=1, batch=1)
    assert seen[-1] == {0, 1, 2, 3}  # no cpu: not pinned

    def boom():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        time_host([boom], n=2, batch=1, cpu=1)
    assert state["cpus"] == {0, 1, 2, 3}


def test_cpu_probe_is_the_median_time_of_its_fixed_workload(monkeypatch):
    """Each run is timed on its own (two clock reads around the loop); the
    probe is the median of the runs in microseconds."""
    clock = iter([0.0, 10e-6, 1.0, 1.0 + 30e-6, 2.0, 2.0 + 20e-6])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    assert bench_module.cpu_probe(runs=3, loop=10) == 20.0
    monkeypatch.undo()
    assert 0 < bench_module.cpu_probe(runs=5) < 1e5


def test_summary_of_an_m_above_every_bucket_names_the_chunks():
    """M = 128 has no kernel row (the layer runs chunks): the summary says so
    instead of failing, and keeps the table's columns."""
    rows = [_row("layer", 128, 400.0, host_us=30.0), _row("baseline", 128, 9000.0),
            _row("layer", 64, 200.0, host_us=25.0), _row("baseline", 64, 5000.0),
            _row("grouped", 64, 190.0)]  # fmt: skip
    _speedups(rows)
    text = summary(_result(rows))
    line = next(x for x in text.splitlines() if x.startswith("| random | 128 |"))
    assert "| chunks | - | - |" in line and "| 9000 |" in line
    header = text.splitlines()[2]
    assert header.count("|") == line.count("|")


def test_residency_reports_each_bound_variant():
    """The result's ``residency``: per variant the launch's CTAs, what the
    device holds at once (the launcher's bind-time occupancy) and the plan's
    CTAs per SM from the manifest's notes."""
    from types import SimpleNamespace as NS

    from benchmarks.bench import residency

    launcher = NS(variant=NS(launch=NS(grid=(72, 1, 1))), residency=120)
    layer = NS(launchers={"mega-sm_90a-m1-float32": launcher})
    manifest = {"variants": [{"name": "mega-sm_90a-m1-float32", "notes": {"ctas_per_sm": 1}}]}
    assert residency(layer, manifest) == {
        "mega-sm_90a-m1-float32": {"grid": 72, "resident": 120, "ctas_per_sm": 1}
    }
    assert residency(NS(), manifest) == {}  # a stand-in layer without launchers


def test_grouped_timeline_reads_stamps_across_a_timer_wrap():
    """``benchmarks.grouped_timeline.timeline``: times in us from the earliest
    end of a PDL wait (entries before it negative; the earliest entry where
    no CTA stamped the wait), right when the 32-bit timer wraps between the
    CTAs' entries; counts
    as they are; summed waits (ns) in us, whatever the times; a point no CTA
    wrote (0: the stamps are zeroed before the call) is None, one some CTAs
    did not write counts the others only."""
    import torch

    from benchmarks.grouped_timeline import per_cta, timeline
    from kernels.grouped_plan import STAMP_COUNTS, STAMP_POINTS, STAMP_SUMS

    ctas, start = 3, (1 << 32) - 150  # ns; CTA 0 and 1 enter before the wrap, 2 after
    words = torch.zeros(ctas, len(STAMP_POINTS), dtype=torch.int64)
    for c in range(ctas):
        for i, name in enumerate(STAMP_POINTS):
            words[c, i] = (start + 1000 * i + 100 * c) % (1 << 32)
            if name in STAMP_COUNTS:
                words[c, i] = 10 + c
            if name in STAMP_SUMS:
                words[c, i] = 2000 + 500 * c + 100 * STAMP_SUMS.index(name)
    words[:, STAMP_POINTS.index("finished")] = 0  # a variant without the finalize
    words[0, STAMP_POINTS.index("fc2_ready")] = 0  # a CTA without FC2 stages
    signed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    got = timeline(signed)
    wait = STAMP_POINTS.index("pdl_wait")  # us after the entries (1000 ns a point)
    assert got["entry"] == pytest.approx((-wait, -wait + 0.1, -wait + 0.2))
    assert got["pdl_wait"] == pytest.approx((0.0, 0.1, 0.2))
    at = {name: float(i - wait) for i, name in enumerate(STAMP_POINTS)}
    assert got["exit"] == pytest.approx((at["exit"], at["exit"] + 0.1, at["exit"] + 0.2))
    fc2 = at["fc2_ready"]
    assert got["fc2_ready"] == pytest.approx((fc2 + 0.1, fc2 + 0.15, fc2 + 0.2))
    assert got["units"] == (10, 11, 12)
    for k, name in enumerate(STAMP_SUMS):
        assert got[name] == pytest.approx((2.0 + 0.1 * k, 2.5 + 0.1 * k, 3.0 + 0.1 * k)), name
    assert got["finished"] is None
    cols = per_cta(signed)  # every CTA's own values, None where it wrote none
    assert cols["fc2_ready"][0] is None
    assert cols["fc2_ready"][1:] == pytest.approx([fc2 + 0.1, fc2 + 0.2])
    assert cols["units"] == [10, 11, 12] and cols["finished"] == [None] * ctas
    words[:, wait] = 0  # no CTA stamped its wait: from the earliest entry
    signed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    assert timeline(signed)["entry"] == pytest.approx((0.0, 0.1, 0.2))
    assert all(
        v is None for v in timeline(torch.zeros(2, len(STAMP_POINTS), dtype=torch.int32)).values()
    )


def test_grouped_timeline_consumer_work_is_busy_time_a_stage():
    """``consumer_work``: END - first full stage - waits for full stages, and
    that and the closes over the CTA's FC1 + FC2 stages; None for a CTA
    without a consumer value (sm_100a) or without stages."""
    from benchmarks.grouped_timeline import consumer_work

    cols = {
        "first_full": [2.0, 3.0, None, 1.0], "consumer_end": [52.0, 43.0, 9.0, 5.0],
        "wait_full": [10.0, 4.0, None, 1.0], "closing": [8.0, 6.0, None, 0.0],
        "fc1_stages": [30, 20, 4, 0], "fc2_stages": [10, 10, 2, 0],
    }  # fmt: skip
    got = consumer_work(cols)
    assert got["busy"][:2] == pytest.approx([40.0, 36.0]) and got["busy"][2:] == [None, None]
    assert got["busy_a_stage"][:2] == pytest.approx([1.0, 1.2])
    assert got["closes_a_stage"][:2] == pytest.approx([0.2, 0.2])
    assert got["busy_a_stage"][2:] == [None, None] and got["closes_a_stage"][3] is None


def test_grouped_timeline_reads_only_a_stamped_variant_of_the_loaded_arch():
    """``stamped_variant``: a grouped variant whose manifest notes name the
    stamps and whose ``partial`` workspace holds them; a release build's, a
    mega variant or a workspace too small for the stamps is refused."""
    from types import SimpleNamespace as NS

    from benchmarks.grouped_timeline import stamped_variant
    from kernels.grouped_plan import STAMP_POINTS, partial_bytes

    full = partial_bytes(132) + 132 * len(STAMP_POINTS) * 4

    def artifact(kernel="grouped", notes=True, partial=full):
        v = NS(name="v", kernel=kernel, launch=NS(grid=(132, 1, 1)),
               workspace=(NS(name="partial", bytes=partial),))  # fmt: skip
        record = {"name": "v", "notes": {"stamps": list(STAMP_POINTS)} if notes else {}}
        return NS(variants=(v,), manifest={"variants": [record]})

    assert stamped_variant(artifact()).name == "v"
    assert stamped_variant(artifact(notes=False)) is None
    assert stamped_variant(artifact(kernel="mega")) is None
    assert stamped_variant(artifact(partial=full - 4)) is None


def test_gpu_state_reads_the_fields_in_order_or_nothing(monkeypatch):
    fields = bench_module.GPU_STATE_FIELDS
    line = ", ".join(f"v{i}" for i in range(len(fields)))
    monkeypatch.setattr(bench_module, "_env_fact", lambda cmd, fallback="unknown": line)
    state = bench_module.gpu_state(torch.device("cpu"))
    assert list(state) == list(fields) and state[fields[-1]] == f"v{len(fields) - 1}"
    # A field nvidia-smi does not know makes it print an error: no partial record.
    monkeypatch.setattr(bench_module, "_env_fact", lambda cmd, fallback="unknown": "")
    assert bench_module.gpu_state(torch.device("cpu")) == {}
    monkeypatch.setattr(bench_module, "_env_fact", lambda cmd, fallback="unknown": "a, b")
    assert bench_module.gpu_state(torch.device("cpu")) == {}


def test_gpu_state_asks_nvidia_smi_for_the_gpu_by_uuid(monkeypatch):
    """nvidia-smi numbers GPUs in PCI order, not as CUDA_VISIBLE_DEVICES
    does: the query names torch's device by its UUID, the index only where
    torch has none."""
    asked = []
    monkeypatch.setattr(
        bench_module, "_env_fact", lambda cmd, fallback="unknown": asked.append(cmd) or ""
    )
    props = SimpleNamespace(uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    bench_module.gpu_state(torch.device("cuda", 1))
    assert "--id=GPU-1234-abcd" in asked[-1]
    props.uuid = None
    bench_module.gpu_state(torch.device("cuda", 1))
    assert "--id=1" in asked[-1]


def test_ab_layer_table_lists_each_artifacts_rounds_per_case():
    from benchmarks.ab_layer import table

    times = {"random 1": {"a": [19.44, 19.92], "b": [23.46]}, "skewed 8": {"b": [40.35, 47.5]}}
    lines = table(times, ["a", "b"])
    assert lines[0] == "| case | a | b |" and lines[1] == "|---|---|---|"
    assert lines[2] == "| random 1 | 19.4 / 19.9 | 23.5 |"
    assert lines[3] == "| skewed 8 |  | 40.4 / 47.5 |"


def test_ab_layer_rounds_rotate_the_artifact_order():
    from benchmarks.ab_layer import round_order

    arts = ["a", "b", "c"]
    assert [round_order(arts, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]
    ]  # fmt: skip
    # Over len(arts) rounds each artifact runs first once.
    assert sorted(round_order(arts, r)[0] for r in range(3)) == arts


def _ab_artifact(root, name, model=None):
    import runtime_fixtures as rf

    rec = rf.record("mega")
    return str(rf.write(root / name, [(rec, rf.cubin(name))], model=model))


def test_ab_layer_refuses_bad_arguments_before_any_gpu_work(tmp_path, capsys):
    import runtime_fixtures as rf

    from benchmarks.ab_layer import parse

    a = _ab_artifact(tmp_path, "a")
    b = _ab_artifact(tmp_path, "b")
    other = _ab_artifact(tmp_path, "other", model=dict(rf.SMALL_MODEL, hidden=512))
    args = parse([a, b, "--rounds", "2", "--tokens", "1,8", "--routing", "random,skewed"])
    assert args.rounds == 2 and args.tokens == [1, 8] and args.routing == ["random", "skewed"]
    bad = {
        "--rounds 0": ([a, b, "--rounds", "0"], "must be at least 1"),
        "--reps 0": ([a, b, "--reps", "0"], "must be at least 1"),
        "tokens": ([a, b, "--tokens", "1,x"], "comma-separated list of integers"),
        "tokens 0": ([a, b, "--tokens", "0,8"], "at least 1"),
        "routing": ([a, b, "--routing", "random,hot"], "unknown routing hot"),
        "twice": ([a, a], "named twice"),
        "missing": ([a, str(tmp_path / "none")], "not a readable artifact"),
        "shape": ([a, other], "another model shape"),
    }
    for case, (argv, message) in bad.items():
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2, case
        assert message in capsys.readouterr().err, case
