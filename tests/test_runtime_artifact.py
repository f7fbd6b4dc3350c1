"""runtime.artifact: manifest checks, cubin hashes, packages and safe unpacking.

Mistakes these tests catch, besides wrong hashes and records: an unpack that
lets a file name repeat, or puts a file where a directory was (or the
reverse); a decompression cap that counts per member, or only file data
(pax and GNU long-name headers, padding and empty members left uncounted);
no cap on the member count; sizes in a manifest that exhaust memory; an
OSError, a RecursionError or a huge number escaping as something other than
ArtifactError; a failed unpack that leaves files behind; a CLI command that
prints a traceback for an unreadable artifact instead of exiting 2.
"""

from __future__ import annotations

import errno
import io
import json
import tarfile
import tempfile
from pathlib import Path

import pytest
import runtime_fixtures as fx
import zstandard
from pipeline_support import run

from runtime import artifact
from runtime.artifact import MAX_HEADER_BYTES, MAX_MEMBERS, MAX_UNPACKED_BYTES, read, unpack
from runtime.errors import ArtifactError


def _variants():
    return [
        (fx.record("mega", tokens=1), fx.cubin("mega1")),
        (fx.record("grouped", tokens=8, finalize=True), fx.cubin("g8f")),
        (fx.record("mega", arch="sm_100a", tokens=2, dtype="bfloat16"), fx.cubin("m100")),
    ]


@pytest.fixture
def good(tmp_path):
    return fx.write(tmp_path / "a", _variants())


def test_reads_every_variant_with_its_cubin(good):
    data = read(good)
    names = [v.name for v in data.variants]
    assert names == sorted(names) and len(names) == 3
    by = {v.name: v for v in data.variants}
    assert by["mega-sm_90a-m1-float32"].cubin == fx.cubin("mega1")
    assert by["grouped-sm_90a-m8-float32-final"].finalize is True
    g = by["grouped-sm_90a-m8-float32-final"]
    assert g.launch.cluster is None and g.launch.grid == (132, 1, 1)
    assert [w.name for w in g.workspace if w.zero] == ["counters"]
    assert [v.name for v in data.for_arch("sm_100a")] == ["mega-sm_100a-m2-bfloat16"]


