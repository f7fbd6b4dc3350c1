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
from sass_tools import compile_specs

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


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name,config", BUILDABLE, ids=[n for n, _ in BUILDABLE])
def test_one_variant_of_each_kernel_of_each_config_compiles(tmp_path, name, config, arch):
    """The grouped M = 8 finalize variant and the mega M = 1 variant (BF16
    logits) of each config, from the config's own specs."""
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
