"""Turning compiled variants into the artifact's manifest (artifacts/FORMAT.md).

Everything written here is a pure function of the compiled results and the
config: the same cubins give byte-identical manifests and cubin files (ptxas
need not give the same cubins for the same PTX: artifacts/FORMAT.md,
"Reproducibility"). Per variant, the ABI the kernel module declares is checked
against what ptxas recorded in the cubin (entry symbol, parameter count and
sizes, ``.reqntid``, architecture) before it is written down.
"""

from __future__ import annotations

import hashlib

import zstandard

from pipeline import toolchain
from pipeline.elf import CubinError, CubinInfo, read_cubin
from pipeline.variants import Variant
from runtime.artifact import canonical_json, config_hash

SCHEMA = 1
#: zstandard level for cubins: 19 is the highest non-"ultra" level; a cubin of
#: ~100 KB compresses in well under a second. Single-threaded compression with
#: a fixed level is byte-deterministic for a given libzstd version, which the
#: manifest records.
ZSTD_LEVEL = 19
PARAM_BYTES = {"pointer": 8, "i32": 4}

__all__ = ["SCHEMA", "ManifestError", "canonical_json", "compress", "config_hash",
           "local_toolchain", "manifest", "min_driver", "variant_record"]  # fmt: skip


class ManifestError(ValueError):
    """A compiled variant whose declared ABI or launch disagrees with its
    cubin; the message names the variant."""


def compress(cubin: bytes) -> bytes:
    """Deterministic zstandard frame of a cubin (content size and checksum on)."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    return cctx.compress(cubin)


def zstd_version() -> str:
    return ".".join(str(x) for x in zstandard.ZSTD_VERSION)


def variant_record(variant: Variant, result: dict, key: str, packed: bytes) -> dict:
    """The manifest record of one compiled variant; ``result`` is a
    worker.result_to_dict, ``packed`` its compressed cubin. Raises
    ManifestError when the cubin contradicts what the kernel declared."""
    cubin = result["cubin"]
    label = "ABI check"
    try:
        info = read_cubin(cubin)
    except CubinError as exc:
        raise ManifestError(f"{label}: the compiled cubin is unreadable: {exc}") from None
    kernel = _check_abi(label, variant, result, info)
    return {
        "name": variant.name,
        "kernel": variant.kernel,
        "arch": variant.arch,
        "tokens": variant.tokens,
        "logits_dtype": variant.logits_dtype,
        "finalize": variant.finalize,
        "sms": variant.sms,
        "file": f"cubins/{variant.name}.cubin.zst",
        "sha256": hashlib.sha256(cubin).hexdigest(),
        "size": len(cubin),
        "compressed_sha256": hashlib.sha256(packed).hexdigest(),
        "compressed_size": len(packed),
        "cache_key": key,
        "entry": result["entry"],
        "params": [
            {"name": p["name"], "kind": p["kind"], "offset": k.offset, "size": k.size}
            for p, k in zip(result["params"], kernel.params, strict=True)
        ],
        "tensor_maps": list(result["tensor_maps"]),
        "launch": result["launch"],
        "resources": {
            "registers": kernel.registers,
            "local_bytes": kernel.frame_bytes,
            "stack_bytes": max(kernel.min_stack_bytes, kernel.max_stack_bytes),
            "static_smem": kernel.static_smem,
            # ptxas reports spill bytes only in its log, never in the cubin. A
            # kernel without a local frame cannot have spilled (spills live in
            # the frame): 0. With a frame, the count is unknown: null, and
            # local_bytes bounds it.
            "spills": 0 if kernel.frame_bytes == 0 else None,
        },
        "workspace": result["workspace"],
        "ptx_sha256": result.get("ptx_sha256"),
        "ptxas": info.ptxas_version,
        "toolkit": info.toolkit,
        "notes": result.get("notes", {}),
    }


def _check_abi(label: str, variant: Variant, result: dict, info: CubinInfo):
    """The cubin's entry for the declared one, after checking arch, entry,
    parameter count and sizes and .reqntid against the declaration."""
    if info.arch != variant.arch:
        raise ManifestError(f"{label}: the cubin is for {info.arch}, expected {variant.arch}")
    entry = result["entry"]
    kernel = info.kernels.get(entry)
    if kernel is None:
        raise ManifestError(
            f"{label}: entry {entry!r} is not a kernel of the cubin "
            f"(found: {', '.join(sorted(info.kernels)) or 'none'})"
        )
    declared = result["params"]
    if len(declared) != len(kernel.params):
        raise ManifestError(
            f"{label}: {len(declared)} parameters declared, the cubin's entry takes "
            f"{len(kernel.params)}"
        )
    for i, (p, k) in enumerate(zip(declared, kernel.params, strict=True)):
        want = PARAM_BYTES.get(p["kind"])
        if want is None:
            raise ManifestError(f"{label}: parameter {p['name']!r}: unknown kind {p['kind']!r}")
        if k.ordinal != i or k.size != want:
            raise ManifestError(
                f"{label}: parameter {i} {p['name']!r} ({p['kind']}) expects {want} bytes, "
                f"the cubin's parameter {k.ordinal} has {k.size}"
            )
    block = tuple(result["launch"]["block"])
    if kernel.reqntid is not None and tuple(kernel.reqntid) != block:
        raise ManifestError(
            f"{label}: launch block {list(block)} differs from the cubin's "
            f".reqntid {list(kernel.reqntid)}"
        )
    return kernel


def min_driver(records: list[dict]) -> int:
    """The lowest ``cuDriverGetVersion`` value that loads every cubin.

    Derivation: ptxas stamps each cubin with the CUDA version of the
    toolchain that assembled it (EIATTR_CUDA_API_VERSION, e.g. 129 = 12.9).
    A driver of that CUDA version or newer loads the cubin. Older drivers
    of the same major version may load it too ("minor version
    compatibility"), but NVIDIA documents exceptions for features newer than
    the driver, so the artifact does not rely on it. No PTX is shipped, so
    there is no JIT requirement beyond this. Result: max over cubins of
    ``major * 1000 + minor * 10`` (12.9 -> 12090)."""
    versions = [r["toolkit"] for r in records]
    if not versions:
        return 0
    top = max(versions)
    return (top // 10) * 1000 + (top % 10) * 10


def local_toolchain() -> dict:
    """The parts of ``toolchain`` this machine decides (the DSL, Python and
    libzstd, which decides the compressed bytes); ``ptxas`` comes from the
    cubins (``manifest``)."""
    return {
        "cutlass_dsl": toolchain.dsl_version(),
        "python": toolchain.python_version(),
        "zstd": zstd_version(),
    }


def manifest(config: dict, records: list[dict], tools: dict, extra: dict | None = None) -> dict:
    """The manifest of a build: ``records`` in any order (sorted here),
    ``tools`` as ``local_toolchain()`` of the machine that compiled them."""
    records = sorted(records, key=lambda r: r["name"])
    ptxas = sorted({f"{r['toolkit'] // 10}.{r['toolkit'] % 10}" for r in records})
    out = {
        "schema": SCHEMA,
        "config": config,
        "config_hash": config_hash(config),
        "toolchain": {**tools, "ptxas": ", ".join(ptxas)},
        "min_driver": min_driver(records),
        "variants": records,
    }
    out.update(extra or {})
    return out
