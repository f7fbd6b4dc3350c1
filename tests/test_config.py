"""Config validation: the good config resolves; every kind of bad config is
refused with the file, the key and the rule, and `moe-build validate` exits 2.
Routing is data: its defaults are GLM-5.3-Flash's, its rules are checked, a
kernel is refused for a routing family it does not run, and every model config
under configs/ resolves to its model's shard (docs/models.md)."""

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import KERNEL_SERVES, ConfigError, load_config, validate
from pipeline.variants import expand
from runtime.constants import KERNELS, MAX_TOKENS

ROOT = Path(__file__).resolve().parents[1]
GLM5 = ROOT / "configs" / "glm5.yaml"
ROUTING_KEYS = ("score", "bias", "groups", "groups_kept", "renormalize")


def glm5_raw() -> dict:
    return yaml.safe_load(GLM5.read_text())


def test_glm5_resolves():
    cfg = load_config(GLM5)
    assert cfg.model.hidden == 4096 and cfg.model.inter == 512
    assert cfg.model.experts == 288 and cfg.model.top_k == 8
    assert cfg.model.routed_scale == 2.5 and cfg.model.swiglu_limit == 10.0
    assert cfg.model.ue8m0 is False and cfg.model.shared_experts == 1
    assert (cfg.model.score, cfg.model.bias, cfg.model.groups, cfg.model.groups_kept) == (
        "sigmoid", True, 1, 1,
    )  # fmt: skip
    assert cfg.model.renormalize is True
    assert {t.arch for t in cfg.targets} == {"sm_90a", "sm_100a"}
    assert set(cfg.logits_dtypes) == {"float32", "bfloat16"}
    assert max(cfg.kernels["mega"].tokens) < min(cfg.kernels["grouped"].tokens)
    assert max(cfg.kernels["grouped"].tokens) == MAX_TOKENS


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
    (("model", "experts"), 0, "model.experts", "must be positive"),
    (("model", "top_k"), 300, "model.top_k", "1..experts"),
    (("model", "routed_scale"), -1.0, "model.routed_scale", "finite positive"),
    (("kernels", "mega", "tokens"), [], "kernels.mega.tokens", "must not be empty"),
    (("kernels", "mega", "tokens"), [1, 1, 2], "kernels.mega.tokens", "duplicate"),
    (
        ("kernels", "grouped", "tokens"),
        [8, MAX_TOKENS + 1],
        "kernels.grouped.tokens",
        f"1..{MAX_TOKENS}",
    ),
    (("kernels", "grouped", "tokens"), [0, 8], "kernels.grouped.tokens", f"1..{MAX_TOKENS}"),
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
    # A shape no mega cluster (at most 16 CTAs) can serve.
    (("model", "inter"), 1152, "kernels.mega", "cannot serve"),
    (("model", "shared_experts"), 2, "model.shared_experts", "must be 0 or 1"),
    # Routing and SwiGLU values.
    (("model", "swiglu_limit"), "10", "model.swiglu_limit", "must be float or null"),
    (("model", "swiglu_limit"), 0.0, "model.swiglu_limit", "finite positive number or null"),
    (("model", "swiglu_limit"), float("inf"), "model.swiglu_limit", "finite positive"),
    (("model", "score"), "tanh", "model.score", "one of sigmoid, softmax"),
    (("model", "score"), None, "model.score", "must be str"),
    (("model", "bias"), 1, "model.bias", "must be bool"),
    (("model", "renormalize"), "yes", "model.renormalize", "must be bool"),
    (("model", "groups"), 0, "model.groups", "positive divisor of experts"),
    (("model", "groups"), 7, "model.groups", "positive divisor of experts (288)"),
    (("model", "groups"), 288, "model.groups", "two best experts"),
    (("model", "groups"), True, "model.groups", "must be int"),
    (("model", "groups_kept"), 2, "model.groups_kept", "1..groups (1)"),
    (("model", "groups_kept"), 0, "model.groups_kept", "1..groups"),
    (("model", "groups_kept"), None, "model.groups_kept", "must be int"),
]


