"""``moe-build verify --device``: load every cubin of the GPU's arch through the
runtime, record what the driver reports, run each variant once against
``runtime.reference``, and write ``verify-<device>.json`` beside the manifest.

The record (sorted-key JSON) holds: the device name, compute capability, SM
count, opt-in shared memory limit, the driver version, and per variant the
driver's function attributes (registers, local bytes, static shared memory,
max threads per block, max dynamic shared memory) and the run's result
(``ok``, the error measures, or the exception text). diff compares these
records between artifacts.

Agreement rule, the same as the runtime's GPU acceptance test
(tests/gpu/test_moe_artifact.py, where the numbers were measured): every
output is compared with the float32 reference that quantizes activations and
hidden values the same way, fed the kernel's own expert choice, as the
relative L2 error ``|got - ref| / |ref|``; it must stay below
``REL_L2_TOL = 1e-2`` (docs/semantics.md, "Accuracy bar"; measured on the H200:
2e-3 to 6e-3, from the tensor cores' FP8 accumulation moving a few hidden
values across an FP8 rounding boundary; broken kernels land at ~0.3 to ~1). The chosen experts must equal the reference's except on
tokens whose selection keys are within ``TIE`` of a tie, and the routing
weights must match to ``rtol=1e-5, atol=1e-6`` (FP32 sigmoid and sum).
"""

from __future__ import annotations

import re
from pathlib import Path

REL_L2_TOL = 1e-2
TIE = 1e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6
ATTRIBUTES = {
    "registers": "NUM_REGS",
    "local_bytes": "LOCAL_SIZE_BYTES",
    "static_smem": "SHARED_SIZE_BYTES",
    "max_threads_per_block": "MAX_THREADS_PER_BLOCK",
    "max_dynamic_smem": "MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "binary_version": "BINARY_VERSION",
}


class DeviceUnavailable(RuntimeError):
    """No usable GPU (or torch/cuda.bindings without CUDA)."""


def device_file_name(name: str) -> str:
    """``verify-<device>.json`` with the device name made file-safe."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "gpu"
    return f"verify-{slug}.json"


def run_variant(layer, variant, shape, routed, shared, generator) -> dict:
    """One call of ``variant`` (through the bound ``layer``) with fresh random
    inputs on ``layer.device``, compared with the reference (module
    docstring); returns ``{"ok": bool, "<output>_rel_l2": x, ...}``."""
    import torch

    from runtime.reference import moe_reference, rel_l2, tie_margin_for

    device = layer.device
    m = variant.tokens
    dtype = torch.float32 if variant.logits_dtype == "float32" else torch.bfloat16
    x = torch.randn(m, shape.hidden, generator=generator, device=device).to(torch.bfloat16)
    logits = torch.randn(m, shape.experts, generator=generator, device=device).to(dtype)
    bias = 0.1 * torch.randn(shape.experts, generator=generator, device=device)
    bias = bias if shape.bias else None  # a model without a bias routes without one
    ids = weights = None
    if variant.kernel == "mega":
        out, ids, weights = layer.mega(x, logits, bias)
        got = {"out": out}
    elif variant.finalize:
        got = {"final": layer.grouped(x, logits, bias, finalize=True)}
    else:
        out, ids, weights, shared_out = layer.grouped(x, logits, bias)
        got = {"out": out}
        if shared_out is not None:  # None without a shared expert
            got["shared"] = shared_out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result, ok = {}, True
    ref = moe_reference(x, logits, bias, routed, shared, shape)
    if ids is not None:
        near_tie = tie_margin_for(logits, bias, shape) < TIE
        same = (ids.view(m, -1).long() == ref.ids.long()).all(dim=1)
        result["routing_ok"] = bool((same | near_tie).all())
        ref = moe_reference(x, logits, bias, routed, shared, shape, ids=ids)
        result["weights_ok"] = bool(torch.allclose(weights.float().view(m, -1), ref.weights,
                                                   rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL))  # fmt: skip
        ok = result["routing_ok"] and result["weights_ok"]
    for key, tensor in got.items():
        if torch.isnan(tensor.float()).any():
            result[f"{key}_rel_l2"] = None
            result["error"] = f"{key} has NaN (unwritten elements)"
            ok = False
            continue
        err = rel_l2(tensor, getattr(ref, key))
        result[f"{key}_rel_l2"] = round(err, 6)
        ok = ok and err < REL_L2_TOL
    result["ok"] = bool(ok)
    return result


def verify_device(path: str | Path, ordinal: int = 0):
    """(record, file written or None, problems). Writes the record beside the
    manifest of an artifact directory (a package is left unchanged)."""
    try:
        import torch

        from runtime import driver, layout, loader
    except ImportError as exc:
        raise DeviceUnavailable(f"--device needs torch and cuda.bindings: {exc}") from None
    if not torch.cuda.is_available() or torch.cuda.device_count() <= ordinal:
        raise DeviceUnavailable(f"--device: no CUDA device {ordinal} is visible")
    device = torch.device("cuda", ordinal)
    art = loader.load(path, device)
    name = torch.cuda.get_device_name(device)
    record = {
        "device": name,
        "ordinal": ordinal,
        "arch": art.arch,
        "capability": list(driver.capability(ordinal)),
        "sm_count": driver.sm_count(ordinal),
        "max_smem_optin": driver.max_smem_optin(ordinal),
        "driver_version": driver.driver_version(),
        "tolerances": {
            "rel_l2": REL_L2_TOL,
            "tie": TIE,
            "weights_rtol": WEIGHT_RTOL,
            "weights_atol": WEIGHT_ATOL,
        },  # fmt: skip
        "variants": {},
    }
    problems = []
    generator = torch.Generator(device=device)
    generator.seed()  # fresh inputs on every verification
    weights, routed, shared = layout.random_moe_weights(art.shape, generator)
    layer = art.bind(weights, device, poison=True)
    manifest_records = {r["name"]: r for r in art.manifest["variants"]}
    for v in art.variants:
        entry = {}
        try:
            launcher = art.launcher(v, ordinal)
            entry["attributes"] = {
                key: driver.function_attribute(launcher.function, attr)
                for key, attr in ATTRIBUTES.items()
            }
            want = manifest_records[v.name].get("resources", {}).get("registers")
            if entry["attributes"]["registers"] != want:
                problems.append(f"variant {v.name}: the driver reports "
                                f"{entry['attributes']['registers']} registers, the manifest "
                                f"{want}")  # fmt: skip
            entry["result"] = run_variant(layer, v, art.shape, routed, shared, generator)
        except Exception as exc:  # noqa: BLE001 - recorded per variant
            entry["result"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if not entry["result"]["ok"]:
            problems.append(f"variant {v.name}: run: {entry['result']}")
        record["variants"][v.name] = entry
    written = None
    root = Path(path)
    if root.is_dir():
        import json

        written = root / device_file_name(name)
        tmp = written.with_name(f".{written.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        tmp.replace(written)
    return record, written, problems
