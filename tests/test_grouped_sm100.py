"""The sm_100a grouped kernel: the shared-memory layout, TMEM use, warp
roles and ABI it builds, checked against the contracts its docstrings and
the device code state (no compiler) and, marked ``compile``, a
representative set of glm5 grouped buckets built for sm_100a with their SASS
read back.

There is no Blackwell GPU here: these tests show the kernel builds into the
instructions the kernel's design needs (tcgen05 FP8 UMMA, TMA, TMEM loads,
cp.async gathers) within one SM's resources; they cannot show it computes
the right numbers. The plan formulas themselves are tested in
``test_grouped_plan.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from grouped_layout import check_kernel_layout, check_notes
from sass_tools import (
    compile_specs,
    count,
    cuobjdump,
    glm5_specs,
    loads_before_pdl_wait,
    resources,
    sass_counts,
)

from runtime.constants import SMEM_LIMIT, SMEM_OPTIN, TILE

pytest.importorskip("cutlass")  # the kernel modules are device code

from kernels import abi  # noqa: E402
from kernels import grouped_moe_sm100 as grouped  # noqa: E402
from kernels import grouped_plan as gp  # noqa: E402
from kernels import spec as kernel_spec  # noqa: E402
from kernels.grouped_common import (  # noqa: E402
    EPILOGUE_THREADS,
    ROUTED_PARAMS,
    THREADS,
)
from kernels.ptx import tcgen05 as tc  # noqa: E402
from kernels.spec import PARAMETER_NAMES, KernelSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKETS = (8, 16, 32, 48, 64, 128, 256, 512)
SMS = 148  # configs/glm5.yaml's sm_100a target
REGISTERS_PER_SM = 65536


def spec(tokens: int, dtype: str = "float32", finalize: bool = False) -> KernelSpec:
    return KernelSpec("grouped", "sm_100a", 4096, 512, 288, 8, 2.5, 10.0, False, tokens, dtype,
                      finalize, SMS)  # fmt: skip


def plan(tokens: int) -> gp.GroupedPlan:
    return gp.GroupedPlan.from_spec(spec(tokens))


# -- host side -------------------------------------------------------------------------------


def kernel(tokens: int) -> grouped.GroupedKernel:
    """The kernel object a build of this bucket compiles (no compile)."""
    return grouped.GroupedKernel(spec(tokens))


@pytest.mark.parametrize("tokens", BUCKETS)
def test_the_layout_the_kernel_builds_keeps_the_device_contract(tokens):
    """The kernel's own layout (its gatherers and accumulator slots) fits
    sm_100a's limit, at the deepest stage count that does, with every region
    as large and aligned as the device code needs and none overlapping."""
    k = kernel(tokens)
    assert (k.layout.gatherers, k.layout.slots) == (k.GATHERERS, k.slots)
    assert k.layout == gp.arch_layout(k.plan, "sm_100a")  # what compile_kernel records
    check_kernel_layout(k, "sm_100a")


@pytest.mark.parametrize("tokens", [8, 64])
def test_notes_follow_the_mega_schema(tokens):
    """The compile notes name what the mega kernels' notes name the same way
    (``mega_common.notes``): ``smem_layout`` {name: [offset, bytes]} from the
    layout builder, ``stages`` x ``stage_bytes`` the ring (weight and token
    stages), and the FC2 claim size as ``fc2_jobs_per_claim``."""
    k = kernel(tokens)
    notes = check_notes(k, "sm_100a", THREADS)
    assert notes["accumulator_slots"] == k.slots


def test_stage_counts_of_the_glm5_buckets():
    # 36 KiB a stage (32 KiB of weights, 4 KiB of tokens): the layout keeps
    # at least 5 stages in flight up to 256 tokens and the plan's fewest
    # (MIN_STAGES, 4) above, where the 512-token unit tables take the fifth
    # (the unit tables grow with the tokens, so smaller buckets may hold more).
    stages = [kernel(m).layout.stages for m in BUCKETS]
    assert stages == sorted(stages, reverse=True), stages
    assert min(s for m, s in zip(BUCKETS, stages, strict=True) if m <= 256) >= 5, stages
    assert min(stages) >= gp.MIN_STAGES == 4, stages


@pytest.mark.parametrize("inter,depth,slots", [(512, 2, 16), (384, 1, 32)])
def test_accumulators_fit_the_tmem_allocation(inter, depth, slots):
    """Each stage's ``depth`` K blocks get ``group`` columns each (N = group), the
    slots rotate through one allocation, which is a legal one (a power of two
    in 32..512) and, one CTA per SM, all of TMEM; as many slots as it holds,
    at most 32."""
    s = dataclasses.replace(spec(64), inter=inter)
    p, k = gp.GroupedPlan.from_spec(s), grouped.GroupedKernel(s)
    assert (
        p.depth == depth and gp.tmem_stage_columns(p) == k.columns == depth * p.group == depth * 16
    )
    columns = grouped.TMEM_COLUMNS
    assert columns == tc.TMEM_MAX_COLUMNS and columns & (columns - 1) == 0
    assert gp.accumulator_slots(p, "sm_100a") == min(32, columns // k.columns) == slots == k.slots
    assert k.slots * k.columns <= columns


def test_warp_roles_cover_the_tmem_lanes():
    """Warps: the producer, the MMA warp, the gatherers, then the epilogue,
    whose threads own one TMEM lane (weight row) each: as many as the UMMA's
    M (one row tile), starting at a warp whose index % 4 is 0 (warp w may
    read lanes 32 * (w % 4) onward)."""
    assert grouped.EPILOGUE == grouped.MMA_WARP + 1 + grouped.GATHERERS
    assert grouped.EPILOGUE % 4 == 0
    assert THREADS == 32 * grouped.EPILOGUE + EPILOGUE_THREADS
    assert EPILOGUE_THREADS == tc.TMEM_LANES == TILE
    # The UMMA instruction descriptor (tcgen05.instruction_desc_e4m3's field
    # layout): M = one row tile, N = a unit's ``group`` tokens (16 on sm_100a
    # at every bucket), F32 accumulators, E4M3 A and B, both K-major.
    for m in (8, 64):
        p = gp.GroupedPlan.from_spec(spec(m))
        d = grouped.idesc_of(p)
        assert ((d >> 24) & 0x1F) << 4 == TILE and ((d >> 17) & 0x3F) << 3 == p.group == 16
        assert (d >> 4) & 3 == 1 and (d >> 7) & 0x3F == 0 and (d >> 15) & 3 == 0


def test_params_and_maps_follow_the_contract():
    """The ABI order is the kernel's own parameter order, every name one the
    runtime can fill (PARAMETER_NAMES), every workspace among them; the maps
    are ones the runtime can build."""
    signature = list(inspect.signature(grouped.GroupedKernel.kernel).parameters)[1:]
    assert list(grouped.PARAMS) == signature
    called = list(inspect.signature(grouped.GroupedKernel.__call__).parameters)[1:]
    assert called == [*signature, "stream"]
    # Without a shared expert: the same order, the shared expert's five dropped.
    routed = list(inspect.signature(grouped.GroupedKernel.kernel_routed).parameters)[1:]
    assert (
        routed
        == list(ROUTED_PARAMS)
        == [p for p in signature if p not in ("s13_scale", "s2_scale", "s13", "s2", "shared_out")]
    )
    launch = list(inspect.signature(grouped.GroupedKernel.routed_only).parameters)[1:]
    assert launch == [*routed, "stream"]
    assert set(grouped.PARAMS) <= set(PARAMETER_NAMES)
    workspaces = grouped.workspaces(plan(64))
    assert {w.name for w in workspaces} <= set(grouped.PARAMS)
    assert all(w.zero == (w.name == "counters") for w in workspaces)
    assert set(grouped.TENSOR_MAPS) <= set(kernel_spec.TENSOR_MAPS)
    assert len(set(grouped.TENSOR_MAPS)) == len(grouped.TENSOR_MAPS)
    # One set of workspaces serves every bucket of the model.
    assert all(grouped.workspaces(plan(m)) == workspaces for m in BUCKETS)


def test_spec_mismatch_is_refused():
    with pytest.raises(ValueError, match="builds grouped/sm_100a"):
        grouped.compile_kernel(KernelSpec("mega", "sm_100a", 4096, 512, 288, 8, 2.5, 10.0,
                                          False, 1, "float32", False, SMS))  # fmt: skip


# -- compiled for sm_100a ----------------------------------------------------------------

#: Both dtypes, both finalize modes, the smallest and largest buckets, the
#: split-halves regime (48 and 64 tokens give more than SPLIT_UNITS units)
#: and a bucket above the SM count (CTA c takes tokens c, c + grid, ...).
SUBSET = (
    "grouped-sm_100a-m8-float32",
    "grouped-sm_100a-m32-bfloat16-final",
    "grouped-sm_100a-m48-float32",
    "grouped-sm_100a-m64-bfloat16-final",
    "grouped-sm_100a-m512-float32-final",
)


@pytest.mark.compile
def test_representative_glm5_grouped_buckets_build_for_sm100a(tmp_path):
    tool = cuobjdump()
    records = compile_specs("sm_100a", glm5_specs("sm_100a", "grouped", SUBSET), tmp_path)
    assert sorted(r["name"] for r in records) == sorted(SUBSET)
    for r in records:
        cubin = tmp_path / (r["name"] + ".cubin")
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
        # No global load on any path before the PDL wait (inputs may come
        # from the previous grid).
        assert loads_before_pdl_wait(tool, cubin) == [], r["name"]
        print(f"{r['name']}: {r['seconds']} s, REG {res['REG']}, smem {r['smem']}, "
              f"stages {r['notes']['stages']}, UTCQMMA {count(ops, 'UTCQMMA')}, "
              f"UTMALDG {count(ops, 'UTMALDG')}, LDTM {count(ops, 'LDTM')}, "
              f"LDGSTS {count(ops, 'LDGSTS')}")  # fmt: skip
        # One UMMA site: DEPTH K blocks x four K32 FP8 UMMAs; two commits
        # (weight stage, accumulator slot); TMA loads of DEPTH boxes; one
        # 32-column TMEM load; the gatherers' cp.async copies.
        assert count(ops, "UTCQMMA") == gp.DEPTH * 4, ops
        assert count(ops, "UTCBAR") == 2, ops
        assert "UTMALDG.3D" in ops and count(ops, "UTMALDG") % gp.DEPTH == 0, ops
        assert ops.get("LDTM.x32", 0) == 1 and count(ops, "LDTM") == 1, ops
        assert count(ops, "LDGSTS") >= gp.DEPTH, ops
        assert "UTCATOMSWS.FIND_AND_SET.ALIGN" in ops and "UTCATOMSWS.AND" in ops, ops
        assert "LDL" not in ops and "STL" not in ops, ops
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res
        # One CTA per SM: registers and shared memory of the whole SM.
        assert res["REG"] * THREADS <= REGISTERS_PER_SM, res
        assert r["smem"] + res["SHARED"] <= SMEM_OPTIN["sm_100a"]
        assert r["smem"] <= SMEM_LIMIT["sm_100a"]
        assert r["notes"]["smem_limit"] == SMEM_LIMIT["sm_100a"]
        # Launch shape and ABI.
        assert r["entry"] == f"{grouped.ENTRY_PREFIX}_0"
        assert r["grid"] == [r["sms"], 1, 1] and r["cluster"] is None
        assert r["block"] == [THREADS, 1, 1] and r["pdl"] is True
        assert r["params"] == [[name, abi.param_kind(name)] for name in grouped.PARAMS]
        assert r["maps"] == list(grouped.TENSOR_MAPS)
        want = grouped.workspaces(plan(r["tokens"]))
        assert r["workspace"] == [[w.name, w.bytes, w.zero] for w in want]
        lay = gp.arch_layout(plan(r["tokens"]), "sm_100a")
        assert r["smem"] == lay.total and r["notes"]["stages"] == lay.stages
        assert r["notes"] == kernel(r["tokens"]).notes(
            tmem_columns=grouped.TMEM_COLUMNS, idesc=f"{grouped.idesc_of(plan(r['tokens'])):#010x}"
        )


@pytest.mark.compile
def test_routed_only_softmax_variant_builds_for_sm100a(tmp_path):
    """A model without a shared expert (the Qwen3 family: softmax, no bias,
    no clamp) builds the routed-only entry: the shared expert's parameters
    and maps dropped, the same UMMA site, no local memory."""
    s = dataclasses.replace(spec(32, "bfloat16", True), experts=128, shared_experts=0,
                            score="softmax", bias=False, limit=None)  # fmt: skip
    (r,) = compile_specs("sm_100a", [("routed", s)], tmp_path)
    tool = cuobjdump()
    ops, res = (
        sass_counts(tool, tmp_path / "routed.cubin"),
        resources(tool, tmp_path / "routed.cubin"),
    )
    assert r["params"] == [[name, abi.param_kind(name)] for name in ROUTED_PARAMS]
    assert r["maps"] == ["w13", "w2"]
    assert count(ops, "UTCQMMA") == gp.DEPTH * 4, ops
    assert "LDL" not in ops and "STL" not in ops and res["LOCAL"] == 0, (ops, res)
    assert "min.NaN.f32" not in (tmp_path / "routed.ptx").read_text()