@pytest.mark.parametrize("path,value,key,rule", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_config_names_key_and_rule(path, value, key, rule):
    with pytest.raises(ConfigError) as info:
        validate(_mutate(path, value), "cfg.yaml")
    assert any(k == key and rule in r for k, r in info.value.problems), info.value.problems
    assert str(info.value).startswith("cfg.yaml: ")


def test_every_problem_is_reported_at_once():
    raw = _mutate(("model", "hidden"), 4000)
    raw["model"]["experts"] = 0
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
    assert "mega-sm_90a-m1-float32" in ok.output and "136 variants" in ok.output
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


# Routing ---------------------------------------------------------------------------------


def _routed(**model) -> dict:
    raw = glm5_raw()
    raw["model"].update(model)
    return raw


def _problems(raw, **kw) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        validate(raw, "cfg.yaml", **kw)
    return info.value.problems


def test_routing_defaults_are_glm5s():
    """Leaving every routing key out (and the clamp in) resolves to exactly
    the config that spells them out; the resolved config always holds them,
    so an artifact records its routing (this changed glm5's config hash)."""
    spelled = validate(glm5_raw(), "a.yaml")
    raw = glm5_raw()
    for key in ROUTING_KEYS:
        del raw["model"][key]
    assert validate(raw, "b.yaml").to_dict() == spelled.to_dict()
    model = spelled.to_dict()["model"]
    assert list(model)[-5:] == list(ROUTING_KEYS)
    assert {k: model[k] for k in ROUTING_KEYS} == {
        "score": "sigmoid", "bias": True, "groups": 1, "groups_kept": 1, "renormalize": True,
    }  # fmt: skip
    # Left out, the clamp is none (the other six models); null says so too.
    del raw["model"]["swiglu_limit"]
    assert validate(raw, "c.yaml", check_kernels=False).model.swiglu_limit is None
    raw["model"]["swiglu_limit"] = None
    assert validate(raw, "c.yaml", check_kernels=False).model.swiglu_limit is None


def test_groups_kept_defaults_to_groups():
    raw = _routed(groups=8)
    del raw["model"]["groups_kept"]
    cfg = validate(raw, "cfg.yaml")  # all 8 groups kept: routes as one group
    assert (cfg.model.groups, cfg.model.groups_kept) == (8, 8)


def test_top_k_must_fit_the_kept_groups():
    # 288 experts in 72 groups of 4; one group kept holds 4 < top_k 8.
    problems = _problems(_routed(groups=72, groups_kept=1), check_kernels=False)
    assert ("model.top_k", "must be at most the 4 experts of the 1 kept groups, got 8") in problems
    validate(_routed(groups=72, groups_kept=2), check_kernels=False)  # 8 experts: fits


def test_groups_need_a_bias():
    problems = _problems(_routed(groups=8, groups_kept=4, bias=False), check_kernels=False)
    assert any(k == "model.groups" and "need bias: true" in r for k, r in problems), problems


def test_softmax_with_or_without_bias_is_a_valid_model():
    for bias in (False, True):
        cfg = validate(_routed(score="softmax", bias=bias), check_kernels=False)
        assert cfg.model.score == "softmax" and cfg.model.bias is bias


FAMILIES = [
    {"score": "softmax"},
    {"score": "softmax", "bias": False, "renormalize": True},
    {"bias": False},
    {"groups": 8, "groups_kept": 4},
    {"groups": 32, "groups_kept": 4},
    {"renormalize": False},
]


@pytest.mark.parametrize(
    "model", FAMILIES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items())
)
def test_kernels_compile_every_routing_family_into_their_specs(model):
    from pipeline.variants import expand

    cfg = validate(_routed(**model))
    specs = {v.spec(cfg) for v in expand(cfg)}
    for key, value in model.items():
        assert {getattr(s, key) for s in specs} == {value}, key
    assert {s.routing for s in specs} == {specs.pop().routing}


def test_kernels_refuse_more_groups_than_the_routing_warp_ranks():
    problems = _problems(_routed(groups=72, groups_kept=2))
    for kernel in KERNELS:
        rules = [r for k, r in problems if k == f"kernels.{kernel}"]
        assert len(rules) == 1, problems
        assert rules[0].startswith(f"the {kernel} kernel routes sigmoid or softmax (+ bias or "
                                   "not) scores within kept expert groups")  # fmt: skip
        assert "ranks 72 expert groups, more than the routing warp's 32 (model.groups)" in rules[0]
    # Only the kernels object: the model itself is valid.
    assert {k for k, _ in problems} == {f"kernels.{k}" for k in KERNELS}
    validate(_routed(groups=72, groups_kept=2), check_kernels=False)


def test_a_model_without_a_swiglu_clamp_builds():
    """The kernels compile SwiGLU without the clamp (``limit`` None) for a
    model that has none; the variants' specs carry None."""
    from pipeline.variants import expand

    cfg = validate(_routed(swiglu_limit=None))
    assert cfg.model.swiglu_limit is None
    assert {v.spec(cfg).limit for v in expand(cfg)} == {None}


def test_every_kernel_states_what_it_routes():
    assert set(KERNEL_SERVES) == set(KERNELS)


# The model configs ------------------------------------------------------------------------

#: The seven shards of docs/models.md: file -> (name, hidden, moe_intermediate_size, TP,
#: experts, top_k, shared, score, bias, groups, groups_kept, renormalize, routed scale,
#: SwiGLU clamp).
MODELS = {
    "glm5.yaml": ("glm5_next_tp4", 4096, 2048, 4, 288, 8, 1, "sigmoid", True, 1, 1, True, 2.5,
                  10.0),
    "glm5-tp8.yaml": ("glm5_tp8", 6144, 2048, 8, 256, 8, 1, "sigmoid", True, 1, 1, True, 2.5,
                      None),
    "deepseek-v3-tp8.yaml": ("deepseek_v3_tp8", 7168, 2048, 8, 256, 8, 1, "sigmoid", True, 8, 4,
                             True, 2.5, None),
    "kimi-k2-tp8.yaml": ("kimi_k2_tp8", 7168, 2048, 8, 384, 8, 1, "sigmoid", True, 1, 1, True,
                         2.827, None),
    "glm4.5-tp4.yaml": ("glm4.5_tp4", 5120, 1536, 4, 160, 8, 1, "sigmoid", True, 1, 1, True, 2.5,
                        None),
    "qwen3-235b-a22b-tp4.yaml": ("qwen3_235b_a22b_tp4", 4096, 1536, 4, 128, 8, 0, "softmax",
                                 False, 1, 1, True, 1.0, None),
    "qwen3-30b-a3b-tp1.yaml": ("qwen3_30b_a3b_tp1", 2048, 768, 1, 128, 8, 0, "softmax", False,
                               1, 1, True, 1.0, None),
}  # fmt: skip

