"""Read, verify and safely unpack a build artifact (artifacts/FORMAT.md, schema 1).

Nothing here touches a GPU: ``read(path)`` returns every variant of the
manifest with its cubin bytes, after checking the manifest's structure, the
config hash, and every cubin's compressed and uncompressed sha256 and size.
A directory and its ``.tar.zst`` package read the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import zstandard

from runtime.constants import ARCHS, KERNELS, LOGITS_DTYPES
from runtime.errors import ArtifactError

SCHEMA = 1
PARAM_KINDS = ("pointer", "i32")
#: What the driver copies per parameter kind (pipeline records read the size
#: from the cubin; the launcher relies on it).
PARAM_BYTES = {"pointer": 8, "i32": 4}
TENSOR_MAPS = ("w13", "w2", "s13", "s2")
#: An unpacked package may not grow past this (a zstandard bomb guard): every
#: decompressed byte counts, tar headers and padding included. A full
#: two-arch build is a few tens of MB. It also bounds each cubin's size.
MAX_UNPACKED_BYTES = 1 << 30
#: A package may hold at most this many members (a full build: well under a
#: hundred cubins, their folder and the manifest).
MAX_MEMBERS = 4096
#: The tar headers of one member (pax and GNU long-name records included) may
#: take at most this many decompressed bytes; a ustar header is 512.
MAX_HEADER_BYTES = 1 << 16
#: Lists and objects in a manifest may nest at most this deep (a real one: 5).
MAX_JSON_DEPTH = 64
_CHUNK = 1 << 20

_VARIANT_KEYS = {
    "name": str, "kernel": str, "arch": str, "tokens": int, "logits_dtype": str,
    "finalize": bool, "sms": int, "file": str, "sha256": str, "size": int,
    "compressed_sha256": str, "compressed_size": int, "entry": str, "params": list,
    "tensor_maps": list, "launch": dict, "workspace": list,
}  # fmt: skip
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(obj) -> str:
    """The manifest's canonical text (FORMAT.md): sorted keys, indent 1, ASCII."""
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def config_hash(config: dict) -> str:
    """sha256 hex of the canonical JSON of a resolved config (FORMAT.md)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


@dataclass(frozen=True)
class Launch:
    """Launch shape fixed at compile time; ``smem`` in bytes of dynamic shared
    memory, ``cluster`` None for a launch without clusters."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int] | None
    smem: int
    pdl: bool


@dataclass(frozen=True)
class WorkspaceNeed:
    """Scratch the runtime owns per (device, stream): ``bytes`` long, zero-filled
    once at allocation where ``zero``."""

    name: str
    bytes: int
    zero: bool


@dataclass(frozen=True)
class Variant:
    """One verified variant record plus its (uncompressed) cubin."""

    name: str
    kernel: str
    arch: str
    tokens: int
    logits_dtype: str
    finalize: bool
    sms: int
    entry: str
    params: tuple[tuple[str, str], ...]  # (name, kind) in ABI order
    tensor_maps: tuple[str, ...]
    launch: Launch
    workspace: tuple[WorkspaceNeed, ...]
    sha256: str
    cubin: bytes

    def describe(self) -> str:
        return f"variant {self.name}"


@dataclass(frozen=True)
class ArtifactData:
    """A verified manifest and all its variants (every arch), sorted by name."""

    source: str
    manifest: dict
    variants: tuple[Variant, ...]

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def min_driver(self) -> int:
        return self.manifest["min_driver"]

    def for_arch(self, arch: str) -> tuple[Variant, ...]:
        return tuple(v for v in self.variants if v.arch == arch)


def read(path: str | os.PathLike) -> ArtifactData:
    """Verified contents of an artifact directory or ``.tar.zst`` package.

    Raises ArtifactError naming the variant or key, the expectation and what
    was found, for: a missing or malformed manifest, a wrong schema or config
    hash, a missing cubin, a size or sha256 mismatch (compressed or not), a
    size past MAX_UNPACKED_BYTES, a manifest nested past MAX_JSON_DEPTH, or a
    package ``unpack`` refuses (hostile members, limits, write errors).
    """
    path = Path(path)
    if path.is_dir():
        return _read_dir(path, source=str(path))
    if not path.is_file():
        raise ArtifactError(f"artifact {path}: no such directory or file")
    with tempfile.TemporaryDirectory(prefix="moe-artifact-") as tmp:
        unpack(path, tmp)
        return _read_dir(_root_of(Path(tmp), path), source=str(path))


