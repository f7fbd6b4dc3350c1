"""``moe-build diff A B``: what changed between two artifacts, per variant.

Compared: the global facts (config, toolchain, min_driver), then per variant
the PTX the cubin was assembled from (``ptx_sha256``; a cubin change with
the same PTX is labelled "(same PTX)"), the cubin (sha256, size), resources (registers, local memory, stack, static
shared memory, spills), launch shape, parameter ABI, entry, tensor maps,
workspaces, SM count, ptxas version and notes, and, when both artifacts carry
a ``verify-<device>.json`` for the same device, what the driver reported and
whether the variant still matched the reference.

Each change has a kind: ``abi`` (entry, parameters, tensor maps, workspace,
SM count, model shape, a variant added or removed), ``launch`` (grid, block,
cluster, dynamic shared memory, PDL, min_driver), ``verify`` (a verification
that passed in A and fails in B), or ``info`` (everything else: code,
resources, toolchain). ``relevant`` is true when any change is abi, launch or
verify: the runtime or its callers must look; ``moe-build diff`` exits 1 then.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

RELEVANT = ("abi", "launch", "verify")

#: Variant record keys -> kind of a change there.
_VARIANT_FIELDS = {
    "entry": "abi",
    "params": "abi",
    "tensor_maps": "abi",
    "workspace": "abi",
    "sms": "abi",
    "launch.grid": "launch",
    "launch.block": "launch",
    "launch.cluster": "launch",
    "launch.smem": "launch",
    "launch.pdl": "launch",
    "ptx_sha256": "info",
    "sha256": "info",
    "size": "info",
    "resources.registers": "info",
    "resources.local_bytes": "info",
    "resources.stack_bytes": "info",
    "resources.static_smem": "info",
    "resources.spills": "info",
    "ptxas": "info",
    "notes": "info",
}


@dataclass(frozen=True)
class Change:
    variant: str  # "" for artifact-wide facts
    field: str
    a: object
    b: object
    kind: str


def _get(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _flatten(value: dict, prefix: str) -> dict:
    """{"a": {"b": 1}} -> {"prefix.a.b": 1}."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict) and item:
            out.update(_flatten(item, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = item
    return out


def diff_manifests(a: dict, b: dict, verify_a: dict | None = None,
                   verify_b: dict | None = None) -> list[Change]:  # fmt: skip
    """Every change from manifest ``a`` to ``b`` (plus their verify records,
    file name -> content), artifact-wide first, then by variant name."""
    changes = []
    model_a, model_b = a["config"].get("model"), b["config"].get("model")
    if model_a != model_b:
        for key in sorted(set(model_a or {}) | set(model_b or {})):
            va, vb = (model_a or {}).get(key), (model_b or {}).get(key)
            if va != vb:
                changes.append(Change("", f"config.model.{key}", va, vb, "abi"))
    for key in sorted(set(a["config"]) | set(b["config"]) - {"model"}):
        if key != "model" and a["config"].get(key) != b["config"].get(key):
            changes.append(Change("", f"config.{key}", a["config"].get(key),
                                  b["config"].get(key), "info"))  # fmt: skip
    for key in sorted(set(a["toolchain"]) | set(b["toolchain"])):
        if a["toolchain"].get(key) != b["toolchain"].get(key):
            changes.append(Change("", f"toolchain.{key}", a["toolchain"].get(key),
                                  b["toolchain"].get(key), "info"))  # fmt: skip
    if a["min_driver"] != b["min_driver"]:
        changes.append(Change("", "min_driver", a["min_driver"], b["min_driver"], "launch"))

    va = {r["name"]: r for r in a["variants"]}
    vb = {r["name"]: r for r in b["variants"]}
    for name in sorted(set(va) | set(vb)):
        if name not in vb:
            changes.append(Change(name, "variant", "present", "removed", "abi"))
            continue
        if name not in va:
            changes.append(Change(name, "variant", "absent", "added", "abi"))
            continue
        for dotted, kind in _VARIANT_FIELDS.items():
            x, y = _get(va[name], dotted), _get(vb[name], dotted)
            if x == y:
                continue
            if isinstance(x, dict) and isinstance(y, dict):  # notes: only what changed
                fx, fy = _flatten(x, dotted), _flatten(y, dotted)
                for key in sorted(set(fx) | set(fy)):
                    if fx.get(key) != fy.get(key):
                        changes.append(Change(name, key, fx.get(key), fy.get(key), kind))
            else:
                changes.append(Change(name, _label(dotted, va[name], vb[name]), x, y, kind))
    changes += _diff_verify(verify_a or {}, verify_b or {})
    return changes


def _label(dotted: str, a: dict, b: dict) -> str:
    """A cubin change from the same PTX is ptxas's own variation (its register
    allocation can follow heap addresses: artifacts/FORMAT.md): said so."""
    if dotted in ("sha256", "size", "resources.registers"):
        ptx = a.get("ptx_sha256")
        if ptx is not None and ptx == b.get("ptx_sha256"):
            return f"{dotted} (same PTX)"
    return dotted


def _diff_verify(a: dict, b: dict) -> list[Change]:
    """Changes between verify records of the same device file name."""
    changes = []
    for file in sorted(set(a) & set(b)):
        ra, rb = a[file], b[file]
        for key in ("driver_version", "device"):
            if ra.get(key) != rb.get(key):
                changes.append(Change("", f"{file}:{key}", ra.get(key), rb.get(key), "info"))
        xa, xb = ra.get("variants", {}), rb.get("variants", {})
        for name in sorted(set(xa) & set(xb)):
            attrs_a, attrs_b = xa[name].get("attributes", {}), xb[name].get("attributes", {})
            for key in sorted(set(attrs_a) | set(attrs_b)):
                if attrs_a.get(key) != attrs_b.get(key):
                    changes.append(Change(name, f"{file}:attributes.{key}", attrs_a.get(key),
                                          attrs_b.get(key), "info"))  # fmt: skip
            ok_a = xa[name].get("result", {}).get("ok")
            ok_b = xb[name].get("result", {}).get("ok")
            if ok_a != ok_b:
                kind = "verify" if ok_a and not ok_b else "info"
                changes.append(Change(name, f"{file}:result.ok", ok_a, ok_b, kind))
    return changes


def relevant(changes: list[Change]) -> bool:
    return any(c.kind in RELEVANT for c in changes)


def _short(value) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:12]  # a sha256
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return "[" + ", ".join(str(v.get("name", v)) + (":" + v["kind"] if "kind" in v else "")
                               for v in value) + "]"  # fmt: skip
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def render(changes: list[Change], a_name: str, b_name: str) -> str:
    """Readable table of the changes (or one line saying there are none)."""
    from pipeline.inspection import table

    if not changes:
        return f"no differences between {a_name} and {b_name}"
    rows = [[c.variant or "(artifact)", c.field, _short(c.a), _short(c.b),
             c.kind.upper() if c.kind in RELEVANT else c.kind] for c in changes]  # fmt: skip
    verdict = (
        "ABI-, launch- or verification-relevant changes: the runtime must be checked"
        if relevant(changes)
        else "no ABI- or launch-relevant changes"
    )
    head = f"A = {a_name}\nB = {b_name}\n\n"
    return head + table(rows, ["variant", "field", "A", "B", "kind"]) + f"\n\n{verdict}"


def to_json(changes: list[Change]) -> dict:
    return {"relevant": relevant(changes), "changes": [asdict(c) for c in changes]}
