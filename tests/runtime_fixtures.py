"""Hand-made artifacts (artifacts/FORMAT.md, schema 1) for the runtime's tests:
a manifest with chosen variant records over given cubin bytes."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import zstandard

from kernels import abi
from runtime.artifact import canonical_json

#: A small MoE shard the CPU tests can afford (the layout rules of glm5).
SMALL_MODEL = {
    "hidden": 256, "inter": 128, "experts": 32, "top_k": 4, "routed_scale": 2.5,
    "swiglu_limit": 10.0, "ue8m0": False, "shared_experts": 1,
}  # fmt: skip

MEGA_PARAMS, MEGA_MAPS = abi.MEGA_PARAMS, abi.MEGA_MAPS
GROUPED_PARAMS = abi.GROUPED_PARAMS
GROUPED_WORKSPACE = (("plan_x", 4096, False), ("plan_s", 512, False), ("hidden", 8192, False),
                     ("hscale", 1024, False), ("partial", 4096, False), ("counters", 2048, True))  # fmt: skip


def config(model: dict | None = None) -> dict:
    return {
        "name": "test",
        "model": dict(model or SMALL_MODEL),
        "kernels": {"mega": {"tokens": [1, 2, 3, 4]},
                    "grouped": {"tokens": [8, 16, 32, 48, 64], "finalize": [False, True]}},
        "logits_dtypes": ["float32", "bfloat16"],
        "targets": [{"arch": "sm_90a", "sms": 132}, {"arch": "sm_100a", "sms": 148}],
    }  # fmt: skip


def record(kernel: str, arch: str = "sm_90a", tokens: int = 1, dtype: str = "float32",
           finalize: bool = False, **overrides) -> dict:  # fmt: skip
    """A variant record without hashes (``write`` fills them from its cubin)."""
    name = f"{kernel}-{arch}-m{tokens}-{dtype}" + ("-final" if finalize else "")
    grouped = kernel == "grouped"
    rec = {
        "name": name, "kernel": kernel, "arch": arch, "tokens": tokens, "logits_dtype": dtype,
        "finalize": finalize, "sms": 132, "file": f"cubins/{name}.cubin.zst",
        "cache_key": "0" * 64, "entry": f"moe_{kernel}_0",
        "params": [{"name": p, "kind": abi.param_kind(p)}
                   for p in (GROUPED_PARAMS if grouped else MEGA_PARAMS)],
        "tensor_maps": ["w13", "w2", "s13", "s2"] if grouped else list(MEGA_MAPS),
        "launch": {"grid": [132, 1, 1] if grouped else [16 * tokens * 9, 1, 1],
                   "block": [256, 1, 1], "cluster": None if grouped else [16, 1, 1],
                   "smem": 200000, "pdl": True},
        "resources": {"registers": 128, "local_bytes": 0, "stack_bytes": 0, "static_smem": 0,
                      "spills": 0},
        "workspace": [{"name": n, "bytes": b, "zero": z} for n, b, z in GROUPED_WORKSPACE]
        if grouped else [{"name": "arrivals", "bytes": 4 * tokens * 16, "zero": True}],
        "notes": {},
    }  # fmt: skip
    rec.update(overrides)
    return rec


def write(root: Path, variants, model: dict | None = None, min_driver: int = 12080,
          manifest_edit=None) -> Path:  # fmt: skip
    """Writes an artifact directory: ``variants`` = [(record, cubin bytes)];
    ``manifest_edit(manifest)`` may change the manifest before it is written."""
    root = Path(root)
    (root / "cubins").mkdir(parents=True, exist_ok=True)
    records = []
    for rec, cubin in variants:
        rec = dict(rec)
        packed = zstandard.ZstdCompressor(level=3).compress(cubin)
        (root / rec["file"]).write_bytes(packed)
        rec.update(sha256=hashlib.sha256(cubin).hexdigest(), size=len(cubin),
                   compressed_sha256=hashlib.sha256(packed).hexdigest(),
                   compressed_size=len(packed))  # fmt: skip
        records.append(rec)
    cfg = config(model)
    manifest = {
        "schema": 1, "config": cfg,
        "config_hash": hashlib.sha256(canonical_json(cfg).encode()).hexdigest(),
        "toolchain": {"cutlass_dsl": "4.8.1", "ptxas": "13.4", "python": "3.11"},
        "min_driver": min_driver,
        "variants": sorted(records, key=lambda r: r["name"]),
    }  # fmt: skip
    if manifest_edit is not None:
        manifest_edit(manifest)
    (root / "manifest.json").write_text(canonical_json(manifest))
    return root


def package(root: Path, archive: Path, prefix: str = "", extra=()) -> Path:
    """Packs ``root`` as tar + zstandard; ``extra``: additional TarInfo
    members (with their data or None), to make hostile packages."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(Path(root).rglob("*")):
            tar.add(path, arcname=prefix + str(path.relative_to(root)), recursive=False)
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    Path(archive).write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return Path(archive)


def cubin(tag: str) -> bytes:
    """Stand-in cubin bytes (CPU tests never load them)."""
    return b"\x7fELF" + tag.encode() * 64
