"""merge, package, inspect, verify and diff on artifacts built from the stub
kernels."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import zstandard
from pipeline_support import (
    artifact_files,
    build,
    compiled,
    copy_artifact,
    copy_config,
    leftovers,
    manifest,
    run,
)

from runtime import artifact
from runtime.artifact import canonical_json


@pytest.fixture
def full(tmp_path, stub_env):
    """A single-machine build of every variant."""
    return build(tmp_path / "full")


def edit_manifest(path, change) -> None:
    m = manifest(path)
    change(m)
    (path / "manifest.json").write_text(canonical_json(m))


# merge ---------------------------------------------------------------------


def test_merged_shards_equal_the_single_machine_build(tmp_path, full):
    shards = [build(tmp_path / f"s{i}", "--shard", f"{i}/3") for i in (1, 2, 3)]
    sizes = [len(manifest(s)["variants"]) for s in shards]
    assert sorted(sizes) == [45, 45, 46] and sum(sizes) == 136
    assert manifest(shards[0])["shard"]["selection"] == [
        r["name"] for r in manifest(full)["variants"]
    ]
    code, _, stderr = run("merge", shards[2], shards[0], shards[1], "-o", tmp_path / "merged")
    assert code == 0, stderr
    assert artifact_files(tmp_path / "merged") == artifact_files(full)


def test_merge_of_per_arch_builds(tmp_path, stub_env):
    both = build(tmp_path / "both", "--kernel", "mega")
    a = build(tmp_path / "a", "--kernel", "mega", "--arch", "sm_90a")
    b = build(tmp_path / "b", "--kernel", "mega", "--arch", "sm_100a")
    assert run("merge", a, b, "-o", tmp_path / "m")[0] == 0
    assert artifact_files(tmp_path / "m") == artifact_files(both)


def test_merge_refuses_incomplete_or_mixed_inputs(tmp_path, stub_env):
    s1 = build(tmp_path / "s1", "--shard", "1/3", "--kernel", "mega")
    s2 = build(tmp_path / "s2", "--shard", "2/3", "--kernel", "mega")
    other = build(tmp_path / "o", "--shard", "3/3", config=copy_config(tmp_path, top_k=6))
    whole = build(tmp_path / "w", "--kernel", "mega", "--arch", "sm_90a")
    cases = [
        ([s1, s2], "shards 3/3 missing"),
        ([s1, s1, s2], "repeats"),
        ([s1, s2, other], "config_hash"),
        ([s1, whole], "some inputs are shards"),
        ([whole, whole], "in both"),
        ([s1, tmp_path / "nothing"], "no such directory"),
    ]
    for inputs, message in cases:
        code, _, stderr = run("merge", *inputs, "-o", tmp_path / "out")
        assert code == 2, stderr
        assert message in stderr, (inputs, stderr)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# package -------------------------------------------------------------------


def test_package_is_deterministic_and_readable(tmp_path, full, monkeypatch):
    assert run("package", full, "-o", tmp_path / "a.tar.zst")[0] == 0
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "cache2"))
    again = build(tmp_path / "again")  # a clean second build
    assert run("package", again, "-o", tmp_path / "b.tar.zst")[0] == 0
    a, b = (tmp_path / "a.tar.zst").read_bytes(), (tmp_path / "b.tar.zst").read_bytes()
    assert a == b
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(a)).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[0] == "cubins"
    assert "build-record.json" not in names and "manifest.json" in names
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    data = artifact.read(tmp_path / "a.tar.zst")
    assert len(data.variants) == 136
    # A package packs and inspects like its directory.
    assert run("package", tmp_path / "a.tar.zst", "-o", tmp_path / "c.tar.zst")[0] == 0
    assert (tmp_path / "c.tar.zst").read_bytes() == a


def _evil_package(path, name: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))


@pytest.mark.parametrize("name", ["../escape.json", "/abs/manifest.json", "a/../../x"])
def test_packages_that_escape_are_refused(tmp_path, stub_env, name):
    evil = tmp_path / "evil.tar.zst"
    _evil_package(evil, name)
    for command in ("verify", "inspect"):
        code, _, stderr = run(command, evil)
        assert code == 2
        assert "escapes the target" in stderr or "absolute path" in stderr
    assert not (tmp_path.parent / "escape.json").exists()


def test_package_refuses_a_corrupted_artifact(tmp_path, full):
    victim = sorted((full / "cubins").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    code, _, stderr = run("package", full, "-o", tmp_path / "p.tar.zst")
    assert code == 2 and "sha256" in stderr and victim.name.split(".")[0] in stderr
    assert not (tmp_path / "p.tar.zst").exists()


# inspect -------------------------------------------------------------------


def test_inspect_lists_every_variant(tmp_path, full):
    code, stdout, _ = run("inspect", full)
    assert code == 0
    assert "min driver  12090" in stdout
    for record in manifest(full)["variants"]:
        assert record["name"] in stdout
    code, stdout, _ = run("inspect", full, "--json")
    assert code == 0 and json.loads(stdout) == manifest(full)
    code, _, stderr = run("inspect", full, "--sass", "mega-sm_90a-m9-float32")
    assert code == 2 and "no variant 'mega-sm_90a-m9-float32'" in stderr


# verify --------------------------------------------------------------------


def test_verify_accepts_a_good_artifact(tmp_path, full):
    code, stdout, _ = run("verify", full)
    assert code == 0 and "136 variants: OK" in stdout
    assert run("package", full, "-o", tmp_path / "p.tar.zst")[0] == 0
    assert run("verify", tmp_path / "p.tar.zst")[0] == 0


def test_verify_catches_corruption_and_lies(tmp_path, full):
    bad_cubin = copy_artifact(full, tmp_path / "bad-cubin")
    victim = bad_cubin / "cubins" / "grouped-sm_90a-m16-float32.cubin.zst"
    packed = bytearray(victim.read_bytes())
    packed[len(packed) // 2] ^= 0xFF  # same size, other bytes
    victim.write_bytes(bytes(packed))
    code, _, stderr = run("verify", bad_cubin)
    assert code == 2 and "grouped-sm_90a-m16-float32" in stderr and "sha256" in stderr

    broken = copy_artifact(full, tmp_path / "broken")
    (broken / "manifest.json").write_text('{"schema": 1, ')
    code, _, stderr = run("verify", broken)
    assert code == 2 and "not JSON" in stderr

    lie = copy_artifact(full, tmp_path / "lie")
    edit_manifest(lie, lambda m: m["variants"][5]["resources"].update(registers=7))
    code, stdout, _ = run("verify", lie)
    name = manifest(lie)["variants"][5]["name"]
    assert code == 1 and f"variant {name}: resources.registers: manifest 7" in stdout

    driver = copy_artifact(full, tmp_path / "driver")
    edit_manifest(driver, lambda m: m.update(min_driver=11000))
    code, stdout, _ = run("verify", driver)
    assert code == 1 and "min_driver: manifest 11000, cubins need 12090" in stdout


# diff ----------------------------------------------------------------------


def test_diff_of_identical_builds_is_empty(tmp_path, full, monkeypatch):
    code, stdout, _ = run("diff", full, full)
    assert code == 0 and "no differences" in stdout


def test_diff_classifies_changes(tmp_path, full):
    launch = copy_artifact(full, tmp_path / "launch")
    edit_manifest(launch, lambda m: m["variants"][0]["launch"].update(smem=8192))
    code, stdout, _ = run("diff", full, launch)
    name = manifest(full)["variants"][0]["name"]
    assert code == 1
    assert name in stdout and "launch.smem" in stdout and "LAUNCH" in stdout

    info = copy_artifact(full, tmp_path / "info")
    edit_manifest(info, lambda m: m["variants"][1]["resources"].update(registers=200))
    code, stdout, _ = run("diff", full, info, "--json")
    report = json.loads(stdout)
    assert code == 0 and report["relevant"] is False
    record = manifest(full)["variants"][1]
    assert report["changes"] == [{"variant": record["name"], "field": "resources.registers",
                                  "a": record["resources"]["registers"], "b": 200,
                                  "kind": "info"}]  # fmt: skip


def test_diff_says_when_a_cubin_changed_but_its_ptx_did_not(tmp_path, full):
    """ptxas can assemble one PTX into different cubins (artifacts/FORMAT.md,
    "Reproducibility"): with equal ptx_sha256 the change is labelled so."""
    ptx = "ab" * 32
    a = copy_artifact(full, tmp_path / "a")
    edit_manifest(a, lambda m: m["variants"][2].update(ptx_sha256=ptx))
    b = copy_artifact(full, tmp_path / "b")

    def reassembled(m):
        m["variants"][2].update(ptx_sha256=ptx)
        m["variants"][2]["resources"].update(registers=201)

    edit_manifest(b, reassembled)
    code, stdout, _ = run("diff", a, b, "--json")
    (change,) = json.loads(stdout)["changes"]
    assert code == 0 and change["field"] == "resources.registers (same PTX)"
    edit_manifest(b, lambda m: m["variants"][2].update(ptx_sha256="cd" * 32))
    fields = {c["field"] for c in json.loads(run("diff", a, b, "--json")[1])["changes"]}
    assert fields == {"ptx_sha256", "resources.registers"}


def test_diff_across_configs_and_selections(tmp_path, full, stub_env):
    other = build(tmp_path / "other", "--arch", "sm_90a", config=copy_config(tmp_path, top_k=6))
    code, stdout, _ = run("diff", full, other, "--json")
    changes = json.loads(stdout)["changes"]
    assert code == 1
    fields = {(c["variant"], c["field"]) for c in changes}
    assert ("", "config.model.top_k") in fields
    assert ("mega-sm_100a-m1-float32", "variant") in fields  # removed
    assert ("mega-sm_90a-m1-float32", "sha256") in fields  # new code for the new top_k
    assert len(compiled(stub_env)) == 136 + 68


def test_diff_compares_verify_records(tmp_path, full):
    a = copy_artifact(full, tmp_path / "a")
    b = copy_artifact(full, tmp_path / "b")
    name = manifest(full)["variants"][0]["name"]
    record = {"device": "NVIDIA H200", "driver_version": 13000,
              "variants": {name: {"attributes": {"registers": 33}, "result": {"ok": True}}}}  # fmt: skip
    (a / "verify-nvidia-h200.json").write_text(json.dumps(record))
    record["variants"][name] = {"attributes": {"registers": 40}, "result": {"ok": False}}
    (b / "verify-nvidia-h200.json").write_text(json.dumps(record))
    code, stdout, _ = run("diff", a, b, "--json")
    changes = {(c["field"], c["kind"]) for c in json.loads(stdout)["changes"]}
    assert code == 1
    assert changes == {
        ("verify-nvidia-h200.json:attributes.registers", "info"),
        ("verify-nvidia-h200.json:result.ok", "verify"),
    }


@pytest.mark.parametrize("record", [[], {"variants": 5}, {"variants": {"v": 3}},
                                    {"variants": {"v": {"attributes": [1]}}},
                                    {"variants": {"v": {"result": "ok"}}}])  # fmt: skip
def test_diff_refuses_malformed_verify_records(tmp_path, full, record):
    a = copy_artifact(full, tmp_path / "a")
    (a / "verify-nvidia-h200.json").write_text(json.dumps(record))
    code, _, stderr = run("diff", a, full)
    assert code == 2 and "verify-nvidia-h200.json" in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_diff_refuses_corrupted_inputs(tmp_path, full):
    bad = copy_artifact(full, tmp_path / "bad")
    victim = sorted((bad / "cubins").iterdir())[0]
    victim.write_bytes(b"junk")
    code, _, stderr = run("diff", full, bad)
    assert code == 2 and "size" in stderr
    code, _, stderr = run("diff", full, tmp_path / "missing")
    assert code == 2 and "no such directory" in stderr


def _imports_cutlass(args: list[str], env_extra: dict | None = None) -> tuple[int, bool]:
    """Runs ``moe-build ARGS`` in a fresh interpreter: (exit status, whether
    cutlass got imported in that process)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\nfrom pipeline.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        "print(rc, any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules))\n"
    )
    env = dict(os.environ, **(env_extra or {}))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    rc, imported = done.stdout.split()[-2:]
    return int(rc), imported == "True"


