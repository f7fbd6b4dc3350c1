"""runtime.artifact: manifest checks, cubin hashes, packages and safe unpacking."""

from __future__ import annotations

import json
import tarfile

import pytest
import runtime_fixtures as fx

from runtime.artifact import read, unpack
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


@pytest.mark.parametrize("prefix", ["", "glm5/"])
def test_package_reads_like_its_directory(good, tmp_path, prefix):
    archive = fx.package(good, tmp_path / "a.tar.zst", prefix=prefix)
    packed, plain = read(archive), read(good)
    assert packed.manifest == plain.manifest
    assert [(v.name, v.cubin) for v in packed.variants] == [
        (v.name, v.cubin) for v in plain.variants
    ]


def _member(name, kind=tarfile.REGTYPE, data=b"x", link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


@pytest.mark.parametrize(
    "member, pattern",
    [
        (_member("../evil"), "escapes the target directory"),
        (_member("cubins/../../evil"), "escapes the target directory"),
        (_member("/tmp/evil"), "absolute path"),
        (_member("link", tarfile.SYMTYPE, link="/etc/passwd"), "is a link"),
        (_member("hard", tarfile.LNKTYPE, link="manifest.json"), "is a link"),
        (_member("fifo", tarfile.FIFOTYPE), "special file"),
    ],
)
def test_unpack_refuses_hostile_members(good, tmp_path, member, pattern):
    archive = fx.package(good, tmp_path / "bad.tar.zst", extra=[member])
    dest = tmp_path / "out" / "inner"
    dest.mkdir(parents=True)
    with pytest.raises(ArtifactError, match=pattern):
        unpack(archive, dest)
    assert not (tmp_path / "out" / "evil").exists() and not (tmp_path / "evil").exists()
    with pytest.raises(ArtifactError, match=pattern):
        read(archive)


def test_unpack_refuses_bombs(good, tmp_path):
    archive = fx.package(good, tmp_path / "a.tar.zst")
    with pytest.raises(ArtifactError, match="unpacks to more than 100 bytes"):
        unpack(archive, tmp_path, max_bytes=100)


def test_refuses_non_package(tmp_path):
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(b"not zstd at all")
    with pytest.raises(ArtifactError, match="not a readable tar.zst"):
        read(junk)
