"""Every model config builds (marked ``compile``): one variant of each kernel
of each config, per arch, compiled by the DSL from the config's own spec; the
SwiGLU clamp present exactly when the model has one (its ``min.NaN.f32``
instructions: the clamp is the only minimum the kernels take), the
shared-expert parameters exactly when it has one, and the bias parameter
read exactly when it routes with one. ``make build-all`` builds every
variant of every config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sass_tools import compile_specs, cuobjdump, loads_before_pdl_wait

from pipeline.config import ConfigError, load_config
from pipeline.variants import expand

pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parents[1]


def _buildable():
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        try:
            config = load_config(path)
        except ConfigError:
            continue
        out.append((path.name, config))
    return out


BUILDABLE = _buildable()


def test_every_model_config_builds():
    assert {name for name, _ in BUILDABLE} == {p.name for p in (ROOT / "configs").glob("*.yaml")}


#: Shapes no config ships, at the edges of what the kernels serve (an odd K
#: extent of hidden and of inter, 14- and 16-CTA mega clusters, top-32 of 512
#: experts in groups, top-2 without a shared expert, softmax with a bias): each
#: also ran on the H200 against the float64 reference at M = 1..200
#: (docs/notes/models-h200.md, "Shapes outside the seven configs").
EDGE_SHAPES = {
    "h1152-i384-softmax-bias": dict(hidden=1152, inter=384, experts=32, top_k=4,
                                    shared_experts=1, score="softmax", bias=True,
                                    renormalize=False),
    "h2176-i896-top32-groups": dict(hidden=2176, inter=896, experts=512, top_k=32,
                                    shared_experts=1, score="sigmoid", bias=True, groups=16,
                                    groups_kept=8, routed_scale=2.0, swiglu_limit=7.0),
    "h1024-i1024-top2-routed": dict(hidden=1024, inter=1024, experts=64, top_k=2,
                                    shared_experts=0, score="sigmoid", bias=True,
                                    renormalize=False),
}  # fmt: skip
#: Edge shapes kept as configs, for the bench and the GPU model tests to build
#: (routed experts that 32 does not divide: 40 with softmax, 60 in 3 groups).
EDGE_CONFIGS = sorted((ROOT / "benchmarks" / "configs").glob("*.yaml"))


def _edge_config(tmp_path, model: dict):
    """A config of ``model`` (over the keys every config spells out) with
    both kernels, every bucket and both archs."""
    import yaml

    full = dict(routed_scale=1.0, swiglu_limit=None, ue8m0=False, groups=1, groups_kept=1,
                renormalize=True) | model  # fmt: skip
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump({
        "name": "edge", "model": full,
        "kernels": {"mega": {"tokens": [1, 2, 3, 4]},
                    "grouped": {"tokens": [8, 16, 32, 48, 64, 96, 128], "finalize": [False, True]}},
        "logits_dtypes": ["float32", "bfloat16"],
        "targets": [{"arch": "sm_90a", "sms": 132}, {"arch": "sm_100a", "sms": 148}],
    }))  # fmt: skip
    return load_config(path)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name,config", BUILDABLE, ids=[n for n, _ in BUILDABLE])
def test_one_variant_of_each_kernel_of_each_config_compiles(tmp_path, name, config, arch):
    """The grouped M = 8 finalize variant and the mega M = 1 variant (BF16
    logits) of each config, from the config's own specs."""
    check_one_variant_of_each_kernel(tmp_path, name, config, arch)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", sorted(EDGE_SHAPES))
def test_edge_shapes_compile(tmp_path, name, arch):
    """The same variants of each edge shape, which validates on both archs."""
    config = _edge_config(tmp_path, EDGE_SHAPES[name])
    check_one_variant_of_each_kernel(tmp_path, name, config, arch)


def test_there_are_edge_configs():
    assert [p.name for p in EDGE_CONFIGS] == ["edge-e40.yaml", "edge-e60.yaml"]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("path", EDGE_CONFIGS, ids=[p.stem for p in EDGE_CONFIGS])
def test_edge_configs_compile(tmp_path, path, arch):
    """The same variants of each config under benchmarks/configs."""
    check_one_variant_of_each_kernel(tmp_path, path.name, load_config(path), arch)


def check_one_variant_of_each_kernel(tmp_path, name, config, arch):
    """Compiles the grouped M = 8 finalize and mega M = 1 variants (BF16
    logits) of ``config`` for ``arch`` and checks their clamp, ABI and bias
    read against the model, and that every global load of their SASS comes
    after the PDL wait on every path (the routing's loads differ by shape)."""
    chosen = [v for v in expand(config, archs=[arch])
              if v.logits_dtype == "bfloat16" and ((v.kernel == "grouped" and v.tokens == 8
                                                    and v.finalize)
                                                   or (v.kernel == "mega" and v.tokens == 1))]  # fmt: skip
    assert {v.kernel for v in chosen} == set(config.kernels), name
    records = compile_specs(arch, [(v.name, v.spec(config)) for v in chosen], tmp_path)
    for v, record in zip(chosen, records, strict=True):
        ptx = (tmp_path / f"{v.name}.ptx").read_text()
        clamps = ptx.count("min.NaN.f32")
        if config.model.swiglu_limit is None:
            assert clamps == 0, (name, v.name, clamps)
        else:
            assert clamps > 0, (name, v.name)
        assert record["entry"].startswith(f"moe_{v.kernel}_")
        names = [p for p, _ in record["params"]]
        # A model without a shared expert gets the routed-only ABI.
        assert ("s13_scale" in names) == bool(config.model.shared_experts), (name, v.name)
        # The bias is read exactly when the model routes with one.
        bias = names.index("bias")
        reads = re.search(rf"_param_{bias}\]", ptx) is not None
        assert reads == config.model.bias, (name, v.name)
        assert loads_before_pdl_wait(cuobjdump(), tmp_path / f"{v.name}.cubin") == [], v.name
