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

from kernels import abi
from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.errors import ArtifactError, InputError
from runtime.inputs import check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.moe import MoELayer, combine, computes_shared, writes_final
from runtime.reference import (
    finalize,
    rel_l2,
)

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")


#: The mega kernel's routed-only ABI (kernels/abi.py); fx.record's default
#: is the ABI with the shared expert and the in-kernel finalize.
MEGA_ROUTED = {
    "params": [{"name": p, "kind": "pointer"} for p in abi.MEGA_ROUTED_PARAMS],
    "tensor_maps": list(abi.MEGA_ROUTED_MAPS),
}
#: The mega ABI of artifacts built before the in-kernel finalize: shared rows
#: but no ``final`` (the layer sums the routes in torch).
MEGA_NO_FINAL = {
    "params": [{"name": p, "kind": "pointer"} for p in abi.MEGA_PARAMS
               if p not in ("final", "arrivals")],
    "tensor_maps": list(abi.MEGA_MAPS), "workspace": [],
}  # fmt: skip


def _variant(kernel, tokens, dtype, finalize=False, shared=True, final=True):
    """A variant record; mega ones with the shared expert unless ``shared``
    is False (the older routed-only ABI) and with the in-kernel finalize
    unless ``final`` is False."""
    extra = {}
    if kernel == "mega":
        extra = MEGA_ROUTED if not shared else ({} if final else MEGA_NO_FINAL)
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


def tags(x, logits, top_k):
    """What the stand-in kernel writes for tokens ``x`` [T, H] (BF16) and
    ``logits`` [T, E]: simple functions of each token's own row, chosen so
    that every sum the layer takes of them is exact in FP32.

    ids [T, k]: the token's top-k logits, best first; weights [T, k]: those
    logits rounded to eighths; out row t*k + j: x[t] * 2^-j; shared row t:
    -x[t] / 2; final [T, H]: sum_j weights * out + shared, rounded once to
    BF16."""
    ids = torch.topk(logits.float(), top_k, dim=-1).indices
    weights = torch.round(logits.float().gather(1, ids) * 8) / 8
    steps = 2.0 ** -torch.arange(top_k, dtype=torch.float32)
    out = (x.float()[:, None, :] * steps[None, :, None]).reshape(-1, x.shape[1])
    shared = -x.float() / 2
    coeff = (weights.double() * steps.double()).sum(-1, keepdim=True)  # [T, 1]
    routed = x.double() * coeff
    return {
        "ids": ids.to(torch.int32), "weights": weights, "out": out.to(torch.bfloat16),
        "shared": shared.to(torch.bfloat16), "routed": routed,
        "final": (routed + shared.double()).to(torch.bfloat16),
    }  # fmt: skip


class TaggedLayer(MoELayer):
    """The layer with its launch replaced by a stand-in kernel writing
    ``tags`` of the padded bucket's inputs (mega variants without
    ``shared_out`` leave it unwritten, as the kernel does; ``skip``: outputs
    left unwritten). No MoE math: what the layer returns can be predicted
    exactly from the caller's (unpadded) inputs."""

    def __init__(self, *args, weights, skip=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.weights, self.skip, self.calls = weights, skip, []

    def _launch(self, variant, buffers, bucket):
        x, logits = buffers["x"], buffers["logits"]
        assert x.shape[0] == bucket and logits.shape[0] == bucket
        self.calls.append((variant.name, x.clone(), logits.clone()))
        t = tags(x, logits, SHAPE.top_k)
        results = {"out": t["out"], "ids": t["ids"].view(-1), "weights": t["weights"].view(-1)}
        if computes_shared(variant):
            results["shared_out"] = t["shared"]
        if writes_final(variant):
            results["final"] = t["final"]
        for name, value in results.items():
            if name not in self.skip:
                buffers[name].copy_(value)


GLM5_LIKE = [_variant("mega", m, d) for m in (1, 2, 3, 4) for d in ("float32", "bfloat16")] + [
    _variant("grouped", m, d, f)
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
    return TaggedLayer(FakeArtifact(variants), tensors, SHAPE, CPU, weights=weights, **kwargs)


def _inputs(m, dtype=torch.float32, g=None):
    g = g or seeding.generator()
    x = torch.randn(m, SHAPE.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, SHAPE.experts, generator=g).to(dtype)
    return x, logits, torch.randn(SHAPE.experts, generator=g) * 0.1


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 48, 63, 64])
def test_layer_dispatches_pads_crops_and_combines(weights, m):
    """M tokens run in the smallest bucket >= M (mega up to 4, then grouped
    with in-kernel finalize), padded with copies of the last token; the
    layer returns the first M rows of the kernel's final (both kernels write
    it: the mega kernel's last-arriving CTAs, the grouped kernel's finalize)."""
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
    assert torch.equal(padded_x[:m], x) and torch.equal(padded_logits[:m], logits)
    assert torch.equal(padded_x[m:], x[-1:].expand(bucket - m, -1))
    assert torch.equal(padded_logits[m:], logits[-1:].expand(bucket - m, -1))


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


NO_FINAL = [_variant("mega", m, d, final=False) for m in (1, 2, 3, 4)
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
    old = [_variant("mega", m, d, shared=False) for m in (1, 2, 3, 4)
           for d in ("float32", "bfloat16")] + GLM5_LIKE[8:]  # fmt: skip
    assert not any(computes_shared(v) for v in old[:8])
    with pytest.raises(ArtifactError, match="mega-sm_90a-m1-float32.*without the shared expert"):
        _layer(weights, variants=old)
    mixed = [old[0], *GLM5_LIKE[1:]]
    with pytest.raises(ArtifactError, match="mega-sm_90a-m1-float32"):
        _layer(weights, variants=mixed)


@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_matches_finalize(with_shared):
    """``combine`` = runtime.reference.finalize on BF16 rows, within one BF16
    rounding of the result (only the FP32 summation order differs)."""
    m, k, h = 3, 8, 512
    g = seeding.generator()
    out = (torch.randn(m * k, h, generator=g) * 4).to(torch.bfloat16)
    weights = torch.rand(m, k, generator=g)
    shared = (torch.randn(m, h, generator=g) * 4).to(torch.bfloat16) if with_shared else None
    got = combine(out, weights, shared)
    want = finalize(out.float(), weights, None if shared is None else shared.float(), k)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert bool(((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all())
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
