"""runtime.moe on the CPU: dispatch, padding, cropping, the shared expert (the
mega kernel's; mega variants without it are refused) and the layer's finalize, with the kernel launch replaced by a stand-in that writes
simple functions of its inputs (``tags``), so every output the layer returns
is checked against an expectation computed from the caller's inputs (the GPU
tests launch the real cubins)."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import seeding
import torch
from gpu_artifacts import final_bound
from layer_fakes import FakeArtifact, TaggedLayer, tags, variant

from runtime.errors import ArtifactError, InputError
from runtime.inputs import check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.moe import combine, computes_shared, writes_final
from runtime.reference import (
    finalize,
    rel_l2,
)

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")


GLM5_LIKE = [variant("mega", m, d) for m in (1, 2, 3, 4) for d in ("float32", "bfloat16")] + [
    variant("grouped", m, d, f)
    for m in (8, 16, 32, 48, 64)
    for d in ("float32", "bfloat16")
    for f in (False, True)
]
BUCKETS = (1, 2, 3, 4, 8, 16, 32, 48, 64)


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, seeding.generator(f"{__name__}.weights"))[0]


def _layer(weights, variants=GLM5_LIKE, **kwargs):
    tensors = check_weights(weights, SHAPE, CPU)
    return TaggedLayer(FakeArtifact(variants), tensors, SHAPE, CPU, **kwargs)


def _inputs(m, dtype=torch.float32, g=None):
    g = g or seeding.generator()
    x = torch.randn(m, SHAPE.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, SHAPE.experts, generator=g).to(dtype)
    return x, logits, torch.randn(SHAPE.experts, generator=g) * 0.1


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 48, 63, 64])
def test_layer_dispatches_pads_crops_and_combines(weights, m):
    """M tokens run in the smallest bucket >= M (mega up to 4, then grouped
    with in-kernel finalize), padded with copies of the last token (by the
    layer for the mega kernel; the grouped kernel takes the M rows and
    ``valid`` = M, and repeats the last itself); the layer returns the first
    M rows of the kernel's final (both kernels write it: the mega kernel's
    last-arriving CTAs, the grouped kernel's finalize)."""
    layer = _layer(weights, poison=True)
    dtype = torch.bfloat16 if m % 2 else torch.float32
    x, logits, bias = _inputs(m, dtype)
    final = layer(x, logits, bias)
    want = tags(x, logits, SHAPE.top_k)["final"]
    assert final.shape == (m, SHAPE.hidden) and final.dtype == torch.bfloat16
    assert torch.equal(final, want), seeding.rerun_hint()
    name, padded_x, padded_logits = layer.calls[-1]
    bucket = padded_x.shape[0]
    kernel = "mega" if m <= 4 else "grouped"
    suffix = "" if kernel == "mega" else "-final"
    assert bucket == next(b for b in BUCKETS if b >= m)
    dtype_name = str(dtype).removeprefix("torch.")
    assert name == f"{kernel}-sm_90a-m{bucket}-{dtype_name}{suffix}"
    assert layer.given[-1] == (name, bucket if kernel == "mega" else m)
    assert torch.equal(padded_x[:m], x) and torch.equal(padded_logits[:m], logits)
    assert torch.equal(padded_x[m:], x[-1:].expand(bucket - m, -1))
    assert torch.equal(padded_logits[m:], logits[-1:].expand(bucket - m, -1))


