"""The sm_90a grouped kernel built by the DSL compiler (marked ``compile``):
a representative set of glm5 grouped variants (both ends of the buckets,
both logits dtypes, finalize off and on, UE8M0 on) compiled in a fresh sm_90a
process, their launch records checked against the plan and their SASS read
back: FP8 wgmma (QGMMA), TMA loads, cp.async gathers, no local memory. And,
unmarked, the shared-memory layout the kernel builds at every bucket.

What the kernel computes is checked on the H200 (``test_grouped_sm90_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from grouped_layout import check_kernel_layout, check_notes
from sass_tools import (
    compile_specs,
    count,
    cuobjdump,
    loads_before_pdl_wait,
    resources,
    sass_counts,
)

from runtime.constants import SMEM_LIMIT, SMEM_OPTIN

pytest.importorskip("cutlass")  # kernels.grouped_common is device code

from kernels import grouped_moe_sm90 as grouped  # noqa: E402
from kernels import grouped_plan as gp  # noqa: E402
from kernels.grouped_common import THREADS  # noqa: E402
from kernels.spec import PARAMETER_NAMES, KernelSpec  # noqa: E402

SMS = 132  # configs/glm5.yaml's sm_90a target
REGISTERS_PER_SM = 65536
GRID_PARAMS = (
    "maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "s13", "s2", "x", "logits",
    "bias", "rows", "out", "shared_out", "final", "ids", "weights", "plan_x", "plan_s",
    "hidden", "hscale", "partial", "counters", "valid",
)  # fmt: skip
SCALARS = ("valid",)  # i32 parameters (the rows the call holds); the rest pointers


def spec(tokens, dtype="float32", finalize=False, ue8m0=False) -> KernelSpec:
    return KernelSpec("grouped", "sm_90a", 4096, 512, 288, 8, 2.5, 10.0, ue8m0, tokens, dtype,
                      finalize, SMS)  # fmt: skip


SPECS = [
    spec(8),
    spec(16, "bfloat16", finalize=True),
    spec(48, ue8m0=True),
    spec(64, "bfloat16"),
    spec(64, finalize=True),
    # A bucket above the SM count: CTA c routes and quantizes tokens c,
    # c + grid, ... (the configs' largest).
    spec(512, finalize=True),
    # Routed experts only, softmax without bias (the Qwen3 family), and
    # DeepSeek-V3's group-limited routing.
    dataclasses.replace(
        spec(32, "bfloat16", finalize=True),
        experts=128,
        shared_experts=0,
        score="softmax",
        bias=False,
        limit=None,
    ),  # fmt: skip
    dataclasses.replace(spec(8), experts=256, groups=8, groups_kept=4, limit=None),
    # inter 384: three K blocks, stages of one (GLM-4.5's shard).
    dataclasses.replace(spec(64, finalize=True), hidden=5120, inter=384, experts=160, limit=None),
]
ROUTED_PARAMS = tuple(p for p in GRID_PARAMS
                      if p not in ("s13_scale", "s2_scale", "s13", "s2", "shared_out"))  # fmt: skip


def params_of(s: KernelSpec) -> tuple[str, ...]:
    return GRID_PARAMS if s.shared_experts else ROUTED_PARAMS


@pytest.mark.parametrize("tokens", [8, 16, 32, 48, 64, 128, 256, 512])
def test_the_layout_the_kernel_builds_keeps_the_device_contract(tokens):
    """The kernel's own layout (its gatherers, no accumulator slots: the MMA
    warpgroup is the epilogue) fits sm_90a's limit at the deepest stage count
    that does, every region as large and aligned as the device code needs."""
    k = grouped.GroupedMoeSm90(spec(tokens))
    assert (k.layout.gatherers, k.layout.slots) == (grouped.GATHERERS, 0)
    check_kernel_layout(k, "sm_90a")


@pytest.mark.parametrize("tokens", [8, 64])
def test_notes_follow_the_mega_schema(tokens):
    """The compile notes name what the mega kernels' notes name the same way
    (``mega_common.notes``): ``smem_layout`` {name: [offset, bytes]} from the
    layout builder, ``stages`` x ``stage_bytes`` the ring (weight and token
    stages), the FC2 claim size as ``fc2_jobs_per_claim``; no accumulator
    slots (the MMA warpgroup is the epilogue)."""
    k = grouped.GroupedMoeSm90(spec(tokens))
    notes = check_notes(k, "sm_90a", THREADS)
    assert notes["accumulator_slots"] == 0


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
        # One stage: depth K blocks x two m64 halves x four k32 steps, each an
        # m64nNk32 FP8 wgmma with FP32 accumulators, N = the unit's tokens
        # (16 up to 16 tokens, 32 above).
        p = gp.GroupedPlan.from_spec(s)
        depth, n = p.depth, p.group
        assert n == (16 if s.tokens <= 16 else 32)
        assert ops.get(f"QGMMA.64x{n}x32.F32.E4M3.E4M3", 0) == depth * 2 * 4, ops
        assert count(ops, "QGMMA") == depth * 2 * 4, ops
        assert count(ops, "UTMALDG") >= 1 and "UTMALDG.3D" in ops, ops  # weight stages
        assert count(ops, "LDGSTS") >= 1, ops  # cp.async B-tile gathers
        assert count(ops, "WARPGROUP.DEPBAR") >= 1, ops  # wgmma.wait_group
        assert "LDL" not in ops and "STL" not in ops, ops
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res
        # No global load on any path before the PDL wait: x, logits and bias
        # may come from the previous grid (the shared expert's L2 prefetch
        # before the wait reads weights, and is no load).
        assert loads_before_pdl_wait(tool, cubin) == [], s
        # One CTA per SM, all resident: registers and shared memory fit.
        assert res["REG"] * THREADS <= REGISTERS_PER_SM, res
        assert r["smem"] <= SMEM_LIMIT["sm_90a"]
        assert r["smem"] + res["SHARED"] <= SMEM_OPTIN["sm_90a"]


@pytest.mark.compile
def test_launch_records_follow_the_plan(built):
    out, records = built
    for i, (s, r) in enumerate(zip(SPECS, records, strict=True)):
        layout = grouped.GroupedMoeSm90(s).layout
        assert r["entry"] == "moe_grouped_sm90_0"
        assert [p for p, _ in r["params"]] == list(params_of(s))
        assert all(kind == ("i32" if p in SCALARS else "pointer") and p in PARAMETER_NAMES
                   for p, kind in r["params"])  # fmt: skip
        assert r["grid"] == [SMS, 1, 1] and r["block"] == [THREADS, 1, 1]
        assert r["cluster"] is None and r["pdl"] is True
        assert r["smem"] == layout.total and r["notes"]["stages"] == layout.stages >= 4
        assert r["notes"] == grouped.GroupedMoeSm90(s).notes()
        assert r["maps"] == (["w13", "w2", "s13", "s2"] if s.shared_experts else ["w13", "w2"])
        want = gp.workspaces(s.hidden, s.inter, s.experts, s.top_k, SMS)
        assert r["workspace"] == [[w.name, w.bytes, w.zero] for w in want]
        # Every parameter is one 8-byte pointer in the PTX entry, but the
        # last, ``valid``: a .u32.
        ptx = (out / f"{i}.ptx").read_text()
        entry = ptx[ptx.index(".entry moe_grouped_sm90_0(") :]
        entry = entry[: entry.index(")")]
        params = re.findall(r"\.param ([^\n]*?)moe_grouped_sm90_0_param_\d+(\[\d+\])?", entry)
        assert len(params) == len(params_of(s))
        assert all(size == "[8]" or ".u64" in decl for decl, size in params[:-1]), params
        assert ".u32" in params[-1][0] and not params[-1][1], params[-1]
        # The next call may launch once every CTA has started (PDL): the
        # trigger comes before the wait, and no global write before the wait
        # (grouped_common's docstring, phase 1).
        body = ptx[ptx.index(".entry moe_grouped_sm90_0(") :]
        wait = body.index("griddepcontrol.wait")
        assert body.index("griddepcontrol.launch_dependents") < wait
        assert not re.search(r"\b(?:st|atom|red|ld)(?:\.[\w:]+)*?\.global\b", body[:wait])


#: Grids other than glm5's for the call counter's check (one small variant each).
OTHER_GRIDS = (7, 114)


@pytest.fixture(scope="module")
def other_grids(tmp_path_factory):
    out = tmp_path_factory.mktemp("grouped90grids")
    specs = [dataclasses.replace(spec(8), sms=g) for g in OTHER_GRIDS]
    records = compile_specs("sm_90a", [(f"g{g}", s) for g, s in zip(OTHER_GRIDS, specs,
                                                                   strict=True)], out)  # fmt: skip
    return [(s, r, (out / f"g{g}.ptx").read_text()) for g, s, r in zip(OTHER_GRIDS, specs,
                                                                        records, strict=True)]  # fmt: skip


def _defs(ptx: str, reg: str) -> list[str]:
    """The PTX instructions that write register ``reg``."""
    return re.findall(rf"^\s*([a-z][\w.]*\s+{re.escape(reg)},[^;]*);", ptx, re.M)


def call_counter_count(ptx: str) -> tuple[int, int, int]:
    """(parameter index, byte offset, limit) of the kernel's one ``atom.inc``
    (the CTA's count on the call counter): the address as an offset from a
    pointer parameter, the limit as the immediate its register is set to."""
    found = re.findall(r"atom\.inc\.relaxed\.gpu\.global\.u32\s+%r\d+,\s*\[(%rd\d+)\],"
                       r"\s*(%r\d+|\d+);", ptx)  # fmt: skip
    assert len(found) == 1, found
    address, limit = found[0]
    if limit.startswith("%"):
        (mov,) = _defs(ptx, limit)
        limit = re.fullmatch(rf"mov\.[bu]32\s+{re.escape(found[0][1])},\s*(\d+)", mov).group(1)
    (add,) = _defs(ptx, address)
    base, offset = re.fullmatch(rf"add\.s64\s+{address},\s*(%rd\d+),\s*(\d+)", add).groups()
    (load,) = _defs(ptx, base)
    param = re.fullmatch(rf"ld\.param\.[bu]64\s+{base},\s*\[\w+_param_(\d+)\]", load).group(1)
    # The call's parity comes from a load of the same word.
    assert re.search(rf"ld\.global\.cg\.[bu]32\s+%r\d+,\s*\[{address}\]", ptx)
    return int(param), int(offset), int(limit)


@pytest.mark.compile
def test_call_counter_wraps_at_twice_the_grid(built, other_grids):
    """end_call's ``atom.inc`` on the call counter has limit 2 * grid - 1 for
    the grid the variant was compiled for (so the counter runs 0 .. 2 * grid
    - 1 and ``calls // grid`` is the call's parity, 0 or 1), on the
    counters workspace's call-counter word."""
    out, records = built
    cases = [(s, r, (out / f"{i}.ptx").read_text())
             for i, (s, r) in enumerate(zip(SPECS, records, strict=True))]  # fmt: skip
    for s, r, ptx in cases + other_grids:
        plan = gp.GroupedPlan.from_spec(s)
        assert r["grid"] == [s.sms, 1, 1]
        param, offset, limit = call_counter_count(ptx)
        assert limit == 2 * s.sms - 1, (s.sms, limit)
        assert param == params_of(s).index("counters")
        assert offset == 4 * plan.counters.calls


@pytest.mark.compile
@pytest.mark.parametrize("arch,sms", [("sm_90a", SMS), ("sm_100a", 148)])
def test_a_diagnostics_build_compiles_and_records_its_stamps(arch, sms, tmp_path, monkeypatch):
    """``MOE_BUILD_STAMPS=1`` at compile time: a grouped variant of either
    arch builds, names its stamp points in the notes, declares one word per
    CTA and point after the FC1 partials, and reads ``%globaltimer`` and
    stores to global memory more often than the release build of the same
    spec (whose notes name no stamps)."""
    s = dataclasses.replace(spec(8, finalize=True), arch=arch, sms=sms)
    monkeypatch.delenv(gp.STAMPS_ENV, raising=False)
    (plain,) = compile_specs(arch, [("plain", s)], tmp_path)
    monkeypatch.setenv(gp.STAMPS_ENV, "1")
    (stamped,) = compile_specs(arch, [("stamped", s)], tmp_path)
    assert "stamps" not in plain["notes"] and stamped["notes"]["stamps"] == list(gp.STAMP_POINTS)
    sizes = [{n: b for n, b, _ in r["workspace"]}["partial"] for r in (plain, stamped)]
    assert sizes[1] == sizes[0] + sms * len(gp.STAMP_POINTS) * 4
    ptx = [(tmp_path / f"{n}.ptx").read_text() for n in ("plain", "stamped")]
    for needle in ("%globaltimer", "st.global.b32"):
        assert ptx[1].count(needle) > ptx[0].count(needle), needle
