"""The sm_90a grouped kernel built by the DSL compiler (marked ``compile``):
a representative set of glm5 grouped variants (both ends of the buckets,
both logits dtypes, finalize off and on, UE8M0 on) compiled in a fresh sm_90a
process, their launch records checked against the plan and their SASS read
back: FP8 wgmma (QGMMA), TMA loads, cp.async gathers, no local memory.

What the kernel computes is checked on the H200 (``test_grouped_sm90_gpu.py``).
"""

from __future__ import annotations

import re

import pytest
from sass_tools import compile_specs, count, cuobjdump, resources, sass_counts

pytest.importorskip("cutlass")  # kernels.grouped_common is device code

from kernels import grouped_plan as gp  # noqa: E402
from kernels.grouped_common import THREADS  # noqa: E402
from kernels.spec import PARAMETER_NAMES, KernelSpec  # noqa: E402

SMS = 132  # configs/glm5.yaml's sm_90a target
REGISTERS_PER_SM = 65536
GRID_PARAMS = (
    "maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "s13", "s2", "x", "logits",
    "bias", "rows", "out", "shared_out", "final", "ids", "weights", "plan_x", "plan_s",
    "hidden", "hscale", "partial", "counters",
)  # fmt: skip


def spec(tokens, dtype="float32", finalize=False, ue8m0=False) -> KernelSpec:
    return KernelSpec("grouped", "sm_90a", 4096, 512, 288, 8, 2.5, 10.0, ue8m0, tokens, dtype,
                      finalize, SMS)  # fmt: skip


SPECS = [
    spec(8),
    spec(16, "bfloat16", finalize=True),
    spec(48, ue8m0=True),
    spec(64, "bfloat16"),
    spec(64, finalize=True),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Compiles SPECS in a fresh process started for sm_90a (cwd a temporary
    directory: nothing the DSL dumps lands in the repository)."""
    out = tmp_path_factory.mktemp("grouped90")
    records = compile_specs("sm_90a", [(str(i), s) for i, s in enumerate(SPECS)], out)
    return out, records


@pytest.mark.compile
def test_variants_build_into_wgmma_tma_and_no_local_memory(built):
    tool = cuobjdump()
    out, records = built
    for i, (s, r) in enumerate(zip(SPECS, records, strict=True)):
        cubin = out / f"{i}.cubin"
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
        print(f"m{s.tokens} {s.logits_dtype} final={s.finalize} ue8m0={s.ue8m0}: "
              f"{r['seconds']} s, REG {res['REG']}, smem {r['smem']}, stages "
              f"{r['notes']['stages']}, QGMMA {count(ops, 'QGMMA')}")  # fmt: skip
        # One stage: DEPTH K blocks x two m64 halves x four k32 steps, each an
        # m64n16k32 FP8 wgmma with FP32 accumulators.
        assert ops.get("QGMMA.64x16x32.F32.E4M3.E4M3", 0) == gp.DEPTH * 2 * 4, ops
        assert count(ops, "QGMMA") == gp.DEPTH * 2 * 4, ops
        assert count(ops, "UTMALDG") >= 1 and "UTMALDG.3D" in ops, ops  # weight stages
        assert count(ops, "LDGSTS") >= 1, ops  # cp.async B-tile gathers
        assert count(ops, "WARPGROUP.DEPBAR") >= 1, ops  # wgmma.wait_group
        assert "LDL" not in ops and "STL" not in ops, ops
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res
        # One CTA per SM, all resident: registers and shared memory fit.
        assert res["REG"] * THREADS <= REGISTERS_PER_SM, res
        assert r["smem"] <= gp.SMEM_LIMIT["sm_90a"]
        assert r["smem"] + res["SHARED"] <= gp.SMEM_OPTIN["sm_90a"]


@pytest.mark.compile
def test_launch_records_follow_the_plan(built):
    out, records = built
    for i, (s, r) in enumerate(zip(SPECS, records, strict=True)):
        plan = gp.GroupedPlan.from_spec(s)
        layout = gp.fit_layout(plan, "sm_90a", gatherers=3)
        assert r["entry"] == "moe_grouped_sm90_0"
        assert [p for p, _ in r["params"]] == list(GRID_PARAMS)
        assert all(kind == "pointer" and p in PARAMETER_NAMES for p, kind in r["params"])
        assert r["grid"] == [SMS, 1, 1] and r["block"] == [THREADS, 1, 1]
        assert r["cluster"] is None and r["pdl"] is True
        assert r["smem"] == layout.total and r["notes"]["stages"] == layout.stages >= 4
        assert r["maps"] == ["w13", "w2", "s13", "s2"]
        want = gp.workspaces(s.hidden, s.inter, s.experts, s.top_k, SMS)
        assert r["workspace"] == [[w.name, w.bytes, w.zero] for w in want]
        # Every parameter is one 8-byte pointer in the PTX entry.
        ptx = (out / f"{i}.ptx").read_text()
        entry = ptx[ptx.index(".entry moe_grouped_sm90_0(") :]
        entry = entry[: entry.index(")")]
        params = re.findall(r"\.param ([^\n]*?)moe_grouped_sm90_0_param_\d+(\[\d+\])?", entry)
        assert len(params) == len(GRID_PARAMS)
        assert all(size == "[8]" or ".u64" in decl for decl, size in params), params
