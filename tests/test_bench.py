"""The benchmark's bookkeeping (the timing itself needs a GPU: `moe-build bench`)."""

import seeding
import torch
from click.testing import CliRunner

from pipeline.bench import ROUTINGS, Row, _speedups, crossover, distinct_experts, routing_inputs
from pipeline.bench_command import table
from pipeline.cli import main
from runtime.model import MoEShape

SHAPE = MoEShape(256, 128, 64, 4, 2.5, 10.0, False, 1)


def _row(kernel, m, t, finalize=None):
    return Row(kernel=kernel, arch="sm_90a", tokens=m, routing="random", distinct_experts=4.0,
               weight_bytes=10**6, time_us=t, time_us_min=t, time_us_max=t, reps=5, tb_s=1.0,
               floor_fraction=0.25, correct=True, rel_l2=1e-3, max_abs=1e-2, near_ties=0,
               finalize=finalize)  # fmt: skip


def test_routing_bias_spread_sets_distinct_experts():
    g = torch.Generator().manual_seed(0)
    counts = {}
    for kind in ROUTINGS:
        _, logits, bias = routing_inputs(kind, 16, SHAPE, 8, g, "cpu")
        assert logits.shape == (8, 16, 64) and bias.shape == (64,)
        counts[kind] = distinct_experts(logits, bias, SHAPE.top_k)
    # Skewed routing concentrates tokens on fewer experts than uniform routing.
    assert counts["skewed"] < counts["random"] <= counts["uniform"] + 2
    assert 1 <= counts["skewed"] and counts["uniform"] <= 64


def test_speedups_and_crossover():
    rows = [_row("baseline", 4, 100.0), _row("mega", 4, 20.0), _row("grouped", 4, 25.0, False),
            _row("grouped", 4, 30.0, True), _row("layer", 4, 22.0)]  # fmt: skip
    _speedups(rows)
    assert rows[1].speedup_vs_baseline == 5.0 and rows[0].speedup_vs_baseline is None
    assert crossover(rows) == [
        {"routing": "random", "tokens": 4, "mega": 20.0, "grouped": 25.0, "faster": "mega"}
    ]


def test_table_lists_every_row():
    rows = [_row("layer", 1, 15.0), _row("baseline", 1, 900.0)]
    _speedups(rows)
    result = {"device": "GPU", "driver": "1", "sms": 1, "copy_tb_s": 4.0, "commit": "abc",
              "date": "2026-01-01", "rows": [r.__dict__ for r in rows]}  # fmt: skip
    text = table(result)
    assert text.count("\n| random |") == 2 and "60.0x" in text


def test_bench_refuses_bad_tokens_and_needs_a_gpu(tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tmp_path), "--tokens", "0,65"])
    assert r.exit_code == 2 and "1..64" in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["bench", str(tmp_path)])
        assert r.exit_code == 2 and "needs a CUDA GPU" in r.output


def test_torch_baseline_matches_the_reference():
    from pipeline.baseline import TorchMoE
    from pipeline.bench import TOLERANCE
    from runtime.layout import random_moe_weights
    from runtime.reference import moe_reference, rel_l2

    shape = MoEShape(512, 256, 64, 4, 2.5, 10.0, False, 1)
    g = seeding.generator()
    prepared, routed, shared = random_moe_weights(shape, g)
    x = torch.randn(5, shape.hidden, generator=g).bfloat16()
    logits = torch.randn(5, shape.experts, generator=g)
    bias = torch.randn(shape.experts, generator=g) * 0.1
    want = moe_reference(x, logits, bias, routed, shared, shape, torch.float64).final
    # BF16 weights: ~1.6e-2 here; a layout or gate/up mix-up lands near 1.
    assert rel_l2(TorchMoE(prepared, shape)(x, logits, bias), want) < TOLERANCE["baseline"]


class _ReferenceLayer:
    """Stands in for a bound layer: the float32 reference, BF16-rounded."""

    def __init__(self, routed, shared, shape):
        self.args = (routed, shared, shape)

    def _ref(self, x, logits, bias):
        from runtime.reference import moe_reference

        return moe_reference(x, logits, bias, *self.args)

    def mega(self, x, logits, bias, shared=False):
        r = self._ref(x, logits, bias)
        out = (r.out.bfloat16(), r.ids, r.weights)
        return (*out, r.shared.bfloat16()) if shared else out

    def grouped(self, x, logits, bias, finalize=False):
        r = self._ref(x, logits, bias)
        if finalize:
            return r.final.bfloat16()
        return r.out.bfloat16(), r.ids, r.weights, r.shared.bfloat16()

    def __call__(self, x, logits, bias):
        return self._ref(x, logits, bias).final.bfloat16()


def test_check_compares_every_kind_with_the_reference():
    from pipeline.bench import Bench
    from runtime.layout import random_moe_weights

    shape = MoEShape(256, 128, 32, 4, 2.5, 10.0, False, 1)
    g = seeding.generator()
    prepared, routed, shared = random_moe_weights(shape, g)
    bench = Bench.__new__(Bench)  # no GPU: only what check() reads
    bench.shape, bench.g, bench.device = shape, g, torch.device("cpu")
    bench.checkpoints = (routed, shared)
    bench.checker = _ReferenceLayer(routed, shared, shape)
    bench.baseline = bench.checker
    for kind, fin in (("mega", False), ("grouped", False), ("grouped", True), ("layer", False),
                      ("baseline", False)):  # fmt: skip
        rel, max_abs, ties = bench.check(kind, 3, "random", fin)
        # BF16 rounding of the outputs only (and of the rows the final sums).
        assert rel < 1e-2 and max_abs < 0.1 and ties >= 0, (kind, fin, rel)
    bench.checker = _ReferenceLayer(random_moe_weights(shape, g)[1], shared, shape)
    assert bench.check("mega", 3, "random")[0] > 0.5  # other weights: caught
