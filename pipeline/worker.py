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

A worker ends with its parent (``exit_with_parent``): a build that is killed
outright (SIGKILL, OOM killer) runs no cleanup, and its workers, still
holding their end of the pool's queues, would otherwise wait forever. Two
mechanisms, either one enough: on Linux the kernel sends the worker SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``, which fires when the
thread that started the worker ends: the build starts and stops its pools
in one thread, see pipeline.build); everywhere, a daemon thread compares
``os.getppid()`` with the parent's pid every ``WATCH_INTERVAL`` seconds and
calls ``os._exit`` when they differ (an orphan's parent becomes init or a
subreaper). The pool's workers are the spawn context's children of the
build process itself, so their ``getppid()`` is the pid the build passes to
``init``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

from kernels import registry
from kernels.spec import CompiledKernel, KernelSpec

#: Seconds between two looks at the parent pid (the portable fallback).
WATCH_INTERVAL = 0.5
#: Exit status of a worker that outlived its parent.
ORPHANED = 70
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def init(arch: str, scratch: str, parent: int | None = None) -> None:
    """Pool initializer: prepares this process to compile for ``arch``.

    ``parent`` is the build's pid: the worker exits when that process is
    gone, including when it died before this ran (``exit_with_parent``).

    The DSL writes the PTX/cubin it is asked to keep into ``CUTE_DSL_DUMP_DIR``
    (default: the working directory); a private directory under ``scratch``
    (which the parent removes after the build) keeps those files out of the
    user's tree and away from other workers: the DSL reads its cubin back
    from that directory, and compiles sharing one directory once returned an
    empty cubin (1 in 6 concurrent compiles of one kernel). The path never
    reaches the cubins (tests/test_pipeline_dsl.py)."""
    exit_with_parent(os.getppid() if parent is None else parent)
    registry.prepare_process(arch)
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix=f"{arch}-", dir=scratch)


def exit_with_parent(parent: int) -> None:
    """This process ends when process ``parent`` (its parent) does: parent
    death signal where the system has one, then a check that the parent
    is still the one (it may have died before the signal was asked for),
    then ``watch_parent``."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # the C library Python runs on
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: the watch alone
            pass
    if os.getppid() != parent:
        os._exit(ORPHANED)
    watch_parent(parent)


def watch_parent(parent: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Starts a daemon thread that calls ``os._exit(ORPHANED)`` once
    ``os.getppid()`` is no longer ``parent``."""

    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(ORPHANED)

    thread = threading.Thread(target=watch, name="moe-build-parent-watch", daemon=True)
    thread.start()
    return thread


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
