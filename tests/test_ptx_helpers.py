"""The PTX helpers of ``kernels/ptx`` (read with ``ast``, nothing imported).

Contracts (``kernels/ptx/__init__.py``): one small helper per instruction,
so every public function of a ``kernels/ptx/*.py`` module

* is used by a kernel module (``kernels/*.py``, the ptx package excluded):
  named as ``ptx.name`` (the package's re-exports), ``wgmma.name`` /
  ``tc.name`` (a family imported as a module), or imported by name; a helper
  also counts as used when a used helper of the package calls it (the
  compositions at the end of ``tcgen05``). A helper no kernel reaches is dead
  code, and this test names it. The one exception: ``PROBE_ONLY``, helpers
  that the device probe kernels of ``tests/gpu`` use and no kernel does;
* emits at most one inline-asm statement: its body calls the package's
  ``asm`` at most once. One asm string may hold a short sequence that makes
  one operation (a predicate set before a wait loop, a register conversion
  before a store, ``round_e4m3``'s integer rounding), as the docstrings say;
  compositions call helpers, never ``asm``.

And every name ``kernels/ptx/__init__.py`` re-exports is defined in the
module it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"
PTX = KERNELS / "ptx"
PACKAGE = "kernels.ptx"
#: (family, helper) -> the tests/gpu probe that uses it where no kernel does
#: (checked both ways: the probe uses it and no kernel module does).
PROBE_ONLY: dict[tuple[str, str], str] = {}


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def helpers() -> dict[str, dict[str, ast.FunctionDef]]:
    """Family (module name) -> public function name -> its definition."""
    out = {}
    for path in sorted(PTX.glob("*.py")):
        if path.name.startswith("_"):
            continue
        out[path.stem] = {
            node.name: node
            for node in parse(path).body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
        }
    return out


def reexports() -> dict[str, str]:
    """Name -> family of every ``from .family import name`` in ``__init__.py``."""
    out = {}
    for node in parse(PTX / "__init__.py").body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def kernel_uses(path: Path, families, exported: dict[str, str]) -> set[tuple[str, str]]:
    """(family, helper) pairs a kernel module names: ``alias.helper`` where
    ``alias`` is bound to the ptx package (re-exports) or to a family
    module, and helpers imported by name from either."""
    tree = parse(path)
    package_aliases, family_aliases, used = set(), {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE and alias.asname:
                    package_aliases.add(alias.asname)
                elif alias.name.startswith(PACKAGE + ".") and alias.asname:
                    family_aliases[alias.asname] = alias.name.rpartition(".")[2]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "kernels" and alias.name == "ptx":
                    package_aliases.add(bound)
                elif node.module == PACKAGE and alias.name in families:
                    family_aliases[bound] = alias.name
                elif node.module == PACKAGE and alias.name in exported:
                    used.add((exported[alias.name], alias.name))
                elif node.module and node.module.startswith(PACKAGE + "."):
                    used.add((node.module.rpartition(".")[2], alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in package_aliases and node.attr in exported:
                used.add((exported[node.attr], node.attr))
            elif node.value.id in family_aliases:
                used.add((family_aliases[node.value.id], node.attr))
    return used


def called_names(fn: ast.FunctionDef) -> list[str]:
    """Names of the plain calls ``name(...)`` in a function's body."""
    return [
        node.func.id
        for node in ast.walk(fn)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]


def internal_calls(family: str, fn: ast.FunctionDef, defined) -> set[tuple[str, str]]:
    """(family, helper) of the package's helpers ``fn`` calls: those of its
    own module and those it imports from a sibling (``from .mbarrier import``)."""
    siblings = {}
    for node in parse(PTX / f"{family}.py").body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in defined:
            for alias in node.names:
                siblings[alias.asname or alias.name] = (node.module, alias.name)
    out = set()
    for name in called_names(fn):
        if name in defined[family]:
            out.add((family, name))
        elif name in siblings:
            out.add(siblings[name])
    return out


def used_helpers() -> set[tuple[str, str]]:
    defined = helpers()
    exported = reexports()
    used = set()
    for path in sorted(KERNELS.glob("*.py")):
        used |= kernel_uses(path, defined, exported)
    todo = [u for u in used if u[0] in defined and u[1] in defined[u[0]]]
    while todo:
        family, name = todo.pop()
        for callee in internal_calls(family, defined[family][name], defined):
            if callee not in used:
                used.add(callee)
                todo.append(callee)
    return used


def test_the_helpers_are_found():
    defined = helpers()
    assert {"mbarrier", "memory", "sync", "tma", "wgmma", "tcgen05"} <= set(defined)
    assert "mbarrier_wait" in defined["mbarrier"] and "umma_k128" in defined["tcgen05"]
    used = used_helpers()
    # Each way of naming a helper is seen: a re-export through ``ptx.``, a
    # family module alias (``tc.``, ``wgmma.``) and a helper only a
    # composition calls.
    assert ("mbarrier", "mbarrier_wait") in used
    assert ("tcgen05", "umma_k128") in used and ("wgmma", "wgmma_e4m3") in used
    assert ("tcgen05", "tcgen05_mma_f8f6f4") in used


def test_every_helper_is_used_by_a_kernel():
    used = used_helpers()
    unused = sorted(
        f"kernels/ptx/{family}.py: {name}"
        for family, names in helpers().items()
        for name in names
        if (family, name) not in used and (family, name) not in PROBE_ONLY
    )
    assert not unused, "PTX helpers no kernel module uses: " + ", ".join(unused)


def test_probe_only_helpers_are_used_by_their_probe_and_no_kernel():
    defined, exported = helpers(), reexports()
    used = used_helpers()
    for (family, name), probe in PROBE_ONLY.items():
        assert name in defined[family], (family, name)
        assert (family, name) in kernel_uses(REPO / probe, defined, exported), (name, probe)
        assert (family, name) not in used, f"{name}: a kernel uses it now; drop it from PROBE_ONLY"


def test_each_helper_emits_at_most_one_asm_statement():
    several = sorted(
        f"{family}.{name} ({calls})"
        for family, names in helpers().items()
        for name, fn in names.items()
        if (calls := called_names(fn).count("asm")) > 1
    )
    assert not several, "helpers with more than one asm statement: " + ", ".join(several)


def test_reexports_name_defined_helpers():
    defined = helpers()
    missing = sorted(f"{family}.{name}" for name, family in reexports().items()
                     if name not in defined.get(family, {}))  # fmt: skip
    assert not missing, missing
