"""Which module builds which (kernel, arch), and how to call it.

A kernel module defines ``compile_kernel(spec: KernelSpec) -> CompiledKernel``.
The files whose text decides its code are the module and everything it imports
from ``kernels/``, found by reading imports (``source_files``), so the build
cache never needs cutlass to compute a key.

CuTe DSL reads the target architecture from ``CUTE_DSL_ARCH`` when cutlass is
first imported (setting it later has no effect: measured with 4.8.1), so one
process compiles for one architecture: ``compile_variant`` refuses a spec whose
arch differs from the one this process was started for.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
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
    """The module of (kernel, arch) and every ``kernels`` module it imports,
    transitively (sorted, absolute); found by parsing, importing nothing."""
    seen: set[Path] = set()
    todo = [module_name(kernel, arch)]
    while todo:
        path = _module_path(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo.append(node.module)
                todo.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(seen)


def _module_path(name: str) -> Path | None:
    """File of a ``kernels.*`` module or package (or of a module named in
    ``$MOE_BUILD_KERNEL_MODULES``), or None for anything else."""
    parts = name.split(".")
    if name in modules().values() and parts[0] != "kernels":
        spec = importlib.util.find_spec(name)
        return Path(spec.origin).resolve() if spec and spec.origin else None
    if parts[0] != "kernels":
        return None
    base = KERNELS_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None