def _edit(path, fn):
    manifest = json.loads((path / "manifest.json").read_text())
    fn(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_refuses_other_schema(good):
    _edit(good, lambda m: m.update(schema=2))
    with pytest.raises(ArtifactError, match=r"schema: expected 1, found 2"):
        read(good)


def test_refuses_changed_config(good):
    _edit(good, lambda m: m["config"]["model"].update(top_k=6))
    with pytest.raises(ArtifactError, match="config_hash"):
        read(good)


def test_refuses_corrupted_compressed_cubin(good):
    path = good / "cubins/grouped-sm_90a-m8-float32-final.cubin.zst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as e:
        read(good)
    msg = str(e.value)
    assert "grouped-sm_90a-m8-float32-final" in msg and "compressed cubin sha256" in msg
    assert "expected" in msg and "found" in msg


def test_refuses_uncompressed_mismatch(good):
    # The .zst file is intact but its content is not the cubin the record names.
    def edit(m):
        m["variants"][0]["sha256"] = "ab" * 32

    _edit(good, edit)
    with pytest.raises(ArtifactError, match=r"uncompressed cubin sha256: expected abab"):
        read(good)


def test_refuses_longer_cubin(good):
    def edit(m):
        m["variants"][0]["size"] -= 1

    _edit(good, edit)
    with pytest.raises(ArtifactError, match=r"uncompressed cubin size: expected \d+ bytes"):
        read(good)


def test_refuses_missing_cubin(good):
    (good / "cubins/mega-sm_90a-m1-float32.cubin.zst").unlink()
    with pytest.raises(ArtifactError, match=r"mega-sm_90a-m1-float32: cubin file .* missing"):
        read(good)


def test_refuses_missing_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json missing"):
        read(tmp_path)


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda r: r.update(kernel="dense"), r"kernel: expected one of"),
        (lambda r: r.update(name="mega-sm_90a-m2-float32"), r"name: expected"),
        (lambda r: r.update(file="../x.cubin.zst"), r"file: expected"),
        (lambda r: r["launch"].update(grid=[0, 1, 1]), r"launch.grid"),
        (lambda r: r["launch"].update(pdl="yes"), r"launch.pdl"),
        (lambda r: r["params"].append({"name": "x", "kind": "pointer"}), r"a name repeats"),
        (lambda r: r["params"].append({"name": "n", "kind": "f32"}), r"params: expected"),
        (lambda r: r.update(tensor_maps=["w3"]), r"tensor_maps entry"),
        (lambda r: r["params"][0].update(size=16), r"param 'maps' \(pointer\): expected 8 bytes"),
        (lambda r: r.update(tokens=True), r"key 'tokens': expected int"),
        (lambda r: r.pop("entry"), r"key 'entry'"),
        (
            lambda r: r.update(size=2**62),
            r"size: expected 0 to 1073741824 bytes, found 4611686\d+",
        ),
        (lambda r: r.update(size=2**64), r"size: expected 0 to 1073741824 bytes"),
        (lambda r: r.update(size=-1), r"size: expected 0 to 1073741824 bytes, found -1"),
        (lambda r: r.update(compressed_size=2**62), r"compressed_size: expected 0 to"),
        (lambda r: r.update(compressed_size=2**64), r"compressed_size: expected 0 to"),
    ],
)
def test_refuses_malformed_records(good, change, pattern):
    _edit(good, lambda m: change(m["variants"][0]))
    with pytest.raises(ArtifactError, match=pattern):
        read(good)


def test_refuses_unsorted_variants(good):
    _edit(good, lambda m: m["variants"].reverse())
    with pytest.raises(ArtifactError, match="sorted by name"):
        read(good)


@pytest.mark.parametrize(
    "record",
    [
        fx.record("mega", tokens=0),
        fx.record("grouped", tokens=0, finalize=True),
        fx.record("mega", tokens=-1),
        fx.record("mega", sms=0),
        fx.record("grouped", tokens=8, sms=0),
        fx.record("mega", entry=""),
    ],
    ids=["mega-tokens-0", "grouped-tokens-0", "tokens--1", "mega-sms-0", "grouped-sms-0",
         "no-entry"],
)  # fmt: skip
def test_refuses_non_positive_tokens_and_sms(tmp_path, record):
    # A complete, consistent artifact (name, file and hashes agree), so only this check trips.
    path = fx.write(tmp_path / "a", [(record, fx.cubin("x"))])
    with pytest.raises(ArtifactError, match="tokens, sms must be positive and entry non-empty"):
        read(path)


def test_refuses_cubins_past_the_limit_in_all(good):
    def edit(m):
        for r in m["variants"]:
            r["size"] = MAX_UNPACKED_BYTES // 2  # each within the limit, together not

    _edit(good, edit)
    with pytest.raises(ArtifactError, match=r"cubins of 1610612736 bytes in all, more than"):
        read(good)


def test_refuses_a_cubin_file_of_another_size_before_reading_it(good, monkeypatch):
    path = good / "cubins/mega-sm_90a-m1-float32.cubin.zst"
    path.write_bytes(path.read_bytes() + b"tail")
    read_bytes = Path.read_bytes

    def guarded(self):
        assert self != path, "a cubin file of the wrong size was read"
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", guarded)
    with pytest.raises(ArtifactError, match=r"compressed cubin size: expected \d+ bytes, found"):
        read(good)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("[" * 100_000 + "]" * 100_000, "manifest.json nests deeper than 64 levels"),
        ("1" * 5000, "manifest.json is not JSON"),
        (b"\xff\xfe{}", "manifest.json is not JSON"),
    ],
    ids=["nested-100000", "5000-digit-int", "not-utf8"],
)
def test_refuses_unparsable_manifest(good, text, pattern):
    write = (good / "manifest.json").write_bytes if isinstance(text, bytes) else None
    (write or (good / "manifest.json").write_text)(text)
    with pytest.raises(ArtifactError, match=pattern):
        read(good)