#: What each config's kernels cannot do today (configs/README.md): per kernel,
#: (what its routing sentence names, the archs whose shape rules refuse it,
#: whether it refuses the shared-expert count). Empty: it builds.
BOTH = ("sm_90a", "sm_100a")
#: The kernels each config asks for; TODAY lists what of it is refused.
ASKS = {"glm5.yaml": {"mega", "grouped"}, "glm5-tp8.yaml": {"mega", "grouped"},
        "kimi-k2-tp8.yaml": {"mega", "grouped"}, "deepseek-v3-tp8.yaml": {"mega", "grouped"},
        "glm4.5-tp4.yaml": {"mega", "grouped"}, "qwen3-235b-a22b-tp4.yaml": {"mega", "grouped"},
        "qwen3-30b-a3b-tp1.yaml": {"mega", "grouped"}}  # fmt: skip
TODAY = {
    "glm5.yaml": {},
    "glm5-tp8.yaml": {},
    "deepseek-v3-tp8.yaml": {},
    "kimi-k2-tp8.yaml": {},
    "glm4.5-tp4.yaml": {},
    "qwen3-235b-a22b-tp4.yaml": {},
    "qwen3-30b-a3b-tp1.yaml": {},
}  # fmt: skip


def test_configs_are_the_seven_models():
    found = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert found == sorted(MODELS) == sorted(TODAY)


@pytest.mark.parametrize("file", MODELS)
def test_model_config_resolves_to_its_shard(file):
    """Every config passes the file's own rules and holds its model's shard:
    inter = moe_intermediate_size / TP."""
    name, hidden, full, tp, experts, top_k, shared, score, bias, groups, kept, renorm, scale, \
        limit = MODELS[file]  # fmt: skip
    raw = yaml.safe_load((ROOT / "configs" / file).read_text())
    m = validate(raw, file, check_kernels=False).model
    assert validate(raw, file, check_kernels=False).name == name
    assert (m.hidden, m.inter * tp, m.inter, m.experts, m.top_k) == (
        hidden, full, full // tp, experts, top_k,
    )  # fmt: skip
    assert (m.shared_experts, m.score, m.bias, m.groups, m.groups_kept, m.renormalize) == (
        shared, score, bias, groups, kept, renorm,
    )  # fmt: skip
    assert (m.routed_scale, m.swiglu_limit, m.ue8m0) == (scale, limit, False)
    assert full % (tp * 128) == 0  # whole 128-column blocks per shard


@pytest.mark.parametrize("file", TODAY)
def test_what_builds_today(file):
    """``moe-build validate`` on each config: which kernels it refuses, and
    for which reasons (the table of configs/README.md)."""
    path = ROOT / "configs" / file
    if not TODAY[file]:
        assert load_config(path).kernels.keys() == ASKS[file] <= set(KERNELS)
        return
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    for kernel, (routing, shape_archs, shared) in TODAY[file].items():
        rules = [r for k, r in problems if k == f"kernels.{kernel}"]
        family = [r for r in rules if r.startswith(f"the {kernel} kernel routes")]
        if routing:
            assert len(family) == 1 and all(p in family[0] for p in routing), rules
        else:
            assert family == [], rules
        archs = {a for a in BOTH for r in rules if f"{kernel} on {a} cannot serve" in r}
        assert archs == set(shape_archs), rules
        shared_rule = ("model.shared_experts", KERNEL_SERVES[kernel].shared_rule)
        assert (shared_rule in problems) == shared
    keys = {k for k, _ in problems}
    assert keys <= {f"kernels.{k}" for k in TODAY[file]} | {"model.shared_experts"}


def test_configs_are_documented():
    readme = (ROOT / "configs" / "README.md").read_text()
    models = (ROOT / "docs" / "models.md").read_text()
    for file in MODELS:
        assert f"`{file}`" in readme and f"configs/{file}" in models, file


def test_cli_validate_names_the_routing_it_cannot_build(tmp_path):
    path = tmp_path / "groups.yaml"
    path.write_text(yaml.safe_dump(_routed(groups=72, groups_kept=2)))
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert "kernels.grouped: the grouped kernel routes sigmoid or softmax" in result.output
    assert "ranks 72 expert groups, more than the routing warp's 32" in result.output
