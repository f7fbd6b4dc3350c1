"""The comparison ``verify --device`` makes, run on the CPU with a stand-in
layer (the GPU path itself runs on the H200: tests/gpu)."""

from __future__ import annotations

import types

import pytest
import seeding
import torch
from pipeline_support import build, run, use_stub

from pipeline.verify_device import device_file_name, run_variant
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.reference import moe_reference

SHAPE = MoEShape(hidden=256, inter=128, experts=32, top_k=4, routed_scale=2.5,
                 swiglu_limit=10.0, ue8m0=False, shared_experts=1)  # fmt: skip
#: A Qwen3-style model: softmax routing, no bias, no shared expert.
SOFTMAX = MoEShape(hidden=256, inter=128, experts=32, top_k=4, routed_scale=1.0,
                   swiglu_limit=None, ue8m0=False, shared_experts=0, score="softmax",
                   bias=False)  # fmt: skip


class ReferenceLayer:
    """Answers like a correct kernel (the FP32 reference, outputs in BF16),
    optionally with one output row damaged."""

    device = torch.device("cpu")

    def __init__(self, routed, shared, damage=None, shape=SHAPE):
        self.routed, self.shared, self.damage, self.shape = routed, shared, damage, shape

    def _ref(self, x, logits, bias):
        # As the runtime's check_bias: a model without a bias is called with None.
        assert (bias is not None) == self.shape.bias, "bias passed to a model without one"
        return moe_reference(x, logits, bias, self.routed, self.shared, self.shape)

    def _hurt(self, t):
        if self.damage == "row":
            t = t.clone()
            t[0] *= 1.5
        elif self.damage == "nan":
            t = t.clone()
            t[-1, -1] = float("nan")
        return t

    def mega(self, x, logits, bias):
        r = self._ref(x, logits, bias)
        return self._hurt(r.out.to(torch.bfloat16)), r.ids, r.weights

    def grouped(self, x, logits, bias, finalize=False):
        r = self._ref(x, logits, bias)
        if finalize:
            return self._hurt(r.final.to(torch.bfloat16))
        if not self.shape.shared_experts:  # no shared rows: the damage goes to out
            return self._hurt(r.out.to(torch.bfloat16)), r.ids, r.weights, None
        return r.out.to(torch.bfloat16), r.ids, r.weights, self._hurt(r.shared.to(torch.bfloat16))


def variant(kernel, tokens, dtype="float32", finalize=False):
    return types.SimpleNamespace(kernel=kernel, tokens=tokens, logits_dtype=dtype,
                                 finalize=finalize)  # fmt: skip


@pytest.fixture(scope="module")
def weights():
    _, routed, shared = random_moe_weights(SHAPE, seeding.generator(f"{__name__}.weights"))
    return routed, shared


@pytest.mark.parametrize(
    "v",
    [
        variant("mega", 3),
        variant("mega", 1, "bfloat16"),
        variant("grouped", 8),
        variant("grouped", 16, "bfloat16", True),
    ],  # fmt: skip
)
def test_a_correct_layer_passes_and_a_damaged_one_fails(weights, v):
    routed, shared = weights
    generator = seeding.generator()  # the inputs run_variant draws
    good = run_variant(ReferenceLayer(routed, shared), v, SHAPE, routed, shared, generator)
    assert good["ok"], good
    assert all(val < 1e-2 for key, val in good.items() if key.endswith("_rel_l2"))
    for damage in ("row", "nan"):
        bad = run_variant(ReferenceLayer(routed, shared, damage), v, SHAPE, routed, shared,
                          generator)  # fmt: skip
        assert not bad["ok"], (damage, bad)


@pytest.mark.parametrize(
    "v",
    [variant("mega", 2), variant("grouped", 8, "bfloat16"), variant("grouped", 8, "float32", True)],
)
def test_a_model_without_bias_or_shared_expert_is_verified(v):
    """Softmax routing, no bias (the call passes None), no shared expert (no
    shared rows to compare): a correct layer passes, a damaged one fails."""
    _, routed, shared = random_moe_weights(SOFTMAX, seeding.generator(f"{__name__}.softmax"))
    generator = seeding.generator()
    good = run_variant(ReferenceLayer(routed, shared, shape=SOFTMAX), v, SOFTMAX, routed, shared,
                       generator)  # fmt: skip
    assert good["ok"], good
    assert "shared_rel_l2" not in good
    for damage in ("row", "nan"):
        bad = run_variant(ReferenceLayer(routed, shared, damage, SOFTMAX), v, SOFTMAX, routed,
                          shared, generator)  # fmt: skip
        assert not bad["ok"], (damage, bad)


def test_device_file_name():
    assert device_file_name("NVIDIA H200") == "verify-nvidia-h200.json"
    assert device_file_name("  ") == "verify-gpu.json"


def test_verify_device_without_a_gpu_is_refused(tmp_path, monkeypatch):
    use_stub(tmp_path, monkeypatch)
    out = build(tmp_path / "a", "--variant", "mega-sm_90a-m1-float32")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _, stderr = run("verify", out, "--device")
    assert code == 2 and "no CUDA device" in stderr


@pytest.mark.gpu
def test_verify_device_on_the_gpu(tmp_path):
    """``moe-build verify --device`` on $MOE_BUILD_ARTIFACT (a directory or
    package built for this GPU's arch), run on a copy so the record lands
    beside a private manifest."""
    import json
    import os
    import shutil
    from pathlib import Path

    source = os.environ.get("MOE_BUILD_ARTIFACT")
    if not source or not Path(source).exists():
        pytest.skip("MOE_BUILD_ARTIFACT is not set")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    copy = tmp_path / "artifact"
    if Path(source).is_dir():
        shutil.copytree(source, copy)
    else:
        from runtime.artifact import unpack

        copy.mkdir()
        unpack(source, copy)
    code, stdout, stderr = run("verify", copy, "--device")
    print(stdout)
    assert code == 0, stdout + stderr
    (path,) = copy.glob("verify-*.json")
    record = json.loads(path.read_text())
    manifest = json.loads((copy / "manifest.json").read_text())
    ours = {r["name"]: r for r in manifest["variants"] if r["arch"] == record["arch"]}
    assert set(record["variants"]) == set(ours)
    for name, entry in record["variants"].items():
        assert entry["result"]["ok"], (name, entry)
        assert entry["attributes"]["registers"] == ours[name]["resources"]["registers"]
    assert record["driver_version"] >= manifest["min_driver"]
    # A second artifact with the same record diffs clean.
    assert run("diff", copy, copy)[0] == 0