@pytest.mark.parametrize("where", ["config", "notes"])
def test_refuses_a_manifest_nested_past_the_limit(good, where):
    deep = {}
    for _ in range(100):  # json parses it; recursive code over it could still fail
        deep = {"x": [deep]}

    def edit(m):
        if where == "config":
            m["config"]["deep"] = deep
            m["config_hash"] = artifact.config_hash(m["config"])
        else:
            m["variants"][0]["notes"] = deep

    _edit(good, edit)
    with pytest.raises(ArtifactError, match="manifest nests deeper than 64 levels"):
        read(good)


@pytest.mark.parametrize("prefix", ["", "glm5/"])
def test_package_reads_like_its_directory(good, tmp_path, prefix):
    archive = fx.package(good, tmp_path / "a.tar.zst", prefix=prefix)
    packed, plain = read(archive), read(good)
    assert packed.manifest == plain.manifest
    assert [(v.name, v.cubin) for v in packed.variants] == [
        (v.name, v.cubin) for v in plain.variants
    ]


def _member(name, kind=tarfile.REGTYPE, data=b"x", link="", pax=None):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.pax_headers = dict(pax or {})
    return info, (data if kind == tarfile.REGTYPE else None)


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize(
    "member, pattern",
    [
        (_member("../evil"), "escapes the target directory"),
        (_member("cubins/../../evil"), "escapes the target directory"),
        (_member("/tmp/evil"), "absolute path"),
        (_member("link", tarfile.SYMTYPE, link="/etc/passwd"), "is a link"),
        (_member("hard", tarfile.LNKTYPE, link="manifest.json"), "is a link"),
        (_member("fifo", tarfile.FIFOTYPE), "special file"),
        (_member("sparse", tarfile.GNUTYPE_SPARSE), "is a sparse file"),
        (_member("evil", pax={"path": "ev\0il"}), "has a NUL in its name"),
    ],
)
def test_unpack_refuses_hostile_members(good, tmp_path, member, pattern):
    archive = fx.package(good, tmp_path / "bad.tar.zst", extra=[member])
    dest = tmp_path / "out" / "inner"
    dest.mkdir(parents=True)
    with pytest.raises(ArtifactError, match=pattern):
        unpack(archive, dest)
    assert not (tmp_path / "out" / "evil").exists() and not (tmp_path / "evil").exists()
    assert _files(dest) == []
    with pytest.raises(ArtifactError, match=pattern):
        read(archive)


@pytest.mark.parametrize(
    "members, pattern",
    [
        # A second copy of a file must not replace the first (verified) one.
        ([_member("manifest.json", data=b"{}")], r"member 'manifest.json' repeats"),
        ([_member("extra"), _member("extra", data=b"y")], r"member 'extra' repeats"),
        ([_member("extra", tarfile.DIRTYPE), _member("extra")], r"member 'extra' repeats"),
        ([_member("extra"), _member("extra", tarfile.DIRTYPE)],
         r"member 'extra' is a directory, but a file of that name came before"),
        ([_member("manifest.json/x")], r"'manifest.json' is a file, not a directory"),
        ([_member("extra"), _member("extra/deeper/x")], r"'extra' is a file, not a directory"),
        ([_member("extra"), _member("extra/sub", tarfile.DIRTYPE)],
         r"'extra' is a file, not a directory"),
    ],
    ids=["file-file-manifest", "file-file", "dir-file", "file-dir", "under-manifest",
         "under-file", "dir-under-file"],
)  # fmt: skip
def test_unpack_refuses_clashing_members(good, tmp_path, members, pattern):
    archive = fx.package(good, tmp_path / "bad.tar.zst", extra=members)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=pattern):
        unpack(archive, dest)
    assert _files(dest) == []


