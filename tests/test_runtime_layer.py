"""runtime.moe on the CPU: dispatch, padding, cropping, the shared expert (the
mega kernel's, or the torch fallback for mega variants without it) and the
layer's finalize, with the kernel launch replaced by the torch reference (the
GPU tests launch the real cubins)."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.errors import InputError
from runtime.inputs import check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.moe import MoELayer, combine, computes_shared
from runtime.reference import (
    expert_forward,
    finalize,
    moe_reference,
    quantize_activations,
    rel_l2,
)
from runtime.shared_expert import SharedExpert

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")


#: The sm_90a mega kernel's ABI with the shared expert (kernels/mega_moe_sm90.py).
MEGA_SHARED = {
    "params": [{"name": p, "kind": "pointer"}
               for p in ("maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "x", "logits",
                         "bias", "rows1", "rows2", "out", "shared_out", "ids", "weights")],
    "tensor_maps": ["w13", "w2", "s13", "s2"],
}  # fmt: skip


def _variant(kernel, tokens, dtype, finalize=False, shared=True):
    """A variant record; mega ones with the shared expert unless ``shared``
    is False (the older routed-only ABI)."""
    extra = MEGA_SHARED if kernel == "mega" and shared else {}
    rec = fx.record(kernel, tokens=tokens, dtype=dtype, finalize=finalize, **extra)
    return Variant(
        name=rec["name"], kernel=kernel, arch="sm_90a", tokens=tokens, logits_dtype=dtype,
        finalize=finalize, sms=132, entry=rec["entry"],
        params=tuple((p["name"], p["kind"]) for p in rec["params"]),
        tensor_maps=tuple(rec["tensor_maps"]), launch=Launch((1, 1, 1), (1, 1, 1), None, 0, False),
        workspace=tuple(WorkspaceNeed(w["name"], w["bytes"], w["zero"]) for w in rec["workspace"]),
        sha256="0" * 64, cubin=b"",
    )  # fmt: skip


class FakeArtifact:
    arch = "sm_90a"

    def __init__(self, variants):
        self.variants = variants

    def launcher(self, variant, ordinal):
        return None

    def tensor_maps(self, tensors, names, device):
        return torch.zeros(128 * len(names), dtype=torch.uint8)


class ReferenceLayer(MoELayer):
    """Launches = the reference on the padded bucket, written to the outputs."""

    def __init__(self, *args, weights, skip=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.weights, self.skip, self.calls = weights, skip, []

    def _launch(self, variant, buffers, bucket):
        x, logits = buffers["x"], buffers["logits"]
        assert x.shape[0] == bucket and logits.shape[0] == bucket
        self.calls.append((variant.name, x.clone(), logits.clone()))
        ref = moe_reference(x, logits, buffers["bias"], self.weights.routed,
                            self.weights.shared, SHAPE)  # fmt: skip
        results = {"out": ref.out, "ids": ref.ids.view(-1), "weights": ref.weights.view(-1)}
        if computes_shared(variant):
            results["shared_out"] = ref.shared
        if variant.finalize:
            results["final"] = ref.final
        for name, value in results.items():
            if name not in self.skip:
                buffers[name].copy_(value)


GLM5_LIKE = [_variant("mega", m, d) for m in (1, 2, 3, 4) for d in ("float32", "bfloat16")] + [
    _variant("grouped", m, d, f)
    for m in (8, 16, 32, 48, 64)
    for d in ("float32", "bfloat16")
    for f in (False, True)
]


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, torch.Generator().manual_seed(torch.seed() % 2**31))[0]


def _layer(weights, variants=GLM5_LIKE, **kwargs):
    tensors = check_weights(weights, SHAPE, CPU)
    return ReferenceLayer(FakeArtifact(variants), tensors, SHAPE, CPU, weights=weights, **kwargs)


def _inputs(m, dtype=torch.float32):
    x = torch.randn(m, SHAPE.hidden).to(torch.bfloat16)
    return x, torch.randn(m, SHAPE.experts).to(dtype), torch.randn(SHAPE.experts) * 0.1


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 48, 63, 64])
def test_layer_matches_reference_for_m(weights, m):
    layer = _layer(weights, poison=True)
    dtype = torch.bfloat16 if m % 2 else torch.float32
    x, logits, bias = _inputs(m, dtype)
    final = layer(x, logits, bias)
    ref = moe_reference(x, logits, bias, weights.routed, weights.shared, SHAPE)
    assert final.shape == (m, SHAPE.hidden) and final.dtype == torch.bfloat16
    assert not final.isnan().any()
    # Same routes and shared rows; only the order of the weighted sum (mega
    # path) or nothing (grouped finalize) differs: a BF16 rounding at most.
    assert rel_l2(final, ref.final) < 4e-3
    name, padded_x, padded_logits = layer.calls[-1]
    bucket = padded_x.shape[0]
    assert name.startswith("mega" if m <= 4 else "grouped")
    assert bucket == next(b for b in (1, 2, 3, 4, 8, 16, 32, 48, 64) if b >= m)
    assert torch.equal(padded_x[m:], x[-1:].expand(bucket - m, -1))
    assert torch.equal(padded_logits[m:], logits[-1:].expand(bucket - m, -1))


def test_kernel_entries_crop_padding(weights):
    layer = _layer(weights, poison=True)
    x, logits, bias = _inputs(3)
    out, ids, w = layer.mega(x, logits, bias)
    k = SHAPE.top_k
    assert out.shape == (3 * k, SHAPE.hidden) and ids.shape == (3, k) and w.shape == (3, k)
    ref = moe_reference(x, logits, bias, weights.routed, weights.shared, SHAPE)
    assert torch.equal(ids, ref.ids) and torch.equal(w, ref.weights)
    x, logits, bias = _inputs(11)
    out, ids, w, shared = layer.grouped(x, logits, bias)
    assert out.shape == (11 * k, SHAPE.hidden) and shared.shape == (11, SHAPE.hidden)
    assert layer.calls[-1][0] == "grouped-sm_90a-m16-float32"
    final = layer.grouped(x, logits, bias, finalize=True)
    assert final.shape == (11, SHAPE.hidden)
    assert layer.calls[-1][0] == "grouped-sm_90a-m16-float32-final"
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
    assert layer.shared_expert is None
    final = layer(*_inputs(2))
    assert layer.calls[-1][0] == "grouped-sm_90a-m8-float32-final" and final.shape[0] == 2
    with pytest.raises(InputError, match="logits: expected dtype torch.float32"):
        layer(*_inputs(2, torch.bfloat16))
    with pytest.raises(InputError, match="no mega variant"):
        layer.mega(*_inputs(2))


def test_mega_path_takes_the_kernels_shared_rows(weights):
    """A mega variant with ``shared_out``: the layer adds the kernel's rows
    (left unwritten, they poison the output) and needs no torch expert."""
    layer = _layer(weights, poison=True, skip=("shared_out",))
    assert layer.shared_expert is None
    for m in (1, 3):
        assert layer(*_inputs(m)).isnan().all()
        out, ids, w, shared = layer.mega(*_inputs(m), shared=True)
        assert shared.shape == (m, SHAPE.hidden) and shared.isnan().all()
        assert not out.isnan().any() and not w.isnan().any()
    layer = _layer(weights, poison=True)
    x, logits, bias = _inputs(3)
    out, ids, w, shared = layer.mega(x, logits, bias, shared=True)
    ref = moe_reference(x, logits, bias, weights.routed, weights.shared, SHAPE)
    assert shared.dtype == torch.bfloat16 and rel_l2(shared, ref.shared) < 4e-3
    assert len(layer.mega(x, logits, bias)) == 3


def test_mega_variants_without_shared_fall_back_to_torch(weights):
    """Routed-only mega variants (older ABI): the torch shared expert fills
    in, for the layer and for ``mega(shared=True)``."""
    old = [_variant("mega", m, d, shared=False) for m in (1, 2, 3, 4)
           for d in ("float32", "bfloat16")] + GLM5_LIKE[8:]  # fmt: skip
    assert not any(computes_shared(v) for v in old[:8])
    layer = _layer(weights, variants=old, poison=True)
    assert layer.shared_expert is not None
    for m in (1, 2, 4):
        x, logits, bias = _inputs(m)
        ref = moe_reference(x, logits, bias, weights.routed, weights.shared, SHAPE)
        assert rel_l2(layer(x, logits, bias), ref.final) < 4e-3
        *_, shared = layer.mega(x, logits, bias, shared=True)
        assert rel_l2(shared, ref.shared) < 4e-3


@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_matches_finalize(with_shared):
    """``combine`` = runtime.reference.finalize on BF16 rows, within one BF16
    rounding of the result (only the FP32 summation order differs)."""
    m, k, h = 3, 8, 512
    out = (torch.randn(m * k, h) * 4).to(torch.bfloat16)
    weights = torch.rand(m, k)
    shared = (torch.randn(m, h) * 4).to(torch.bfloat16) if with_shared else None
    got = combine(out, weights, shared)
    want = finalize(out.float(), weights, None if shared is None else shared.float(), k)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert bool(((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all())
    exact = finalize(out.double(), weights.double(),
                     None if shared is None else shared.double(), k, rounded=False)  # fmt: skip
    assert rel_l2(got, exact) < 4e-3


def test_shared_expert_matches_reference(weights):
    for ue8m0 in (False, True):
        shape = MoEShape(**{**fx.SMALL_MODEL, "ue8m0": ue8m0})
        x = (torch.randn(4, SHAPE.hidden) * 3).to(torch.bfloat16)
        got = SharedExpert(weights.shared, shape)(x)
        xq, sx = quantize_activations(x, ue8m0)
        ref = expert_forward(xq, sx, weights.shared, 0, shape.swiglu_limit, torch.float64).y
        assert got.dtype == torch.bfloat16 and got.shape == (4, SHAPE.hidden)
        assert rel_l2(got, ref) < 4e-3


def test_custom_table_is_checked(weights):
    from runtime.plan import Step

    table = {"float32": {m: Step("grouped", 8) for m in range(1, 9)}, "bfloat16": {}}
    layer = _layer(weights, table=table)
    layer(*_inputs(3))
    assert layer.calls[-1][0] == "grouped-sm_90a-m8-float32"
    assert layer.shared_expert is None and layer.dtypes == ("float32",)
    with pytest.raises(InputError, match=r"table\['float32'\]\[9\]: .* names no variant"):
        _layer(weights, table={"float32": {9: Step("grouped", 8)}})
    with pytest.raises(InputError, match="names no variant"):
        _layer(weights, table={"float32": {1: Step("mega", 2, True)}, "bfloat16": {}})
