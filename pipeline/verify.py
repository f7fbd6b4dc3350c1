"""``moe-build verify``: is an artifact intact and does its manifest tell the
truth about its cubins?

Offline (any machine): the runtime's reader checks the schema, the config
hash and every cubin's sizes and sha256 (runtime.artifact); then each cubin
is parsed (pipeline.elf) and compared with its record: architecture, entry
symbol, parameter count, sizes and offsets, registers, local memory, stack,
static shared memory, the assembler version, and ``min_driver`` and
``toolchain.ptxas`` recomputed from the cubins. A manifest edited by hand
(hashes left intact) fails here.

On a GPU (``--device``): pipeline.verify_device.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import manifest as mf
from pipeline.artifacts import open_artifact
from pipeline.elf import CubinError, read_cubin


def check_records(manifest: dict, cubins: dict[str, bytes]) -> list[str]:
    """Disagreements between the manifest and the cubins (empty: none)."""
    problems = []
    for record in manifest["variants"]:
        name = record["name"]
        label = f"variant {name}"
        try:
            info = read_cubin(cubins[name])
        except CubinError as exc:
            problems.append(f"{label}: cubin unreadable: {exc}")
            continue
        if info.arch != record["arch"]:
            problems.append(f"{label}: arch: manifest {record['arch']}, cubin {info.arch}")
        kernel = info.kernels.get(record["entry"])
        if kernel is None:
            found = ", ".join(sorted(info.kernels)) or "none"
            problems.append(f"{label}: entry {record['entry']!r} not in the cubin ({found})")
            continue
        params = [(p.offset, p.size) for p in kernel.params]
        declared = [(p.get("offset"), p.get("size")) for p in record["params"]]
        if params != declared:
            problems.append(f"{label}: params (offset, size): manifest {declared}, cubin {params}")
        resources = {
            "registers": kernel.registers,
            "local_bytes": kernel.frame_bytes,
            "stack_bytes": max(kernel.min_stack_bytes, kernel.max_stack_bytes),
            "static_smem": kernel.static_smem,
        }
        for key, found in resources.items():
            want = record.get("resources", {}).get(key)
            if want != found:
                problems.append(f"{label}: resources.{key}: manifest {want}, cubin {found}")
        for key, found in (("toolkit", info.toolkit), ("ptxas", info.ptxas_version)):
            if record.get(key) != found:
                problems.append(f"{label}: {key}: manifest {record.get(key)}, cubin {found}")
    if not problems:
        want = mf.min_driver(manifest["variants"])
        if manifest["min_driver"] != want:
            problems.append(f"min_driver: manifest {manifest['min_driver']}, cubins need {want}")
        ptxas = ", ".join(sorted({f"{r['toolkit'] // 10}.{r['toolkit'] % 10}"
                                  for r in manifest["variants"]}))  # fmt: skip
        if manifest["toolchain"].get("ptxas") != ptxas:
            problems.append(
                f"toolchain.ptxas: manifest {manifest['toolchain'].get('ptxas')}, cubins {ptxas}"
            )
    return problems


def verify_offline(path: str | Path) -> tuple[dict, list[str]]:
    """(manifest, problems); raises ArtifactError when the artifact is
    corrupted or malformed (the runtime's checks)."""
    with open_artifact(path) as opened:
        cubins = {v.name: v.cubin for v in opened.data.variants}
        return opened.manifest, check_records(opened.manifest, cubins)
