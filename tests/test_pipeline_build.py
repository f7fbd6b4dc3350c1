"""moe-build compile end to end with the pure-Python stub kernels: the
artifact, the cache, atomicity, failures and bad inputs."""

from __future__ import annotations

import json

from pipeline_support import (
    GLM5,
    artifact_files,
    build,
    compiled,
    leftovers,
    manifest,
    run,
)

from runtime import artifact


def test_compile_writes_an_artifact_the_runtime_reads(tmp_path, stub_env):
    out = build(tmp_path / "a", "--jobs", "2")
    data = artifact.read(out)
    m = manifest(out)
    names = [v.name for v in data.variants]
    assert len(names) == 2 * (4 * 2 + 15 * 2 * 2)  # archs x (mega + grouped) variants
    assert names == sorted(names)
    assert m["min_driver"] == 12090  # stub cubins say CUDA 12.9, like ptxas 12.9 does
    assert m["toolchain"]["ptxas"] == "12.9"
    record = m["variants"][0]
    assert [(p["offset"], p["size"]) for p in record["params"]] == [(0, 8), (8, 8), (16, 4)]
    assert record["resources"]["registers"] == 32 + record["tokens"]
    assert record["resources"]["spills"] == 0
    assert (out / "build-record.json").is_file()
    files = sorted(p.name for p in (out / "cubins").iterdir())
    assert files == sorted(f"{n}.cubin.zst" for n in names)
    assert leftovers(tmp_path) == []


def test_second_build_compiles_nothing(tmp_path, stub_env):
    build(tmp_path / "a", "--arch", "sm_90a")
    first = compiled(stub_env)
    assert len(first) == 68
    code, stdout, _ = run("compile", GLM5, "-o", tmp_path / "b", "--arch", "sm_90a", "--json")
    assert code == 0
    assert compiled(stub_env) == first  # nothing new compiled
    events = [json.loads(line) for line in stdout.splitlines()]
    assert events[0] == {"event": "start", "variants": 68, "cached": 68, "compile": 0, "jobs": 0}
    assert {e["status"] for e in events if e["event"] == "variant"} == {"cached"}
    assert events[-1]["ok"] is True and events[-1]["cached"] == 68
    assert artifact_files(tmp_path / "a") == artifact_files(tmp_path / "b")


def test_clean_builds_are_byte_identical(tmp_path, stub_env, monkeypatch):
    """Different caches, output dirs, job counts and working directories."""
    build(tmp_path / "one", "--jobs", "1", "--kernel", "mega")
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "other-cache"))
    monkeypatch.chdir(tmp_path)
    build(tmp_path / "sub" / "two", "--jobs", "3", "--kernel", "mega")
    assert artifact_files(tmp_path / "one") == artifact_files(tmp_path / "sub" / "two")
    assert len(compiled(stub_env)) == 2 * 16


def test_failing_variant_names_itself_and_writes_nothing(tmp_path, stub_env, monkeypatch):
    out = build(tmp_path / "a", "--kernel", "mega", "--no-cache")
    before = artifact_files(out)
    monkeypatch.setenv("MOE_BUILD_STUB_FAIL", "mega-sm_90a-m2-float32")
    code, _, stderr = run("compile", GLM5, "-o", out, "--kernel", "mega", "--no-cache")
    assert code == 1
    assert "mega-sm_90a-m2-float32: RuntimeError: ptxas fatal: stub failure" in stderr
    assert "nothing was written" in stderr
    assert artifact_files(out) == before  # the previous artifact is untouched
    assert leftovers(tmp_path) == []
    code, _, _ = run("compile", GLM5, "-o", tmp_path / "new", "--kernel", "mega", "--no-cache")
    assert code == 1 and not (tmp_path / "new").exists()


def test_failure_leaves_good_variants_cached(tmp_path, stub_env, monkeypatch):
    monkeypatch.setenv("MOE_BUILD_STUB_FAIL", "mega-sm_90a-m2-float32")
    code, _, _ = run("compile", GLM5, "-o", tmp_path / "a", "--kernel", "mega", "--arch", "sm_90a")
    assert code == 1
    monkeypatch.delenv("MOE_BUILD_STUB_FAIL")
    build(tmp_path / "a", "--kernel", "mega", "--arch", "sm_90a")
    assert sorted(compiled(stub_env)).count("mega-sm_90a-m2-float32") == 2
    assert len(compiled(stub_env)) == 8 + 1


