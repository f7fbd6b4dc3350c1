"""Build configs: YAML at the edge, frozen dataclasses inside, and ``validate``
as the single statement of what a config may be.

A config names one MoE shard (``model``, routing included), the token buckets
of each kernel, the router-logit dtypes and the target architectures with
their SM counts (see configs/README.md for the schema). Every rule lives in
``validate``; its errors name the file, the key and the rule. What each
kernel can serve is stated twice, once per kind of limit: its shapes in
``kernels/shapes.py``, its routing family and SwiGLU in ``KERNEL_SERVES``
here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernels.routing import MAX_GROUPS
from kernels.shapes import unsupported
from runtime.constants import ARCHS, KERNELS, LOGITS_DTYPES, MAX_TOKENS, TILE
from runtime.model import SCORES, MoEShape


class ConfigError(ValueError):
    """A config that cannot be built: ``problems`` lists (key, rule) pairs."""

    def __init__(self, path: str, problems: list[tuple[str, str]]):
        self.path = path
        self.problems = problems
        lines = [f"{path}: {key}: {rule}" for key, rule in problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class KernelBuckets:
    """Token buckets (sorted M values) a kernel is compiled for, and its
    finalize settings (grouped only; mega is always ``(False,)``)."""

    tokens: tuple[int, ...]
    finalize: tuple[bool, ...] = (False,)


@dataclass(frozen=True)
class Target:
    """An architecture and the SM count its variants are compiled for."""

    arch: str
    sms: int


@dataclass(frozen=True)
class BuildConfig:
    name: str
    model: MoEShape
    kernels: dict[str, KernelBuckets]  # kernel name -> buckets, in KERNELS order
    logits_dtypes: tuple[str, ...]
    targets: tuple[Target, ...]

    def to_dict(self) -> dict:
        """The resolved config as plain JSON-able data (what the manifest
        records and ``config_hash`` hashes)."""
        kernels = {}
        for kernel, b in self.kernels.items():
            entry = {"tokens": list(b.tokens)}
            if kernel == "grouped":
                entry["finalize"] = list(b.finalize)
            kernels[kernel] = entry
        return {
            "name": self.name,
            "model": self.model.to_dict(),
            "kernels": kernels,
            "logits_dtypes": list(self.logits_dtypes),
            "targets": [{"arch": t.arch, "sms": t.sms} for t in self.targets],
        }


@dataclass(frozen=True)
class _Optional:
    """A schema key that may be left out: it then resolves to ``default``
    (None for ``groups_kept`` means "= groups", resolved by MoEShape). With
    ``nullable`` an explicit YAML null is a value too."""

    typ: type
    default: object
    nullable: bool = False


# Schema: key -> type (required) or _Optional. Types are checked exactly (a
# bool is not an int). The resolved config always holds every key, so every
# artifact records its routing explicitly.
_TOP = {"name": str, "model": dict, "kernels": dict, "logits_dtypes": list, "targets": list}
_MODEL = {
    "hidden": int,
    "inter": int,
    "experts": int,
    "top_k": int,
    "routed_scale": float,
    "swiglu_limit": _Optional(float, None, nullable=True),
    "ue8m0": bool,
    "shared_experts": int,
    "score": _Optional(str, "sigmoid"),
    "bias": _Optional(bool, True),
    "groups": _Optional(int, 1),
    "groups_kept": _Optional(int, None),
    "renormalize": _Optional(bool, True),
}
_KERNEL_KEYS = {"mega": {"tokens": list}, "grouped": {"tokens": list, "finalize": list}}
_TARGET = {"arch": str, "sms": int}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate mapping keys (PyYAML keeps the
    last one silently)."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | Path) -> BuildConfig:
    """Reads and validates a YAML config; raises ConfigError."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(path, [("<file>", f"cannot read: {e.strerror or e}")]) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(path, [("<yaml>", f"not valid YAML: {e}")]) from None
    return validate(raw, path)


