"""The build-cache key changes with every input that changes generated code,
and with nothing else."""

from __future__ import annotations

import dataclasses
import hashlib

from pipeline_support import GLM5, build, compiled, manifest

from kernels import registry
from kernels.spec import KernelSpec
from pipeline import toolchain
from pipeline.cache import CACHE_FORMAT, BuildCache, cache_key, source_hashes

SPEC = KernelSpec(kernel="mega", arch="sm_90a", hidden=4096, inter=512, experts=288, top_k=8,
                  scale=2.5, limit=10.0, ue8m0=False, tokens=1, logits_dtype="float32",
                  finalize=False, sms=132)  # fmt: skip
#: One changed value per KernelSpec field.
CHANGED = {
    "kernel": "grouped",
    "arch": "sm_100a",
    "hidden": 8192,
    "inter": 256,
    "experts": 256,
    "top_k": 6,
    "scale": 2.0,
    "limit": 7.0,
    "ue8m0": True,
    "tokens": 2,
    "logits_dtype": "bfloat16",
    "finalize": True,
    "sms": 148,
    "shared_experts": 0,
    "score": "softmax",
    "bias": False,
    "groups": 8,
    "groups_kept": 4,
    "renormalize": False,
}
SOURCES = {"kernels/mega_moe_sm90.py": "0" * 64, "kernels/spec.py": "1" * 64}
TOOLS = {"dsl": {"nvidia-cutlass-dsl": "4.8.1"}, "compiler": {}, "python": "3.11", "env": {}}


def test_every_spec_field_changes_the_key():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(KernelSpec)}
    base = cache_key(SPEC, SOURCES, TOOLS)
    keys = {base}
    for name, value in CHANGED.items():
        key = cache_key(dataclasses.replace(SPEC, **{name: value}), SOURCES, TOOLS)
        assert key != base, name
        keys.add(key)
    assert len(keys) == len(CHANGED) + 1


def test_sources_and_toolchain_change_the_key():
    base = cache_key(SPEC, SOURCES, TOOLS)
    assert cache_key(SPEC, {**SOURCES, "kernels/spec.py": "2" * 64}, TOOLS) != base
    assert cache_key(SPEC, {**SOURCES, "kernels/ptx/new.py": "3" * 64}, TOOLS) != base
    for key, value in [
        ("dsl", {"nvidia-cutlass-dsl": "4.9.0"}),
        ("compiler", {"_cutlass_ir.so": "4" * 64}),
        ("python", "3.12"),
        ("env", {"CUTE_DSL_LINEINFO": "1"}),
    ]:
        assert cache_key(SPEC, SOURCES, {**TOOLS, key: value}) != base, key
    # The same content in another order is the same key.
    assert cache_key(SPEC, dict(reversed(list(SOURCES.items()))), TOOLS) == base


def test_dsl_environment_keeps_only_what_can_change_code():
    env = {
        "CUTE_DSL_LINEINFO": "1",
        "CUTE_DSL_COMPILER_OPT": "x",
        "CUTE_DSL_KEEP": "ptx,cubin",
        "CUTE_DSL_DUMP_DIR": "/tmp/a",
        "CUTE_DSL_ARCH": "sm_90a",
        "CUTE_DSL_LOG_LEVEL": "10",
        "HOME": "/root",
        "MOE_BUILD_STAMPS": "1",  # the grouped kernels' diagnostics build
    }
    assert toolchain.dsl_environment(env) == {
        "CUTE_DSL_COMPILER_OPT": "x",
        "CUTE_DSL_LINEINFO": "1",
        "MOE_BUILD_STAMPS": "1",
    }