def unpack(archive: str | os.PathLike, dest: str | os.PathLike, max_bytes: int = MAX_UNPACKED_BYTES,
           max_members: int = MAX_MEMBERS) -> None:  # fmt: skip
    """Unpacks a tar + zstandard package into the existing directory ``dest``,
    accepting only regular files and directories whose names stay inside
    ``dest`` (no absolute names, no ``..``, no links, device nodes or sparse
    files), each file name once, no file where a directory goes or the reverse.

    Limits (ArtifactError naming the package and the limit): more than
    ``max_bytes`` decompressed bytes in all (every byte of the tar stream:
    headers, pax and GNU long-name records, padding, data), more than
    ``max_members`` members, more than MAX_HEADER_BYTES of headers for one
    member. An unreadable stream or an OSError while writing (a name too
    long, a full disk) is an ArtifactError too. On any failure, what this
    call created under ``dest`` is removed again; what was there stays.
    """
    dest = Path(dest).resolve()
    created: list[Path] = []  # in creation order: files, and directories made for them
    try:
        with open(archive, "rb") as raw:
            counted = _Counted(zstandard.ZstdDecompressor().stream_reader(raw), archive, max_bytes)
            _unpack_members(counted, archive, dest, max_bytes, max_members, created)
    except BaseException as e:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink()
        if isinstance(e, (tarfile.TarError, zstandard.ZstdError, EOFError)):
            raise ArtifactError(f"package {archive}: not a readable tar.zst ({e})") from e
        if isinstance(e, OSError):
            raise ArtifactError(f"package {archive}: cannot unpack ({e})") from e
        raise


def _unpack_members(counted: _Counted, archive, dest: Path, max_bytes: int, max_members: int,
                    created: list[Path]) -> None:  # fmt: skip
    written = members = 0
    counted.reading_headers(True)
    with tarfile.open(fileobj=counted, mode="r|") as tar:
        while (member := tar.next()) is not None:
            counted.reading_headers(False)
            members += 1
            if members > max_members:
                raise ArtifactError(f"package {archive}: more than {max_members} members")
            target = _member_target(dest, member, archive)
            if member.isdir():
                if target.exists() and not target.is_dir():
                    raise ArtifactError(
                        f"package {archive}: member {member.name!r} is a directory, but a file "
                        "of that name came before"
                    )
                _make_dirs(dest, target, archive, member.name, created)
            else:
                written += member.size
                if written > max_bytes:
                    raise ArtifactError(
                        f"package {archive}: unpacks to more than {max_bytes} bytes "
                        f"(its files, up to {member.name!r})"
                    )
                if target.exists():
                    raise ArtifactError(f"package {archive}: member {member.name!r} repeats")
                _make_dirs(dest, target.parent, archive, member.name, created)
                with open(target, "xb") as out:
                    created.append(target)
                    shutil.copyfileobj(tar.extractfile(member), out, _CHUNK)
            counted.reading_headers(True)


class _Counted:
    """The decompressed tar stream of a package, as tarfile reads it, every
    byte counted: ArtifactError once more than ``max_bytes`` came out in all,
    or more than MAX_HEADER_BYTES since ``reading_headers(True)``."""

    def __init__(self, stream, archive, max_bytes: int):
        self._stream, self._archive, self._max = stream, archive, max_bytes
        self.count = 0
        self._headers_from: int | None = None

    def reading_headers(self, reading: bool) -> None:
        """Whether tarfile reads a member's headers now (until the next call)."""
        self._headers_from = self.count if reading else None

    def read(self, size: int = -1) -> bytes:
        chunk = self._stream.read(_CHUNK if size is None or size < 0 else min(size, _CHUNK))
        self.count += len(chunk)
        if self.count > self._max:
            raise ArtifactError(
                f"package {self._archive}: unpacks to more than {self._max} bytes "
                "(decompressed tar stream, headers included)"
            )
        if self._headers_from is not None and self.count - self._headers_from > MAX_HEADER_BYTES:
            raise ArtifactError(
                f"package {self._archive}: a member's tar headers (pax or GNU long-name "
                f"records) take more than {MAX_HEADER_BYTES} bytes"
            )
        return chunk