def test_unpack_refuses_a_name_too_long_for_the_file_system(good, tmp_path):
    archive = fx.package(good, tmp_path / "bad.tar.zst", extra=[_member("a" * 300)])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=r"bad.tar.zst: cannot unpack \(.*name too long"):
        unpack(archive, dest)
    assert _files(dest) == []


def test_unpack_turns_a_full_disk_into_artifact_error(good, tmp_path, monkeypatch):
    archive = fx.package(good, tmp_path / "a.tar.zst")
    written = []

    def full(source, out, length=0):
        written.append(out.name)
        if len(written) == 2:  # the second file: the first one is complete by then
            raise OSError(errno.ENOSPC, "No space left on device")
        out.write(source.read())

    monkeypatch.setattr(artifact.shutil, "copyfileobj", full)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=r"a.tar.zst: cannot unpack .*No space left on device"):
        unpack(archive, dest)
    assert len(written) == 2 and _files(dest) == []


def test_failed_unpack_keeps_what_was_there_and_removes_the_rest(good, tmp_path):
    archive = fx.package(good, tmp_path / "bad.tar.zst", extra=[_member("manifest.json")])
    dest = tmp_path / "out"
    (dest / "cubins").mkdir(parents=True)
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="repeats"):
        unpack(archive, dest)
    assert _files(dest) == ["cubins", "keep.txt"]
    assert (dest / "keep.txt").read_text() == "mine"


def _tar_of(archive) -> bytes:
    """The decompressed tar stream of a package."""
    with open(archive, "rb") as raw:
        return zstandard.ZstdDecompressor().stream_reader(raw).read()


def test_unpack_refuses_bombs(good, tmp_path):
    archive = fx.package(good, tmp_path / "a.tar.zst")
    limit = len(_tar_of(archive))  # every byte of the good package fits
    (tmp_path / "ok").mkdir()
    unpack(archive, tmp_path / "ok", max_bytes=limit)
    assert "manifest.json" in _files(tmp_path / "ok")
    bomb = fx.package(good, tmp_path / "bomb.tar.zst", extra=[_member("z", data=bytes(1 << 22))])
    assert bomb.stat().st_size < 4096  # 4 MiB of zeros
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=rf"bomb.tar.zst: unpacks to more than {limit} bytes"):
        unpack(bomb, dest, max_bytes=limit)
    assert _files(dest) == []


def test_unpack_refuses_files_past_the_limit_before_reading_them(good, tmp_path):
    # Two members, each within the limit, together past it: refused on the
    # second one's declared size, before its data is decompressed.
    archive = fx.package(good, tmp_path / "a.tar.zst")
    limit = len(_tar_of(archive)) + (3 << 19)
    extra = [_member("y", data=bytes(1 << 20)), _member("z", data=bytes(1 << 20))]
    bomb = fx.package(good, tmp_path / "bomb.tar.zst", extra=extra)
    with pytest.raises(ArtifactError, match=rf"more than {limit} bytes \(its files, up to 'z'\)"):
        unpack(bomb, tmp_path, max_bytes=limit)


def test_unpack_counts_the_whole_stream_not_each_member(good, tmp_path):
    # 64 one-byte files add 64 bytes of data but 64 KiB of tar headers and
    # padding: no member comes near the limit, the package passes it.
    archive = fx.package(good, tmp_path / "a.tar.zst")
    limit = len(_tar_of(archive)) + (16 << 10)
    extra = [_member(f"f{i:02d}") for i in range(64)]
    bomb = fx.package(good, tmp_path / "bomb.tar.zst", extra=extra)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=rf"unpacks to more than {limit} bytes \(decompressed"):
        unpack(bomb, dest, max_bytes=limit)
    assert _files(dest) == []


