"""The pipeline with the real CuTe DSL compiler: a tiny stand-in kernel for
determinism and the ELF reader, and a representative subset of the real
kernels (one variant per kernel and arch). All marked ``compile``."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest
from pipeline_support import GLM5, artifact_files, build, manifest, modules_env, run

from kernels import registry
from pipeline.elf import read_cubin
from pipeline.inspection import ToolMissing, find_tool
from runtime import artifact

pytestmark = pytest.mark.compile

FAKE_VARIANTS = ("--variant", "mega-*-m1-*", "--variant", "grouped-*-m8-float32-final")


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.MODULES_ENV, modules_env("pipeline_fake_kernel"))
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "cache"))


def _cuobjdump():
    try:
        return find_tool("cuobjdump")
    except ToolMissing:
        pytest.skip("cuobjdump not installed")


#: Variant-record fields that follow from the cubin's bytes, which ptxas does
#: not always reproduce from the same PTX (artifacts/FORMAT.md, "Reproducibility").
CUBIN_FIELDS = ("sha256", "size", "compressed_sha256", "compressed_size", "resources")


def test_clean_dsl_builds_reproduce_the_ptx_and_the_manifest(tmp_path, fake_env, monkeypatch):
    """Two clean builds (other cache, working directory, job count) of real
    DSL cubins for both archs give the same PTX and the same manifest but for
    the cubin-derived fields; the cubins themselves usually agree too (counted
    and printed, not required: see CUBIN_FIELDS)."""
    one = build(tmp_path / "one", *FAKE_VARIANTS, "--jobs", "1")
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "cache2"))
    monkeypatch.chdir(tmp_path)
    two = build(tmp_path / "elsewhere" / "two", *FAKE_VARIANTS, "--jobs", "2")
    a, b = manifest(one), manifest(two)
    assert len(a["variants"]) == len(b["variants"]) == 6
    for ra, rb in zip(a["variants"], b["variants"], strict=True):
        assert ra["ptx_sha256"] == rb["ptx_sha256"], ra["name"]
        assert {k: v for k, v in ra.items() if k not in CUBIN_FIELDS} == {
            k: v for k, v in rb.items() if k not in CUBIN_FIELDS
        }, ra["name"]
    strip = {k: v for k, v in a.items() if k != "variants"}
    assert strip == {k: v for k, v in b.items() if k != "variants"}
    files_a, files_b = artifact_files(one), artifact_files(two)
    assert sorted(files_a) == sorted(files_b)
    differ = [n for n in files_a if n.startswith("cubins/") and files_a[n] != files_b[n]]
    print(f"cubins that differ between the two builds (same PTX): {differ or 'none'}")
    assert not list(tmp_path.glob("*.cubin")) and not list(tmp_path.glob("*.ptx"))


def test_elf_reader_agrees_with_cuobjdump(tmp_path, fake_env):
    tool = _cuobjdump()
    data = artifact.read(build(tmp_path / "a", *FAKE_VARIANTS))
    for v in data.variants:
        path = tmp_path / f"{v.name}.cubin"
        path.write_bytes(v.cubin)
        text = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
        regs, stack, shared, _ = (int(x) for x in found.groups())
        k = read_cubin(v.cubin).kernels[v.entry]
        assert (k.registers, max(k.min_stack_bytes, k.max_stack_bytes), k.static_smem) == (
            regs, stack, shared
        )  # fmt: skip
        elf = subprocess.run([tool, "-elf", str(path)], capture_output=True, text=True).stdout
        header = elf.replace(" ", "").split("\n", 2)[
            1
        ]  # "64bitelf:type=2,abi=7,sm=90a,toolkit=129,..."
        assert f"sm={v.arch.removeprefix('sm_')}," in header
        toolkit = re.search(r"toolkit=([0-9.]+),", header).group(1)
        info = read_cubin(v.cubin)
        assert toolkit in (str(info.toolkit), info.toolkit_version)
        if v.arch == "sm_100a":  # ELF ABI 8 carries ptxas's own version string
            assert info.ptxas is not None and info.ptxas.startswith(info.toolkit_version + ".")


def test_inspect_sass(tmp_path, fake_env):
    _cuobjdump()
    out = build(tmp_path / "a", "--variant", "mega-sm_90a-m1-float32")
    code, stdout, stderr = run("inspect", out, "--sass", "mega-sm_90a-m1-float32")
    assert code == 0, stderr
    assert "code for sm_90a" in stdout and "fake_mega_sm_90a_0" in stdout and "EXIT" in stdout


#: One variant of each registered (kernel, arch): every entry of registry.MODULES.
REAL_VARIANTS = [
    ("mega", "sm_90a", "mega-sm_90a-m1-float32"),
    ("mega", "sm_100a", "mega-sm_100a-m4-bfloat16"),
    ("grouped", "sm_90a", "grouped-sm_90a-m64-float32-final"),
    ("grouped", "sm_100a", "grouped-sm_100a-m8-bfloat16"),
]


def _module_file(module: str):
    return registry.KERNELS_DIR / (module.split(".")[-1] + ".py")


def test_every_registered_kernel_module_exists():
    """Each module registry.MODULES names is a file of the kernels package
    that defines ``compile_kernel`` (found by parsing, importing nothing): a
    renamed or deleted module fails here, not at build time. The real-kernel
    build below covers every entry."""
    assert {(k, a) for k, a, _ in REAL_VARIANTS} == set(registry.MODULES)
    for (kernel, arch), module in registry.MODULES.items():
        path = _module_file(module)
        assert module == f"kernels.{path.stem}" and path.is_file(), (
            f"{kernel}/{arch}: {module} has no file {path}"
        )
        tree = ast.parse(path.read_text(), str(path))
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "compile_kernel" in defined, f"{path} defines no compile_kernel"


@pytest.mark.parametrize("kernel, arch, variant", REAL_VARIANTS)
def test_real_kernel_builds_and_verifies(tmp_path, monkeypatch, kernel, arch, variant):
    """One variant of each real kernel through compile and verify."""
    monkeypatch.delenv(registry.MODULES_ENV, raising=False)
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "cache"))
    module = registry.module_name(kernel, arch)
    assert _module_file(module).is_file(), f"{kernel}/{arch}: {module} does not exist"
    out = build(tmp_path / "a", "--variant", variant, config=GLM5)
    code, stdout, _ = run("verify", out)
    assert code == 0, stdout
    (record,) = manifest(out)["variants"]
    assert record["name"] == variant and record["arch"] == arch
    assert [p["name"] for p in record["params"]] and record["resources"]["registers"] > 0
    assert len(record["ptx_sha256"]) == 64


def test_compile_keeps_cutlass_out_of_the_parent(tmp_path, fake_env):
    """Only the per-arch workers import cutlass (CUTE_DSL_ARCH must be set
    before that import, and the parent serves two archs)."""
    from test_pipeline_artifacts import _imports_cutlass

    args = ["compile", str(GLM5), "-o", str(tmp_path / "a"), "--variant", "mega-*-m1-float32"]
    tests = str(GLM5.parent.parent / "tests")
    assert _imports_cutlass(args, {"PYTHONPATH": tests}) == (0, False)
    assert len(manifest(tmp_path / "a")["variants"]) == 2
