"""The compile worker: one process compiles variants of one architecture.

CuTe DSL fixes its target architecture when cutlass is first imported
(``CUTE_DSL_ARCH``), so every worker process serves exactly one arch: the
pool initializer ``init(arch)`` sets the environment before anything imports
cutlass, and ``compile_one`` refuses specs of another arch (through
``kernels.registry.compile_variant``).

Results cross the process boundary as plain dicts (``result_to_dict``) so the
parent never needs cutlass; a compiler failure comes back as
``{"error": "<exception text>"}`` rather than an exception, so the parent can
name the variant and keep the other results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
import traceback

from kernels import registry
from kernels.spec import CompiledKernel, KernelSpec


def init(arch: str, scratch: str) -> None:
    """Pool initializer: prepares this process to compile for ``arch``.

    The DSL writes the PTX/cubin it is asked to keep into ``CUTE_DSL_DUMP_DIR``
    (default: the working directory); a private directory under ``scratch``
    (which the parent removes after the build) keeps those files out of the
    user's tree and away from other workers: the DSL reads its cubin back
    from that directory, and compiles sharing one directory once returned an
    empty cubin (1 in 6 concurrent compiles of one kernel). The path never
    reaches the cubins (tests/test_pipeline_dsl.py)."""
    registry.prepare_process(arch)
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix=f"{arch}-", dir=scratch)


def compile_one(spec_fields: dict) -> dict:
    """Compiles one variant; returns ``result_to_dict`` of it plus
    ``seconds``, or ``{"error": text, "seconds": s}``."""
    start = time.monotonic()
    try:
        spec = KernelSpec(**spec_fields)
        compiled = registry.compile_variant(spec)
        if not isinstance(compiled, CompiledKernel):
            raise TypeError(
                f"compile_kernel returned {type(compiled).__name__}, not CompiledKernel"
            )
        out = result_to_dict(compiled)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the variant
        if isinstance(exc, KeyboardInterrupt):
            raise
        out = {"error": _describe(exc)}
    out["seconds"] = time.monotonic() - start
    return out


def result_to_dict(compiled: CompiledKernel) -> dict:
    """The parts of a CompiledKernel the manifest records (JSON-able, except
    ``cubin`` which stays bytes)."""
    launch = compiled.launch
    return {
        "cubin": bytes(compiled.cubin),
        "entry": compiled.entry,
        "params": [{"name": p.name, "kind": p.kind} for p in compiled.params],
        "launch": {
            "grid": list(launch.grid),
            "block": list(launch.block),
            "cluster": list(launch.cluster) if launch.cluster is not None else None,
            "smem": int(launch.smem),
            "pdl": bool(launch.pdl),
        },
        "tensor_maps": list(compiled.tensor_maps),
        "workspace": [dataclasses.asdict(w) for w in compiled.workspace],
        "notes": _jsonable(compiled.notes),
        # The code ptxas was given: equal PTX with unequal cubins is ptxas's
        # own variation (artifacts/FORMAT.md, "Reproducibility").
        "ptx_sha256": hashlib.sha256(compiled.ptx.encode()).hexdigest() if compiled.ptx else None,
    }


def _jsonable(value):
    """Notes as plain JSON types (tuples become lists; anything else its str)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _describe(exc: BaseException) -> str:
    """The exception's own text, plus the innermost frames of kernel code so
    the error points at a line (the DSL's messages often already do)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = [
        f"{f.filename}:{f.lineno} in {f.name}"
        for f in traceback.extract_tb(exc.__traceback__)
        if "/kernels/" in f.filename or "/tests/" in f.filename
    ]
    if frames:
        text += "\n  at " + "\n  at ".join(frames[-3:])
    return text
