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

from benchmarks import bench
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.plan import default_table
from runtime.reference import finalize

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
    variants = [SimpleNamespace(kernel=k, tokens=t, logits_dtype=d, finalize=f,
                                name=f"{k}-m{t}-{d}" + ("-final" if f else ""))
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
    monkeypatch.setattr(bench, "CHECK_ROWS", 4)


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


class _Launches(ReferenceLayer):
    """The layer's launch of one variant (``_run``, ``_crop``, the block's
    views, ``final_writers``: every mega variant and each grouped finalize
    one) over the float32 reference: BF16 rows, and ``final`` the FP32 sum
    of those rows rounded once (``runtime.reference.finalize``), as the
    kernels write it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.final_writers = {f"mega-m{t}-{d}" for t in BUCKETS["mega"] for d in self.dtypes}
        self.final_writers |= {f"grouped-m{t}-{d}-final" for t in BUCKETS["grouped"]
                               for d in self.dtypes}  # fmt: skip

    def _sum(self, out, weights, shared):
        """``final`` as the kernels write it: the FP32 sum of the BF16 rows,
        rounded to BF16 once."""
        return finalize(out, weights, shared, self.args[2].top_k).bfloat16()

    def _outputs(self, variant, r) -> dict:
        out = r.out.bfloat16()
        shared = None if r.shared is None else r.shared.bfloat16()
        return {"out": out, "ids": r.ids, "weights": r.weights, "shared_out": shared,
                "final": self._sum(out, r.weights, shared)}  # fmt: skip

    def _run(self, variant, x, logits, bias, m, final_only=False):
        assert x.shape[0] == m == variant.tokens and not final_only
        return self._outputs(variant, self._ref(x, logits, bias)), self

    @staticmethod
    def view(block, name, rows):
        return block[name][:rows]

    def _crop(self, layout, block, m):
        return block["out"], block["ids"], block["weights"]


class _DroppedRoute(_Launches):
    """``final`` without each token's last route."""

    def _outputs(self, variant, r):
        got = super()._outputs(variant, r)
        kept = r.weights.clone()
        kept[:, -1] = 0
        got["final"] = self._sum(got["out"], kept, got["shared_out"])
        return got


class _OtherRows(_Launches):
    """A grouped finalize variant whose rows (and its ``final`` with them)
    are not its plain variant's: one BF16 ulp up where the row is positive."""

    def _outputs(self, variant, r):
        got = super()._outputs(variant, r)
        if variant.name.endswith("-final"):
            bits = got["out"].view(torch.int16)
            got["out"] = torch.where(bits > 0, bits + 1, bits).view(torch.bfloat16)
            got["final"] = self._sum(got["out"], r.weights, got["shared_out"])
        return got


class _Unsummed(_Launches):
    """``final`` never written on one value (NaN-poisoned)."""

    def _outputs(self, variant, r):
        got = super()._outputs(variant, r)
        got["final"][0, 0] = float("nan")
        return got


@pytest.mark.parametrize("family", SHAPES)
def test_the_final_sum_check_passes_the_kernels_sum(family, capsys):
    """Every final writer of the artifact is checked once, its grouped ones
    against their plain variant's rows as well."""
    check.test_final_is_the_weighted_sum_of_its_own_rows(_bound(SHAPES[family], _Launches),
                                                         "float32")  # fmt: skip
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("small ")]
    assert [line.split()[1] for line in lines] == (
        [f"grouped-m{t}-float32-final:" for t in BUCKETS["grouped"]]
        + [f"mega-m{t}-float32:" for t in BUCKETS["mega"]]
    )
    assert all("at most" in line for line in lines)
    assert sum("as grouped-m" in line and line.endswith(": True") for line in lines) == 5


@pytest.mark.parametrize(
    ("layer_class", "message"),
    [(_DroppedRoute, "values of final past the bound"),
     (_OtherRows, "bit-equal to grouped-m8-float32's"),
     (_Unsummed, "unwritten final")],
)  # fmt: skip
def test_the_final_sum_check_fails_a_wrong_sum_or_rows(layer_class, message):
    bound = _bound(SHAPES["sigmoid-bias"], layer_class)
    with pytest.raises(AssertionError, match=message):
        check.test_final_is_the_weighted_sum_of_its_own_rows(bound, "float32")
