"""runtime.moe on the CPU: dispatch, padding, cropping, the shared expert and
the layer's finalize, with the kernel launch replaced by the torch reference
(the GPU tests launch the real cubins)."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.errors import InputError
from runtime.inputs import check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.moe import MoELayer
from runtime.reference import expert_forward, moe_reference, quantize_activations
from runtime.shared_expert import SharedExpert

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")


def _variant(kernel, tokens, dtype, finalize=False):
    rec = fx.record(kernel, tokens=tokens, dtype=dtype, finalize=finalize)
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
        if variant.kernel == "grouped":
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


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 48, 63, 64])
def test_layer_matches_reference_for_m(weights, m):
    layer = _layer(weights, poison=True)
    dtype = torch.bfloat16 if m % 2 else torch.float32
    x, logits, bias = _inputs(m, dtype)
    final = layer(x, logits, bias)
    ref = moe_reference(x, logits, bias, weights.routed, weights.shared, SHAPE)
    assert final.shape == (m, SHAPE.hidden) and final.dtype == torch.bfloat16
    assert not final.isnan().any()
    # Same routes; only the shared expert's accumulation order (mega path) or
    # nothing (grouped finalize) differs: a BF16 rounding at most.
    assert _rel_l2(final, ref.final) < 4e-3
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


def test_shared_expert_matches_reference(weights):
    for ue8m0 in (False, True):
        shape = MoEShape(**{**fx.SMALL_MODEL, "ue8m0": ue8m0})
        x = (torch.randn(4, SHAPE.hidden) * 3).to(torch.bfloat16)
        got = SharedExpert(weights.shared, shape)(x)
        xq, sx = quantize_activations(x, ue8m0)
        ref = expert_forward(xq, sx, weights.shared, 0, shape.swiglu_limit, torch.float64).y
        assert got.dtype == torch.bfloat16 and got.shape == (4, SHAPE.hidden)
        assert _rel_l2(got, ref) < 4e-3


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
