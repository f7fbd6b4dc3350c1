"""``moe-build package``: one deterministic ``.tar.zst`` file of an artifact.

The same artifact directory always gives the same bytes: members sorted by
name, directories before their contents, mtime 0, uid/gid 0, empty owner
names, modes 0644/0755, POSIX ustar headers, a single-threaded zstandard
frame at a fixed level. Members sit at the top of the archive (no leading
folder). ``build-record.json`` stays out: it describes one build machine and
run, not the artifact. The artifact is verified before packing, and the
package is read back through the runtime's reader (which refuses members that
escape the target) before it is moved into place.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import zstandard

from pipeline.artifacts import ArtifactError, open_artifact
from runtime import artifact

ZSTD_LEVEL = 19
EXCLUDED = ("build-record.json",)


class PackageError(RuntimeError):
    """The package cannot be written (message says why)."""


def members(root: Path) -> list[str]:
    """Relative POSIX names to pack: manifest, cubins, verify records."""
    names = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise PackageError(f"{path}: links are not packed")
        if rel in EXCLUDED or rel.startswith(".") or "/." in rel:
            continue
        names.append(rel)
    return names


def tar_bytes(root: Path) -> bytes:
    """The deterministic tar stream (uncompressed) of ``root``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for rel in members(root):
            path = root / rel
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if path.is_dir():
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def package(source: str | Path, out: str | Path) -> Path:
    """Packs the verified artifact ``source`` into ``out`` (atomically);
    raises ArtifactError or PackageError."""
    out = Path(out).absolute()
    if out.is_dir():
        raise PackageError(f"output {out}: is a directory")
    with open_artifact(source) as opened:
        data = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(
            tar_bytes(opened.root)
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    except OSError as exc:
        raise PackageError(f"output {out}: cannot write in {out.parent}: "
                           f"{exc.strerror or exc}") from None  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        artifact.read(tmp)  # the runtime's own reader accepts it
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


__all__ = ["ArtifactError", "PackageError", "members", "package", "tar_bytes"]
