"""Opening an existing artifact (directory or ``.tar.zst`` package) for the
commands that read one: merge, package, inspect, verify, diff.

Reading and integrity checks are the runtime's (runtime.artifact: schema,
config hash, every cubin's sizes and sha256, safe unpacking); this module only
adds the directory the files live in, so commands can reach the compressed
bytes and the files beside the manifest (verify records).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime import artifact
from runtime.errors import ArtifactError

__all__ = ["ArtifactError", "Opened", "open_artifact"]


@dataclass(frozen=True)
class Opened:
    """A verified artifact and the directory holding its files (a temporary
    one for a package, valid inside ``open_artifact``'s block)."""

    root: Path
    data: artifact.ArtifactData

    @property
    def manifest(self) -> dict:
        return self.data.manifest

    def extra_records(self, prefix: str = "verify-") -> dict[str, dict]:
        """JSON files beside the manifest named ``<prefix>*.json`` -> content."""
        import json

        out = {}
        for path in sorted(self.root.glob(f"{prefix}*.json")):
            try:
                out[path.name] = json.loads(path.read_text())
            except (OSError, ValueError, RecursionError) as exc:
                raise ArtifactError(f"{path}: not readable JSON ({exc})") from None
            _check_verify_record(path, out[path.name])
        return out


@contextlib.contextmanager
def open_artifact(path: str | Path) -> Iterator[Opened]:
    """Yields the verified artifact at ``path`` (a directory, its
    ``manifest.json``, or a package); raises ArtifactError."""
    path = Path(path)
    if path.name == "manifest.json" and path.is_file():
        path = path.parent  # the artifact directory, named by its manifest
    if path.is_dir():
        yield Opened(path, artifact.read(path))
        return
    if not path.is_file():
        raise ArtifactError(f"artifact {path}: no such directory or file")
    with tempfile.TemporaryDirectory(prefix="moe-build-open-") as tmp:
        artifact.unpack(path, tmp)
        root = Path(tmp)
        if not (root / "manifest.json").is_file():
            entries = list(root.iterdir())
            if len(entries) == 1 and (entries[0] / "manifest.json").is_file():
                root = entries[0]
        data = artifact.read(root)
        yield Opened(root, artifact.ArtifactData(str(path), data.manifest, data.variants))


def _check_verify_record(path: Path, record) -> None:
    """The structure ``moe-build diff`` reads from a ``verify-*.json``: an
    object whose ``variants`` (if present) map names to objects, each with
    ``attributes`` and ``result`` objects when present."""
    if not isinstance(record, dict):
        raise ArtifactError(f"{path}: expected a JSON object, found {type(record).__name__}")
    variants = record.get("variants", {})
    if not isinstance(variants, dict):
        raise ArtifactError(f"{path}: variants: expected an object, found {variants!r:.60}")
    for name, entry in variants.items():
        if not isinstance(entry, dict):
            raise ArtifactError(f"{path}: variants.{name}: expected an object")
        for key in ("attributes", "result"):
            if not isinstance(entry.get(key, {}), dict):
                raise ArtifactError(f"{path}: variants.{name}.{key}: expected an object")
