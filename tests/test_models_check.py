"""The per-model GPU check (tests/gpu/test_models_gpu.py) and its artifact
discovery, on CPU: the check run over a stand-in layer (the float32
reference, BF16-rounded: ``layer_fakes.ReferenceLayer``) of three routing
families passes and prints one line per M; a layer with wrong weights, wrong
ids or unwritten rows fails it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import seeding
import torch
from gpu_artifacts import artifact_name, model_artifacts
from layer_fakes import ReferenceLayer

from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.plan import default_table

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import test_models_gpu as check  # noqa: E402

#: GLM-5's family (sigmoid + bias, shared expert, clamp), Qwen3's (softmax,
#: no bias, no shared expert) and DeepSeek-V3's (8 groups, 4 kept), small.
SHAPES = {
    "sigmoid-bias": MoEShape(256, 128, 32, 4, 2.5, 10.0, False, 1),
    "softmax-no-bias": MoEShape(256, 128, 32, 4, 1.0, None, False, 0, score="softmax", bias=False),
    "groups": MoEShape(256, 128, 32, 4, 2.5, None, False, 1, groups=8, groups_kept=4),
}
BUCKETS = {"mega": (1, 2, 3, 4), "grouped": (8, 16, 32, 48, 64)}


def _artifact(shape, grouped_finalize=(False, True)):
    variants = [SimpleNamespace(kernel=k, tokens=t, logits_dtype=d, finalize=f)
                for k, ts in BUCKETS.items() for t in ts for d in check.DTYPES
                for f in (grouped_finalize if k == "grouped" else (False,))]  # fmt: skip
    return SimpleNamespace(shape=shape, variants=variants, manifest={"config": {"name": "small"}})


def _bound(shape, layer_class=ReferenceLayer, grouped_finalize=(False, True), **kwargs):
    """(name, artifact, layer, weights) as the GPU test's fixture gives
    them; the layer's dispatch table is the runtime's default for the
    artifact's buckets."""
    weights = random_moe_weights(shape, seeding.generator("weights"))
    layer = layer_class(weights[1], weights[2], shape, **kwargs)
    artifact = _artifact(shape, grouped_finalize)
    buckets = {}
    for v in artifact.variants:
        buckets.setdefault(v.kernel, {}).setdefault(v.tokens, set()).add(v.finalize)
    layer.tables = {d: default_table(buckets) for d in layer.dtypes}
    return "small", artifact, layer, weights


@pytest.fixture(autouse=True)
def _no_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    # Fewer M values and calls than on the GPU, for time: each bucket kind,
    # a padded mega-range M and one between grouped buckets.
    monkeypatch.setattr(check, "TOKENS", (1, 3, 8, 13))
    monkeypatch.setattr(check, "ROWS", 4)


@pytest.mark.parametrize("family", SHAPES)
def test_the_check_passes_a_correct_layer_and_prints_each_case(family, capsys):
    check.test_model_matches_reference(_bound(SHAPES[family]), "float32", "skewed")
    lines = capsys.readouterr().out.splitlines()
    cases = [line for line in lines if line.startswith("small float32")]
    assert [c.split("M=")[1].split()[0] for c in cases] == ["1", "3", "8", "13"]
    shared = SHAPES[family].shared_experts
    for line in cases:
        assert "layer " in line and "max abs" in line and "near ties" in line, line
        assert ("shared" in line) == bool(shared), line
    assert "mega out" in cases[0] and "grouped(padded to 8) out" in cases[0]
    assert "mega" not in cases[2] and "grouped out" in cases[2]


def test_the_check_compares_the_layer_on_reference_routing_without_its_kernels_entry(capsys):
    """Grouped variants with finalize only: no grouped entry serves M = 8 or
    13, and the layer is compared on the reference's routing, near-tie
    tokens left out."""
    bound = _bound(SHAPES["softmax-no-bias"], grouped_finalize=(True,))
    check.test_model_matches_reference(bound, "bfloat16", "random")
    cases = [x for x in capsys.readouterr().out.splitlines() if x.startswith("small bfloat16")]
    assert len(cases) == 4 and "grouped" not in cases[2] and "layer " in cases[2]


def test_the_check_skips_a_dtype_the_artifact_lacks():
    bound = _bound(SHAPES["softmax-no-bias"], dtypes=("float32",))
    with pytest.raises(pytest.skip.Exception, match="no bfloat16-logits variant"):
        check.test_model_matches_reference(bound, "bfloat16", "random")


class _WrongWeights(ReferenceLayer):
    def mega(self, x, logits, bias, shared=False):
        out, ids, w, *rest = super().mega(x, logits, bias, shared)
        return (out, ids, w * (1 + 1e-3), *rest)


class _WrongIds(ReferenceLayer):
    """The grouped entry's last id of each token replaced by another expert
    (no near tie made it so)."""

    def grouped(self, x, logits, bias, finalize=False):
        out, ids, w, shared = super().grouped(x, logits, bias, finalize)
        ids = ids.clone()
        ids[:, -1] = (ids[:, 0] + 1) % self.args[2].experts
        return out, ids, w, shared


class _Unwritten(ReferenceLayer):
    def __call__(self, x, logits, bias):
        final = super().__call__(x, logits, bias)
        final[-1, 0] = float("nan")
        return final


class _OffRows(ReferenceLayer):
    """Routed rows 5% off: above the pooled bar, below no other check."""

    def mega(self, x, logits, bias, shared=False):
        out, *rest = super().mega(x, logits, bias, shared)
        return (out * 1.05, *rest)


@pytest.mark.parametrize(
    ("layer_class", "message"),
    [(_WrongWeights, "mega call 0: weights up to"),
     (_WrongIds, "grouped call 0: ids differ on"),
     (_Unwritten, "unwritten layer output"),
     (_OffRows, "mega out: rel L2")],
)  # fmt: skip
def test_the_check_fails_a_wrong_layer(layer_class, message):
    bound = _bound(SHAPES["softmax-no-bias"], layer_class)
    with pytest.raises(AssertionError, match=message):
        check.test_model_matches_reference(bound, "float32", "random")


def test_model_artifacts_takes_artifacts_and_directories_of_them(tmp_path, monkeypatch):
    for name in ("glm5", "qwen3-30b-a3b-tp1"):
        (tmp_path / "parent" / name).mkdir(parents=True)
        (tmp_path / "parent" / name / "manifest.json").write_text("{}")
    (tmp_path / "parent" / "README.md").write_text("not an artifact")
    (tmp_path / "parent" / "empty").mkdir()
    (tmp_path / "kimi.tar.zst").write_bytes(b"")
    joined = os.pathsep.join(str(p) for p in (tmp_path / "parent", tmp_path / "kimi.tar.zst",
                                       tmp_path / "missing"))  # fmt: skip
    monkeypatch.setenv("MOE_MODEL_ARTIFACTS", joined)
    found = model_artifacts()
    assert [artifact_name(p) for p in found] == ["glm5", "qwen3-30b-a3b-tp1", "kimi", "missing"]
    monkeypatch.setenv("MOE_MODEL_ARTIFACTS", str(tmp_path / "parent" / "glm5"))
    assert model_artifacts() == [tmp_path / "parent" / "glm5"]
    monkeypatch.delenv("MOE_MODEL_ARTIFACTS")
    monkeypatch.setenv("MOE_BUILD_ARTIFACT", str(tmp_path / "parent"))
    assert len(model_artifacts()) == 2 and artifact_name(None) == "none"