def _make_dirs(dest: Path, path: Path, archive, name: str, created: list[Path]) -> None:
    """Creates ``path`` (inside ``dest``) and its missing parents, recording
    each; refuses a file where one of them goes."""
    current = dest
    for part in path.relative_to(dest).parts:
        current = current / part
        if current.is_dir():
            continue
        if current.exists():
            raise ArtifactError(
                f"package {archive}: member {name!r}: {str(current.relative_to(dest))!r} "
                "is a file, not a directory"
            )
        current.mkdir()
        created.append(current)


def _member_target(dest: Path, member: tarfile.TarInfo, archive) -> Path:
    name = member.name
    if not (member.isfile() or member.isdir()) or member.issparse():
        kind = "link" if (member.issym() or member.islnk()) else "special file"
        kind = "sparse file" if member.issparse() else kind
        raise ArtifactError(
            f"package {archive}: member {name!r} is a {kind}; only regular files "
            "and directories are accepted"
        )
    if "\0" in name:
        raise ArtifactError(f"package {archive}: member {name!r} has a NUL in its name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ArtifactError(f"package {archive}: member {name!r} has an absolute path")
    if ".." in pure.parts:
        raise ArtifactError(f"package {archive}: member {name!r} escapes the target directory")
    target = (dest / pure).resolve()
    if target != dest and dest not in target.parents:
        raise ArtifactError(f"package {archive}: member {name!r} escapes the target directory")
    return target


def _root_of(tmp: Path, archive: Path) -> Path:
    """The unpacked directory holding manifest.json: the top, or its single
    sub-directory (packages may or may not carry a top-level folder)."""
    if (tmp / "manifest.json").is_file():
        return tmp
    entries = [p for p in tmp.iterdir()]
    if len(entries) == 1 and (entries[0] / "manifest.json").is_file():
        return entries[0]
    raise ArtifactError(f"package {archive}: no manifest.json at its top or in its one folder")


def _read_dir(root: Path, source: str) -> ArtifactData:
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise ArtifactError(f"artifact {source}: manifest.json missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ArtifactError(f"artifact {source}: manifest.json unreadable ({e})") from e
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: a JSONDecodeError or huge int
        raise ArtifactError(f"artifact {source}: manifest.json is not JSON ({e})") from e
    except RecursionError as e:
        raise ArtifactError(
            f"artifact {source}: manifest.json nests deeper than {MAX_JSON_DEPTH} levels"
        ) from e
    check_manifest(manifest, source)
    variants = tuple(_read_variant(root, record, source) for record in manifest["variants"])
    return ArtifactData(source=source, manifest=manifest, variants=variants)


def check_manifest(manifest, source: str = "artifact") -> None:
    """Structure of a schema-1 manifest (everything but the cubin files),
    nesting at most MAX_JSON_DEPTH deep, its cubins MAX_UNPACKED_BYTES in all."""
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{source}: manifest is not a JSON object")
    if _deeper_than(manifest, MAX_JSON_DEPTH):
        raise ArtifactError(f"{source}: manifest nests deeper than {MAX_JSON_DEPTH} levels")
    if manifest.get("schema") != SCHEMA:
        raise ArtifactError(
            f"{source}: manifest schema: expected {SCHEMA}, found {manifest.get('schema')!r}"
        )
    for key, kind in (("config", dict), ("config_hash", str), ("toolchain", dict),
                      ("min_driver", int), ("variants", list)):  # fmt: skip
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise ArtifactError(
                f"{source}: manifest key {key!r}: expected {kind.__name__}, "
                f"found {type(manifest.get(key)).__name__}"
            )
    found = config_hash(manifest["config"])
    if found != manifest["config_hash"]:
        raise ArtifactError(
            f"{source}: config_hash: expected {manifest['config_hash']} "
            f"(recorded), found {found} (sha256 of the canonical config)"
        )
    names = [r.get("name") if isinstance(r, dict) else None for r in manifest["variants"]]
    for record in manifest["variants"]:
        check_variant_record(record, source)
    if names != sorted(names) or len(set(names)) != len(names):
        raise ArtifactError(f"{source}: variants must be unique and sorted by name")
    total = sum(r["size"] for r in manifest["variants"])
    if total > MAX_UNPACKED_BYTES:
        raise ArtifactError(
            f"{source}: variants: cubins of {total} bytes in all, more than {MAX_UNPACKED_BYTES}"
        )


def check_variant_record(record, source: str = "artifact") -> None:
    """One variant record's keys, types and internal consistency; ``size`` and
    ``compressed_size`` at most MAX_UNPACKED_BYTES."""
    if not isinstance(record, dict):
        raise ArtifactError(f"{source}: a variant record is not a JSON object")
    label = f"{source}: variant {record.get('name', '?')}"
    for key, kind in _VARIANT_KEYS.items():
        value = record.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ArtifactError(f"{label}: key {key!r}: expected {kind.__name__}, found {value!r}")
    for key in ("size", "compressed_size"):
        if not 0 <= record[key] <= MAX_UNPACKED_BYTES:
            raise ArtifactError(
                f"{label}: {key}: expected 0 to {MAX_UNPACKED_BYTES} bytes, found {record[key]}"
            )
    _expect(label, "kernel", record["kernel"], KERNELS)
    _expect(label, "arch", record["arch"], ARCHS)
    _expect(label, "logits_dtype", record["logits_dtype"], LOGITS_DTYPES)
    if record["kernel"] == "mega" and record["finalize"]:
        raise ArtifactError(f"{label}: finalize: expected false for mega, found true")
    expected = (f"{record['kernel']}-{record['arch']}-m{record['tokens']}-"
                f"{record['logits_dtype']}" + ("-final" if record["finalize"] else ""))  # fmt: skip
    if record["name"] != expected:
        raise ArtifactError(f"{label}: name: expected {expected!r} from its fields")
    if record["file"] != f"cubins/{record['name']}.cubin.zst":
        raise ArtifactError(
            f"{label}: file: expected 'cubins/{record['name']}.cubin.zst', found {record['file']!r}"
        )
    for key in ("sha256", "compressed_sha256"):
        if not _HEX64.match(record[key]):
            raise ArtifactError(f"{label}: {key}: expected 64 lowercase hex digits")
    if record["tokens"] < 1 or record["sms"] < 1 or not record["entry"]:
        raise ArtifactError(f"{label}: tokens, sms must be positive and entry non-empty")
    for param in record["params"]:
        if not (isinstance(param, dict) and isinstance(param.get("name"), str)
                and param.get("kind") in PARAM_KINDS):  # fmt: skip
            raise ArtifactError(
                f"{label}: params: expected {{'name': str, 'kind': 'pointer'|'i32'}}, found {param!r}"
            )
        size = param.get("size")
        if size is not None and size != PARAM_BYTES[param["kind"]]:
            raise ArtifactError(
                f"{label}: param {param['name']!r} ({param['kind']}): expected "
                f"{PARAM_BYTES[param['kind']]} bytes, the cubin records {size!r}"
            )
    params = [p["name"] for p in record["params"]]
    if len(set(params)) != len(params):
        raise ArtifactError(f"{label}: params: a name repeats in {params}")
    for name in record["tensor_maps"]:
        _expect(label, "tensor_maps entry", name, TENSOR_MAPS)
    _check_launch(label, record["launch"])
    for need in record["workspace"]:
        if not (isinstance(need, dict) and isinstance(need.get("name"), str)
                and _positive_int(need.get("bytes")) and isinstance(need.get("zero"), bool)):  # fmt: skip
            raise ArtifactError(
                f"{label}: workspace: expected {{'name', 'bytes' > 0, 'zero': bool}}, found {need!r}"
            )


def _check_launch(label: str, launch: dict) -> None:
    def dims(key, value):
        if not (
            isinstance(value, list) and len(value) == 3 and all(_positive_int(v) for v in value)
        ):
            raise ArtifactError(f"{label}: launch.{key}: expected 3 positive ints, found {value!r}")

    dims("grid", launch.get("grid"))
    dims("block", launch.get("block"))
    if launch.get("cluster") is not None:
        dims("cluster", launch.get("cluster"))
    smem = launch.get("smem")
    if not isinstance(smem, int) or isinstance(smem, bool) or smem < 0:
        raise ArtifactError(f"{label}: launch.smem: expected bytes >= 0, found {smem!r}")
    if not isinstance(launch.get("pdl"), bool):
        raise ArtifactError(f"{label}: launch.pdl: expected a bool, found {launch.get('pdl')!r}")


def _read_variant(root: Path, record: dict, source: str) -> Variant:
    label = f"{source}: variant {record['name']}"
    path = root / record["file"]
    if not path.is_file():
        raise ArtifactError(f"{label}: cubin file {record['file']} missing")
    try:
        found = path.stat().st_size
        if found != record["compressed_size"]:  # before reading a file of any size
            raise ArtifactError(
                f"{label}: compressed cubin size: expected {record['compressed_size']} bytes, "
                f"found {found}"
            )
        packed = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{label}: cubin file {record['file']} unreadable ({e})") from e
    _check_bytes(
        label, "compressed", packed, record["compressed_size"], record["compressed_sha256"]
    )
    try:
        cubin = _decompress(packed, record["size"] + 1)
    except zstandard.ZstdError as e:
        raise ArtifactError(f"{label}: {record['file']} does not decompress ({e})") from e
    _check_bytes(label, "uncompressed", cubin, record["size"], record["sha256"])
    launch = record["launch"]
    return Variant(
        name=record["name"], kernel=record["kernel"], arch=record["arch"],
        tokens=record["tokens"], logits_dtype=record["logits_dtype"],
        finalize=record["finalize"], sms=record["sms"], entry=record["entry"],
        params=tuple((p["name"], p["kind"]) for p in record["params"]),
        tensor_maps=tuple(record["tensor_maps"]),
        launch=Launch(
            grid=tuple(launch["grid"]), block=tuple(launch["block"]),
            cluster=tuple(launch["cluster"]) if launch["cluster"] is not None else None,
            smem=launch["smem"], pdl=launch["pdl"],
        ),
        workspace=tuple(WorkspaceNeed(w["name"], w["bytes"], w["zero"]) for w in record["workspace"]),
        sha256=record["sha256"], cubin=cubin,
    )  # fmt: skip


def _decompress(packed: bytes, limit: int) -> bytes:
    """At most ``limit`` bytes of a zstandard stream (one more than expected
    is enough to detect a cubin that is too long, without inflating a bomb)."""
    reader = zstandard.ZstdDecompressor().stream_reader(packed)
    chunks, have = [], 0
    while have < limit:
        chunk = reader.read(limit - have)
        if not chunk:
            break
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _check_bytes(label: str, what: str, data: bytes, size: int, sha: str) -> None:
    if len(data) != size:
        raise ArtifactError(
            f"{label}: {what} cubin size: expected {size} bytes, found {len(data)}"
            + (" or more" if what == "uncompressed" and len(data) > size else "")
        )
    found = hashlib.sha256(data).hexdigest()
    if found != sha:
        raise ArtifactError(f"{label}: {what} cubin sha256: expected {sha}, found {found}")


def _expect(label: str, key: str, value, allowed) -> None:
    if value not in allowed:
        raise ArtifactError(f"{label}: {key}: expected one of {list(allowed)}, found {value!r}")


def _deeper_than(value, depth: int) -> bool:
    """Whether lists and objects nest more than ``depth`` deep in a JSON value
    (without recursion; a scalar nests 0 deep)."""
    level = [value]
    for _ in range(depth):
        level = [c for v in level if isinstance(v, (dict, list))
                 for c in (v.values() if isinstance(v, dict) else v)]  # fmt: skip
        if not level:
            return False
    return any(isinstance(v, (dict, list)) for v in level)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


__all__ = ["ArtifactData", "Launch", "Variant", "WorkspaceNeed", "canonical_json",
           "check_manifest", "read", "unpack"]  # fmt: skip
