"""The sm_100a grouped kernel: its layout and TMEM/warp constants (no
compiler) and, marked ``compile``, a representative set of glm5 grouped
buckets built for sm_100a with their SASS read back.

There is no Blackwell GPU here: these tests show the kernel builds into the
instructions the seed's design needs (tcgen05 FP8 UMMA, TMA, TMEM loads,
cp.async gathers) within one SM's resources; they cannot show it computes
the right numbers. The plan formulas themselves are tested in
``test_grouped_plan.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sass_tools import compile_specs, count, cuobjdump, glm5_specs, resources, sass_counts

pytest.importorskip("cutlass")  # the kernel modules are device code

from kernels import grouped_moe_sm100 as grouped  # noqa: E402
from kernels import grouped_plan as gp  # noqa: E402
from kernels.grouped_common import THREADS  # noqa: E402
from kernels.ptx import tcgen05 as tc  # noqa: E402
from kernels.spec import PARAMETER_NAMES, KernelSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKETS = (8, 16, 32, 48, 64)
SMS = 148  # configs/glm5.yaml's sm_100a target
REGISTERS_PER_SM = 65536


def spec(tokens: int, dtype: str = "float32", finalize: bool = False) -> KernelSpec:
    return KernelSpec("grouped", "sm_100a", 4096, 512, 288, 8, 2.5, 10.0, False, tokens, dtype,
                      finalize, SMS)  # fmt: skip


def plan(tokens: int) -> gp.GroupedPlan:
    return gp.GroupedPlan.from_spec(spec(tokens))


# -- host side -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", BUCKETS)
def test_layout_is_the_deepest_that_fits(tokens):
    lay = grouped.layout_of(plan(tokens))
    limit = gp.SMEM_LIMIT["sm_100a"]
    assert lay.total <= limit
    assert gp.MIN_STAGES <= lay.stages <= gp.MAX_STAGES
    if lay.stages < gp.MAX_STAGES:
        deeper = gp.smem_layout(plan(tokens), lay.stages + 1, grouped.GATHERERS, grouped.SLOTS)
        assert deeper.total > limit
    assert lay.slots == grouped.SLOTS and lay.gatherers == grouped.GATHERERS
    # The scale ring and stage words outlive a stage by up to stages + slots.
    assert lay.ring > lay.stages + lay.slots and lay.posts > lay.stages + lay.slots
    for name, start, _ in lay.regions():
        if name in ("w", "b"):
            assert start % 1024 == 0  # 128B-swizzle atoms of UMMA operands
    assert lay.a_bytes % 1024 == 0 and lay.b_bytes % 1024 == 0


def test_stage_counts_of_the_glm5_buckets():
    # 36 KiB a stage (32 KiB of weights, 4 KiB of tokens): the seed's layout
    # keeps at least 5 stages in flight at every bucket (the unit tables grow
    # with the tokens, so smaller buckets may hold more).
    stages = [grouped.layout_of(plan(m)).stages for m in BUCKETS]
    assert stages == sorted(stages, reverse=True), stages
    assert min(stages) >= 5, stages


def test_tmem_and_warp_roles():
    assert grouped.COLUMNS == gp.DEPTH * gp.GROUP == 32
    assert grouped.SLOTS * grouped.COLUMNS <= grouped.TMEM_COLUMNS <= tc.TMEM_MAX_COLUMNS
    assert grouped.SLOTS == 16
    # Warps: producer, MMA, gatherers, then four epilogue warps whose warp % 4
    # covers the four 32-lane TMEM quadrants (thread e reads lane e).
    assert grouped.EPILOGUE == grouped.MMA_WARP + 1 + grouped.GATHERERS
    assert grouped.EPILOGUE % 4 == 0
    assert THREADS == 32 * (grouped.EPILOGUE + 4) == 256
    d = grouped.IDESC
    assert ((d >> 17) & 0x3F) << 3 == gp.GROUP and ((d >> 24) & 0x1F) << 4 == 128
    assert (d >> 4) & 3 == 1 and (d >> 7) & 0x3F == 0 and (d >> 15) & 3 == 0


def test_params_and_maps_follow_the_contract():
    assert set(grouped.PARAMS) <= set(PARAMETER_NAMES)
    assert grouped.PARAMS == (
        "maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "s13", "s2", "x", "logits",
        "bias", "rows", "out", "shared_out", "final", "ids", "weights", "plan_x", "plan_s",
        "hidden", "hscale", "partial", "counters",
    )  # fmt: skip
    assert grouped.TENSOR_MAPS == ("w13", "w2", "s13", "s2")
    names = [w.name for w in grouped.workspaces(plan(64))]
    assert names == ["plan_x", "plan_s", "hidden", "hscale", "partial", "counters"]
    assert [w.name for w in grouped.workspaces(plan(64)) if w.zero] == ["counters"]
    # One set of workspaces serves every bucket of the model.
    assert grouped.workspaces(plan(8)) == grouped.workspaces(plan(64))


def test_spec_mismatch_is_refused():
    with pytest.raises(ValueError, match="builds grouped/sm_100a"):
        grouped.compile_kernel(KernelSpec("mega", "sm_100a", 4096, 512, 288, 8, 2.5, 10.0,
                                          False, 1, "float32", False, SMS))  # fmt: skip


# -- compiled for sm_100a ----------------------------------------------------------------

#: Both dtypes, both finalize modes, the smallest and largest buckets and the
#: split-halves regime (48 and 64 tokens give more than SPLIT_UNITS units).
SUBSET = (
    "grouped-sm_100a-m8-float32",
    "grouped-sm_100a-m32-bfloat16-final",
    "grouped-sm_100a-m48-float32",
    "grouped-sm_100a-m64-bfloat16-final",
)


@pytest.mark.compile
def test_representative_glm5_grouped_buckets_build_for_sm100a(tmp_path):
    tool = cuobjdump()
    records = compile_specs("sm_100a", glm5_specs("sm_100a", "grouped", SUBSET), tmp_path)
    assert sorted(r["name"] for r in records) == sorted(SUBSET)
    for r in records:
        cubin = tmp_path / (r["name"] + ".cubin")
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
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
        assert r["smem"] + res["SHARED"] <= gp.SMEM_OPTIN["sm_100a"]
        assert r["smem"] <= gp.SMEM_LIMIT["sm_100a"]
        # Launch shape and ABI.
        assert r["entry"] == "moe_grouped_sm100_0"
        assert r["grid"] == [r["sms"], 1, 1] and r["cluster"] is None
        assert r["block"] == [THREADS, 1, 1] and r["pdl"] is True
        assert r["params"] == [[name, "pointer"] for name in grouped.PARAMS]
        assert r["maps"] == ["w13", "w2", "s13", "s2"]
        want = grouped.workspaces(plan(r["tokens"]))
        assert r["workspace"] == [[w.name, w.bytes, w.zero] for w in want]
        assert r["smem"] == grouped.layout_of(plan(r["tokens"])).total
