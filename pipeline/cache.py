"""Content-addressed build cache: a compiled variant is reused when, and only
when, every input that can change its generated code is the same.

The key is the sha256 of the canonical JSON of:
- ``spec``: every KernelSpec field (kernel, arch, shape, bucket, dtype, SMs...);
- ``sources``: sha256 of every Python file of the ``kernels`` package (so a
  helper reached through any import, relative ones included, is covered) and
  of a kernel module outside the package with what it imports
  (``kernels.registry.source_files``), named relative to the repository so
  the checkout location does not matter;
- ``toolchain``: the DSL distributions and versions, the DSL's fingerprint of
  its compiler library, the Python version, and the set CUTE_DSL_* variables
  that can change code generation (pipeline.toolchain.identity).
Nothing else: not the output directory, the job count, the shard, the order of
variants or the cache directory (tests/test_pipeline_cache.py proves both
directions).

Layout: ``$MOE_BUILD_CACHE`` (default ``~/.cache/moe-build``) /
``v1/<key[:2]>/<key>/{cubin, result.json}``. An entry is written into a
temporary directory beside its place and renamed in (``result.json`` last);
an entry whose cubin does not match the sha256 in ``result.json`` is treated
as a miss and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from kernels import registry
from kernels.spec import KernelSpec

#: Bumped when the entry layout or what ``result.json`` holds changes.
CACHE_FORMAT = 2
CACHE_ENV = "MOE_BUILD_CACHE"


def default_dir() -> Path:
    """``$MOE_BUILD_CACHE`` or ``~/.cache/moe-build``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moe-build"


def source_hashes(kernel: str, arch: str) -> dict[str, str]:
    """Files that decide (kernel, arch)'s code -> sha256 of their bytes,
    named relative to the repository root (or by file name outside it)."""
    root = registry.KERNELS_DIR.parent
    out = {}
    for path in registry.source_files(kernel, arch):
        try:
            name = path.relative_to(root).as_posix()
        except ValueError:
            name = path.name
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def cache_key(spec: KernelSpec, sources: dict[str, str], toolchain: dict) -> str:
    """sha256 hex of everything that decides the variant's generated code."""
    material = {
        "format": CACHE_FORMAT,
        "spec": asdict(spec),
        "sources": sources,
        "toolchain": toolchain,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class BuildCache:
    """Compiled results by key, on disk. ``root=None`` disables caching."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) / f"v{CACHE_FORMAT}" if root is not None else None

    def _entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str) -> dict | None:
        """The stored result (worker.result_to_dict form) or None."""
        if self.root is None:
            return None
        entry = self._entry(key)
        try:
            result = json.loads((entry / "result.json").read_text())
            cubin = (entry / "cubin").read_bytes()
        except (OSError, ValueError):
            return None
        if hashlib.sha256(cubin).hexdigest() != result.get("cubin_sha256"):
            return None
        del result["cubin_sha256"]
        result["cubin"] = cubin
        return result

    def put(self, key: str, result: dict) -> None:
        """Stores a result atomically; a cache that cannot be written is
        skipped (the build still succeeds), never left half-written."""
        if self.root is None:
            return
        entry = self._entry(key)
        meta = {k: v for k, v in result.items() if k not in ("cubin", "seconds")}
        meta["cubin_sha256"] = hashlib.sha256(result["cubin"]).hexdigest()
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", dir=entry.parent))
        except OSError:
            return
        try:
            (tmp / "cubin").write_bytes(result["cubin"])
            (tmp / "result.json").write_text(json.dumps(meta, sort_keys=True))
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