def test_an_empty_batch_is_an_empty_output(weights):
    """M = 0 (an engine's step with no tokens on this rank) gives a BF16
    [0, H] output and launches nothing; its tensors are checked as any
    call's, and the kernel entries, which launch, still want M >= 1."""
    layer = _layer(weights, poison=True)
    for dtype in (torch.float32, torch.bfloat16):
        x, logits, bias = _inputs(0, dtype)
        final = layer(x, logits, bias)
        assert final.shape == (0, SHAPE.hidden) and final.dtype == torch.bfloat16
        assert final.device == CPU
    assert layer.calls == []
    x, logits, bias = _inputs(0)
    with pytest.raises(InputError, match=r"logits: expected shape \[0, 32\], found \[0, 16\]"):
        layer(x, logits[:, :16], bias)
    with pytest.raises(InputError, match=r"x: expected shape \[0, 256\], found \[0, 128\]"):
        layer(x[:, :128], logits, bias)
    with pytest.raises(InputError, match="x: expected dtype torch.bfloat16"):
        layer(x.float(), logits, bias)
    with pytest.raises(InputError, match="bias: expected dtype torch.float32"):
        layer(x, logits, bias.double())
    with pytest.raises(InputError, match="logits: expected dtype"):
        layer(x, logits.half(), bias)
    for entry in (layer.mega, layer.grouped):
        with pytest.raises(InputError, match=r"x: expected M \(tokens\) in 1\.\.512, found 0"):
            entry(x, logits, bias)
    assert layer.calls == []


def test_kernel_entries_crop_padding(weights):
    layer = _layer(weights, poison=True)
    k = SHAPE.top_k
    x, logits, bias = _inputs(3)
    out, ids, w = layer.mega(x, logits, bias)
    want = tags(x, logits, k)
    assert out.shape == (3 * k, SHAPE.hidden) and ids.shape == (3, k) and w.shape == (3, k)
    assert torch.equal(out, want["out"]) and torch.equal(ids, want["ids"])
    assert torch.equal(w, want["weights"])
    assert layer.calls[-1][0] == "mega-sm_90a-m3-float32"
    x, logits, bias = _inputs(11, g=seeding.generator(seeding.current_test() + ":11"))
    want = tags(x, logits, k)
    out, ids, w, shared = layer.grouped(x, logits, bias)
    assert out.shape == (11 * k, SHAPE.hidden) and shared.shape == (11, SHAPE.hidden)
    assert layer.calls[-1][0] == "grouped-sm_90a-m16-float32"
    assert torch.equal(out, want["out"]) and torch.equal(ids, want["ids"])
    assert torch.equal(w, want["weights"]) and torch.equal(shared, want["shared"])
    final = layer.grouped(x, logits, bias, finalize=True)
    assert final.shape == (11, SHAPE.hidden) and torch.equal(final, want["final"])
    assert layer.calls[-1][0] == "grouped-sm_90a-m16-float32-final"
    # Without finalize, the layer itself combines the grouped kernel's rows.
    only = [v for v in GLM5_LIKE if v.kernel == "grouped" and not v.finalize]
    assert torch.equal(_layer(weights, variants=only)(x, logits, bias), want["final"])
    with pytest.raises(
        InputError, match=r"mega .*no bucket serves M = 5 \(compiled: \[1, 2, 3, 4\]\)"
    ):
        layer.mega(*_inputs(5))


def test_unwritten_outputs_show_as_nan(weights):
    layer = _layer(weights, poison=True, skip=("out",))
    out, ids, w = layer.mega(*_inputs(2))
    assert out.isnan().all() and not w.isnan().any()
    layer = _layer(weights, poison=True, skip=("final",))
    assert layer(*_inputs(40)).isnan().all()


def test_layer_without_mega_or_bf16_variants(weights):
    only = [v for v in GLM5_LIKE if v.kernel == "grouped" and v.logits_dtype == "float32"]
    layer = _layer(weights, variants=only)
    x, logits, bias = _inputs(2)
    final = layer(x, logits, bias)
    assert layer.calls[-1][0] == "grouped-sm_90a-m8-float32-final" and final.shape[0] == 2
    assert torch.equal(final, tags(x, logits, SHAPE.top_k)["final"])
    with pytest.raises(InputError, match="logits: expected dtype torch.float32"):
        layer(*_inputs(2, torch.bfloat16))
    with pytest.raises(InputError, match="no mega variant"):
        layer.mega(*_inputs(2))


NO_FINAL = [variant("mega", m, d, final=False) for m in (1, 2, 3, 4)
            for d in ("float32", "bfloat16")] + GLM5_LIKE[8:]  # fmt: skip