def validate(raw, path: str = "<config>", check_kernels: bool = True) -> BuildConfig:
    """The single statement of what a config may be. Returns the resolved
    BuildConfig or raises ConfigError listing every problem found.

    ``check_kernels=False`` checks the file's own rules only (schema, values,
    routing consistency) and skips whether the listed kernels can serve the
    model (shapes, routing family, shared experts): it reads the shard of a
    model no kernel serves yet. Building always checks everything."""
    problems: list[tuple[str, str]] = []

    def bad(key: str, rule: str) -> None:
        problems.append((key, rule))

    def fields(obj, schema: dict, where: str) -> dict:
        """Type-checked known keys of a mapping; unknown and missing keys
        reported."""
        if not isinstance(obj, dict):
            bad(where or "<top>", f"must be a mapping, got {_kind(obj)}")
            return {}
        out = {}
        for key in obj:
            if key not in schema:
                bad(_join(where, key), f"unknown key (allowed: {', '.join(schema)})")
        for key, typ in schema.items():
            full = _join(where, key)
            optional = typ if isinstance(typ, _Optional) else None
            if optional is not None:
                typ = optional.typ
                if key not in obj:
                    out[key] = optional.default
                    continue
            elif key not in obj:
                bad(full, "missing")
                continue
            value = obj[key]
            if value is None and optional is not None and optional.nullable:
                out[key] = None
                continue
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not typ:
                null = " or null" if optional is not None and optional.nullable else ""
                bad(full, f"must be {typ.__name__}{null}, got {_kind(value)}")
                continue
            out[key] = value
        return out

    top = fields(raw, _TOP, "")
    name = top.get("name")
    if name is not None and not _NAME.match(name):
        bad("name", "must be letters, digits, '_', '.' or '-' (starting with a letter or digit)")

    model = _model(fields(top.get("model", {}), _MODEL, "model") if "model" in top else {}, bad)

    kernels: dict[str, KernelBuckets] = {}
    raw_kernels = top.get("kernels")
    if raw_kernels is not None:
        for key in raw_kernels:
            if key not in KERNELS:
                bad(f"kernels.{key}", f"unknown kernel (known: {', '.join(KERNELS)})")
        if not any(k in raw_kernels for k in KERNELS):
            bad("kernels", f"must name at least one of {', '.join(KERNELS)}")
        for kernel in KERNELS:
            if kernel in raw_kernels:
                where = f"kernels.{kernel}"
                entry = fields(raw_kernels[kernel], _KERNEL_KEYS[kernel], where)
                buckets = _buckets(entry, where, bad)
                if buckets is not None:
                    kernels[kernel] = buckets

    dtypes = _unique_list(top.get("logits_dtypes"), "logits_dtypes", str, bad)
    for d in dtypes or ():
        if d not in LOGITS_DTYPES:
            bad("logits_dtypes", f"unknown dtype {d!r} (known: {', '.join(LOGITS_DTYPES)})")

    targets = []
    for i, t in enumerate(top.get("targets") or []):
        entry = fields(t, _TARGET, f"targets[{i}]")
        arch, sms = entry.get("arch"), entry.get("sms")
        if arch is not None and arch not in ARCHS:
            bad(f"targets[{i}].arch", f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
        if sms is not None and not 1 <= sms <= 1024:
            bad(f"targets[{i}].sms", f"must be in 1..1024, got {sms}")
        if arch in {x.arch for x in targets}:
            bad(f"targets[{i}].arch", f"duplicate arch {arch!r}")
        if arch is not None and sms is not None:
            targets.append(Target(arch, sms))
    if "targets" in top and not top["targets"]:
        bad("targets", "must list at least one target")

    if model is not None and check_kernels:
        for kernel, buckets in kernels.items():
            serves = KERNEL_SERVES[kernel]
            if model.shared_experts not in serves.shared_experts:
                bad("model.shared_experts", serves.shared_rule)
            differences = routing_differences(kernel, model)
            if differences:
                rule = f"the {kernel} kernel {serves.describe()}; this model {_and(differences)}"
                bad(f"kernels.{kernel}", rule)
            for target in targets:
                for m in buckets.tokens:
                    for reason in unsupported(
                        kernel, target.arch, model.hidden, model.inter, model.experts,
                        model.top_k, m,
                    ):  # fmt: skip
                        rule = f"{kernel} on {target.arch} cannot serve this shape: {reason}"
                        if (f"kernels.{kernel}", rule) not in problems:
                            bad(f"kernels.{kernel}", rule)

    if problems:
        raise ConfigError(path, problems)
    return BuildConfig(
        name=name,
        model=model,
        kernels=kernels,
        logits_dtypes=tuple(dtypes),
        targets=tuple(targets),
    )


def _model(m: dict, bad) -> MoEShape | None:
    if len(m) != len(_MODEL):
        return None  # already reported
    ok = True
    for key in ("hidden", "inter"):
        if m[key] <= 0 or m[key] % TILE:
            bad(f"model.{key}", f"must be a positive multiple of {TILE}, got {m[key]}")
            ok = False
    if m["experts"] <= 0:
        bad("model.experts", f"must be positive, got {m['experts']}")
        ok = False
    if not 1 <= m["top_k"] <= max(m["experts"], 1):
        bad("model.top_k", f"must be in 1..experts ({m['experts']}), got {m['top_k']}")
        ok = False
    if not (math.isfinite(m["routed_scale"]) and m["routed_scale"] > 0):
        bad("model.routed_scale", f"must be a finite positive number, got {m['routed_scale']}")
        ok = False
    limit = m["swiglu_limit"]
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        bad("model.swiglu_limit", f"must be a finite positive number or null, got {limit}")
        ok = False
    if m["shared_experts"] not in (0, 1):
        bad("model.shared_experts", f"must be 0 or 1, got {m['shared_experts']}")
        ok = False
    if m["score"] not in SCORES:
        bad("model.score", f"must be one of {', '.join(SCORES)}, got {m['score']!r}")
        ok = False
    return MoEShape(**m) if _groups(m, bad) and ok else None


def _groups(m: dict, bad) -> bool:
    """The expert-group rules; False when one is broken (reported)."""
    groups, experts = m["groups"], m["experts"]
    kept = groups if m["groups_kept"] is None else m["groups_kept"]
    if groups < 1 or experts % groups:
        bad("model.groups", f"must be a positive divisor of experts ({experts}), got {groups}")
        return False
    if groups > 1 and experts // groups < 2:
        bad("model.groups", f"a group is scored by its two best experts: {groups} groups of "
                            f"{experts} experts leave {experts // groups} per group")  # fmt: skip
        return False
    if groups > 1 and not m["bias"]:
        # DeepSeek-V3's group score (sum of the two best biased scores) is the
        # only group rule stated here; models that group unbiased scores use
        # other rules (DeepSeek-V2: the best score of each group).
        bad("model.groups", "expert groups are scored by the sum of each group's two best "
                            "score + bias values: they need bias: true")  # fmt: skip
        return False
    if not 1 <= kept <= groups:
        bad("model.groups_kept", f"must be in 1..groups ({groups}), got {kept}")
        return False
    reachable = kept * (experts // groups)
    if m["top_k"] > reachable:
        bad("model.top_k", f"must be at most the {reachable} experts of the {kept} kept "
                           f"groups, got {m['top_k']}")  # fmt: skip
        return False
    return True


# What each kernel routes -------------------------------------------------------------


@dataclass(frozen=True)
class KernelServes:
    """The routing family and expert math one kernel computes (beside its
    shape rules in kernels/shapes.py): the score functions, bias settings and
    renormalization it serves, whether it can drop expert groups (a model
    whose tokens keep all their groups routes as one group), whether it needs
    a SwiGLU clamp, and the shared-expert counts it runs (``shared_rule``
    says why when a model has another)."""

    score: tuple[str, ...]
    bias: tuple[bool, ...]
    group_limited: bool
    renormalize: tuple[bool, ...]
    needs_clamp: bool
    shared_experts: tuple[int, ...]
    shared_rule: str

    def describe(self) -> str:
        """The family in words, e.g. "routes sigmoid + bias scores without
        expert groups into renormalized weights and clamps SwiGLU"."""
        scores = " or ".join(self.score)
        bias = {(True,): " + bias", (False,): ""}.get(self.bias, " (+ bias or not)")
        groups = "within kept expert groups" if self.group_limited else "without expert groups"
        weights = {(True,): "renormalized", (False,): "unnormalized"}.get(
            self.renormalize, "renormalized or not"
        )
        clamp = "clamps SwiGLU" if self.needs_clamp else "runs SwiGLU with or without a clamp"
        return f"routes {scores}{bias} scores {groups} into {weights} weights and {clamp}"


#: kernel -> what it serves. Both kernels route in one warp
#: (kernels/moe_common.py, kernels/routing.py): sigmoid or softmax scores,
#: the top_k largest score (+ bias), within the best groups when the model
#: drops groups (at most ``routing.MAX_GROUPS``), weights from the unbiased
#: scores, renormalized or not, times the routed scale; and both run SwiGLU
#: with the compiled clamp or, for a model without one, none.
KERNEL_SERVES = {
    "mega": KernelServes(
        score=SCORES, bias=(True, False), group_limited=True, renormalize=(True, False),
        needs_clamp=False, shared_experts=(0, 1),
        shared_rule="the mega kernel runs 0 or 1 shared experts",
    ),
    "grouped": KernelServes(
        score=SCORES, bias=(True, False), group_limited=True, renormalize=(True, False),
        needs_clamp=False, shared_experts=(0, 1),
        shared_rule="the grouped kernel runs 0 or 1 shared experts",
    ),
}  # fmt: skip


def routing_differences(kernel: str, model: MoEShape) -> list[str]:
    """How ``model``'s routing and SwiGLU differ from what ``kernel`` serves
    (``KERNEL_SERVES``), one phrase per model key; empty when it serves them."""
    serves = KERNEL_SERVES[kernel]
    out = []
    if model.score not in serves.score:
        out.append(f"uses {model.score} scores (model.score)")
    if model.bias not in serves.bias:
        has = "has a" if model.bias else "has no"
        out.append(f"{has} score-correction bias (model.bias)")
    if model.groups_kept < model.groups and not serves.group_limited:
        out.append(f"selects within the best {model.groups_kept} of {model.groups} expert "
                   "groups (model.groups)")  # fmt: skip
    elif model.groups_kept < model.groups and model.groups > MAX_GROUPS:
        out.append(f"ranks {model.groups} expert groups, more than the routing warp's "
                   f"{MAX_GROUPS} (model.groups)")  # fmt: skip
    if model.renormalize not in serves.renormalize:
        does = "renormalizes" if model.renormalize else "does not renormalize"
        out.append(f"{does} its weights (model.renormalize)")
    if serves.needs_clamp and model.swiglu_limit is None:
        out.append("has no SwiGLU clamp (model.swiglu_limit)")
    return out


def _and(phrases: list[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _buckets(entry: dict, where: str, bad) -> KernelBuckets | None:
    tokens = _unique_list(entry.get("tokens"), f"{where}.tokens", int, bad)
    if tokens is None:
        return None
    out_of_range = [m for m in tokens if not 1 <= m <= MAX_TOKENS]
    if out_of_range:
        bad(f"{where}.tokens", f"buckets must be in 1..{MAX_TOKENS}, got {out_of_range}")
        return None
    finalize = (False,)
    if "finalize" in entry:
        finalize = _unique_list(entry["finalize"], f"{where}.finalize", bool, bad)
        if finalize is None:
            return None
    return KernelBuckets(tokens=tuple(sorted(tokens)), finalize=tuple(sorted(finalize)))


def _unique_list(value, key: str, typ, bad):
    """A non-empty list of ``typ`` without duplicates, or None (reported)."""
    if value is None:
        return None
    if not value:
        bad(key, "must not be empty")
        return None
    wrong = [v for v in value if type(v) is not typ]
    if wrong:
        bad(key, f"items must be {typ.__name__}, got {wrong!r}")
        return None
    dupes = sorted({v for v in value if value.count(v) > 1}, key=str)
    if dupes:
        bad(key, f"duplicate entries {dupes!r}")
        return None
    return list(value)


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
