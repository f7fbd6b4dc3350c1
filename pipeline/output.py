"""Writing an artifact directory so that it is either complete or absent.

``Staging(target)`` makes a temporary directory beside the target (same file
system, so the final rename is atomic), is filled with the cubins and the
build record, then ``commit(manifest)`` writes ``manifest.json`` last and
renames the directory into place. Any exception or interrupt before that
removes the temporary directory and leaves an existing target untouched.

Replacing an existing target: it must be an artifact (it has a
``manifest.json``) or empty; anything else is refused so that a mistyped
``-o`` never deletes unrelated files. The old directory is renamed aside,
the new one renamed in, then the old one removed: at no moment does the
target path hold a half-written artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from runtime.artifact import canonical_json


class OutputError(RuntimeError):
    """The output path cannot be written or replaced (message says why)."""


def check_target(target: Path) -> None:
    """Refuses a target that is a file or a non-empty non-artifact directory."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise OutputError(f"output {target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (target / "manifest.json").is_file():
        raise OutputError(
            f"output {target}: refusing to replace a non-empty directory that is not an "
            "artifact (no manifest.json)"
        )


class Staging:
    """A temporary artifact directory beside ``target``; use as a context
    manager (removed on any exit that did not commit)."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target).absolute()
        check_target(self.target)
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=parent))
        except OSError as exc:
            raise OutputError(f"output {self.target}: cannot write in {parent}: "
                              f"{exc.strerror or exc}") from None  # fmt: skip
        self.committed = False

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)

    def write(self, relpath: str, data: bytes) -> None:
        path = self.path / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def write_json(self, relpath: str, obj, canonical: bool = False) -> None:
        text = (
            canonical_json(obj) if canonical else json.dumps(obj, indent=1, sort_keys=True) + "\n"
        )
        self.write(relpath, text.encode())

    def commit(self, manifest: dict) -> Path:
        """Writes manifest.json (last) and moves the directory into place."""
        self.write_json("manifest.json", manifest, canonical=True)
        for path in self.path.rglob("*"):  # readable by others, like any build output
            path.chmod(0o755 if path.is_dir() else 0o644)
        self.path.chmod(0o755)
        check_target(self.target)
        old = None
        try:
            if self.target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-",
                                            dir=self.target.parent))  # fmt: skip
                os.replace(self.target, old / "artifact")
            os.replace(self.path, self.target)
        except OSError as exc:
            if old is not None and (old / "artifact").exists() and not self.target.exists():
                os.replace(old / "artifact", self.target)
            raise OutputError(f"output {self.target}: cannot move the build into place: "
                              f"{exc.strerror or exc}") from None  # fmt: skip
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self.committed = True
        return self.target