def test_unpack_counts_pax_headers(good, tmp_path):
    # A pax record under the per-member header limit still counts in the total.
    archive = fx.package(good, tmp_path / "a.tar.zst")
    limit = len(_tar_of(archive)) + (16 << 10)
    extra = [_member("x", pax={"comment": "c" * (MAX_HEADER_BYTES - 1024)})]
    bomb = fx.package(good, tmp_path / "bomb.tar.zst", extra=extra)
    with pytest.raises(ArtifactError, match=rf"unpacks to more than {limit} bytes \(decompressed"):
        unpack(bomb, tmp_path, max_bytes=limit)


def _pax_bomb(path, size: int):
    """A package whose first member has a pax header of ``size`` bytes (one
    comment record), written as a stream: a few KB on disk."""
    head = tarfile.TarInfo("././@PaxHeader")
    head.type, head.size = tarfile.XHDTYPE, size
    record = b"%d comment=" % size  # the record's length counts its own digits
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    parts = [compressor.compress(head.tobuf(format=tarfile.USTAR_FORMAT) + record)]
    chunk, left = b"c" * (1 << 20), size - len(record) - 1
    while left > 0:
        parts.append(compressor.compress(chunk[: min(left, len(chunk))]))
        left -= len(chunk)
    tail = _member("manifest.json", data=b"{}")[0].tobuf(format=tarfile.USTAR_FORMAT)
    parts += [compressor.compress(b"\n" + b"\0" * (-size % 512) + tail + b"{}".ljust(512, b"\0")
                                  + bytes(1024)), compressor.flush()]  # fmt: skip
    path.write_bytes(b"".join(parts))
    return path


def test_unpack_refuses_a_pax_header_bomb(tmp_path):
    bomb = _pax_bomb(tmp_path / "bomb.tar.zst", 1 << 30)  # 1 GiB of pax header
    assert bomb.stat().st_size < 64 << 10
    dest = tmp_path / "out"
    dest.mkdir()
    pattern = rf"bomb.tar.zst: a member's tar headers .* more than {MAX_HEADER_BYTES} bytes"
    with pytest.raises(ArtifactError, match=pattern):
        unpack(bomb, dest)
    assert _files(dest) == []
    with pytest.raises(ArtifactError, match=pattern):
        read(bomb)


def test_pax_bomb_builder_makes_a_readable_tar(tmp_path):
    # The bomb above is refused for its header, not for being malformed.
    bomb = _pax_bomb(tmp_path / "small.tar.zst", 4096)
    with tarfile.open(fileobj=io.BytesIO(_tar_of(bomb))) as tar:
        (member,) = tar.getmembers()
    assert member.name == "manifest.json" and len(member.pax_headers["comment"]) > 4000


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
@pytest.mark.parametrize("field", ["name", "linkname"])
def test_unpack_refuses_huge_long_name_headers(tmp_path, fmt, field):
    info = tarfile.TarInfo("x" * (1 << 20) if field == "name" else "link")
    info.type = tarfile.REGTYPE if field == "name" else tarfile.SYMTYPE
    info.linkname = "" if field == "name" else "y" * (1 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        tar.addfile(info, io.BytesIO(b""))
    bomb = tmp_path / "bomb.tar.zst"
    bomb.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    with pytest.raises(ArtifactError, match=rf"more than {MAX_HEADER_BYTES} bytes"):
        unpack(bomb, tmp_path)


def _empty_files(n: int) -> bytes:
    """A tar of ``n`` empty regular files f0000000, f0000001, ...: one ustar
    header patched per member (name and checksum)."""
    info = tarfile.TarInfo("f0000000")
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    base = 256 + sum(header[:148]) + sum(header[156:]) - sum(b"f0000000")
    out = bytearray()
    for i in range(n):
        name = b"f%07d" % i
        header[0:8] = name
        header[148:155] = b"%06o\0" % (base + sum(name))
        out += header
    return bytes(out + bytes(1024))


def test_unpack_refuses_too_many_members(tmp_path):
    bomb = tmp_path / "bomb.tar.zst"
    bomb.write_bytes(zstandard.ZstdCompressor().compress(_empty_files(100_000)))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=rf"bomb.tar.zst: more than {MAX_MEMBERS} members"):
        unpack(bomb, dest)
    assert _files(dest) == []