def test_declared_abi_that_contradicts_the_cubin_fails(tmp_path, stub_env, monkeypatch):
    monkeypatch.setenv("MOE_BUILD_STUB_BAD_ABI", "mega-sm_100a-m3-bfloat16")
    code, _, stderr = run("compile", GLM5, "-o", tmp_path / "a", "--kernel", "mega")
    assert code == 1
    assert "mega-sm_100a-m3-bfloat16: ABI check: 4 parameters declared" in stderr
    assert not (tmp_path / "a").exists()


def test_compiler_crash_fails_the_build(tmp_path, stub_env, monkeypatch):
    monkeypatch.setenv("MOE_BUILD_STUB_CRASH", "mega-sm_90a-m1-float32")
    code, _, stderr = run(
        "compile", GLM5, "-o", tmp_path / "a", "--kernel", "mega", "--arch", "sm_90a", "-j", "1"
    )
    assert code == 1
    assert "mega-sm_90a-m1-float32" in stderr and "compiler process died" in stderr
    assert not (tmp_path / "a").exists() and leftovers(tmp_path) == []


def test_bad_inputs_exit_2_with_a_clear_message(tmp_path, stub_env):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    cases = [
        (["compile", tmp_path / "missing.yaml"], "cannot read"),
        (["compile", broken], "not valid YAML"),
        (
            ["compile", GLM5, "--arch", "sm_80"],
            "--arch sm_80: unknown arch (known: sm_90a, sm_100a)",
        ),
        (["compile", GLM5, "--kernel", "dense"], "--kernel dense: unknown kernel"),
        (["compile", GLM5, "--shard", "3/2"], "expected i/n with 1 <= i <= n"),
        (["compile", GLM5, "--shard", "x"], "expected i/n"),
        (["compile", GLM5, "-o", a_file / "out"], "cannot write in"),
        (["compile", GLM5, "-o", foreign], "refusing to replace a non-empty directory"),
        (["compile", GLM5, "-o", a_file], "is a file"),
    ]
    for args, message in cases:
        code, _, stderr = run(*args)
        assert code == 2, (args, stderr)
        assert message in stderr, (args, stderr)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert compiled(stub_env) == []


def test_arch_not_in_config_is_refused(tmp_path, stub_env):
    config = tmp_path / "c.yaml"
    config.write_text(
        GLM5.read_text().replace("  - arch: sm_100a  # B200 / GB200\n    sms: 148\n", "")
    )
    code, _, stderr = run("compile", config, "--arch", "sm_100a", "-o", tmp_path / "a")
    assert code == 2
    assert "--arch sm_100a: not a target of this config (sm_90a)" in stderr


def test_variant_filter(tmp_path, stub_env):
    out = build(tmp_path / "a", "--variant", "*-m1-float32", "--variant", "grouped-sm_90a-m64-*")
    names = [r["name"] for r in manifest(out)["variants"]]
    assert names == [
        "grouped-sm_90a-m64-bfloat16",
        "grouped-sm_90a-m64-bfloat16-final",
        "grouped-sm_90a-m64-float32",
        "grouped-sm_90a-m64-float32-final",
        "mega-sm_100a-m1-float32",
        "mega-sm_90a-m1-float32",
    ]
    code, _, stderr = run("compile", GLM5, "-o", tmp_path / "b", "--variant", "nothing*")
    assert code == 2 and "--variant nothing*: matches no variant" in stderr


def test_terminated_build_leaves_nothing(tmp_path, stub_env):
    """SIGTERM (a cancelled CI job) mid-build: no artifact, no temporary
    directory, workers gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, MOE_BUILD_STUB_SLEEP="30", PYTHONPATH=str(GLM5.parent.parent / "tests"))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "compile", str(GLM5), "-o", str(out), "-j", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(tmp_path), "the build never started"
    while not compiled(stub_env) and time.monotonic() < deadline:
        time.sleep(0.1)  # a compile is running
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted; nothing was written" in stderr
    assert not out.exists() and leftovers(tmp_path) == []
