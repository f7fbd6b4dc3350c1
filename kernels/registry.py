"""Which module builds which (kernel, arch), and how to call it.

A kernel module defines ``compile_kernel(spec: KernelSpec) -> CompiledKernel``.
The files whose text can decide its code (``source_files``) are every Python
file of the ``kernels`` package, whatever imports them and however (absolute,
relative, lazily inside a function), plus every module outside the package
that the kernel module reaches through imports, absolutely or relatively: the
repository's own (``runtime.constants``, which the kernels read their
constants from) and the stand-in kernels of the tests with their helpers.
Found by listing and parsing, importing nothing, so the build cache never
needs cutlass to compute a key.

CuTe DSL reads the target architecture from ``CUTE_DSL_ARCH`` when cutlass is
first imported (setting it later has no effect: measured with 4.8.1), so one
process compiles for one architecture: ``compile_variant`` refuses a spec whose
arch differs from the one this process was started for.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

from kernels.spec import CompiledKernel, KernelSpec

KERNELS_DIR = Path(__file__).resolve().parent

MODULES = {
    ("mega", "sm_90a"): "kernels.mega_moe_sm90",
    ("mega", "sm_100a"): "kernels.mega_moe_sm100",
    ("grouped", "sm_90a"): "kernels.grouped_moe_sm90",
    ("grouped", "sm_100a"): "kernels.grouped_moe_sm100",
}


#: Replaces entries of MODULES for this process and the processes it starts:
#: ``"kernel/arch=module[,kernel/arch=module...]"``. Tests use it to build the
#: real pipeline around small stand-in kernels.
MODULES_ENV = "MOE_BUILD_KERNEL_MODULES"


def modules() -> dict[tuple[str, str], str]:
    """MODULES with the overrides of ``$MOE_BUILD_KERNEL_MODULES`` applied."""
    out = dict(MODULES)
    for item in filter(None, os.environ.get(MODULES_ENV, "").split(",")):
        target, sep, module = item.partition("=")
        kernel, slash, arch = target.strip().partition("/")
        if not (sep and slash and kernel and arch and module.strip()):
            raise ValueError(f"${MODULES_ENV}: expected kernel/arch=module, got {item!r}")
        out[(kernel, arch)] = module.strip()
    return out


def module_name(kernel: str, arch: str) -> str:
    table = modules()
    try:
        return table[(kernel, arch)]
    except KeyError:
        known = ", ".join(f"{k}/{a}" for k, a in table)
        raise KeyError(f"no kernel module for {kernel}/{arch} (known: {known})") from None


def prepare_process(arch: str) -> None:
    """Sets the DSL environment for compiling ``arch``; call before importing
    cutlass in this process."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")


def compile_variant(spec: KernelSpec) -> CompiledKernel:
    """Compiles one variant in this process (no GPU needed)."""
    wanted = os.environ.get("CUTE_DSL_ARCH")
    if wanted != spec.arch:
        raise RuntimeError(
            f"this process compiles for CUTE_DSL_ARCH={wanted!r}, not {spec.arch!r}: "
            "call kernels.registry.prepare_process(arch) before cutlass is imported"
        )
    module = importlib.import_module(module_name(spec.kernel, spec.arch))
    return module.compile_kernel(spec)


def source_files(kernel: str, arch: str) -> list[Path]:
    """Every ``.py`` file of the ``kernels`` package, plus the module of
    (kernel, arch) and every module outside the package that it reaches
    through imports (absolute and relative, followed transitively, through
    the package's modules too): the repository's (``runtime.constants``) and
    an outside kernel's helpers; sorted, absolute. A package's
    ``__init__.py`` counts when the package itself is imported.

    Hashing the whole package costs a few more rebuilds (an edit to one
    kernel's file also re-keys the other kernels) and can never miss a file
    that a compile reads."""
    seen: set[Path] = set(package_files())
    todo = [module_name(kernel, arch)]
    parsed: set[Path] = set()
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if path is None or path in parsed:
            continue
        parsed.add(path)
        seen.add(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, node.level, package)
                if base is None:
                    continue
                if base:
                    todo.append(base)
                todo.extend(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
    return sorted(seen)


def package_files() -> list[Path]:
    """Every Python source file under ``kernels/`` (sorted, absolute)."""
    return sorted(p.resolve() for p in KERNELS_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def _absolute(module: str | None, level: int, package: str) -> str | None:
    """The absolute name of ``from <level dots><module> import ...`` inside
    ``package`` ("" for a top-level ``from . import x`` target; None when the
    dots climb above the top)."""
    if level == 0:
        return module
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (level - 1)]
    if module:
        base.append(module)
    return ".".join(base)


def _module_path(name: str) -> Path | None:
    """File of a ``kernels.*`` module or package, of another module of the
    repository (``runtime.constants``: the directory above ``kernels``), or of
    a module outside it that is named in ``$MOE_BUILD_KERNEL_MODULES`` or
    imported by one (found on ``sys.path``); never imported. None for
    anything else (the standard library, cutlass, torch)."""
    parts = name.split(".")
    if parts[0] == "kernels":
        return _file_of(KERNELS_DIR, parts[1:])
    found = _file_of(KERNELS_DIR.parent, parts)
    if found is not None:
        return found
    outside = {m.split(".")[0] for m in modules().values() if not m.startswith("kernels")}
    if parts[0] not in outside:
        return None
    for root in map(Path, sys.path or ["."]):
        found = _file_of(root, parts)
        if found is not None:
            return found
    return None


def _file_of(root: Path, parts: list[str]) -> Path | None:
    """``root/<parts>.py`` or ``root/<parts>/__init__.py`` (resolved), if a file."""
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None
