"""The project's import graph, read from the source (nothing is imported).

Contracts: no module of ``kernels``, ``runtime``, ``pipeline`` or
``benchmarks`` reaches itself through imports (absolute or relative, at
module level or inside a function: a lazy import hides a circle, it does not
remove it); ``runtime`` imports nothing of ``kernels`` (it serves artifacts
without the kernels' sources); ``runtime.constants`` imports nothing but the
standard library, so every layer can import it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "runtime", "pipeline", "benchmarks")


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted name -> file of every module of ``packages`` under ``root``
    (those that exist); a package's ``__init__.py`` is the package's name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every import statement of module ``name`` (file
    ``path``), anywhere in its body: ``import a.b`` is ``("a.b", ())``,
    ``from a import b, c`` is ``("a", ("b", "c"))``; relative imports are
    resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                assert node.level - 1 <= len(parts), f"{name}: relative import above the top"
                base = ".".join([*parts[: len(parts) - (node.level - 1)], *filter(None, [base])])
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. ``from a import b`` is an
    edge to ``a.b`` when that is a module (the package ``a`` is only passed
    through), else to ``a``; names that are no module of ``found`` (the
    standard library, torch, cutlass) are dropped."""
    graph = {}
    for name, path in found.items():
        targets = set()
        for base, names in imports(name, path):
            for target in [f"{base}.{n}" for n in names] or [base]:
                if target in found:
                    targets.add(target)
                elif base in found:
                    targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]``, or None when the graph has none
    (iterative depth-first search, modules and edges in sorted order)."""
    state = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    for start in sorted(graph):
        if state[start]:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt, 2) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif state.get(nxt, 2) == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def project_graph() -> dict[str, set[str]]:
    return import_graph(modules(REPO))


# -- the project -------------------------------------------------------------------------


def test_the_packages_are_all_read():
    found = modules(REPO)
    for name in ("kernels.shapes", "kernels.grouped_plan", "kernels.ptx", "runtime.constants",
                 "runtime.loader", "pipeline.build"):  # fmt: skip
        assert name in found, name
    graph = project_graph()
    assert "kernels.grouped_plan" in graph["kernels.shapes"]
    assert "runtime.constants" in graph["kernels.grouped_plan"]
    assert "kernels.ptx.mbarrier" in graph["kernels.ptx.tcgen05"]  # relative import


def test_no_import_circle():
    cycle = find_cycle(project_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_runtime_imports_nothing_of_kernels():
    graph = project_graph()
    bad = {
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name == "runtime" or name.startswith("runtime.")
        for target in targets
        if target == "kernels" or target.startswith("kernels.")
    }
    assert not bad, sorted(bad)


def test_constants_is_a_leaf():
    found = imports("runtime.constants", REPO / "runtime" / "constants.py")
    assert not project_graph()["runtime.constants"], found
    tops = {base.split(".")[0] for base, _ in found}
    assert tops <= set(sys.stdlib_module_names) | {"__future__"}, found


# -- the checker itself ------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_through_a_lazy_relative_import_is_found(tmp_path):
    _tree(tmp_path, {
        "kernels/__init__.py": "",
        "kernels/a.py": "from kernels import b\n",
        "kernels/b.py": "def f():\n    from .sub import c\n",
        "kernels/sub/__init__.py": "",
        "kernels/sub/c.py": "import os\n\n\ndef g():\n    from .. import a\n",
    })  # fmt: skip
    graph = import_graph(modules(tmp_path, ("kernels",)))
    assert graph["kernels.a"] == {"kernels.b"}
    assert graph["kernels.b"] == {"kernels.sub.c"}
    assert graph["kernels.sub.c"] == {"kernels.a"}
    assert find_cycle(graph) == ["kernels.a", "kernels.b", "kernels.sub.c", "kernels.a"]


def test_no_circle_in_a_package_that_imports_its_submodules(tmp_path):
    # A package's __init__ importing its submodules, which import each
    # other through ``from . import x``: no circle.
    _tree(tmp_path, {
        "kernels/__init__.py": "",
        "kernels/ptx/__init__.py": "from .x import f\nfrom .y import g\n",
        "kernels/ptx/x.py": "from ._asm import asm\n",
        "kernels/ptx/y.py": "from . import x\nfrom ._asm import asm\n",
        "kernels/ptx/_asm.py": "",
        "kernels/k.py": "from kernels import ptx\nfrom kernels.ptx import y\n",
    })  # fmt: skip
    graph = import_graph(modules(tmp_path, ("kernels",)))
    assert graph["kernels.ptx.y"] == {"kernels.ptx.x", "kernels.ptx._asm"}
    assert graph["kernels.k"] == {"kernels.ptx", "kernels.ptx.y"}
    assert find_cycle(graph) is None
