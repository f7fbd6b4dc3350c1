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

Owned names. Every temporary directory names the process that made it, so
that one left by a killed process can be told from one in use:
``<stem><pid>-<host>-XXXXXXXX``, where ``host`` is ``host_tag()`` (8 hex
digits of the host name's SHA-256) and ``XXXXXXXX`` is mkdtemp's random
part. The stems: ``.<target>.tmp-`` (staging, beside the target),
``.<target>.old-`` (the replaced artifact, as ``<that>/artifact``, beside the
target) and ``moe-build-`` (a build's scratch, in the temporary directory;
pipeline.build). The owner is dead when the host is this one and
``os.kill(pid, 0)`` raises ProcessLookupError. Directories of a live owner
or of another host are never touched; neither is anything that does not
match a stem, mkdtemp's suffix and the owner form exactly, nor a file, a
symbolic link or another user's directory. Names without an owner (written
before owners were recorded: ``<stem>XXXXXXXX``) count as stale once they
are ``LEGACY_AGE`` (a day) old: no build runs that long, and a younger one
may still be in use.

The swap (``commit``), step by step:

1. ``mkdtemp(".<target>.old-<owner>-")`` and rename the target into it as
   ``artifact``, if there is a target;
2. rename the staging directory to the target;
3. remove the ``.old-`` directory.

SIGINT, SIGTERM and SIGHUP are held back from before 1 to after 3
(``_signals_held``): one that arrives meanwhile is handled after the swap,
with the new artifact in place. An exception between 1 and 2 (e.g. the
second rename fails) renames ``artifact`` back to the target before it
propagates. Nothing removes the old artifact before the new one is in
place, so a crash or SIGKILL at any point leaves the target (old or new),
or, between 1 and 2, the old artifact in a ``.old-`` directory of a dead
owner, which the next Staging of that target restores.

Recovery: ``Staging(target)`` (every compile and merge, before it writes)
first looks at the target's ``.old-`` directories whose owner is dead. If
the target is missing, the most recent one's ``artifact`` is renamed back to
the target (``Staging.recovered`` says from where); once the target is a
directory, such ``.old-`` directories are removed (their artifact was
replaced, or has just been restored). Then it removes the target's stale
``.tmp-`` directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

from runtime.artifact import canonical_json

#: Age (seconds) after which a temporary directory without an owner in its name is stale.
LEGACY_AGE = 24 * 3600
_MKDTEMP = r"[a-z0-9_]{8}"  # tempfile's random part: 8 of its 37 characters
_SWAP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


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


def host_tag() -> str:
    """This machine in owned names: 8 hex digits of its host name's SHA-256."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owned_prefix(stem: str) -> str:
    """The mkdtemp prefix of a directory owned by this process."""
    return f"{stem}{os.getpid()}-{host_tag()}-"


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return True  # never ours to judge (0 and -1 would name process groups)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def stale(directory: str | os.PathLike, stem: str) -> list[Path]:
    """This user's directories in ``directory`` named ``stem`` + owner +
    mkdtemp suffix whose owner is dead, and ``stem`` + suffix ones at least
    LEGACY_AGE old (module docstring); sorted by name."""
    pattern = re.compile(re.escape(stem) + r"(?:(\d+)-([0-9a-f]{8})-)?" + _MKDTEMP)
    here, now = host_tag(), time.time()
    uid = os.getuid() if hasattr(os, "getuid") else None
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
            continue
        pid, host = match.groups()
        if pid is None:
            if now - st.st_mtime < LEGACY_AGE:
                continue
        elif host != here or _alive(int(pid)):
            continue
        found.append(Path(entry.path))
    return sorted(found)


def sweep(directory: str | os.PathLike, stem: str) -> list[Path]:
    """Removes ``stale(directory, stem)``; returns what it removed."""
    removed = []
    for path in stale(directory, stem):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def recover(target: Path) -> Path | None:
    """The recovery step of the protocol (module docstring) for ``target``:
    returns the ``.old-`` directory the artifact was restored from, if any."""
    asides = stale(target.parent, f".{target.name}.old-")
    restored = None
    if not target.exists() and not target.is_symlink():
        held = [a for a in asides if (a / "artifact").is_dir()]
        if held:
            newest = max(held, key=lambda a: a.stat().st_mtime)
            with contextlib.suppress(OSError):  # another process got there first
                os.replace(newest / "artifact", target)
                restored = newest
    if target.is_dir() and not target.is_symlink():
        for aside in asides:
            shutil.rmtree(aside, ignore_errors=True)
    return restored


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP held back meanwhile, then handled as they
    would have been. In every thread they are blocked (pthread_sigmask), so
    one directed at this thread waits for the end; in the main thread (where
    Python runs its handlers, whichever thread the signal reached) each one's
    handler, unless it is SIG_IGN, is also replaced by one that notes the
    signal, and a noted signal is raised again once the handlers are back."""
    noted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _SWAP_SIGNALS:
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):
                previous[sig] = signal.signal(sig, lambda signum, frame: noted.append(signum))
    mask = None
    if hasattr(signal, "pthread_sigmask"):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SWAP_SIGNALS)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig in dict.fromkeys(noted):
            signal.raise_signal(sig)


class Staging:
    """A temporary artifact directory beside ``target``; use as a context
    manager (removed on any exit that did not commit). Creating one runs the
    recovery step first (module docstring); ``recovered`` is the ``.old-``
    directory an artifact was restored from, or None."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target).absolute()
        parent = self.target.parent
        self.recovered = recover(self.target) if parent.is_dir() else None
        check_target(self.target)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            sweep(parent, f".{self.target.name}.tmp-")
            prefix = owned_prefix(f".{self.target.name}.tmp-")
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
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
        """Writes manifest.json (last) and moves the directory into place
        (the swap of the module docstring)."""
        self.write_json("manifest.json", manifest, canonical=True)
        for path in self.path.rglob("*"):  # readable by others, like any build output
            path.chmod(0o755 if path.is_dir() else 0o644)
        self.path.chmod(0o755)
        check_target(self.target)
        with _signals_held():
            old = None
            try:
                if self.target.exists():
                    prefix = owned_prefix(f".{self.target.name}.old-")
                    old = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                    os.replace(self.target, old / "artifact")
                os.replace(self.path, self.target)
            except BaseException as exc:
                if old is not None:
                    self._put_back(old)
                if isinstance(exc, OSError):
                    raise OutputError(f"output {self.target}: cannot move the build into place: "
                                      f"{exc.strerror or exc}") from None  # fmt: skip
                raise
            self.committed = True
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return self.target

    def _put_back(self, old: Path) -> None:
        """Undoes step 1 of the swap; where that fails the old artifact stays
        in ``old`` for the next Staging to restore."""
        with contextlib.suppress(OSError):
            if (old / "artifact").exists() and not self.target.exists():
                os.replace(old / "artifact", self.target)
            if not (old / "artifact").exists():
                os.rmdir(old)
