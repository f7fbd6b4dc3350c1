"""``moe-build verify --device``: load every cubin of the GPU's arch through the
runtime, record what the driver reports, run each variant once against
``runtime.reference``, and write ``verify-<device>.json`` beside the manifest.

The record (sorted-key JSON) holds: the device name, compute capability, SM
count, opt-in shared memory limit, the driver version, and per variant the
driver's function attributes (registers, local bytes, static shared memory,
max threads per block, max dynamic shared memory) and the run's result
(``ok``, the error measures, or the exception text). diff compares these
records between artifacts.

Agreement rule (one place, with its reason): every output is compared with
the float64 reference fed the kernel's own expert choice (a near-tie may
resolve either way), as ``max |got - ref| / max |ref|``. The kernels and the
reference quantize activations and hidden values to FP8 the same way, so the
remaining differences are accumulation order (FP32 in the kernels) and the
BF16 rounding of the outputs (2^-9 relative): a hidden value that lands on the
other side of an FP8 rounding boundary moves one output by ~2^-4 of one
term's contribution. ``REL_TOL = 2e-2`` sits above both and far below any real
fault (wrong rows, scales or experts give errors of order 1). The routing
weights must match to 1e-5 relative (FP32 sigmoid and sum), and at least
``MIN_ID_AGREEMENT`` of the chosen experts must be the reference's.
"""

from __future__ import annotations

import re
from pathlib import Path

REL_TOL = 2e-2
WEIGHT_TOL = 1e-5
MIN_ID_AGREEMENT = 0.95
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


def _rel_err(got, ref) -> float:
    ref = ref.double()
    scale = ref.abs().max().item() or 1.0
    return (got.double() - ref).abs().max().item() / scale


def run_variant(layer, variant, shape, routed, shared, generator) -> dict:
    """One call of ``variant`` (through the bound ``layer``) with fresh random
    inputs on ``layer.device``, compared with the reference (module
    docstring); returns ``{"ok": bool, "<output>_rel_err": x, ...}``."""
    import torch

    from runtime.reference import moe_reference

    device = layer.device
    m = variant.tokens
    dtype = torch.float32 if variant.logits_dtype == "float32" else torch.bfloat16
    x = torch.randn(m, shape.hidden, generator=generator, device=device).to(torch.bfloat16)
    logits = torch.randn(m, shape.experts, generator=generator, device=device).to(dtype)
    bias = 0.1 * torch.randn(shape.experts, generator=generator, device=device)
    if variant.kernel == "mega":
        out, ids, weights = layer.mega(x, logits, bias)
        got = {"out": out}
    elif variant.finalize:
        final = layer.grouped(x, logits, bias, finalize=True)
        ids = weights = None
        got = {"final": final}
    else:
        out, ids, weights, shared_out = layer.grouped(x, logits, bias)
        got = {"out": out, "shared": shared_out}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref = moe_reference(x, logits, bias, routed, shared, shape, dtype=torch.float64, ids=ids)
    result = {}
    if ids is not None:
        plain = moe_reference(x, logits, bias, routed, shared, shape, dtype=torch.float64)
        agree = ids.view(m, -1).long().sort(1).values == plain.ids.long().sort(1).values
        result["id_agreement"] = round(agree.float().mean().item(), 6)
        result["weights_rel_err"] = _rel_err(weights.float().view(m, -1), ref.weights)
    for key, tensor in got.items():
        if torch.isnan(tensor.float()).any():
            result[f"{key}_rel_err"] = None
            result["error"] = f"{key} has NaN (unwritten elements)"
            continue
        result[f"{key}_rel_err"] = _rel_err(tensor, getattr(ref, key))
    ok = "error" not in result and all(
        result[f"{k}_rel_err"] is not None and result[f"{k}_rel_err"] <= REL_TOL for k in got
    )
    if ids is not None:
        ok = ok and result["id_agreement"] >= MIN_ID_AGREEMENT
        ok = ok and result["weights_rel_err"] <= WEIGHT_TOL
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
        "tolerances": {"rel": REL_TOL, "weights": WEIGHT_TOL, "ids": MIN_ID_AGREEMENT},
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
