"""Config validation: the good config resolves; every kind of bad config is
refused with the file, the key and the rule, and `moe-build validate` exits 2."""

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import ConfigError, load_config, validate
from pipeline.variants import expand

GLM5 = Path(__file__).resolve().parents[1] / "configs" / "glm5.yaml"


def glm5_raw() -> dict:
    return yaml.safe_load(GLM5.read_text())


def test_glm5_resolves():
    cfg = load_config(GLM5)
    assert cfg.model.hidden == 4096 and cfg.model.inter == 512
    assert cfg.model.experts == 288 and cfg.model.top_k == 8
    assert cfg.model.routed_scale == 2.5 and cfg.model.swiglu_limit == 10.0
    assert cfg.model.ue8m0 is False and cfg.model.shared_experts == 1
    assert {t.arch for t in cfg.targets} == {"sm_90a", "sm_100a"}
    assert set(cfg.logits_dtypes) == {"float32", "bfloat16"}
    assert max(cfg.kernels["mega"].tokens) < min(cfg.kernels["grouped"].tokens)
    assert max(cfg.kernels["grouped"].tokens) == 64


def test_variants_cover_every_combination():
    cfg = load_config(GLM5)
    names = [v.name for v in expand(cfg)]
    assert len(names) == len(set(names))
    mega = len(cfg.kernels["mega"].tokens) * 2 * 2
    grouped = len(cfg.kernels["grouped"].tokens) * 2 * 2 * 2
    assert len(names) == mega + grouped
    assert "mega-sm_90a-m1-float32" in names
    assert "grouped-sm_100a-m64-bfloat16-final" in names
    only = expand(cfg, archs={"sm_90a"}, kernels={"mega"})
    assert {v.arch for v in only} == {"sm_90a"} and {v.kernel for v in only} == {"mega"}


def test_spec_carries_model_and_variant():
    cfg = load_config(GLM5)
    v = expand(cfg, kernels={"grouped"})[0]
    spec = v.spec(cfg)
    assert (spec.kernel, spec.arch, spec.tokens, spec.sms) == ("grouped", v.arch, v.tokens, v.sms)
    assert spec.hidden == 4096 and spec.scale == 2.5 and spec.limit == 10.0


def _mutate(path, value):
    raw = glm5_raw()
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


BAD = [
    (("model", "bogus"), 1, "model.bogus", "unknown key"),
    (("model", "hidden"), KeyError, "model.hidden", "missing"),
    (("model", "top_k"), "8", "model.top_k", "must be int"),
    (("model", "ue8m0"), 1, "model.ue8m0", "must be bool"),
    (("model", "experts"), True, "model.experts", "must be int"),
    (("model", "hidden"), 4000, "model.hidden", "multiple of 128"),
    (("model", "inter"), 0, "model.inter", "multiple of 128"),
    (("model", "experts"), 100, "model.experts", "multiple of 32"),
    (("model", "top_k"), 300, "model.top_k", "1..experts"),
    (("model", "routed_scale"), -1.0, "model.routed_scale", "finite positive"),
    (("kernels", "mega", "tokens"), [], "kernels.mega.tokens", "must not be empty"),
    (("kernels", "mega", "tokens"), [1, 1, 2], "kernels.mega.tokens", "duplicate"),
    (("kernels", "grouped", "tokens"), [8, 65], "kernels.grouped.tokens", "1..64"),
    (("kernels", "grouped", "tokens"), [0, 8], "kernels.grouped.tokens", "1..64"),
    (("kernels", "grouped", "finalize"), [True, True], "kernels.grouped.finalize", "duplicate"),
    (("kernels", "mega", "finalize"), [True], "kernels.mega.finalize", "unknown key"),
    (("kernels", "tiny"), {"tokens": [1]}, "kernels.tiny", "unknown kernel"),
    (("logits_dtypes",), ["float16"], "logits_dtypes", "unknown dtype"),
    (("targets",), [{"arch": "sm_80", "sms": 108}], "targets[0].arch", "unknown arch"),
    (("targets",), [{"arch": "sm_90a", "sms": 0}], "targets[0].sms", "1..1024"),
    (
        ("targets",),
        [{"arch": "sm_90a", "sms": 132}, {"arch": "sm_90a", "sms": 66}],
        "targets[1].arch",
        "duplicate arch",
    ),
    (("targets",), [], "targets", "at least one"),
    (("name",), "glm 5", "name", "letters"),
    # A shape the mega kernel's 16-CTA cluster cannot serve.
    (("model", "inter"), 256, "kernels.mega", "cannot serve"),
    (("model", "shared_experts"), 0, "model.shared_experts", "exactly one shared expert"),
]


@pytest.mark.parametrize("path,value,key,rule", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_config_names_key_and_rule(path, value, key, rule):
    with pytest.raises(ConfigError) as info:
        validate(_mutate(path, value), "cfg.yaml")
    assert any(k == key and rule in r for k, r in info.value.problems), info.value.problems
    assert str(info.value).startswith("cfg.yaml: ")


def test_every_problem_is_reported_at_once():
    raw = _mutate(("model", "hidden"), 4000)
    raw["model"]["experts"] = 100
    with pytest.raises(ConfigError) as info:
        validate(raw, "cfg.yaml")
    keys = {k for k, _ in info.value.problems}
    assert {"model.hidden", "model.experts"} <= keys


def test_yaml_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    dup = tmp_path / "dup.yaml"
    dup.write_text(GLM5.read_text() + "\nname: again\n")
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(dup)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_cli_validate_ok_and_bad(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(GLM5)])
    assert ok.exit_code == 0, ok.output
    assert "mega-sm_90a-m1-float32" in ok.output and "56 variants" in ok.output
    raw = copy.deepcopy(glm5_raw())
    raw["model"]["top_k"] = "eight"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(main, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "model.top_k" in result.output and str(bad) in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_cli_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "validate" in result.output