def test_mega_layer_call_returns_the_kernels_final(weights):
    """A mega variant with ``final``: ``layer(...)`` is the one launch and
    returns the rows the kernel wrote (left unwritten, they show as NaN)."""
    assert all(writes_final(v) for v in GLM5_LIKE[:8])
    layer = _layer(weights, poison=True, skip=("final",))
    for m in (1, 3):
        assert layer(*_inputs(m)).isnan().all()
    layer = _layer(weights, poison=True, skip=("out", "shared_out"))
    x, logits, bias = _inputs(2)
    assert torch.equal(layer(x, logits, bias), tags(x, logits, SHAPE.top_k)["final"])


def test_mega_path_takes_the_kernels_shared_rows(weights):
    """A mega variant with ``shared_out`` but no ``final`` (built before the
    in-kernel finalize): the layer adds the kernel's rows (left unwritten,
    they poison the output) and needs no torch expert."""
    assert not any(writes_final(v) for v in NO_FINAL[:8])
    layer = _layer(weights, variants=NO_FINAL, poison=True, skip=("shared_out",))
    for m in (1, 3):
        assert layer(*_inputs(m)).isnan().all()
        out, ids, w, shared = layer.mega(*_inputs(m), shared=True)
        assert shared.shape == (m, SHAPE.hidden) and shared.isnan().all()
        assert not out.isnan().any() and not w.isnan().any()
    layer = _layer(weights, variants=NO_FINAL, poison=True)
    x, logits, bias = _inputs(3)
    assert torch.equal(layer(x, logits, bias), tags(x, logits, SHAPE.top_k)["final"])
    out, ids, w, shared = layer.mega(x, logits, bias, shared=True)
    assert shared.dtype == torch.bfloat16
    assert torch.equal(shared, tags(x, logits, SHAPE.top_k)["shared"])
    assert len(layer.mega(x, logits, bias)) == 3


def test_mega_variants_without_shared_are_refused(weights):
    """Routed-only mega variants (the older ABI) for a model with a shared
    expert: no layer call may run an expert in torch, so bind refuses them,
    naming them; for a model without a shared expert they are what serves."""
    old = [variant("mega", m, d, shared=False) for m in (1, 2, 3, 4)
           for d in ("float32", "bfloat16")] + GLM5_LIKE[8:]  # fmt: skip
    assert not any(computes_shared(v) for v in old[:8])
    with pytest.raises(ArtifactError, match="mega-sm_90a-m1-float32.*without the shared expert"):
        _layer(weights, variants=old)
    mixed = [old[0], *GLM5_LIKE[1:]]
    with pytest.raises(ArtifactError, match="mega-sm_90a-m1-float32"):
        _layer(weights, variants=mixed)


@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_matches_finalize(with_shared):
    """``combine`` = the exact weighted sum of its BF16 rows within
    ``final_bound`` (tests/gpu_artifacts.py: FP32 ulps of the summands in
    any order, then one BF16 rounding), as the kernels' own sums are held."""
    m, k, h = 3, 8, 512
    g = seeding.generator()
    out = (torch.randn(m * k, h, generator=g) * 4).to(torch.bfloat16)
    weights = torch.rand(m, k, generator=g)
    shared = (torch.randn(m, h, generator=g) * 4).to(torch.bfloat16) if with_shared else None
    got = combine(out, weights, shared)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    want, bound = final_bound(out, weights, shared)
    assert bool(((got.double() - want).abs() <= bound).all())
    exact = finalize(out.double(), weights.double(),
                     None if shared is None else shared.double(), k, rounded=False)  # fmt: skip
    assert rel_l2(got, exact) < 4e-3


def test_custom_table_is_checked(weights):
    from runtime.plan import Step

    table = {"float32": {m: Step("grouped", 8) for m in range(1, 9)}, "bfloat16": {}}
    layer = _layer(weights, table=table)
    layer(*_inputs(3))
    assert layer.calls[-1][0] == "grouped-sm_90a-m8-float32"
    assert layer.dtypes == ("float32",)
    with pytest.raises(InputError, match=r"table\['float32'\]\[9\]: .* names no variant"):
        _layer(weights, table={"float32": {9: Step("grouped", 8)}})
    with pytest.raises(InputError, match="names no variant"):
        _layer(weights, table={"float32": {1: Step("mega", 2, True)}, "bfloat16": {}})
