"""For the compile-marked kernel tests: compile variants in a fresh process
started for one arch (the DSL reads CUTE_DSL_ARCH once, at import), then read
the cubins back (SASS instruction counts and resource usage, through the
nvidia-cuda-cuobjdump wheel). Imports no cutlass itself."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kernels.spec import KernelSpec

REPO = Path(__file__).resolve().parents[1]
GLM5 = REPO / "configs" / "glm5.yaml"

# Runs in the child: argv = out dir, arch, JSON [[name, spec fields], ...].
_COMPILE = r"""
import json, sys, time
from pathlib import Path
from kernels.registry import prepare_process
prepare_process(sys.argv[2])
from kernels.registry import compile_variant
from kernels.spec import KernelSpec

out = Path(sys.argv[1])
records = []
for name, fields in json.loads(sys.argv[3]):
    spec = KernelSpec(**fields)
    start = time.perf_counter()
    ck = compile_variant(spec)
    (out / f"{name}.cubin").write_bytes(ck.cubin)
    (out / f"{name}.ptx").write_text(ck.ptx or "")
    records.append({
        "name": name, "tokens": spec.tokens, "finalize": spec.finalize, "sms": spec.sms,
        "top_k": spec.top_k, "seconds": round(time.perf_counter() - start, 2),
        "entry": ck.entry, "params": [[p.name, p.kind] for p in ck.params],
        "grid": ck.launch.grid, "block": ck.launch.block, "cluster": ck.launch.cluster,
        "smem": ck.launch.smem, "pdl": ck.launch.pdl, "maps": ck.tensor_maps,
        "workspace": [[w.name, w.bytes, w.zero] for w in ck.workspace], "notes": ck.notes,
    })
(out / "records.json").write_text(json.dumps(records))
"""


def compile_specs(arch: str, named: list[tuple[str, KernelSpec]], out: Path) -> list[dict]:
    """Compiles each (name, spec) for ``arch`` in one fresh process (cwd
    ``out``, so nothing the DSL dumps lands in the repository); writes
    ``out/<name>.cubin`` and ``.ptx`` and returns one record per spec, in order."""
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "PYTHONPATH": str(REPO)}
    payload = json.dumps([[name, asdict(spec)] for name, spec in named])
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(out), arch, payload],
        cwd=out, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "records.json").read_text())


def glm5_specs(arch: str, kernel: str, names=None) -> list[tuple[str, KernelSpec]]:
    """configs/glm5.yaml's variants of ``kernel`` for ``arch`` (all, or those
    named), as (variant name, spec)."""
    from pipeline.config import load_config
    from pipeline.variants import expand

    config = load_config(GLM5)
    variants = expand(config, archs=[arch], kernels=[kernel])
    return [(v.name, v.spec(config)) for v in variants if names is None or v.name in names]


def cuobjdump() -> str:
    """The cuobjdump of the nvidia-cuda-cuobjdump wheel (skips without it)."""
    found = sorted(Path(sys.prefix).rglob("cuobjdump"))
    found = [p for p in found if p.is_file() and os.access(p, os.X_OK)]
    if not found:
        pytest.skip("cuobjdump (nvidia-cuda-cuobjdump wheel) is not installed")
    return str(found[0])


#: One SASS instruction of cuobjdump's listing: address, predicate, opcode
#: (with its modifiers), operands.
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


@functools.lru_cache(maxsize=64)
def _dump(tool: str, cubin: str, stamp: tuple[int, int]) -> str:
    return subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def dump_sass(tool: str, cubin: Path) -> str:
    """``cubin``'s SASS listing, disassembled once per file version (the
    tests read each cubin's SASS for several checks)."""
    st = Path(cubin).stat()
    return _dump(tool, str(cubin), (st.st_mtime_ns, st.st_size))


def sass_counts(tool: str, cubin: Path) -> dict[str, int]:
    """How often each SASS opcode (with its modifiers) occurs in ``cubin``."""
    counts: dict[str, int] = {}
    for _, _, op, _ in _INSTRUCTION.findall(dump_sass(tool, cubin)):
        counts[op] = counts.get(op, 0) + 1
    return counts


def resources(tool: str, cubin: Path) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL of the cubin's kernel."""
    text = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def count(counts: dict[str, int], prefix: str) -> int:
    """Occurrences of opcode ``prefix`` with any modifiers."""
    return sum(n for op, n in counts.items() if op == prefix or op.startswith(prefix + "."))


def loads_before_pdl_wait(tool: str, cubin: Path) -> list[str]:
    """The global loads (``LDG``, ``LDGSTS``, generic ``LD``) of ``cubin``'s
    kernel that some path from its entry reaches without passing a
    ``griddepcontrol.wait`` (SASS ``ACQBULK``): a load of an input the
    previous grid writes must come after the wait on every path. ptxas moves
    ``ld.global.nc`` loads freely, across the wait too; weak loads it keeps
    after a wait that dominates them. The walk sees no predicate, so a wait in
    a branch does not count for the code after the branches meet. It follows
    the SASS control flow: an unpredicated ``BRA`` jumps, a predicated one or
    ``BRA.DIV`` may also fall through, an unpredicated ``EXIT`` ends a path, a
    ``CALL`` goes to its target and on (its ``RET`` ends the callee's path);
    indirect jumps fail the walk."""
    return unwaited_loads(dump_sass(tool, cubin))


def unwaited_loads(sass: str) -> list[str]:
    """``loads_before_pdl_wait`` of one kernel's SASS text (cuobjdump's
    ``/*addr*/ [@pred] OPCODE operands ;`` lines): "addr opcode operands" of
    each load some path reaches before an ``ACQBULK``."""
    code = [(int(a, 16), bool(p), op, rest) for a, p, op, rest in _INSTRUCTION.findall(sass)]
    index = {addr: i for i, (addr, *_) in enumerate(code)}
    unwaited, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i in unwaited or i >= len(code):
            continue
        unwaited.add(i)
        _, predicated, op, rest = code[i]
        base = op.split(".")[0]
        assert base not in ("BRX", "JMX", "JMP"), (op, rest)
        if op == "ACQBULK" and not predicated:
            continue
        if base in ("BRA", "CALL"):
            todo.append(index[int(re.findall(r"0x([0-9a-f]+)", rest)[-1], 16)])
            if predicated or op != "BRA":
                todo.append(i + 1)
        elif not (base in ("EXIT", "RET") and not predicated):
            todo.append(i + 1)
    return [f"{code[i][0]:04x} {code[i][2]}{code[i][3].rstrip()}" for i in sorted(unwaited)
            if code[i][2].split(".")[0] in ("LDG", "LD", "LDGSTS")]  # fmt: skip
