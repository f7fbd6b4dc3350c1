"""Which compiler builds the cubins, known without importing cutlass.

Two uses: the build cache key (everything about the toolchain that can change
generated code) and the manifest's ``toolchain`` record. The ptxas version is
not here: the manifest reads it from the cubins themselves (pipeline.elf).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys

from kernels.grouped_plan import STAMPS_ENV

#: Distributions whose code generates the cubins (the DSL front end and the
#: bundled NVVM/ptxas live in the libs-* wheels).
DSL_DISTRIBUTIONS = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
)

#: The project's variables that change generated code: the grouped kernels'
#: diagnostics build (``kernels.grouped_plan.STAMPS_ENV``).
CODE_ENV = (STAMPS_ENV,)

#: CUTE_DSL_* variables that cannot change generated code (what to dump and
#: where, logging, the DSL's own caches). Every other CUTE_DSL_* variable that
#: is set goes into the cache key: an unknown one costs a rebuild, never a
#: stale cubin. CUTE_DSL_ARCH is the variant's arch, keyed through the spec.
_DSL_ENV_IGNORED = {
    "CUTE_DSL_ARCH",
    "CUTE_DSL_KEEP",
    "CUTE_DSL_KEEP_IR",
    "CUTE_DSL_KEEP_PTX",
    "CUTE_DSL_KEEP_CUBIN",
    "CUTE_DSL_KEEP_SASS",
    "CUTE_DSL_DUMP_DIR",
    "CUTE_DSL_CACHE_DIR",
    "CUTE_DSL_NO_CACHE",
    "CUTE_DSL_DISABLE_FILE_CACHING",
    "CUTE_DSL_JIT_CACHE_MAX_ELEMS",
    "CUTE_DSL_LOG_TO_CONSOLE",
    "CUTE_DSL_LOG_TO_FILE",
    "CUTE_DSL_LOG_LEVEL",
    "CUTE_DSL_PRINT_IR",
    "CUTE_DSL_PRINT_AFTER_PREPROCESSOR",
    "CUTE_DSL_SHOW_STACKTRACE",
    "CUTE_DSL_FILTER_STACKTRACE",
    "CUTE_DSL_WARNINGS_IGNORE",
    "CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS",
    "CUTE_DSL_JIT_TIME_PROFILING",
}


class ToolchainError(RuntimeError):
    """The compiler is not installed (message says what is missing)."""


@functools.cache
def dsl_versions() -> dict[str, str]:
    """Installed DSL distributions -> version (only those installed)."""
    out = {}
    for dist in DSL_DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def dsl_version() -> str:
    """The nvidia-cutlass-dsl version; raises ToolchainError without it."""
    version = dsl_versions().get("nvidia-cutlass-dsl")
    if version is None:
        raise ToolchainError(
            "nvidia-cutlass-dsl is not installed: compiling needs the 'compile' extra "
            "(pip install 'moe-build[compile]')"
        )
    return version


@functools.cache
def compiler_fingerprints() -> dict[str, str]:
    """The DSL's own fingerprint of its compiler library (``DSO_SHA256`` in
    ``_cutlass_ir_version_*.py``, read as text: no import)."""
    out = {}
    for dist in DSL_DISTRIBUTIONS:
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            name = str(f)
            if name.endswith(".py") and "_cutlass_ir_version_" in name:
                text = f.locate().read_text()
                out.update(re.findall(r'"([^"]+\.so)"\s*:\s*"([0-9a-f]{64})"', text))
    return dict(sorted(out.items()))


def python_version() -> str:
    """``"3.11"``: the DSL traces Python code, so the interpreter is an input."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def dsl_environment(environ=None) -> dict[str, str]:
    """The set CUTE_DSL_* variables that may change generated code, and the
    project's own (``CODE_ENV``)."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k.startswith("CUTE_DSL_") and k not in _DSL_ENV_IGNORED) or k in CODE_ENV
    }


def identity() -> dict:
    """Everything about the compiler that goes into the build-cache key."""
    return {
        "dsl": dsl_versions(),
        "compiler": compiler_fingerprints(),
        "python": python_version(),
        "env": dsl_environment(),
    }
