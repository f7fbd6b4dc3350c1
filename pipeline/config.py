"""Build configs: YAML at the edge, frozen dataclasses inside, and ``validate``
as the single statement of what a config may be.

A config names one MoE shard (``model``), the token buckets of each kernel,
the router-logit dtypes and the target architectures with their SM counts
(see configs/README.md for the schema). Every rule lives in ``validate``; its
errors name the file, the key and the rule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernels.shapes import unsupported
from runtime.constants import ARCHS, KERNELS, LOGITS_DTYPES, MAX_TOKENS, TILE
from runtime.model import MoEShape


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


# Schema: key -> (type, required). Types are checked exactly (a bool is not an int).
_TOP = {"name": str, "model": dict, "kernels": dict, "logits_dtypes": list, "targets": list}
_MODEL = {
    "hidden": int,
    "inter": int,
    "experts": int,
    "top_k": int,
    "routed_scale": float,
    "swiglu_limit": float,
    "ue8m0": bool,
    "shared_experts": int,
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


def validate(raw, path: str = "<config>") -> BuildConfig:
    """The single statement of what a config may be. Returns the resolved
    BuildConfig or raises ConfigError listing every problem found."""
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
            if key not in obj:
                bad(full, "missing")
                continue
            value = obj[key]
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not typ:
                bad(full, f"must be {typ.__name__}, got {_kind(value)}")
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

    if model is not None:
        for kernel, buckets in kernels.items():
            if kernel == "grouped" and model.shared_experts != 1:
                bad("model.shared_experts", "the grouped kernel computes exactly one shared expert")
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
    if m["experts"] <= 0 or m["experts"] % 32:
        bad("model.experts", f"must be a positive multiple of 32, got {m['experts']}")
        ok = False
    if not 1 <= m["top_k"] <= max(m["experts"], 1):
        bad("model.top_k", f"must be in 1..experts ({m['experts']}), got {m['top_k']}")
        ok = False
    for key in ("routed_scale", "swiglu_limit"):
        if not (math.isfinite(m[key]) and m[key] > 0):
            bad(f"model.{key}", f"must be a finite positive number, got {m[key]}")
            ok = False
    if m["shared_experts"] not in (0, 1):
        bad("model.shared_experts", f"must be 0 or 1, got {m['shared_experts']}")
        ok = False
    return MoEShape(**m) if ok else None


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