def test_reading_commands_need_no_compiler(tmp_path, full):
    """Release and serving machines inspect, verify, diff, package and merge
    artifacts without the DSL."""
    package = str(tmp_path / "p.tar.zst")
    for args in (["inspect", str(full)], ["verify", str(full)], ["diff", str(full), str(full)],
                 ["package", str(full), "-o", package],
                 ["merge", str(full), "-o", str(tmp_path / "m")]):  # fmt: skip
        assert _imports_cutlass(args) == (0, False), args


def test_more_shards_than_variants(tmp_path, stub_env):
    whole = build(tmp_path / "whole", "--kernel", "mega", "--arch", "sm_90a")
    shards = [build(tmp_path / f"s{i}", "--kernel", "mega", "--arch", "sm_90a", "--shard",
                    f"{i}/10") for i in range(1, 11)]  # fmt: skip
    assert [len(manifest(s)["variants"]) for s in shards] == [1] * 8 + [0, 0]
    assert run("verify", shards[-1])[0] == 0
    assert run("merge", *shards, "-o", tmp_path / "merged")[0] == 0
    assert artifact_files(tmp_path / "merged") == artifact_files(whole)


def test_merge_accepts_packaged_shards(tmp_path, stub_env):
    whole = build(tmp_path / "whole", "--kernel", "mega")
    packages = []
    for i in (1, 2):
        shard = build(tmp_path / f"s{i}", "--kernel", "mega", "--shard", f"{i}/2")
        packages.append(tmp_path / f"s{i}.tar.zst")
        assert run("package", shard, "-o", packages[-1])[0] == 0
    assert run("merge", *packages, "-o", tmp_path / "m")[0] == 0
    assert artifact_files(tmp_path / "m") == artifact_files(whole)