def test_unpack_takes_members_up_to_the_limit(tmp_path):
    archive = tmp_path / "many.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor().compress(_empty_files(50)))
    for dest in ("fits", "refused"):
        (tmp_path / dest).mkdir()
    unpack(archive, tmp_path / "fits", max_members=50)
    assert _files(tmp_path / "fits") == [f"f{i:07d}" for i in range(50)]
    with pytest.raises(ArtifactError, match="more than 49 members"):
        unpack(archive, tmp_path / "refused", max_members=49)
    assert _files(tmp_path / "refused") == []


def test_failed_read_leaves_no_temporary_files(good, tmp_path, monkeypatch):
    bomb = fx.package(good, tmp_path / "bomb.tar.zst", extra=[_member("a" * 300)])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(ArtifactError, match="cannot unpack"):
        read(bomb)
    assert _files(scratch) == []


def test_refuses_non_package(tmp_path):
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(b"not zstd at all")
    with pytest.raises(ArtifactError, match="not a readable tar.zst"):
        read(junk)


def _hostile(good, tmp_path, kind: str):
    """A package (or directory) each reader must refuse with ArtifactError."""
    out = tmp_path / f"{kind}.tar.zst"
    if kind == "pax-bomb":
        return _pax_bomb(out, 1 << 30)
    if kind == "many-members":  # one directory, repeated: nothing to create after the first
        header = _member("d", tarfile.DIRTYPE)[0].tobuf(format=tarfile.USTAR_FORMAT)
        out.write_bytes(zstandard.ZstdCompressor().compress(header * 100_000 + bytes(1024)))
        return out
    if kind == "file-then-dir":
        return fx.package(good, out, extra=[_member("x"), _member("x", tarfile.DIRTYPE)])
    if kind == "long-name":
        return fx.package(good, out, extra=[_member("a" * 300)])
    if kind == "nested-manifest":
        (good / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
        return good
    assert kind == "size-2**62"
    _edit(good, lambda m: m["variants"][0].update(size=2**62))
    return good


KINDS = ["pax-bomb", "many-members", "file-then-dir", "long-name", "nested-manifest",
         "size-2**62"]  # fmt: skip


@pytest.mark.parametrize("command", ["verify", "inspect", "diff"])
@pytest.mark.parametrize("kind", KINDS)
def test_commands_exit_2_with_one_line_for_unreadable_artifacts(tmp_path, command, kind):
    good = fx.write(tmp_path / "good", _variants())
    bad = _hostile(fx.write(tmp_path / "bad", _variants()), tmp_path, kind)
    args = ("diff", good, bad) if command == "diff" else (command, bad)
    code, stdout, stderr = run(*args)  # an exception would escape here
    assert code == 2, stdout + stderr
    assert len(stderr.splitlines()) == 1 and stderr.startswith("error: "), stderr
    assert str(bad) in stderr


def test_diff_exits_2_for_a_verify_record_nested_too_deeply(tmp_path):
    good = fx.write(tmp_path / "good", _variants())
    bad = fx.write(tmp_path / "bad", _variants())
    (bad / "verify-nvidia-h200.json").write_text("[" * 100_000 + "]" * 100_000)
    code, stdout, stderr = run("diff", good, bad)
    assert code == 2, stdout + stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert f"{bad / 'verify-nvidia-h200.json'}" in lines[0] and "recursion" in lines[0], stderr