def test_source_hashes_cover_the_package_and_an_outside_module(tmp_path, monkeypatch):
    module = tmp_path / "cache_probe_kernel.py"
    module.write_text("from kernels.spec import KernelSpec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.MODULES_ENV, "mega/sm_90a=cache_probe_kernel")
    first = source_hashes("mega", "sm_90a")
    package = {p.relative_to(registry.KERNELS_DIR.parent).as_posix()
               for p in registry.KERNELS_DIR.rglob("*.py") if "__pycache__" not in p.parts}  # fmt: skip
    assert {"kernels/ptx/fmath.py", "kernels/ptx/mbarrier.py", "kernels/spec.py"} <= package
    # kernels.spec reads runtime.constants: the one file outside both it reaches.
    assert set(first) == package | {"cache_probe_kernel.py", "runtime/constants.py"}
    spec_bytes = (registry.KERNELS_DIR / "spec.py").read_bytes()
    assert first["kernels/spec.py"] == hashlib.sha256(spec_bytes).hexdigest()
    module.write_text("from kernels.spec import KernelSpec\n# edited\n")
    assert (
        source_hashes("mega", "sm_90a")["cache_probe_kernel.py"] != first["cache_probe_kernel.py"]
    )


def test_relative_imports_of_an_outside_kernel_are_followed(tmp_path, monkeypatch):
    """A stand-in kernel package reaching its helpers through ``from . import``
    and ``from ..x import``: each helper is hashed, and editing it re-keys."""
    pkg = tmp_path / "probe_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("X = 1\n")
    (pkg / "sub" / "kernel.py").write_text("from .. import helper\nfrom ..helper import X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.MODULES_ENV, "mega/sm_90a=probe_pkg.sub.kernel")
    first = source_hashes("mega", "sm_90a")
    assert {"kernel.py", "helper.py"} <= set(first)
    (pkg / "helper.py").write_text("X = 2\n")
    assert source_hashes("mega", "sm_90a")["helper.py"] != first["helper.py"]


def test_editing_a_ptx_helper_changes_every_kernel_key(tmp_path, monkeypatch):
    """The PTX helpers are reached through relative imports (``from ._asm
    import``); an edit to one (``div.rn`` -> ``div.approx``) must give every
    kernel a new cache key, or a build would serve the old cubin."""
    import shutil

    root = tmp_path / "checkout"
    shutil.copytree(registry.KERNELS_DIR, root / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    monkeypatch.setattr(registry, "KERNELS_DIR", root / "kernels")
    fmath = root / "kernels" / "ptx" / "fmath.py"
    text = fmath.read_text()
    assert "div.rn" in text
    before = {t: cache_key(SPEC, source_hashes(*t), TOOLS) for t in registry.MODULES}
    fmath.write_text(text.replace("div.rn", "div.approx", 1))
    after = {t: cache_key(SPEC, source_hashes(*t), TOOLS) for t in registry.MODULES}
    for target in registry.MODULES:
        assert after[target] != before[target], target


def test_editing_a_shared_constant_changes_every_kernel_key(tmp_path, monkeypatch):
    """The kernels read TILE, MAX_TOKENS and the shared-memory limits from
    ``runtime.constants`` (outside ``kernels/``): an edit there must give every
    kernel a new key, while runtime modules no kernel imports stay out of it."""
    import shutil

    root = tmp_path / "checkout"
    shutil.copytree(registry.KERNELS_DIR, root / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (root / "runtime").mkdir()
    for name in ("__init__.py", "constants.py", "model.py"):
        shutil.copy(registry.KERNELS_DIR.parent / "runtime" / name, root / "runtime" / name)
    monkeypatch.setattr(registry, "KERNELS_DIR", root / "kernels")
    constants = root / "runtime" / "constants.py"
    text = constants.read_text()
    assert "SMEM_RESERVED = 1024\n" in text
    before = {t: source_hashes(*t) for t in registry.MODULES}
    for target, sources in before.items():
        assert "runtime/constants.py" in sources and "runtime/model.py" not in sources, target
    constants.write_text(text.replace("SMEM_RESERVED = 1024\n", "SMEM_RESERVED = 2048\n"))
    for target in registry.MODULES:
        after = cache_key(SPEC, source_hashes(*target), TOOLS)
        assert after != cache_key(SPEC, before[target], TOOLS), target


def test_keys_ignore_output_jobs_shard_and_order(tmp_path, stub_env):
    """The same variant gets the same key from builds that differ only in
    things that cannot change its code."""
    build(tmp_path / "full", "--kernel", "mega", "--jobs", "1")
    build(tmp_path / "x" / "shard", "--kernel", "mega", "--shard", "2/3", "--jobs", "2")
    build(tmp_path / "one", "--variant", "mega-sm_90a-m3-*", "--no-cache")
    full = {r["name"]: r["cache_key"] for r in manifest(tmp_path / "full")["variants"]}
    for other in ("x/shard", "one"):
        for r in manifest(tmp_path / other)["variants"]:
            assert r["cache_key"] == full[r["name"]]
    # The shard and the filtered build were served from the cache (only the
    # --no-cache build compiled again).
    assert len(compiled(stub_env)) == 16 + 2


def test_changed_config_recompiles_only_what_changed(tmp_path, stub_env):
    build(tmp_path / "a", "--kernel", "mega", "--arch", "sm_90a")
    config = tmp_path / "c.yaml"
    config.write_text(GLM5.read_text().replace("sms: 148", "sms: 140"))
    build(tmp_path / "b", "--kernel", "mega", "--arch", "sm_90a", config=config)
    assert len(compiled(stub_env)) == 8  # sm_100a's SM count does not touch sm_90a variants
    config.write_text(GLM5.read_text().replace("top_k: 8", "top_k: 6"))
    build(tmp_path / "c", "--kernel", "mega", "--arch", "sm_90a", config=config)
    assert len(compiled(stub_env)) == 16


def test_cache_entries_are_checked_and_rewritten(tmp_path):
    cache = BuildCache(tmp_path / "cache")
    result = {"cubin": b"\x7fELF" + bytes(60), "entry": "k", "seconds": 1.0}
    cache.put("ab" * 32, result)
    got = cache.get("ab" * 32)
    assert got == {"cubin": result["cubin"], "entry": "k"}
    entry = tmp_path / "cache" / f"v{CACHE_FORMAT}" / "ab" / ("ab" * 32)
    (entry / "cubin").write_bytes(b"corrupted")
    assert cache.get("ab" * 32) is None
    cache.put("ab" * 32, result)
    assert cache.get("ab" * 32)["cubin"] == result["cubin"]
    assert BuildCache(None).get("ab" * 32) is None


def test_unwritable_cache_does_not_fail_the_build(tmp_path, stub_env, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("MOE_BUILD_CACHE", str(blocker / "cache"))
    build(tmp_path / "a", "--variant", "mega-sm_90a-m1-*")
    build(tmp_path / "b", "--variant", "mega-sm_90a-m1-*")
    assert len(compiled(stub_env)) == 4


def test_config_order_changes_no_key(tmp_path, stub_env):
    """Listing dtypes and targets in another order names the same variants
    with the same keys: nothing recompiles."""
    build(tmp_path / "a", "--kernel", "mega")
    text = GLM5.read_text().replace("[float32, bfloat16]", "[bfloat16, float32]")
    head, sep, targets = text.partition("targets:\n")
    entries = targets.strip("\n").split("\n  - ")
    config = tmp_path / "reordered.yaml"
    config.write_text(head + sep + "  - " + "\n  - ".join(reversed([e.removeprefix("  - ")
                                                                   for e in entries])) + "\n")  # fmt: skip
    build(tmp_path / "b", "--kernel", "mega", config=config)
    assert len(compiled(stub_env)) == 16
    a, b = manifest(tmp_path / "a"), manifest(tmp_path / "b")
    assert a["config_hash"] != b["config_hash"]  # the config records the order as written
    assert [r["cache_key"] for r in a["variants"]] == [r["cache_key"] for r in b["variants"]]


def test_a_diagnostics_build_has_its_own_cache_key(monkeypatch):
    """The grouped kernels' stamps change their code, so the variable is part
    of the toolchain identity the key is made of."""
    from kernels.grouped_plan import STAMPS_ENV

    monkeypatch.delenv(STAMPS_ENV, raising=False)
    plain = toolchain.dsl_environment()
    monkeypatch.setenv(STAMPS_ENV, "1")
    assert toolchain.dsl_environment() == {**plain, STAMPS_ENV: "1"}
