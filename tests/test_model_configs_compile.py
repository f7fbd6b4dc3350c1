"""The model configs that build today (marked ``compile``): one variant of
each config that validates, per arch, compiled by the DSL from the config's
own spec, and the SwiGLU clamp present exactly when the model has one (its
``min.NaN.f32`` instructions: the clamp is the only minimum the kernels
take). ``moe-build compile configs/<file>`` builds the whole set."""

from __future__ import annotations

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


def test_more_than_one_model_builds():
    assert {name for name, _ in BUILDABLE} >= {"glm5.yaml", "kimi-k2-tp8.yaml", "glm5-tp8.yaml"}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name,config", BUILDABLE, ids=[n for n, _ in BUILDABLE])
def test_one_variant_of_each_buildable_config_compiles(tmp_path, name, config, arch):
    variants = [v for v in expand(config, archs=[arch]) if v.tokens == 8 and v.finalize]
    if not variants:
        pytest.skip(f"{name} has no grouped finalize variant for {arch}")
    v = variants[0]
    record = compile_specs(arch, [(v.name, v.spec(config))], tmp_path)[0]
    ptx = (tmp_path / f"{v.name}.ptx").read_text()
    clamps = ptx.count("min.NaN.f32")
    if config.model.swiglu_limit is None:
        assert clamps == 0, (name, clamps)
    else:
        assert clamps > 0, name
    assert record["entry"].startswith(f"moe_{v.kernel}_")
